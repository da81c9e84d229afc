"""Shared fixtures: real kvfs mounts through /dev/fuse.

``Mount`` runs ``mount.py VOLUME MOUNTPOINT --foreground`` in a subprocess, waits for the
kernel mount with a timeout (failing with the process's stderr if it died), and unmounts
with ``fusermount3 -u``, checking the exit code. Mount tests are skipped only when
/dev/fuse is absent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MOUNT_PY = ROOT / "mount.py"
HAVE_FUSE = os.path.exists("/dev/fuse")
MOUNT_TIMEOUT = 20.0


def run_mount_py(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run mount.py to completion (refusals, daemon mode) and capture its output."""
    return subprocess.run([sys.executable, str(MOUNT_PY), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def fusermount_u(mountpoint: Path | str, lazy: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)],
                          capture_output=True, text=True, timeout=30)


def wait_unmounted(mountpoint: Path | str, timeout: float = MOUNT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while os.path.ismount(mountpoint):
        assert time.monotonic() < deadline, f"{mountpoint} still mounted"
        time.sleep(0.02)


class Mount:
    """One mount.py process over ``volume`` at ``mountpoint``; restartable."""

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
        args = [sys.executable, str(MOUNT_PY), str(self.volume), str(self.mountpoint),
                "--foreground", "--log", str(self.log), *self.extra]
        if self.size:
            args += ["--size", self.size]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not os.path.ismount(self.mountpoint):
            rc = self.proc.poll()
            if rc is not None:
                out, err = self.proc.communicate()
                self.proc = None
                pytest.fail(f"mount.py exited with {rc} before mounting:\n{err}{out}"
                            f"\nlog:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"mount not live after {MOUNT_TIMEOUT} s\nlog:\n{self.log_text()}")
            time.sleep(0.02)
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"

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


need_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator:
    """A factory of fresh mounts in tmp_path; each is unmounted (exit 0 checked) after."""
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    mounts: list[Mount] = []

    def make(name: str = "vol", size: str | None = "64M", extra: tuple[str, ...] = (),
             start: bool = True) -> Mount:
        m = Mount(tmp_path / f"{name}.kvfs", tmp_path / f"{name}.mnt", size, extra)
        mounts.append(m)
        return m.start() if start else m

    yield make
    failures = []
    for m in mounts:
        if m.proc is not None:
            rc = m.stop()
            if rc != 0:
                failures.append(f"{m.volume}: exit {rc}\n{m.log_text()}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def kvfs(make_mount) -> Mount:
    """A fresh 64 MiB volume mounted in the foreground."""
    return make_mount()


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One mount for a whole test module (each test uses its own session names)."""
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    d = tmp_path_factory.mktemp("shared")
    m = Mount(d / "vol.kvfs", d / "mnt", "64M").start()
    yield m
    if m.proc is not None:
        rc = m.stop()
        assert rc == 0, m.log_text()
