#!/usr/bin/env python3
"""Print a kvfs volume's superblocks, ring usage, index and (with --session) extents.

``kvfs-dump VOLUME [--session NAME] [--json]``. Opens the volume read-only. Names are
printed with anything unprintable escaped (``\x1b``...): a name cannot drive the terminal.
Exit 0, 1 (no such session), 2 (the volume cannot be opened).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvfs.cli.output import pipe_safe, shown
from kvfs.engine.errors import KVFSError
from kvfs.engine.format import SB_CLEAN, SB_NEEDS_FSCK, Superblock
from kvfs.engine.store import Store
from kvfs.engine.volume import VolumeFile


@pipe_safe
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfs-dump", description=__doc__.splitlines()[0])
    ap.add_argument("volume")
    ap.add_argument("--session", help="print this session's files and extents")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        vol = VolumeFile.open(a.volume, readonly=True)
        try:
            slots = vol.read_slots()
        finally:
            vol.close()
        store = Store.open(a.volume, readonly=True)
    except (KVFSError, OSError) as e:
        print(f"kvfs-dump: {e}", file=sys.stderr)
        return 2
    sbs = [{"slot": i, **{k: (v.hex() if isinstance(v, bytes) else v) for k, v in sb.__dict__.items()}}
           if isinstance(sb, Superblock) else {"slot": i, "error": str(sb)}
           for i, sb in enumerate(slots)]
    try:
        out: dict = {"superblocks": sbs, "stats": store.stats(), "tree_root": store.tree.root.__dict__}
        if a.session:
            s = store.idx.find(a.session)
            if s is None:
                print(f"no session {shown(a.session)!r}", file=sys.stderr)
                return 1
            out["session"] = {
                "name": s.name, "sno": s.sno, "meta_pos": s.meta_pos, "files": {
                    f.name: {"fno": f.fno, "size": f.size, "stored": f.stored(), "meta_pos": f.meta_pos,
                             "extents": [{"file_off": o, "pos": e[0], "skip": e[1], "len": e[2],
                                          "entry_size": e[3]} for o, e in zip(f.off, f.ext, strict=True)]}
                    for f in s.files.values()}}
        else:
            out["sessions"] = store.list_sessions()
    finally:
        store.crash()
    if a.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    for sb in out["superblocks"]:
        if "error" in sb:
            print(f"superblock slot {sb['slot']}: {sb['error']}")
            continue
        print(f"superblock slot {sb['slot']} seq={sb['seq']} head={sb['head']} tail={sb['tail']} "
              f"ckpt={sb['ckpt_pos']} next_sno={sb['next_sno']} clean={bool(sb['flags'] & SB_CLEAN)} "
              f"needs_fsck={bool(sb['flags'] & SB_NEEDS_FSCK)}")
    v = out["stats"]["volume"]
    print(f"ring: {v['used']}/{v['capacity']} bytes used ({v['used_ratio']:.1%}), {v['sessions']} sessions")
    print(f"tree: {out['stats']['index']['tree']}")
    if "session" in out:
        for name, f in out["session"]["files"].items():
            print(f"{shown(name)}: {f['size']} bytes ({f['stored']} stored), {len(f['extents'])} extents")
            for x in f["extents"]:
                print(f"  [{x['file_off']}, +{x['len']}) -> entry {x['pos']} skip {x['skip']} size {x['entry_size']}")
    else:
        for n in out["sessions"]:
            print(shown(n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
