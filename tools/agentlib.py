"""Helpers shared by the agent tools (``tools/demo.py``, ``tools/agent_day.py``).

Owns: running ``mount.py`` in the foreground in a subprocess over a temp volume (or a plain
directory with ``use_mount=False``) and unmounting it, the checks for whether a mount is
possible here, the warm tier's temp directory on tmpfs; and observing (the mount's generated
``/.kvfs/stats`` and ``/.kvfs/metrics``, histogram quantiles, a process's resident memory,
latency samples). The byte-exact checks are in ``agent_exact.py``, the agent day's page and
plot in ``agent_day_report.py``.

Never imports torch or numpy at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
