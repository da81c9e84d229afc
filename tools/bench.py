#!/usr/bin/env python3
"""kvfs benchmarks side by side: every figure of the page, its peer measured in the same run.

    python tools/bench.py [--quick] [--out DIR] [--only NAME,...] [--docs PATH | --no-docs]

Runs the figure functions of ``bench_engine``, ``bench_codec``, ``bench_mount``,
``bench_native``, ``bench_warm``, ``bench_hot`` and ``bench_quality`` (each imported optionally: a missing
module or function is reported as "not available", never a crash; a function that raises
is reported as failed and the run goes on), writes ``DIR/results.json`` and one PNG per figure, and regenerates
``docs/benchmarks.md`` with the machine, the command, a table per figure (subject, peer,
ratio, goal, met?), the plots (copied to ``docs/img/``) and a plain sentence for every
goal missed. ``--only`` takes figure numbers (``1,8``), module names (``engine``) or
``module:function`` (``engine:cold_read``); figures not run keep their previous results
from ``DIR/results.json`` in the page. The docs are written by full runs only unless
``--docs PATH`` is given (``--quick`` numbers go to ``DIR/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import math
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench_common import Result, describe_machine_md, fmt_ratio, fmt_value, machine_description

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench")

MODULES = ("engine", "codec", "mount", "native", "warm", "hot", "quality")  # tools/bench_<name>.py
# figure -> (title, peer, [(module, function), ...]); a module's FIGURES dict may add more
FIGURES: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "1": ("Cold random read of one round of one layer, page cache dropped",
          "plain `pread` of a file on ext4", [("engine", "cold_read"), ("mount", "random_read"),
                                              ("native", "random_read")]),
    "2": ("Sequential write and read of a large layer file; a round made durable", "ext4 file; `dd`",
          [("engine", "append_throughput"), ("mount", "fsync_appends"), ("mount", "seq_read"),
           ("mount", "concurrent_read"), ("native", "round_durable")]),
    "3": ("Warm → cold: group migration, write-behind, and dropping a clean group",
          "`dd` of the same bytes; the 5 ms goal",
          [("warm", "migration|bench_migration"), ("warm", "migration_floors"),
           ("warm", "bench_writebehind"), ("warm", "bench_writebehind_files"),
           ("native", "channel_stream"), ("warm", "bench_clean_eviction")]),
    "4": ("Resume a 2k-token session of a ~1B random bf16 model",
          "recompute prefill; safetensors file; torch.save file", [("hot", "resume")]),
    "5": ("Decode step, TieredCache vs DynamicCache at the same window", "DynamicCache",
          [("hot", "decode_step"), ("hot", "decode_writebehind")]),
    "6": ("Sessions served under a fixed device budget", "DynamicCache holding all KV",
          [("hot", "sessions_under_budget")]),
    "7": ("Open/mount time and RSS with 10k / 100k / 1M sessions", "the same at the smallest count",
          [("engine", "open_sessions"), ("mount", "mount_time")]),
    "8": ("Lossless compression ratio and speed on fp16 and bf16 KV", "plain zstd level 1",
          [("codec", "compression")]),
    "9": ("memmap read of one round vs `torch.load` of the same round", "`torch.load`",
          [("warm", "memmap_read|bench_memmap_vs_torch_load")]),
    "10": ("Perplexity of a real model (SmolLM2-135M) with a hot window", "the full cache",
           [("quality", "quality")]),
    "11": ("Read a 1 KiB piece of a random session's layer, or a whole session, among 2,000 "
           "sessions, every cache dropped", "open + pread + close of the per-layer ext4 file by path",
           [("native", "piece_read"), ("native", "fresh_read")]),
}
# what a figure's bound rows mean, under its title (the numbers are the run's own)
FIGURE_TEXT: dict[str, str] = {
    "1": ("The native rows read through kvfs's own channel (docs/mount.md): the client holds the "
          "file's extents, as an agent that wrote or read the session does, and reads the entry "
          "from the volume directly, bypassing the page cache; its header, table and every block "
          "are checked, then the published tail and cut count. The *checked-read floor* row is "
          "the same direct read, one CRC-32C per 32 KiB block and one copy out, with no Python "
          "around them: no read that checks what it returns goes below it. Where the native row "
          "misses its goal and the floor does not, what stops it is the interpreter's own cost "
          "right after the I/O wait (planning, the header and table checks, the published block: "
          "a few dozen Python steps on cold CPU caches); a read path compiled to native code "
          "would close that gap, which this code base (pure Python, no extension module) does "
          "not have. The FUSE rows are bound by their own floor (a pyfuse3 passthrough)."),
    "4": ("The resume goes through the warm tier's cold backend: the native channel when the "
          "mount serves one, its files on the *FUSE face* row. Two rows bound it, measured alone "
          "in the same run: *cold reads alone* (every layer read in one batch) and *layout alone* "
          "(the token-major bytes laid out as [1, H, T, D] K and V from RAM, one copy). The "
          "layer files are token-major by contract (rounds are appended token by token and the "
          "FUSE face shows them so); a safetensors file stores each tensor already laid out, so "
          "its load has no layout step. The resume overlaps the two (the next batch of layers is "
          "read while one is laid out): it cannot be shorter than the longer of them."),
    "11": ("Every cache is dropped before each read (`echo 3 > /proc/sys/vm/drop_caches` when "
           "root: pages, dentries and inodes), so the ext4 peer walks the path from the disk. The "
           "native row's client holds the extents of the sessions it wrote (an agent's "
           "sessions); the second row asks the mount for them on every read, whose index may "
           "need B+ tree pages from the disk; the third reads through the FUSE face. The *new "
           "client* rows are a new process reading sessions it never saw, each found in the "
           "mount's catalog (the page cache dropped once before they start); their *I/O floor* "
           "is the direct read alone, the *checked-read floor* the same read with a CRC-32C of "
           "every 32 KiB block read and one copy out, no Python around either: no read that "
           "checks what it returns goes below it."),
}
# "a|b": the first of these names the module has. Functions returning a flat dict of numbers
# instead of results: how to read one call as subject / peer samples.
FLAT: dict[str, dict[str, Any]] = {
    "bench_migration": dict(figure="3", name="group migration of 10 sessions (~87 MB), warm → cold",
                            subject="kvfs warm tier: migrate()", peer="dd bs=4M conv=fsync, same bytes",
                            unit="MB/s", keys=("migrate_MBps", "dd_MBps"), better="higher", goal=0.8,
                            note="the article moves a group in < 200 ms"),
    "bench_writebehind": dict(figure="3", name="write-behind of ~87 MB (24 layers) until sync()",
                              subject="kvfs warm tier: append + write-behind + sync() (native channel)",
                              peer="dd bs=4M conv=fsync, same bytes, same mount", unit="MB/s",
                              keys=("writebehind_MBps", "dd_MBps"), better="higher", goal=0.9,
                              note="the RAM tier appends round by round while its writer streams "
                                   "to the mount through its native channel"),
    "bench_writebehind_files": dict(
        figure="3", name="write-behind of ~87 MB (24 layers) until sync() [FUSE face]",
        subject="kvfs warm tier: append + write-behind + sync() (the mount's files)",
        peer="dd bs=4M conv=fsync, same bytes, same mount", unit="MB/s",
        keys=("writebehind_MBps", "dd_MBps"), better="higher", goal=None,
        note="the same, the warm tier writing the mount's files through FUSE"),
    "channel_stream": dict(
        figure="3", name="write-behind of ~87 MB (24 layers) until sync() [channel alone]",
        subject="the same bytes through the native channel alone (8 MiB requests, one sync)",
        peer="dd bs=4M conv=fsync, same bytes, same mount", unit="MB/s",
        keys=("channel_MBps", "dd_MBps"), better="higher", goal=None,
        note="what bounds write-behind through the channel: its requests alone, no RAM tier"),
    "bench_clean_eviction": dict(figure="3", name="drop a clean 10-session group from RAM",
                                 subject="kvfs warm tier: migrate() of clean sessions",
                                 peer="the 5 ms goal", unit="ms", keys=("evict_ms", "goal_ms"),
                                 better="lower", goal=1.0,
                                 note="the mount already holds every byte: nothing is copied; "
                                      "the article's bar is 200 ms"),
    "bench_memmap_vs_torch_load": dict(figure="9", name="read one round of every layer into a tensor",
                                       subject="warm tier memmap read", peer="torch.load of a torch.save file",
                                       unit="µs", keys=("memmap_us", "torch_load_us"), better="lower",
                                       goal=None, note="the article reports memmap 3.2× faster"),
}


# ------------------------------------------------------------------------ running
def _module(name: str) -> tuple[Any | None, str]:
    try:
        return importlib.import_module(f"bench_{name}"), ""
    except Exception as e:  # ImportError, or a half-written module that does not import
        return None, f"tools/bench_{name}.py not available ({type(e).__name__}: {e})"


def _resolve(module: str, names: str) -> str:
    mod, _ = _module(module)
    for n in names.split("|"):
        if callable(getattr(mod, n, None)):
            return n
    return names.split("|")[0]


def plan(only: list[str] | None) -> list[tuple[str, str, str | None]]:
    """(module, function, figure or None) to run, in figure order, then unplaced extras."""
    planned = [(m, _resolve(m, f), fig) for fig, (_, _, prov) in FIGURES.items() for m, f in prov]
    placed = {(m, f) for m, f, _ in planned}
    for m in MODULES:  # functions a module lists in its FIGURES that the table above lacks
        mod, _ = _module(m)
        for f, fn in (getattr(mod, "FIGURES", None) or {}).items():
            fname = getattr(fn, "__name__", f)
            if (m, fname) not in placed:
                planned.append((m, fname, None))
                placed.add((m, fname))
    if not only:
        return planned
    keep = []
    for m, f, fig in planned:
        for o in only:
            o = o.removeprefix("bench_")
            if o == fig or o == m or o == f"{m}:{f}" or o == f:
                keep.append((m, f, fig))
                break
    return keep


@contextmanager
def cold_root(workdir: str, quick: bool) -> Iterator[tuple[str, str]]:
    """(path, what it is) for functions taking ``cold_root``: a fresh kvfs mount when
    ``bench_mount.mounted`` and /dev/fuse are there, else a plain directory on the same disk."""
    base = Path(workdir) / "work" / "cold_root"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    mod, _ = _module("mount")
    mounted = getattr(mod, "mounted", None)
    try:
        if mounted is not None and Path("/dev/fuse").exists():
            try:
                with mounted(base / "vol.kvfs", base / "mnt", (1 if quick else 4) << 30) as m:
                    yield str(m), "kvfs mount"
                return
            except RuntimeError as e:  # the mount did not come up: say so, use a directory
                log.warning("no kvfs mount for cold_root (%s): using a directory", e)
        (base / "dir").mkdir()
        yield str(base / "dir"), "ext4 directory (no mount available)"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_one(module: str, func: str, quick: bool, workdir: str) -> dict[str, Any]:
    """Call one figure function; its results normalised, or why it did not run."""
    rec: dict[str, Any] = {"provider": f"bench_{module}.{func}", "status": "ok", "results": [],
                           "series": {}, "info": {}}
    mod, why = _module(module)
    fn = getattr(mod, func, None) if mod is not None else None
    if fn is None:
        rec.update(status="not available", error=why or f"bench_{module}.{func} does not exist")
        log.warning("%s: %s", rec["provider"], rec["error"])
        return rec
    kw: dict[str, Any] = {}
    params = inspect.signature(fn).parameters
    if "quick" in params:
        kw["quick"] = quick
    if "workdir" in params:
        kw["workdir"] = workdir
    if "tmp" in params:
        kw["tmp"] = str(Path(workdir) / "work")
        Path(kw["tmp"]).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        with ExitStack() as stack:
            if "cold_root" in params:
                kw["cold_root"], rec["cold_root"] = stack.enter_context(cold_root(workdir, quick))
            log.info("running %s(%s)", rec["provider"], ", ".join(f"{k}={v!r}" for k, v in kw.items()))
            out = fn(**kw)
    except Exception as e:
        rec.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        log.error("%s failed: %s", rec["provider"], rec["error"])
        return rec
    finally:
        rec["seconds"] = round(time.perf_counter() - t0, 2)
    out = out if isinstance(out, dict) else {"results": list(out or [])}
    if "results" not in out:  # a plain dict of numbers: kept and shown as is, no ratio
        out = {"results": [], "info": {"raw": out}}
    for r in out.get("results", []):
        res = r if isinstance(r, Result) else Result.from_dict(r)
        d = res.to_dict()  # ratio, goal_met and stats recomputed from the samples, uniformly
        if isinstance(r, dict):
            d = {**r, **d}
        d["provider"] = rec["provider"]
        rec["results"].append(d)
    rec["series"] = out.get("series", {}) or {}
    rec["info"] = out.get("info", {}) or {}
    log.info("%s: %d results in %.1f s", rec["provider"], len(rec["results"]), rec["seconds"])
    return rec


def run_flat(module: str, func: str, quick: bool, workdir: str) -> dict[str, Any]:
    """A function returning a flat dict: called several times, read through ``FLAT``."""
    spec = FLAT[func]
    calls = [run_one(module, func, quick, workdir) for _ in range(1 if quick else 3)]
    rec = calls[-1]
    raws = [c["info"].get("raw", {}) for c in calls if c["status"] == "ok"]
    if rec["status"] != "ok" or not raws:
        return rec
    sk, pk = spec["keys"]
    res = Result(spec["figure"], spec["name"], spec["subject"], spec["peer"], spec["unit"],
                 {"subject": [float(r[sk]) for r in raws], "peer": [float(r[pk]) for r in raws]},
                 better=spec["better"], goal=spec["goal"],
                 note=f"{spec['note']}; {len(raws)} calls, each one sample of each (subject first)")
    rec.update(results=[{**res.to_dict(), "provider": rec["provider"]}], seconds=sum(c.get("seconds", 0) for c in calls),
               info={"calls": raws})
    return rec


def group(runs: list[dict[str, Any]], planned: list[tuple[str, str, str | None]]) -> dict[str, dict]:
    """Results grouped by figure (a result's own ``figure`` wins over the plan's)."""
    figs: dict[str, dict] = {}

    def fig(fid: str) -> dict:
        title, peer, _ = FIGURES.get(fid, (f"Figure {fid}", "", []))
        return figs.setdefault(fid, {"title": title, "peer": peer, "results": [], "series": {},
                                     "providers": []})

    for (_, _, pfig), rec in zip(planned, runs, strict=True):
        home = pfig or (rec["results"][0]["figure"] if rec["results"] else "extra")
        fig(home)["providers"].append({k: v for k, v in rec.items() if k not in ("results", "series")})
        for r in rec["results"]:
            fig(str(r.get("figure") or home))["results"].append(r)
        for sid, s in rec["series"].items():
            fig(str(sid) if str(sid) in FIGURES else home)["series"][rec["provider"]] = s
    return figs


# ------------------------------------------------------------------------ plots
def plot(fid: str, f: dict, path: Path) -> bool:
    """One PNG per figure: subject vs peer bars (min/max whiskers), then any series curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a provider with curves is drawn as curves only (its ratios are in the table)
    rows = [r for r in f["results"] if r.get("subject_value") is not None
            and not f["series"].get(r.get("provider", ""))]
    curves = [(prov, key, s) for prov, s in f["series"].items() for key in s if key != "sessions"
              and "sessions" in s]
    n = len(rows) + len(curves)
    if n == 0:
        return False
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows, strict=False):
        who = [("subject", "C0")] + ([("peer", "0.6")] if r.get("peer_value") is not None else [])
        for i, (w, color) in enumerate(who):
            v, st = r[f"{w}_value"], r[f"{w}_stats"]
            err = None
            if r.get("stat", "median") == "median" and st["n"] > 1:
                err = [[v - st["min"]], [st["max"] - v]]
            ax.bar(i, v, color=color, yerr=err, capsize=4)
            ax.text(i, v, fmt_value(v), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(who)))
        ax.set_xticklabels([textwrap.fill(r[w] or w, 22) for w, _ in who], fontsize=7)
        ax.set_ylabel(r["unit"] + (f" ({r['stat']})" if r.get("stat", "median") != "median" else ""))
        met = r.get("goal_met")
        title = textwrap.fill(r["name"], 46) + f"\nratio {fmt_ratio(r.get('ratio'))}, goal {r.get('goal_text', '-')}"
        ax.set_title(title, fontsize=8, color={True: "darkgreen", False: "darkred"}.get(met, "black"))
    for ax, (prov, key, s) in zip(list(axes.flat)[len(rows):], curves, strict=False):
        ax.plot(s["sessions"], s[key], marker="o")
        ax.set_xscale("log")
        ax.set_xlabel("sessions in the volume")
        ax.set_ylabel(key.replace("_", " "))
        ax.set_title(f"{prov.removeprefix('bench_')}: {key.replace('_', ' ')} vs sessions", fontsize=8)
        ax.set_ylim(0, max([v for v in s[key] if v is not None] + [0]) * 1.15 or 1)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"Figure {fid}: {f['title']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------ the page
def _cell(r: dict, who: str) -> str:
    st = r.get(f"{who}_stats") or {}
    v = r.get(f"{who}_value")
    if v is None:
        return "-"
    s = fmt_value(v, r["unit"])
    if st.get("n", 0) > 1:
        s += f" [{fmt_value(st['min'])}–{fmt_value(st['max'])}]"
    return s


def missed_sentence(r: dict) -> str:
    stat = r.get("stat", "median")
    cmp = "at most" if r.get("better") == "lower" else "at least"
    return (f"**Goal missed** — {r['name']}: {r['subject']} measures {fmt_value(r['subject_value'], r['unit'])} "
            f"({stat}) against {fmt_value(r['peer_value'], r['unit'])} for {r['peer']}, a ratio of "
            f"{fmt_ratio(r['ratio'])} where the goal is {cmp} {r['goal']:g}×.")


def render(doc: dict, img_rel: str) -> str:
    figs = dict(doc["figures"])
    for fid, (title, peer, prov) in FIGURES.items():  # every figure has a place on the page
        figs.setdefault(fid, {"title": title, "peer": peer, "results": [], "series": {}, "providers": [
            {"provider": "`, `".join(f"bench_{m}.{f.split('|')[0]}" for m, f in prov),
             "status": "not run", "error": "not selected by --only in this run"}]})
    figs = dict(sorted(figs.items(), key=lambda kv: (len(kv[0]), kv[0])))
    out = ["# Benchmarks", "",
           "Generated by `tools/bench.py` — do not edit by hand; re-run the command below. Every kvfs",
           "figure (the *subject*) is measured in the same run as its *peer*, interleaved sample by",
           "sample, so a busy machine slows both alike. Cells show the median (or the named",
           "percentile) with [min–max] over the repetitions; the ratio is subject / peer.", "",
           "## How it was run", "", f"```\n{doc['command']}\n```", "",
           f"Run {doc['started']} → {doc['finished']} at commit `{doc['git']}`"
           + (" (**--quick**: tiny sizes, few repetitions — smoke numbers, not results)" if doc["quick"] else "")
           + "." + (" Figures this run did not select keep their results from an earlier run in the "
                    "same directory; each such figure names that run, its command and its commit."
                    if any(p.get("from_run") for f in figs.values() for p in f["providers"]) else ""),
           "", describe_machine_md(doc["machine"]), "", "## Summary", "",
           "| # | measurement | subject | peer | ratio | goal | met? |", "|---|---|---|---|---|---|---|"]
    for fid, f in figs.items():
        for r in f["results"]:
            met = {True: "yes", False: "**no**"}.get(r.get("goal_met"), "-")
            out.append(f"| {fid} | {r['name']} | {_cell(r, 'subject')} | {_cell(r, 'peer')} | "
                       f"{fmt_ratio(r.get('ratio'))} | {r.get('goal_text', '-')} | {met} |")
        if not f["results"]:
            out.append(f"| {fid} | {f['title']} | not measured | | | | |")
    for fid, f in figs.items():
        out += ["", f"## Figure {fid}: {f['title']}", "", f"Peer: {f['peer']}.", ""]
        if fid in FIGURE_TEXT:
            out += [textwrap.fill(FIGURE_TEXT[fid], 92), ""]
        for p in f["providers"]:
            if p["status"] != "ok":
                out.append(f"- `{p['provider']}`: **{p['status']}** — {p.get('error', '')}")
            elif "raw" in p.get("info", {}):
                out += [f"- `{p['provider']}` returned no subject/peer results; its output:", "",
                        "```json", json.dumps(p["info"]["raw"], indent=1, default=str), "```", ""]
            elif p.get("cold_root"):
                out.append(f"- `{p['provider']}` read and wrote its cold tier on: {p['cold_root']}.")
            if p.get("from_run"):
                out.append(f"- `{p['provider']}`: from an earlier run ({p['from_run']}).")
        if f["results"]:
            out += ["", "| measurement | subject | peer | subject value | peer value | ratio | goal | met? |",
                    "|---|---|---|---|---|---|---|---|"]
            for r in f["results"]:
                met = {True: "yes", False: "**no**"}.get(r.get("goal_met"), "-")
                out.append(f"| {r['name']} | {r['subject']} | {r['peer'] or '-'} | {_cell(r, 'subject')} | "
                           f"{_cell(r, 'peer')} | {fmt_ratio(r.get('ratio'))} | {r.get('goal_text', '-')} | {met} |")
            notes = sorted({r["note"] for r in f["results"] if r.get("note")})
            out += [""] + [f"- {n}" for n in notes]
            missed = [missed_sentence(r) for r in f["results"] if r.get("goal_met") is False]
            for m in missed:
                out += ["", m]
        if f.get("image"):
            out += ["", f"![Figure {fid}]({img_rel}/{f['image']})"]
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def merge_previous(doc: dict, prev_path: Path) -> None:
    """Functions not run now keep their results from the previous run in the same DIR."""
    try:
        prev = json.loads(prev_path.read_text())
    except (OSError, ValueError):
        return
    if prev.get("quick") != doc["quick"]:
        return
    ran = {p["provider"] for f in doc["figures"].values() for p in f["providers"]}
    for fid, f in prev.get("figures", {}).items():
        old = [p for p in f.get("providers", []) if p["provider"] not in ran]
        if not old:
            continue
        keep = {p["provider"] for p in old}
        cur = doc["figures"].setdefault(fid, {**f, "results": [], "series": {}, "providers": []})
        for p in old:
            p.setdefault("from_run", f"{prev.get('started')} at commit `{prev.get('git')}`: "
                                     f"`{prev.get('command')}`")
        cur["providers"] += old
        cur["results"] += [r for r in f.get("results", []) if r.get("provider") in keep]
        cur["series"].update({k: v for k, v in f.get("series", {}).items() if k in keep})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions (< 3 min)")
    ap.add_argument("--out", default=str(ROOT / "bench-out"), help="results, plots, scratch files")
    ap.add_argument("--only", default="", help="figures (1,8), modules (engine) or module:function")
    ap.add_argument("--docs", default=None, help="write the page here (default: docs/benchmarks.md "
                    "for full runs, DIR/benchmarks.md for --quick)")
    ap.add_argument("--no-docs", action="store_true", help="write results.json and plots only")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kvfs").setLevel(logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    only = [x.strip() for x in a.only.split(",") if x.strip()] or None
    planned = plan(only)
    if not planned:
        log.error("--only %s matches no figure, module or function", a.only)
        return 2
    doc: dict[str, Any] = {
        "command": " ".join(["python", "tools/bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": a.quick, "git": _git(),
        "machine": machine_description(out)}
    runs = [(run_flat if f in FLAT else run_one)(m, f, a.quick, str(out)) for m, f, _ in planned]
    shutil.rmtree(out / "work", ignore_errors=True)
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    doc["figures"] = group(runs, planned)
    if only:
        merge_previous(doc, out / "results.json")
    doc["figures"] = dict(sorted(doc["figures"].items(), key=lambda kv: (len(kv[0]), kv[0])))
    for fid, f in doc["figures"].items():
        name = f"bench_fig{fid}.png"
        try:
            if plot(fid, f, out / name):
                f["image"] = name
        except Exception as e:  # a plot must never lose the numbers
            log.error("plot of figure %s failed: %s", fid, e)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    log.info("wrote %s", out / "results.json")
    docs = None if a.no_docs else Path(a.docs) if a.docs else (out / "benchmarks.md" if a.quick
                                                               else ROOT / "docs" / "benchmarks.md")
    if docs is not None:
        img = docs.parent / "img"
        img.mkdir(parents=True, exist_ok=True)
        for f in doc["figures"].values():
            if f.get("image") and (out / f["image"]).exists():
                shutil.copyfile(out / f["image"], img / f["image"])
        docs.write_text(render(doc, "img"))
        log.info("wrote %s", docs)
    bad = [p for f in doc["figures"].values() for p in f["providers"] if p["status"] == "failed"]
    for fid, f in doc["figures"].items():
        for r in f["results"]:
            print(f"[{fid}] {r['name']}: {fmt_ratio(r.get('ratio'))} (goal {r.get('goal_text', '-')}, "
                  f"met: {r.get('goal_met')})")
        for p in f["providers"]:
            if p["status"] != "ok":
                print(f"[{fid}] {p['provider']}: {p['status']} — {p.get('error', '')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
