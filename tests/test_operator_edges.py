"""An operator's rough edges, each found by using the tools as a new operator would:
``kvfs-stat | head`` ended in a BrokenPipeError traceback, creating a large volume showed
nothing for minutes, and the README described another demo than ``tools/demo.py`` runs.
(fsck on a mounted volume: tests/test_needs_fsck.py; a refused metrics port and the
agents' gauges: tests/test_mount_metrics_port.py.)"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, ROOT, fusermount_u

from kvfs.engine.store import Store

MB = 1 << 20


def run_into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a console script whose stdout's reader has already gone (``| head`` done)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    finally:
        os.close(w)


@pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")
def test_kvfs_stat_into_a_closed_pipe_is_quiet(make_mount) -> None:
    m = make_mount()
    (m.sessions / "s").mkdir()
    for args in ([], ["--json"]):
        p = run_into_closed_pipe(["kvfs.cli.stat", str(m.root), *args])
        assert p.returncode == 0 and "Traceback" not in p.stderr and not p.stderr, p.stderr


def test_dump_and_fsck_into_a_closed_pipe_are_quiet(tmp_path: Path) -> None:
    vol = tmp_path / "v.kvfs"
    s = Store.create(str(vol), 16 * MB)
    for i in range(50):
        s.create_session(f"s{i}")
    s.close()
    for mod in ("kvfs.cli.dump", "kvfs.cli.fsck"):
        p = run_into_closed_pipe([mod, str(vol)])
        assert p.returncode == 0 and "Traceback" not in p.stderr, (mod, p.stderr)


def test_volume_fill_reports_progress(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    Store.create(str(tmp_path / "v.kvfs"), 40 * MB, fill=True,
                 progress=lambda done, total: seen.append((done, total))).close()
    assert seen and seen[-1] == (40 * MB, 40 * MB)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))


@pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")
def test_creating_a_volume_shows_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    """Before: a zero-filled volume of many GB took minutes with nothing on the screen."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvfs.cli.mount", str(tmp_path / "big.kvfs"),
                             str(mnt), "--size", "192M", "--foreground"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt) and time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        while select.select([master], [], [], 0.5)[0]:  # what the bar wrote before the mount
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
        assert os.path.ismount(mnt), seen.decode(errors="replace")
    finally:
        if os.path.ismount(mnt):
            fusermount_u(mnt)
        proc.wait(timeout=30)
        os.close(master)
    text = seen.decode(errors="replace")
    assert "creating volume" in text and "192M" in text and "100%" in text, text
    assert proc.returncode == 0


def test_readme_describes_the_demo_that_runs() -> None:
    """The README said 6 agents for 12 rounds on a small Llama; the demo runs 3 agents for
    6 rounds each on SmolLM2-135M."""
    demo = (ROOT / "tools" / "demo.py").read_text()
    sessions = int(re.search(r'"--sessions", type=int, default=(\d+)', demo).group(1))
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import demo as demo_mod
    finally:
        sys.path.pop(0)
    rounds = len(demo_mod.QUESTIONS)
    assert re.search(r'"--rounds", type=int, default=len\(QUESTIONS\)', demo)
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("make demo"))
    assert f"{sessions} chat agents" in line and f"{rounds} rounds" in line, line
    assert "SmolLM2-135M" in line and "Llama" not in line, line

