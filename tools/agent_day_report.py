"""The agent day's report (``tools/agent_day.py``): pages made of marked sections, the plot
of a day's samples, and the table, notes and section of a day's results for
``docs/agent-day.md``.

Never imports matplotlib at module level (only :func:`plot_day`, when called).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


# --------------------------------------------------------------------------- pages
def section(page: str, key: str) -> str | None:
    """The text between the markers of ``key`` (None when absent)."""
    begin, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    i = page.find(begin)
    j = page.find(end, i + len(begin)) if i >= 0 else -1
    return None if i < 0 or j < 0 else page[i + len(begin):j].strip("\n")


def write_sections(page: Path, order: Sequence[str], prefix: str, name: str, body: str,
                   default_head: str) -> None:
    """Rewrite ``page`` with ``body`` as the marked section ``prefix:name``. Everything before
    the first marked section (the page's hand-written head; ``default_head`` for a new page)
    and the other sections of ``order`` stay as they are; sections come in ``order``."""
    old = page.read_text() if page.exists() else ""
    i = old.find(f"<!-- {prefix}:")
    head = (old if i < 0 else old[:i]).strip() or default_head
    parts = [head.rstrip()]
    for n in order:
        text = body if n == name else section(old, f"{prefix}:{n}")
        if text:
            parts.append(f"<!-- {prefix}:{n} -->\n{text.rstrip()}\n<!-- /{prefix}:{n} -->")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n\n".join(parts) + "\n")


# --------------------------------------------------------------------------- plots
def plot_day(rows: list[dict[str, Any]], path: Path, title: str, *, drills: Sequence[tuple[str, float, float]],
             restarts_h: Sequence[float], device_line: float, warm_line: float) -> None:
    """Six panels over the simulated hours of ``rows`` (``tools/agent_day.py``'s samples):
    load, tier usage, hot hit rate, latencies, cumulative moves and alerts, RSS."""
    import math  # noqa: PLC0415

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    h = [r["h"] for r in rows]

    def col(k: str, scale: float = 1.0) -> list[float]:
        return [math.nan if r[k] is None else r[k] * scale for r in rows]

    rate = [math.nan] + [(b["interactions"] - a["interactions"]) / max(b["h"] - a["h"], 1e-9)
                         for a, b in zip(rows, rows[1:], strict=False)]
    fig, ax = plt.subplots(6, 1, figsize=(10, 15), sharex=True)
    ax[0].plot(h, col("active"), label="active sessions")
    ax[0].set_ylabel("sessions")
    ax[0].legend(loc="upper left")
    twin = ax[0].twinx()
    twin.plot(h, rate, color="tab:gray", lw=0.8, label="turns per simulated hour")
    twin.set_ylabel("turns / h")
    twin.legend(loc="upper right")
    ax[1].plot(h, col("hot_ratio", 100), label="device (% of budget)")
    ax[1].plot(h, col("warm_ratio", 100), label="warm (% of cap)")
    ax[1].axhline(device_line * 100, ls=":", color="tab:blue", lw=0.8)
    ax[1].axhline(warm_line * 100, ls=":", color="tab:orange", lw=0.8)
    ax[1].set_ylabel("% used")
    ax[1].legend(loc="upper left")
    twin = ax[1].twinx()
    twin.plot(h, col("cold_used", 1 / (1 << 20)), color="tab:green", label="cold ring in use (MiB)")
    twin.set_ylabel("MiB")
    twin.legend(loc="lower right")
    ax[2].plot(h, col("hit_rate", 100), label="hot hit rate (per sample)")
    ax[2].axhline(95, ls=":", color="red", lw=0.8)
    ax[2].set_ylabel("%")
    ax[2].legend(loc="lower left")
    for k, lab in (("evict_ms", "warm eviction, one group (mean)"), ("cold_p50", "cold read p50 (as the agent sees it)"),
                   ("cold_p99", "cold read p99 (as the agent sees it)"), ("engine_p99", "kv_cold_read_p99_ms (mount)")):
        ax[3].plot(h, col(k), marker=".", lw=0.8, label=lab)
    ax[3].axhline(1.0, ls=":", color="red", lw=0.8)
    ax[3].set_yscale("log")
    ax[3].set_ylabel("ms")
    ax[3].legend(loc="upper left", fontsize=8)
    for k, lab in (("moves", "hot → warm rounds (watermark)"), ("migrations", "warm → cold sessions"),
                   ("promotions", "cold → warm promotions"), ("alerts", "alerts fired")):
        ax[4].plot(h, col(k), label=lab, drawstyle="steps-post")
    ax[4].set_yscale("symlog")
    ax[4].set_ylabel("cumulative")
    ax[4].legend(loc="upper left", fontsize=8)
    ax[5].plot(h, col("rss", 1 / (1 << 20)), label="agent process")
    ax[5].plot(h, col("mount_rss", 1 / (1 << 20)), label="mount.py")
    ax[5].set_ylabel("RSS MiB")
    ax[5].set_ylim(bottom=0)
    ax[5].legend(loc="lower right")
    ax[5].set_xlabel("simulated hour of the day")
    ax[5].set_xlim(0, 24)
    ax[5].set_xticks(range(0, 25, 2))
    for a in ax:
        for kind, start, end in drills:
            a.axvspan(start, end, color="tab:red" if kind == "device" else "tab:purple", alpha=0.1)
        for r in restarts_h:
            a.axvline(r, color="black", lw=0.6, ls="--")
    fig.suptitle(f"{title} (shaded: alert drills, red device / purple warm; dashed: restarts)")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --------------------------------------------------------------------------- the agent-day report
def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}" if v < 1 else f"{v:.1f}"


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / (1 << 20):.1f} MiB"


def day_figures(res: dict[str, Any], prof: Any) -> list[tuple[str, str, str, str]]:
    """(figure, value, goal, met) rows of a day's report; met is "yes", "**NO**", "" or a note."""
    c, rss, ev, eng, mr = res["counts"], res["rss"], res["warm_evict"], res["engine_cold_read"], res["mount_rss"]
    met = {name: "yes" if ok else "**NO**" for name, ok in res["goals"]}
    hr, n = res["hit_rate"], int
    topic = (f"; the recall by summary found the earlier topic's round {n(c['recall_topic_ok'])} times of "
             f"{n(c['recall_topic_checks'])}" if c["recall_topic_checks"] else "")
    agent = res["cold_read_p99_ms"]
    rows = [
        ("interactions served", f"{n(c['interactions']):,} turns ({n(c['steps']):,} forward steps) in "
         f"{n(c['sessions']):,} sessions, {n(c['returns']):,} return visits, {n(c['recalls']):,} recalls{topic}",
         "", ""),
        ("OOMs (torch OOM / MemoryError caught per turn)", f"{n(c['oom'])}", "0", met["OOMs"]),
        ("other errors", f"{n(c['errors'])}", "0", met["errors"]),
        ("hot hit rate", f"{'n/a' if hr is None else f'{hr:.2%}'}: {n(c['hits']):,} of {n(c['steps']):,} steps "
         f"served from the hot window without waiting on a read; misses: {n(c['miss_recall'])} after a recall, "
         f"{n(c['miss_resume'])} first steps after a resume, {n(c['miss_refill'])} refills after budget moves",
         "≥ 95 %", met["hot hit rate >= 95 %"]),
    ]
    how = {"channel": "through the mount's native channel: its extents, then the volume read directly",
           "files": "open + preadv + close of the layer files" + (" through FUSE" if eng else "")}.get(
        res.get("cold_kind", "files"), res.get("cold_kind", ""))
    rows.append((f"cold read p50 / p99 as the agent sees it ({how}; one call of the warm tier's cold "
                 "backend, timed in the agent)",
                 f"{_ms(res['cold_read_p50_ms'])} / {_ms(agent)} ms ({res['cold_reads']:,} reads)",
                 "p99 < 1 ms", met["cold read p99 < 1 ms"]))
    if eng:
        w1 = eng["within_1ms"]
        rows.append(("cold read p50 / p99 inside the mount (`kv_cold_read_ms`: reads through its FUSE "
                     "face, the agent's when it uses the files)",
                     f"≈ {_ms(eng['p50'])} / ≈ {_ms(eng['p99'])} ms (bucket estimates); "
                     f"{'n/a' if w1 is None else f'{w1:.2%}'} of {n(eng['reads']):,} reads ≤ 1 ms; "
                     f"`kv_cold_read_p99_ms` sampled: {_ms(eng['gauge_end'])} ms at the end, max {_ms(eng['gauge_max'])} ms",
                     "", ""))
    rows += [
        ("warm eviction latency (one LRU group written to the mount, fsynced, dropped)",
         f"mean {_ms(ev['mean'])} ms, p99 ≈ {_ms(ev['p99'])} ms ({ev['n']} groups)" if ev["n"] else "none",
         "", ""),
        ("peak usage", f"device {res['hot_peak']:.0%} of the budget (watermark {prof.device_watermark:.0%}), "
         f"warm {res['warm_peak']:.0%} of the cap (migrates at {prof.warm_migrate_at:.0%}); cold: "
         f"{_mib(res['cold_used_end'])} of the ring in use at the end", "", ""),
        ("migrations", f"{res['moves']:,} rounds hot → warm (watermark), {res['migrations']:,} sessions "
         f"warm → cold, {res['promotions']:,} promoted cold → warm", "", ""),
        ("alerts fired", f"{n(c['alerts_in_drill'] + c['alerts_outside'])}: {n(c['alerts_in_drill'])} during "
         f"the drills, {n(c['alerts_outside'])} outside", "", ""),
        ("agent process RSS", f"{_mib(rss['start'])} at {rss['at_h']:.1f} h → {_mib(rss['end'])} at the end, "
         f"max {_mib(rss['max'])} (+{_mib(rss['growth'])}; {_mib(rss['first'])} at 0 h)",
         "flat: + ≤ max(5 %, 16 MiB)", met["flat RSS"]),
        ("mount.py RSS", f"{_mib(mr['start'])} → {_mib(mr['end'])}, max {_mib(mr['max'])}" if mr else "n/a", "", ""),
        ("byte-exact checks", f"{n(c['check_recall']):,} recalls, {n(c['check_window']):,} hot windows, "
         f"{n(c['check_stored']):,} stored histories (retired or resumed sessions): {res['mismatches']} "
         f"mismatches", "0", met["byte mismatches"]),
        ("resume after a restart", f"{n(c['check_resume_gen'] - c['bad_resume_gen'])} of "
         f"{n(c['check_resume_gen'])} sessions continued exactly as a copy that never stopped "
         f"({n(c['restarts'])} restarts, slowest close + reopen {c['restart_ms']:.0f} ms)", "all",
         met["resumed sessions continue identically"]),
    ]
    return rows


def day_section(res: dict[str, Any], prof: Any, argv: list[str], img: str) -> str:
    """The page section of one ``tools/agent_day.py`` result (``res``) for profile ``prof``."""
    lines = [f"## {prof.name}", "", f"Workload: {res['story']}.", "",
             f"Command: `python tools/agent_day.py {' '.join(argv)}`{' (its ' + prof.name + ' part)' if 'all' in argv else ''}"
             f"; run {res['date']} on {res['host']}: "
             f"{res['real_s']:.0f} s real for 24 simulated hours (1 real second = {res['speed']:.0f} "
             f"simulated seconds).", "",
             f"Set-up: {res['geo']}; hot window {prof.max_kv_len} tokens, device budget "
             f"{res['budget_bytes'] / 1024:.0f} KiB ({res['budget_windows']:g} × {res['peak_sessions']} peak sessions "
             f"× one window; watermark {prof.device_watermark:.0%}); warm cap {res['warm_cap'] >> 20} MiB on tmpfs, "
             f"{prof.warm_shards:,} shards by {'device id' if prof.shard_key == 'device' else 'md5(session id)'}, "
             f"migrate at {prof.warm_migrate_at:.0%} in groups of {prof.lru_group}; cold: {res['cold']}.", "",
             "| figure | value | goal | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {goal} | {ok} |" for name, value, goal, ok in day_figures(res, prof)]
    lines += ["", f"![{prof.name}: a simulated day]({img})", ""]
    missed = [name for name, ok in res["goals"] if not ok]
    lines.append("**Every goal met.**" if not missed else f"**Goals missed: {', '.join(missed)}.**")
    lines += [f"- {note}" for note in res["notes"]]
    lines += ["", "Events (simulated time): " + "; ".join(res["events"]) + "."]
    return "\n".join(lines)


def day_notes(res: dict[str, Any], prof: Any) -> list[str]:
    """Plain statements about figures that miss a goal or need a word."""
    out = []
    c, agent = res["counts"], res["cold_read_p99_ms"]
    if agent is not None and agent >= 1:
        path = ("its extents from the mount (one request) and a direct read of the volume"
                if res.get("cold_kind") == "channel" else
                "three FUSE round trips (open, read, close) served by the mount process")
        out.append(f"The cold read as the agent sees it is above 1 ms at p99 ({agent:.1f} ms; p50 "
                   f"{res['cold_read_p50_ms']:.2f} ms): {path}, while the agent's forward passes keep "
                   f"one of the host's {res['cpus']} cores busy.")
    if prof.warm_migrate_at > prof.alert_warm_pct and c["alerts_outside"]:
        out.append(f"The {prof.name} profile migrates warm at {prof.warm_migrate_at:.0%} but its warm alert fires "
                   f"above {prof.alert_warm_pct:.0%}: in normal operation the warm tier sits between the two, so the "
                   f"alert fired {int(c['alerts_outside'])} times outside the drills (each firing migrates a group "
                   "early). The article's values; a threshold pair to revisit.")
    for name, ok in res["goals"]:
        if not ok:
            out.append(f"Goal missed: {name} (see the table).")
    return out
