"""``kvfs.ops.agents.roots``: the RAM-tier roots whose agents' figures a mount and
``kvfs-stat`` sum include the private fallbacks ``kvfs.warm.rootdir.open_root`` moves to
when another user squatted a root's name, and only fallbacks nobody else could plant."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.mount_runner import run_as
from kvfs.ops import agents
from kvfs.warm.rootdir import FALLBACK_TAG, open_root

ATTACKER = 4201
as_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                             reason="needs root and setpriv")


@pytest.fixture
def shared() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvfs-roots-"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_tag_is_the_warm_tiers() -> None:
    assert agents.FALLBACK_TAG == FALLBACK_TAG


def test_fallbacks_beside_a_root_are_roots_unless_planted(shared: Path) -> None:
    me = os.geteuid()
    ours = shared / f"kvfs-warm-{me}{FALLBACK_TAG}ab_12"
    ours.mkdir(mode=0o700)
    open_ = shared / f"kvfs-warm-{me}{FALLBACK_TAG}0000"
    open_.mkdir()
    os.chmod(open_, 0o777)  # writable by others: open_root never makes one so
    (shared / f"kvfs-warm-{me}{FALLBACK_TAG}link").symlink_to(ours)
    wrong = shared / f"kvfs-warm-{me + 1}{FALLBACK_TAG}zz"  # named for another uid
    wrong.mkdir(mode=0o700)
    (shared / f"kvfs-warm-{me}").mkdir(mode=0o700)
    got = agents.roots(str(shared / "kvfs-warm-{uid}"))
    assert sorted(got) == sorted([str(shared / f"kvfs-warm-{me}"), str(ours)])
    plain = shared / "plain"
    fb = shared / f"plain{FALLBACK_TAG}x1"
    fb.mkdir(mode=0o700)
    assert agents.roots(str(plain)) == [str(plain), str(fb)]


@as_root
def test_a_squatted_roots_fallback_is_read(shared: Path) -> None:
    """Another user squats our per-uid root: open_root moves to a private fallback, and
    roots() names it, so the agent's published figures are summed."""
    root = shared / f"kvfs-warm-{os.geteuid()}"
    run_as(ATTACKER, f"import os; os.mkdir({str(root)!r}, 0o700)")
    r = open_root(str(root))
    try:
        assert FALLBACK_TAG in os.path.basename(r.path)
        assert r.path in agents.roots(str(shared / "kvfs-warm-{uid}"))
    finally:
        r.close()
    assert str(root) not in agents.roots(str(shared / "kvfs-warm-{uid}"))  # the squatter's
