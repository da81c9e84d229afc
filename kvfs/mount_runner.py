"""Real kvfs mounts run for tests, benchmarks and tools (no pytest import).

``Mount`` runs ``kvfs-mount VOLUME MOUNTPOINT --foreground`` in a subprocess, waits for
the kernel mount with a timeout (raising ``MountFailed`` with the process's stderr and
log if it died), and unmounts with ``fusermount3 -u``, checking the exit code. ``As`` and
``run_as`` run code as another uid (permission tests on ``--allow-other`` mounts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MOUNT_CMD = (sys.executable, "-m", "kvfs.cli.mount")
HAVE_FUSE = os.path.exists("/dev/fuse")
MOUNT_TIMEOUT = 20.0


class MountFailed(AssertionError):
    """The mount process did not come up (an ``AssertionError``: tests report it as a failure)."""


def run_mount(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run the mount command to completion (refusals, daemon mode) and capture its output."""
    return subprocess.run([*MOUNT_CMD, *args], capture_output=True, text=True, timeout=timeout)


def fusermount_u(mountpoint: Path | str, lazy: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)],
                          capture_output=True, text=True, timeout=30)


def wait_unmounted(mountpoint: Path | str, timeout: float = MOUNT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while os.path.ismount(mountpoint):
        if time.monotonic() > deadline:
            raise MountFailed(f"{mountpoint} still mounted after {timeout} s")
        time.sleep(0.02)


class Mount:
    """One mount process over ``volume`` at ``mountpoint``; restartable."""

    def __init__(self, volume: Path, mountpoint: Path, size: str | None = "64M",
                 extra: tuple[str, ...] = ()) -> None:
        self.volume, self.mountpoint, self.size, self.extra = volume, mountpoint, size, extra
        self.log = volume.with_name(volume.name + ".log")
        self.proc: subprocess.Popen[str] | None = None
        mountpoint.mkdir(parents=True, exist_ok=True)

    @property
    def root(self) -> Path:
        return self.mountpoint

    @property
    def sessions(self) -> Path:
        return self.mountpoint / "sessions"

    def start(self) -> Mount:
        assert self.proc is None, "already started"
        args = [*MOUNT_CMD, str(self.volume), str(self.mountpoint),
                "--foreground", "--log", str(self.log), *self.extra]
        if self.size:
            args += ["--size", self.size]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not os.path.ismount(self.mountpoint):
            rc = self.proc.poll()
            if rc is not None:
                out, err = self.proc.communicate()
                self.proc = None
                raise MountFailed(f"the mount exited with {rc} before mounting:\n{err}{out}"
                            f"\nlog:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.kill()
                raise MountFailed(f"mount not live after {MOUNT_TIMEOUT} s\nlog:\n{self.log_text()}")
            time.sleep(0.02)
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"

    def stats(self) -> dict:
        """The mount's ``/.kvfs/stats``."""
        return json.loads((self.root / ".kvfs" / "stats").read_text())

    def pushed(self, timeout: float = 60.0) -> dict:
        """The shared-tier stats once nothing is queued for the cluster and no session
        lease is held (a mount with ``--shared``); MountFailed after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()["shared"]
            if st["queued_bytes"] == 0 and st["queued_sessions"] == 0 and not st["tier_leases_held"]:
                return st
            if time.monotonic() > deadline:
                raise MountFailed(f"{self.mountpoint}: not pushed to the shared tier in "
                                  f"{timeout} s: {st}")
            time.sleep(0.05)

    def stop(self, how: str = "fusermount") -> int:
        """Unmount (``fusermount`` or ``sigterm``), wait for the process; its exit code."""
        assert self.proc is not None
        if how == "fusermount":
            r = fusermount_u(self.mountpoint)
            assert r.returncode == 0, f"fusermount3 -u failed: {r.stderr}"
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=MOUNT_TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self.proc = None
        wait_unmounted(self.mountpoint)
        return rc

    def kill(self) -> None:
        """SIGKILL the mount process (a crash) and detach the dead mountpoint."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=MOUNT_TIMEOUT)
            self.proc = None
        if os.path.ismount(self.mountpoint):
            fusermount_u(self.mountpoint, lazy=True)
            wait_unmounted(self.mountpoint)

    def remount(self) -> Mount:
        assert self.stop() == 0, self.log_text()
        return self.start()


_AS_AGENT = r"""
import os, sys
fds = {}
for line in sys.stdin:
    try:
        out = repr(eval(line, {"os": os, "fds": fds}))
    except OSError as e:
        out = f"errno {e.errno}"
    print(out, flush=True)
"""


def run_as(uid: int, code: str, timeout: float = 120) -> str:
    """Run Python ``code`` (dedented) as ``uid`` with no groups; its stdout, stripped.
    ``AssertionError`` with its stderr if it fails."""
    p = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
         textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


class As:
    """A python process running as another uid that evaluates one expression per line."""

    def __init__(self, uid: int) -> None:
        self.p = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
             sys.executable, "-c", _AS_AGENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")

    def __call__(self, expr: str) -> str:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(expr + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(timeout=10)
