"""Shared helpers of the benchmark tools: timing, statistics, cache dropping, the machine.

Owns the ``Result`` record every benchmark figure is reported as, and the contract between
``tools/bench.py`` and the modules it calls (``bench_engine``, ``bench_mount``,
``bench_warm``, ``bench_hot``):

    def some_figure(quick: bool = False, workdir: str | None = None) -> dict:
        return {"results": [Result(...), ...],      # or their ``to_dict()``
                "series": {...},                    # optional: data for curves (x -> y lists)
                "info": {...}}                      # optional: sizes, settings, notes

A result compares a *subject* (kvfs) with a *peer* (what a user would otherwise use),
both measured in the same run, interleaved; ``ratio`` is ``median(subject) /
median(peer)``. ``better`` says which direction wins ("lower" for times, "higher" for
throughputs and compression ratios); ``goal`` is a bound on the ratio in that direction
(``ratio <= goal`` when lower is better, ``ratio >= goal`` when higher is better).

Never imports kvfs, torch or matplotlib: every benchmark module can import it cheaply.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger("bench")

MiB = 1 << 20
KiB = 1 << 10


# ------------------------------------------------------------------------- statistics
def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN when empty."""
    s = sorted(float(x) for x in xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50)


def summarize(xs: Sequence[float]) -> dict[str, float]:
    """median, min, max, p50, p99, mean and n of a list of samples."""
    vals = [float(x) for x in xs]
    if not vals:
        return {"n": 0, "median": math.nan, "min": math.nan, "max": math.nan, "p50": math.nan,
                "p99": math.nan, "mean": math.nan}
    return {"n": len(vals), "median": median(vals), "min": min(vals), "max": max(vals),
            "p50": median(vals), "p99": percentile(vals, 99), "mean": sum(vals) / len(vals)}


def ratio(subject: float | None, peer: float | None) -> float | None:
    """``subject / peer``; None when either is missing, NaN or the peer is zero."""
    if subject is None or peer is None or not math.isfinite(subject) or not math.isfinite(peer):
        return None
    return None if peer == 0 else subject / peer


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.2f}×"


def fmt_value(v: float | None, unit: str = "") -> str:
    """A number with about three significant digits, then its unit."""
    if v is None or not math.isfinite(v):
        return "-"
    a = abs(v)
    s = f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.1 else f"{v:.3g}"
    return f"{s} {unit}".strip()


# ------------------------------------------------------------------------- the record
@dataclass
class Result:
    """One compared measurement: subject vs peer, samples of each, ratio of the medians."""

    figure: str  # the page's figure number ("1".."9"), or a name for extra figures
    name: str  # what is measured, e.g. "random 96 KiB read, p50"
    subject: str  # e.g. "kvfs engine read"
    peer: str  # e.g. "os.pread, ext4 file"; "" when there is no peer
    unit: str  # e.g. "ms", "MiB/s", "x"
    values: dict[str, list[float]] = field(default_factory=dict)  # {"subject": [...], "peer": [...]}
    better: str = "lower"  # "lower" or "higher": which direction of the ratio wins
    goal: float | None = None  # bound on the ratio (<= when lower is better, >= when higher)
    note: str = ""
    stat: str = "median"  # statistic of the samples the ratio uses: "median", "p50", "p99"

    def stats(self, who: str) -> dict[str, float]:
        return summarize(self.values.get(who, []))

    def value(self, who: str) -> float | None:
        vals = self.values.get(who) or []
        if not vals:
            return None
        return percentile(vals, 99) if self.stat == "p99" else median(vals)

    @property
    def ratio(self) -> float | None:
        return ratio(self.value("subject"), self.value("peer"))

    @property
    def goal_met(self) -> bool | None:
        r = self.ratio
        if self.goal is None or r is None:
            return None
        return r <= self.goal if self.better == "lower" else r >= self.goal

    @property
    def goal_text(self) -> str:
        if self.goal is None:
            return "-"
        return f"{'≤' if self.better == 'lower' else '≥'} {self.goal:g}×"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ratio=self.ratio, goal_met=self.goal_met, goal_text=self.goal_text,
                 subject_stats=self.stats("subject"), peer_stats=self.stats("peer"),
                 subject_value=self.value("subject"), peer_value=self.value("peer"))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


# ------------------------------------------------------------------------- timing
def clock() -> float:
    return time.perf_counter()


@contextlib.contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as t: ...`` then ``t[0]`` is the elapsed seconds."""
    out: list[float] = []
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - t0)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def interleave(pairs: Sequence[tuple[str, Callable[[], float]]], reps: int,
               warmup: int = 0) -> dict[str, list[float]]:
    """Run each named measurement ``reps`` times, alternating their order every round.

    Each callable returns its own measured value (so it can exclude its set-up). Round ``i``
    runs the list forwards when ``i`` is even and backwards when odd, so a drift in the
    machine's load hits subject and peer alike. ``warmup`` rounds are run and discarded.
    """
    out: dict[str, list[float]] = {name: [] for name, _ in pairs}
    for i in range(warmup + reps):
        order = pairs if i % 2 == 0 else list(reversed(pairs))
        for name, fn in order:
            v = fn()
            if i >= warmup:
                out[name].append(v)
    return out


# ------------------------------------------------------------------------- caches
def fadvise_dontneed(path: str | os.PathLike[str], sync: bool = True) -> None:
    """Drop a file's clean pages from the page cache (``sync``: write dirty pages first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_caches(paths: Iterable[str | os.PathLike[str]] = (), level: int = 3) -> str:
    """Drop the page cache: the whole system's when root, else ``paths``' pages. Returns how.

    ``echo 3 > /proc/sys/vm/drop_caches`` affects every process on the machine; callers
    that drop before every sample should pass their files and use :func:`fadvise_dontneed`.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fadvise_dontneed(p)
        return "fadvise"


# ------------------------------------------------------------------------- the machine
def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def mount_of(path: str | os.PathLike[str]) -> dict[str, str]:
    """Device, mount point and filesystem type holding ``path`` (from /proc/mounts)."""
    real = os.path.realpath(path)
    best = {"device": "?", "mountpoint": "/", "fstype": "?"}
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        dev, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mountpoint"]):
            best = {"device": dev, "mountpoint": mnt, "fstype": fstype}
    return best


def disk_description(path: str | os.PathLike[str]) -> dict[str, Any]:
    m = mount_of(path)
    d: dict[str, Any] = dict(m, path=str(path))
    try:
        du = shutil.disk_usage(path)
        d.update(size_gib=round(du.total / 2**30, 1), free_gib=round(du.free / 2**30, 1))
    except OSError:
        pass
    name = os.path.basename(m["device"])
    rot = _read(f"/sys/block/{name}/queue/rotational").strip()
    if rot:
        d["rotational"] = rot == "1"
    model = _read(f"/sys/block/{name}/device/model").strip()
    if model:
        d["model"] = model
    return d


def on_tmpfs(path: str | os.PathLike[str]) -> bool:
    return mount_of(path)["fstype"] in ("tmpfs", "ramfs")


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "-"


def machine_description(disk_path: str | os.PathLike[str] = "/var/tmp") -> dict[str, Any]:
    """CPU, cores, RAM, the disk under ``disk_path``, kernel, Python and library versions."""
    cpu = "?"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1),
        "disk": disk_description(disk_path), "kernel": platform.release(),
        "os": _os_name(), "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("numpy", "torch", "transformers", "zstandard",
                                              "safetensors", "pyfuse3")},
        "loadavg_at_start": load,
    }


def _os_name() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return platform.system()


def describe_machine_md(m: dict[str, Any]) -> str:
    """The machine description as a few Markdown bullet lines."""
    d = m.get("disk", {})
    disk = (f"{d.get('device', '?')} ({d.get('fstype', '?')}, "
            f"{'rotational' if d.get('rotational') else 'non-rotational'}"
            f"{', ' + d['model'] if d.get('model') else ''}, {d.get('size_gib', '?')} GiB) "
            f"mounted at {d.get('mountpoint', '?')}, benchmark files under {d.get('path', '?')}")
    vers = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    return "\n".join([
        f"- CPU: {m.get('cpu')} — {m.get('cores')} cores; RAM {m.get('ram_gib')} GiB",
        f"- Disk: {disk}",
        f"- Kernel {m.get('kernel')} ({m.get('os')}); Python {m.get('python')}; {vers}",
        f"- Load average at start: {m.get('loadavg_at_start')} (the machine is shared: "
        "subject and peer are always measured interleaved in the same run)",
    ])


# ------------------------------------------------------------------------- data and peers
def kv_bytes(n: int, seed: int = 0, dtype: str = "float16") -> bytes:
    """``n`` bytes of KV-like data: random normal activations, 16-bit, token-major."""
    import numpy as np

    vals = np.random.default_rng(seed).standard_normal(n // 2, dtype=np.float32)
    if dtype == "bfloat16":
        return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return vals.astype(np.float16).tobytes()


def unlink(*paths: str | os.PathLike[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def dd_seconds(src: str | os.PathLike[str], dst: str | os.PathLike[str], bs: str = "1M") -> float:
    """Seconds ``dd if=src of=dst bs=BS conv=fsync`` reports for the copy (a new ``dst``)."""
    import re

    unlink(dst)
    p = subprocess.run(["dd", f"if={src}", f"of={dst}", f"bs={bs}", "conv=fsync"],
                       capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.eE+-]+) s", p.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {p.stderr!r}")
    return float(m.group(1))


# ------------------------------------------------------------------------- processes
def run_json_child(args: list[str], timeout: float = 600) -> dict[str, Any]:
    """Run ``python args...`` and parse the last stdout line as JSON."""
    import json

    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"child {args} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def vm_rss_kib() -> int:
    """This process's resident set size in KiB (VmRSS)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def bench_dir(out: str | os.PathLike[str] | None = None) -> Path:
    """A scratch directory on a real disk (not tmpfs): ``out``/work, or /var/tmp/kvfs-bench."""
    base = Path(out) / "work" if out else Path("/var/tmp/kvfs-bench")
    base.mkdir(parents=True, exist_ok=True)
    if on_tmpfs(base):
        log.warning("%s is on tmpfs: disk figures will measure RAM, not the disk", base)
    return base
