"""kill -9 of the mount process in the middle of writes: every fsynced byte survives,
nothing readable is wrong, and the volume checks clean. An aborted FUSE connection closes
the volume cleanly."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount

from kvfs.mount_runner import fusermount_u, wait_unmounted

N_FILES = 4


def blob(j: int) -> bytes:
    return random.Random(j).randbytes(6 << 20)


def writer(m: Mount, synced: dict[int, int], stop: threading.Event) -> None:
    """Append slices of each file's blob; record a size only once its fsync returned."""
    rnd = random.Random(7)
    blobs = [blob(j) for j in range(N_FILES)]
    fds = []
    try:
        for j in range(N_FILES):
            d = m.sessions / f"crash-{j}"
            d.mkdir()
            fds.append(os.open(d / "layer_0", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        size = [0] * N_FILES
        while not stop.is_set():
            j = rnd.randrange(N_FILES)
            n = rnd.choice((512, 4096, 30_000, 200_000))
            if size[j] + n > len(blobs[j]):
                continue
            os.write(fds[j], blobs[j][size[j]:size[j] + n])
            size[j] += n
            if rnd.random() < 0.5:
                os.fsync(fds[j])
                synced[j] = size[j]
    except OSError:
        pass  # the mount died under us
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def test_kill_9_during_writes_keeps_fsynced_bytes(make_mount) -> None:
    m = make_mount()
    synced: dict[int, int] = {}
    stop = threading.Event()
    t = threading.Thread(target=writer, args=(m, synced, stop), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while sum(synced.values()) < 3 << 20 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.02)
    m.kill()  # SIGKILL mid-write, then fusermount3 -u -z the dead mountpoint
    stop.set()
    t.join(timeout=20)
    assert not t.is_alive()
    assert synced, "the writer never got an fsync through"

    m.start()  # recovery: checkpoint + replay of the ring after it
    for j in range(N_FILES):
        path = m.sessions / f"crash-{j}" / "layer_0"
        if j not in synced:
            continue
        data = path.read_bytes()
        assert len(data) >= synced[j], f"file {j}: fsynced {synced[j]}, found {len(data)}"
        assert data == blob(j)[:len(data)], f"file {j}: wrong bytes after the crash"
    assert m.stop() == 0, m.log_text()

    r = subprocess.run([sys.executable, "-m", "kvfs.cli.fsck", str(m.volume), "-q"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_aborted_fuse_connection_still_closes_the_volume_cleanly(make_mount) -> None:
    """The kernel may end the connection (an administrator's abort through fusectl; once
    seen at the end of an unmount after heavy load): the mount exits 0 with the volume
    closed cleanly, and what was fsync'd is there at the next mount."""
    ctl = Path("/sys/fs/fuse/connections")
    if not os.path.ismount(ctl):
        r = subprocess.run(["mount", "-t", "fusectl", "none", str(ctl)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"fusectl is not mounted and cannot be: {r.stderr.decode().strip()}")
    m = make_mount()
    d = m.sessions / "ab"
    d.mkdir()
    data = os.urandom(300_000)
    with open(d / "layer_0", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    (ctl / str(os.minor(os.stat(m.mountpoint).st_dev)) / "abort").write_text("1\n")
    assert m.proc is not None
    assert m.proc.wait(timeout=30) == 0, m.log_text()
    m.proc = None
    if os.path.ismount(m.mountpoint):  # left "not connected" if the unmount did not get through
        fusermount_u(m.mountpoint, lazy=True)
    wait_unmounted(m.mountpoint)
    log = m.log_text()
    assert "volume closed cleanly" in log, log
    m.start()
    assert (d / "layer_0").read_bytes() == data
