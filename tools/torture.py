#!/usr/bin/env python3
"""kvfs torture: crash loops, power cuts, bit flips, full volume, bad input, load, handles.

    python tools/torture.py [--trials N] [--seconds S] [--only NAME[,NAME]] [--json OUT]
                            [--workdir DIR] [--seed N] [--quick]

Scenarios (``docs/reliability.md`` says what each one checks): ``kill9``, ``faults``
(``torture_crash.py``), ``flips``, ``full`` (``torture_mount.py``), ``badinput``, ``load``
(``torture_input.py``), ``stale``, ``race``, ``buffers`` (``torture_hardening.py``),
``nrace``, ``nkill9`` (the native channel: ``torture_native.py``), ``quota``, ``flood``
(``torture_limits.py``). Each is bounded by a count -- its full-run default, ``--quick``
for the pytest-sized one, or ``--trials`` (kills, power cuts, flipped bits, rounds; for
``load``, seconds; for ``flood``, idle connections) -- and by ``--seconds``, a time cap per
scenario; it stops by itself. A
summary table is printed; the exit status is 1 when any check failed.
``tests/test_reliability.py`` calls the same functions with small counts. The mount-level
scenarios use the real-mount helper of ``kvfs.mount_runner`` (``kvfs-mount --foreground`` in a
subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torture_crash as tc
import torture_hardening as th
import torture_input as ti
import torture_limits as tl
import torture_mount as tm
import torture_native as tn
from torture_common import FULL, QUICK, Result

log = logging.getLogger("kvfs.torture")

Scenario = Callable[[Path, int, float, random.Random], Result]
NAMES = ("kill9", "faults", "flips", "full", "badinput", "load", "stale", "race", "buffers",
         "nrace", "nkill9", "quota", "flood")


def scenarios() -> dict[str, Scenario]:
    """Name -> function: 1-2 in ``torture_crash.py``, 3-4 in ``torture_mount.py``, 5-6 in
    ``torture_input.py``, 7-9 in ``torture_hardening.py``, 10-11 in ``torture_limits.py``."""
    return {"kill9": tc.kill9, "faults": tc.faults, "flips": tm.flips, "full": tm.full,
            "badinput": ti.badinput, "load": ti.load, "stale": th.stale, "race": th.race,
            "buffers": th.buffers, "nrace": tn.nrace, "nkill9": tn.nkill9, "quota": tl.quota,
            "flood": tl.flood}


def table(results: list[Result]) -> str:
    rows = [f"{'scenario':<9} {'trials':>11} {'seconds':>8} {'failures':>8}  figures"]
    for r in results:
        figs = " ".join(f"{k}={v:,}" if float(v).is_integer() else f"{k}={v:g}"
                        for k, v in sorted(r.counts.items()))
        rows.append(f"{r.name:<9} {f'{r.done}/{r.planned}':>11} {r.seconds:>8.1f} {r.nfail:>8}  {figs}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, help="count for every scenario run (default: full run)")
    ap.add_argument("--seconds", type=float, default=900.0, help="time cap per scenario")
    ap.add_argument("--only", help="comma-separated scenario names: " + ",".join(NAMES))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep volumes and logs here (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the pytest-sized counts")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = a.only.split(",") if a.only else list(NAMES)
    bad = [x for x in names if x not in NAMES]
    if bad:
        ap.error(f"unknown scenario {bad}; choose from {', '.join(NAMES)}")
    run = scenarios()
    counts = QUICK if a.quick else FULL
    results = []
    with contextlib.ExitStack() as stack:
        work = Path(a.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfs-torture-")))
        for name in names:
            d = work / name
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            n = a.trials if a.trials is not None else counts[name]
            t0 = time.monotonic()
            log.info("=== %s: %d, at most %.0f s", name, n, a.seconds)
            try:
                r = run[name](d, n, t0 + a.seconds, random.Random(a.seed))
            except Exception as e:  # noqa: BLE001 - a broken scenario fails
                log.exception("%s broke", name)
                r = Result(name, n)
                r.fail(f"scenario aborted: {e!r}")
            r.seconds = round(time.monotonic() - t0, 1)
            results.append(r)
            log.info("=== %s: %s in %.1f s", name, "ok" if r.ok else f"{r.nfail} FAILURES", r.seconds)
    print(table(results))
    for r in results:
        for msg in r.failures:
            print(f"FAIL {r.name}: {msg}")
    if a.json:
        doc = {"argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "results": [asdict(r) for r in results]}
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
