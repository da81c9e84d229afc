#!/usr/bin/env python3
"""fsck for a kvfs volume: ``kvfs-fsck VOLUME [--repair]``.

Exit status: 0 clean, 1 problems found (repaired or not), 2 unusable (also: the volume is
mounted; unmount first). Clears the needs-fsck mark a mount sets on errors, with --repair.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvfs.cli.output import pipe_safe
from kvfs.engine.fsck import check_volume


@pipe_safe
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfs-fsck", description=__doc__.splitlines()[0])
    ap.add_argument("volume")
    ap.add_argument("--repair", action="store_true", help="rebuild the checkpoint, cut damaged files, clear the needs-fsck mark")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    ap.add_argument("--verbose", "-v", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    bar = None
    if not a.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="checking sessions", unit="session", file=sys.stderr)

    def progress(i: int, n: int) -> None:
        if bar is not None:
            bar.total = n
            bar.n = i
            bar.refresh()

    res = check_volume(a.volume, repair=a.repair, progress=progress)
    if bar is not None:
        bar.close()
    if res.in_use:  # one thing to say, and nothing was checked
        print(f"kvfs-fsck: {res.problems[0]}", file=sys.stderr)
        return res.status
    for p in res.problems:
        print(f"problem: {p}")
    for r in res.repaired:
        print(f"repaired: {r}")
    if res.index_budget:
        print(f"index: about {res.index_used} of {res.index_budget} bytes of its budget")
        for uid, n in list(res.index_by_uid.items())[:20]:
            print(f"  uid {uid}: {n} index bytes")
        if len(res.index_by_uid) > 20:
            print(f"  ... {len(res.index_by_uid) - 20} more uids")
    state = {0: "clean", 1: "problems found", 2: "unusable"}[res.status]
    print(f"{a.volume}: {state}: {res.sessions} sessions, {res.files} files, "
          f"{res.bytes_checked} bytes verified")
    return res.status


if __name__ == "__main__":
    sys.exit(main())
