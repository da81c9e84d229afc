"""Forking a stored session in the warm tier (``WarmTier.fork``): with a mount the source is
synced and copied there in the session's commit order, so the branch is on the mount before
``fork`` returns and a failed copy leaves nothing; without one it is copied in RAM."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import blob

from kvfs.session.names import KEY_CENTROIDS, META
from kvfs.warm import WarmError, WarmTier
from kvfs.warm.coldfiles import ColdStore
from kvfs.warm.summary import summarize_keys

META_DOC = {"tokens": 24, "rounds": [[0, 8]]}


def _fill(w: WarmTier, sid: str) -> dict[str, object]:
    keys = np.random.default_rng(5).standard_normal((2, 8, 4, 16)).astype(np.float16)
    for layer in range(3):
        w.append(sid, layer, blob(layer, 5000 + 100 * layer))
    w.side_append(sid, KEY_CENTROIDS, blob(9, 640))
    for r, k in enumerate(keys):
        w.put_summary(sid, r, summarize_keys(k))
    w.put_meta(sid, META_DOC)
    return {"layers": {n: w.read(sid, n, 0, w.size(sid, n)) for n in range(3)},
            "side": w.side_read(sid, KEY_CENTROIDS, 0, 640), "summaries": w.summaries(sid)}


def _same(w: WarmTier, sid: str, want: dict[str, object]) -> None:
    assert w.layer_sizes(sid) == {n: len(b) for n, b in want["layers"].items()}  # type: ignore[attr-defined]
    for n, b in want["layers"].items():  # type: ignore[attr-defined]
        assert np.array_equal(w.read(sid, n, 0, len(b)), b)
    assert np.array_equal(w.side_read(sid, KEY_CENTROIDS, 0, 640), want["side"])
    assert np.array_equal(w.summaries(sid), want["summaries"])
    assert w.get_meta(sid) == META_DOC


def test_fork_on_the_mount_copies_an_unsynced_source_whole(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4, writebehind=False) as w:
        want = _fill(w, "root")  # in RAM only: nothing written behind yet
        assert not os.path.exists(os.path.join(cold, "sessions", "root", META))
        w.fork("root", "branch")
        assert w.where("branch") == "cold"  # on the mount, not copied through RAM
        assert os.path.exists(os.path.join(cold, "sessions", "root", META))  # synced first
        _same(w, "branch", want)
        w.append("branch", 0, blob(50, 300))  # the branch grows on its own
        assert w.size("root", 0) == 5000 and w.size("branch", 0) == 5300
    with WarmTier(cold, root, shards=4) as w:  # a new process finds both
        _same(w, "root", want)
        assert w.size("branch", 0) == 5300


def test_fork_in_ram_without_a_mount(tmp_path):
    with WarmTier(None, str(tmp_path / "w"), shards=4) as w:
        want = _fill(w, "root")
        w.fork("root", "branch")
        assert w.where("branch") == "warm"
        _same(w, "branch", want)


def test_fork_refuses_an_existing_name_and_a_missing_source(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        _fill(w, "root")
        _fill(w, "taken")
        with pytest.raises(FileExistsError):
            w.fork("root", "taken")
        with pytest.raises(FileExistsError):
            w.fork("root", "root")
        with pytest.raises(KeyError):
            w.fork("nowhere", "b")
        with pytest.raises(WarmError):
            w.fork("root", "../x")  # a name no session may have
        assert w.where("b") is None and w.get_meta("taken") == META_DOC


def test_a_copy_that_fails_leaves_no_branch(dirs, monkeypatch):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        want = _fill(w, "root")
        w.sync("root")
        real = ColdStore.write

        def write(self, sid, changes, *a, **kw):
            if sid == "branch" and any(c.name == META for c in changes.items):
                raise OSError(28, "No space left on device")  # the claim is the last write
            return real(self, sid, changes, *a, **kw)

        monkeypatch.setattr(ColdStore, "write", write)
        with pytest.raises(OSError):
            w.fork("root", "branch")
        monkeypatch.undo()
        assert w.where("branch") is None
        assert not os.path.exists(os.path.join(cold, "sessions", "branch"))
        _same(w, "root", want)
        w.fork("root", "branch")  # the name is free again
        _same(w, "branch", want)
