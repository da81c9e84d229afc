#!/usr/bin/env python3
"""A day of agent traffic per profile, compressed into minutes: the end-to-end check.

    python tools/agent_day.py --profile gov|ecommerce|iot|all [--minutes M] [--sessions N]
                              [--out DIR] [--no-mount] [--json PATH] [--seed S] [--verbose]

Per profile: a temp volume mounted by ``mount.py --profile P`` (``agentlib.Volume``), a tiny
random Llama, a ``KVRouter`` with the profile's tiers and alert rules live, and a closed-loop
traffic generator whose concurrency follows the profile's daily load curve, for one simulated
day in ``--minutes`` real minutes (``docs/agent-day.md`` says what a run does and checks). Owns
the command line and one profile's run; the workloads are in ``agent_day_workloads.py``, the
day loop in ``agent_day_sim.py`` (restarts and drills: ``agent_day_events.py``; samples and
figures: ``agent_day_samples.py``), the report in ``agent_day_report.py``. Writes to stdout,
the profile's section of ``DIR/agent-day.md`` and ``DIR/img/agent-day-<profile>.png``.
Exit status 0 when every goal is met.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import agent_day_report as report
import agentlib as lib
from agent_day_sim import Day
from agent_day_workloads import DAY_S, RESTARTS_H, WORKLOADS

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_HEAD = "# A day of agent traffic\n\nWritten by `tools/agent_day.py` (see docs/agent-day.md)."


# --------------------------------------------------------------------------- main
def run_profile(name: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import os
    import platform

    import torch

    from kvfs.ops import profiles

    w, prof = WORKLOADS[name], profiles.load(name)
    use_mount = not args.no_mount
    if use_mount and not (avail := lib.mount_available())[0]:
        print(f"NOTE: cannot mount ({avail[1]}); using a plain directory as the cold tier")
        use_mount = False
    base = Path(tempfile.mkdtemp(prefix=f"kvfs-day-{name}-"))
    warm = lib.warm_dir(base, prefix=f"kvfs-day-{name}-warm-")
    ckpt = max(0.05, prof.checkpoint_interval_s * args.minutes * 60 / DAY_S)
    opts = ["--profile", name, "-o", f"checkpoint_interval_s={ckpt:.3f}"]
    print(f"[{name}] a simulated day in {args.minutes:g} min ...", flush=True)
    try:
        with lib.Volume(base, use_mount, size=args.volume_size, options=opts,
                        say=print if args.verbose else None) as vol:
            day = Day(w, args, vol, warm)
            res = day.run()
        g = day.geo
        res["geo"] = (f"tiny random Llama ({g.num_layers} layers × {g.num_kv_heads} KV heads × {g.head_dim}, fp32, "
                      f"{g.session_token_bytes} KV bytes per token)")
        res["story"], res["budget_windows"] = w.story, w.budget_windows
        res["cold"] = (f"a {args.volume_size} volume mounted with `mount.py --profile {name}` (index checkpoint "
                       f"every {ckpt:.2f} s real = {prof.checkpoint_interval_s:g} s simulated)"
                       if use_mount else "a plain directory (--no-mount)")
        if use_mount and vol.returncode != 0:
            res["goals"].append(("clean unmount", False))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(warm, ignore_errors=True)
    res["ok"] = all(ok for _, ok in res["goals"])
    res["cpus"] = os.cpu_count()
    res["notes"] = report.day_notes(res, prof)
    res["date"] = time.strftime("%Y-%m-%d")
    res["host"] = (f"{os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}, "
                   f"torch {torch.__version__}")
    out = Path(args.out)
    img = out / "img" / f"agent-day-{name}.png"
    report.plot_day(res["rows"], img, f"kvfs agent day: {name}", drills=res["drills"], restarts_h=RESTARTS_H,
                 device_line=prof.device_watermark, warm_line=prof.warm_migrate_at)
    page = out / "agent-day.md"
    report.write_sections(page, list(WORKLOADS), "agent-day", name, report.day_section(res, prof, argv, f"img/{img.name}"),
                       default_head=DEFAULT_HEAD)
    for fig, value, goal, ok in report.day_figures(res, prof):
        print(f"  {fig}: {value}" + {"": "", "yes": "  [met]", "**NO**": f"  [MISSED: {goal}]"}.get(ok, f"  [{ok}]"))
    rss, MiB = res["rss"], 1 << 20
    marks = ", ".join(f"{m} min {v / MiB:.1f} MiB" for m, v in rss["at_min"].items())
    grew = rss["growth_since_2min"]
    print(f"  agent RSS by real time: {marks or 'no mark reached'}; {rss['end'] / MiB:.1f} MiB at the "
          f"end ({rss['end_min']:.1f} min)" + (f"; {grew / MiB:+.1f} MiB since 2 min" if grew is not None else ""))
    def split(p: dict | None) -> str:
        return ", ".join(f"{k} {v / MiB:.1f}" for k, v in (p or {}).items())
    for m, p in [*rss["parts_at_min"].items(), ("end", rss["parts_end"])]:
        print(f"    at {m}{' min' if m != 'end' else ''}: {split(p)} MiB")
    if (tr := rss.get("heap_trims")) and tr["trims"]:
        print(f"    heap trims after releases (KVRouter.heap): {tr['trims']}, {tr['ms']:.0f} ms in all, the longest "
              f"{tr['max_ms']:.1f} ms; RSS returned {tr['returned'] / MiB:.1f} MiB")
    for line in rss.get("heap_growth", []):
        print(f"    heap {line}")
    for note in res["notes"]:
        print(f"  NOTE: {note}")
    print(f"[{name}] {'every goal met' if res['ok'] else 'GOALS MISSED'}; wrote {page} and {img}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, choices=[*WORKLOADS, "all"])
    p.add_argument("--minutes", type=float, default=3.0, help="real minutes for the simulated day")
    p.add_argument("--sessions", type=int, help="concurrent sessions at the busiest hour")
    p.add_argument("--out", default=str(ROOT / "docs"), help="where agent-day.md and img/ go")
    p.add_argument("--no-mount", action="store_true", help="cold tier in a plain directory")
    p.add_argument("--volume-size", default="1G")
    p.add_argument("--json", help="also write the figures (without the time series) here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace the Python heap: the lines that grew most from 2 minutes to the end")
    args = p.parse_args(argv)
    if args.tracemalloc:
        import tracemalloc
        tracemalloc.start(1)
    if args.minutes <= 0 or (args.sessions is not None and args.sessions < 1):
        p.error("--minutes and --sessions must be > 0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    names = list(WORKLOADS) if args.profile == "all" else [args.profile]
    results = {n: run_profile(n, args, argv) for n in names}
    if args.json:
        slim = {n: {k: v for k, v in r.items() if k != "rows"} for n, r in results.items()}
        Path(args.json).write_text(json.dumps(slim, indent=2, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
