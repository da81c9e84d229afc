"""Helpers shared by the agent tools (``tools/demo.py``, ``tools/agent_day.py``).

Owns: running ``mount.py`` in the foreground in a subprocess over a temp volume (or a plain
directory with ``use_mount=False``) and unmounting it, the checks for whether a mount is
possible here, the warm tier's temp directory on tmpfs; observing (the mount's generated
``/.kvfs/stats`` and ``/.kvfs/metrics``, histogram quantiles, a process's resident memory,
latency samples); exactness (a per-session record of every K/V byte the model produced, fed
from the cache's layers, and the comparisons of recalled, windowed and stored bytes with it);
pages made of marked sections; and the rendering of an agent day's results (table, notes,
plot) for ``docs/agent-day.md``.

Never imports torch at module level (only the exactness helpers use it, when called).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class Volume:
    """``mount.py`` in the foreground in a subprocess, or a plain directory (``use_mount=False``).

    ``size`` creates the volume; ``options`` are extra ``mount.py`` arguments (e.g.
    ``["--profile", "iot", "-o", "checkpoint_interval_s=2"]``); ``say`` prints the story
    (``None``: quiet).
    """

    def __init__(self, base: Path, use_mount: bool, *, size: str = "256M",
                 options: Sequence[str] = (), say: Callable[[str], None] | None = print) -> None:
        self.base = base
        self.mnt = base / "mnt"
        self.mnt.mkdir()
        self.volume = base / "volume.kvfs"
        self.log = base / "mount.log"
        self.proc: subprocess.Popen | None = None
        self.use_mount = use_mount
        self.size = size
        self.options = list(options)
        self.say = say or (lambda _msg: None)
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> Volume:
        if not self.use_mount:
            (self.mnt / "sessions").mkdir()  # the layout a mounted volume shows
            self.say(f"cold tier: plain directory {self.mnt} (--no-mount)")
            return self
        tail = ["--size", self.size, "--foreground", *self.options]
        args = [sys.executable, "-m", "kvfs.cli.mount", str(self.volume), str(self.mnt), *tail,
                "--log", str(self.log)]
        self.say("$ " + " ".join(["kvfs-mount", str(self.volume), str(self.mnt), *tail]) + " &")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise SystemExit(f"mount.py exited with {self.proc.returncode}: {err.strip() or out.strip()}"
                                 f"\n(see {self.log}; run with --no-mount to use a plain directory)")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit("mount.py did not mount within 30 s")
            time.sleep(0.05)
        self.say(f"mounted {self.volume.name} at {self.mnt}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is None:
            return
        self.say(f"$ fusermount3 -u {self.mnt}")
        r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            self.say(f"fusermount3 -u failed ({r.returncode}): {r.stderr.strip()}; stopping mount.py")
            self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.say(f"mount.py exited with {rc} ({'clean unmount' if rc == 0 else 'see ' + str(self.log)})")
        self.returncode = rc
        self.proc = None


def mount_available() -> tuple[bool, str]:
    if not os.path.exists("/dev/fuse"):
        return False, "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return False, "fusermount3 is not installed"
    return True, ""


def warm_dir(base: Path, prefix: str = "kvfs-demo-warm-") -> Path:
    """The warm tier lives on tmpfs (/dev/shm) when there is one, as in production."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=prefix, dir=shm))
    return base / "warm"


# --------------------------------------------------------------------------- observing
def mount_stats(mnt: Path) -> dict[str, Any] | None:
    """``/.kvfs/stats`` of a mounted volume as a dict (None when not mounted or unreadable)."""
    try:
        return json.loads((mnt / ".kvfs" / "stats").read_bytes())
    except (OSError, ValueError):
        return None


def mount_metrics(mnt: Path) -> dict[str, float] | None:
    """``/.kvfs/metrics`` of a mounted volume, parsed (``kvfs.metrics.parse``)."""
    from kvfs.ops import metrics  # noqa: PLC0415 - keeps this module import-light

    try:
        return metrics.parse((mnt / ".kvfs" / "metrics").read_bytes())
    except (OSError, ValueError):
        return None


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size of a process (``VmRSS`` in /proc), None if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- exactness
def token_major(k: Any, v: Any) -> np.ndarray:
    """The layer-file bytes of ``[1, H, T, D]`` K/V tensors (per token K then V), as uint8."""
    import torch  # noqa: PLC0415 - callers have it loaded already

    tm = torch.stack((k[0].transpose(0, 1), v[0].transpose(0, 1)), dim=1).contiguous().cpu()
    return tm.reshape(-1).view(torch.uint8).numpy()


class KVRecord:
    """Every K/V byte a session's model produced, per layer, token-major (the reference).

    :func:`record_into` makes a cache feed it from each layer's ``update`` (the states the
    attention layers hand to the cache, before any tiering), so it is independent of what the
    tiers store and read back. One buffer for all layers, grown by doubling from ``tokens``
    (few, same-sized allocations: a long-running generator must not fragment its own heap).
    """

    def __init__(self, num_layers: int, token_bytes: int, tokens: int = 64) -> None:
        self.token_bytes = token_bytes
        self.buf = np.empty((num_layers, max(1, tokens) * token_bytes), np.uint8)
        self.ends = [0] * num_layers

    @classmethod
    def of(cls, layers: Sequence[np.ndarray], token_bytes: int) -> KVRecord:
        """A record holding ``layers`` (uint8, one per layer, equal lengths)."""
        rec = cls(len(layers), token_bytes, max(1, len(layers[0]) // token_bytes))
        for i, data in enumerate(layers):
            rec.buf[i, :len(data)] = data
            rec.ends[i] = len(data)
        return rec

    @property
    def tokens(self) -> int:
        return self.ends[0] // self.token_bytes

    def add(self, layer: int, k: Any, v: Any) -> None:
        data, end = token_major(k, v), self.ends[layer]
        if end + len(data) > self.buf.shape[1]:
            grown = np.empty((self.buf.shape[0], max(2 * self.buf.shape[1], end + len(data))), np.uint8)
            grown[:, :self.buf.shape[1]] = self.buf
            self.buf = grown
        self.buf[layer, end:end + len(data)] = data
        self.ends[layer] = end + len(data)

    def span(self, layer: int, start: int, end: int) -> np.ndarray:
        """Bytes of tokens ``[start, end)`` of ``layer`` (a view)."""
        return self.buf[layer, start * self.token_bytes:end * self.token_bytes]

    def layer(self, layer: int) -> np.ndarray:
        """Every byte of ``layer`` so far (a view)."""
        return self.buf[layer, :self.ends[layer]]


def record_into(cache: Any, rec: KVRecord) -> None:
    """Wrap each layer's ``update`` of a ``TieredCache`` so its inputs go to ``rec`` too.

    The wrapper holds its layer and ``rec`` weakly (the caller keeps ``rec``): a cache's
    layers and the cache refer to each other, so anything they hold lives until the cyclic
    collector runs, and a busy day would pile up the records of finished sessions.
    """
    for lay in cache.layers:
        lay.update = _recording_update(weakref.ref(lay), type(lay).update, lay.idx, weakref.ref(rec))


def _recording_update(layer: Any, cls_update: Any, idx: int, rec: Any) -> Any:
    def update(k: Any, v: Any, *a: Any, **kw: Any) -> Any:
        r = rec()
        if r is not None:
            r.add(idx, k, v)
        return cls_update(layer(), k, v, *a, **kw)

    return update


def recall_exact(cache: Any, rec: KVRecord, rounds: list[int], attended_start: int) -> bool | None:
    """Whether the recalled copies of ``rounds`` (what ``cache.recall`` just returned, with the
    window's ``attended_start`` at that moment) are the produced bytes; None: nothing was read."""
    p = min(cache.sink_tokens, cache.seen)  # the sinks are attended already: never recalled
    spans = [(max(a, p), min(b, attended_start)) for a, b in (cache.rounds[r] for r in rounds)]
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        return None
    tb = rec.token_bytes
    for lay in cache.layers:
        got, at, checked = token_major(lay.recall_keys, lay.recall_values), 0, []
        if len(got) != sum(b - a for a, b in spans) * tb:
            return False
        for a, b in spans:
            want = rec.span(lay.idx, a, b)
            shift = cache.recall_shifts[len(checked)]
            checked.append(shift)
            if shift:  # re-rotated: the keys moved by the cache's own rotation
                want = _rotated(cache, want, b - a, shift)
            if not np.array_equal(got[at:at + (b - a) * tb], want):
                return False
            at += (b - a) * tb
    return True


def _rotated(cache: Any, produced: np.ndarray, tokens: int, shift: int) -> np.ndarray:
    """Token-major bytes of ``tokens`` produced tokens with their keys moved ``shift``
    positions by the cache's own rotation (what a re-rotating cache holds)."""
    from kvfs.torch.fingerprint import kv_from_bytes

    k, v = kv_from_bytes(produced, cache.geo, tokens)
    return token_major(cache.rope.rotate(k, shift), v)


def window_exact(cache: Any, rec: KVRecord) -> bool:
    """Whether the cache has seen what ``rec`` holds and what its device holds (the sinks,
    then the window) is those bytes."""
    def held(lay: Any) -> np.ndarray:
        p = lay.pinned
        sinks = rec.span(lay.idx, 0, p)
        if lay.sink_shift:  # re-rotating: the sinks' keys sit just before the window
            sinks = _rotated(cache, sinks, p, lay.sink_shift)
        return np.concatenate([sinks, rec.span(lay.idx, lay.window_start, lay.seen)])

    return rec.tokens == cache.seen and all(
        np.array_equal(token_major(lay.keys, lay.values), held(lay))
        for lay in cache.layers if lay.stored)


def stored_layers(warm: Any, sid: str, num_layers: int, token_bytes: int, tokens: int) -> list[np.ndarray]:
    """The first ``tokens`` tokens of every layer as stored (warm and/or cold; no promotion)."""
    return [warm.read(sid, layer, 0, tokens * token_bytes, promote=False) for layer in range(num_layers)]


def digests(layers: Sequence[np.ndarray]) -> list[bytes]:
    """SHA-256 of each layer's bytes (what a session keeps while it waits for a return visit)."""
    return [hashlib.sha256(np.ascontiguousarray(data)).digest() for data in layers]


# --------------------------------------------------------------------------- latencies
class Latencies:
    """Latency samples in ms (a flat ``array('d')``: 8 bytes a sample, no object per sample)."""

    def __init__(self) -> None:
        from array import array  # noqa: PLC0415

        self.ms = array("d")

    def add(self, ms: float) -> None:
        self.ms.append(ms)

    def __len__(self) -> int:
        return len(self.ms)

    def quantiles(self, start: int = 0, qs: Sequence[float] = (0.5, 0.99)) -> list[float | None]:
        """Quantiles of the samples from index ``start`` on (None when there are none)."""
        import numpy as np  # noqa: PLC0415

        a = np.frombuffer(self.ms, dtype=np.float64)[start:] if len(self.ms) else np.empty(0)
        if not len(a):
            return [None for _ in qs]
        return [float(np.quantile(a, q)) for q in qs]


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus-style quantile of cumulative bucket counts ``{upper bound: count}``
    (linear inside a bucket; the last finite bound for the +Inf bucket)."""
    items = sorted(buckets.items())
    total = items[-1][1] if items else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo_b, lo_c = 0.0, 0.0
    for bound, count in items:
        if count >= rank:
            if bound == float("inf"):
                return lo_b
            return lo_b + (bound - lo_b) * ((rank - lo_c) / (count - lo_c) if count > lo_c else 1.0)
        lo_b, lo_c = bound, count
    return lo_b


def histogram_buckets(parsed: dict[str, float], name: str) -> dict[float, float]:
    """``{le: cumulative count}`` of histogram ``name`` from ``kvfs.metrics.parse`` output."""
    out: dict[float, float] = {}
    prefix = f"{name}_bucket{{le=\""
    for key, val in parsed.items():
        if key.startswith(prefix):
            out[float(key[len(prefix):-2])] = val
    return out


def local_histogram(name: str) -> tuple[dict[float, float], float, float]:
    """``({le: cumulative count}, sum, count)`` of histogram ``kvfs.metrics.<name>`` of this
    process (take two and subtract: the registry lives as long as the process)."""
    from kvfs.ops import metrics  # noqa: PLC0415

    h = getattr(metrics, name)
    buckets: dict[float, float] = {}
    for fam in h.collect():
        for smp in fam.samples:
            if smp.name.endswith("_bucket"):
                buckets[float(smp.labels["le"])] = smp.value
    total, count = metrics.histogram_totals(h)
    return buckets, total, count


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
    for k, lab in (("evict_ms", "warm eviction, one group (mean)"), ("cold_p50", "cold read p50 (agent, via FUSE)"),
                   ("cold_p99", "cold read p99 (agent, via FUSE)"), ("engine_p99", "kv_cold_read_p99_ms (mount)")):
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
    if eng:
        w1 = eng["within_1ms"]
        rows.append(("cold read p50 / p99 in the mount (`kv_cold_read_ms`, the day's reads)",
                     f"≈ {_ms(eng['p50'])} / ≈ {_ms(eng['p99'])} ms (bucket estimates); "
                     f"{'n/a' if w1 is None else f'{w1:.2%}'} of {n(eng['reads']):,} reads ≤ 1 ms; "
                     f"`kv_cold_read_p99_ms` sampled: {_ms(eng['gauge_end'])} ms at the end, max {_ms(eng['gauge_max'])} ms",
                     "p99 < 1 ms", met["cold read p99 < 1 ms"]))
    rows.append((f"cold read p50 / p99 as the agent sees it (open + preadv + close of a layer file "
                 f"{'through FUSE' if eng else 'in the cold directory'}, timed in the agent)",
                 f"{_ms(res['cold_read_p50_ms'])} / {_ms(agent)} ms ({res['cold_reads']:,} reads)",
                 "p99 < 1 ms" if not eng else "(end to end; not the tier's goal)",
                 met["cold read p99 < 1 ms"] if not eng else "" if agent is None or agent < 1 else "above 1 ms"))
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
    if res["engine_cold_read"] and agent is not None and agent >= 1:
        inside = "meets" if dict(res["goals"])["cold read p99 < 1 ms"] else "misses"
        out.append(f"The cold read as the agent sees it is above 1 ms at p99 ({agent:.1f} ms; p50 "
                   f"{res['cold_read_p50_ms']:.2f} ms): three FUSE round trips (open, read, close) served by the "
                   f"mount process while the agent's forward passes keep one of the host's {res['cpus']} cores busy. "
                   f"The read inside the mount {inside} the goal.")
    if prof.warm_migrate_at > prof.alert_warm_pct and c["alerts_outside"]:
        out.append(f"The {prof.name} profile migrates warm at {prof.warm_migrate_at:.0%} but its warm alert fires "
                   f"above {prof.alert_warm_pct:.0%}: in normal operation the warm tier sits between the two, so the "
                   f"alert fired {int(c['alerts_outside'])} times outside the drills (each firing migrates a group "
                   "early). The article's values; a threshold pair to revisit.")
    for name, ok in res["goals"]:
        if not ok:
            out.append(f"Goal missed: {name} (see the table).")
    return out
