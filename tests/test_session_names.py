"""A session's file names are spelled in kvfs/session/ alone: every other module names
them through ``kvfs.session.names`` (so a new session file is added there, once)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvfs
from kvfs.mount_runner import HAVE_FUSE, Mount
from kvfs.session import names
from kvfs.warm import WarmTier

PKG = Path(kvfs.__file__).resolve().parent
FILE_NAMES = {names.META, names.ACKED, names.TOKENS, names.SUMMARIES, names.INCARNATION,
              *names.SIDE_STREAMS}
# ``tokens`` is also meta.json's field and a dict key everywhere: as a file name it is
# passed to a call or bound to a name, so only those spellings of it count
FIELD_TOO = {names.TOKENS}


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}


def _is_field_use(node: ast.Constant, parent: ast.AST | None) -> bool:
    """``meta["tokens"]``, ``{"tokens": n}``, ``.get("tokens")``, ``k == "tokens"``,
    ``("format", ..., "tokens")``, ``__slots__``: the field, not the file."""
    if isinstance(parent, ast.Subscript | ast.Compare | ast.Tuple | ast.List | ast.Set):
        return True
    if isinstance(parent, ast.Dict):
        return node in parent.keys
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute):
        return parent.func.attr in ("get", "pop", "setdefault")
    return False


def spellings(path: Path) -> list[str]:
    """Where ``path`` spells a session file name in code (docstrings and messages in
    prose are not names: only a literal equal to one, or one that builds ``layer_<n>``)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = _parents(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            v, parent = node.value, parents.get(node)
            if isinstance(parent, ast.JoinedStr):
                if parent.values and parent.values[0] is node and v == names.LAYER_PREFIX:
                    out.append(f"{path.relative_to(PKG.parent)}:{node.lineno} builds {v}<n>")
                continue
            if v in FIELD_TOO and _is_field_use(node, parent):
                continue
            if v in FILE_NAMES or v.startswith(names.LAYER_PREFIX) and v[len(names.LAYER_PREFIX):].isdigit():
                out.append(f"{path.relative_to(PKG.parent)}:{node.lineno} spells {v!r}")
            elif v.startswith(names.LAYER_PREFIX + "("):  # a pattern of layer names
                out.append(f"{path.relative_to(PKG.parent)}:{node.lineno} matches {v!r}")
    return out


def test_no_session_file_name_outside_kvfs_session() -> None:
    bad = [hit for p in sorted(PKG.rglob("*.py")) if "session" != p.relative_to(PKG).parts[0]
           for hit in spellings(p)]
    assert not bad, "spell these through kvfs.session.names:\n" + "\n".join(bad)


def test_the_check_finds_each_kind_of_spelling(tmp_path: Path) -> None:
    """The checker itself: every way a name is spelled is caught, prose and fields are not."""
    src = tmp_path / "kvfs" / "x.py"
    src.parent.mkdir()
    src.write_text(
        'A = "meta.json"\n'
        'B = f"layer_{3}"\n'
        'C = open_small(sid, "tokens")\n'
        'D = "key_centroids"\n'
        'E = r"layer_(0|[1-9][0-9]*)"\n'
        'ok1 = meta["tokens"]\n'
        'ok2 = {"tokens": 3}\n'
        'ok3 = f"session {sid}: meta.json says {n} tokens, layer_{k} holds less"\n'
        '"""Docs may name meta.json and layer_<n>."""\n')
    global PKG
    old, PKG = PKG, tmp_path / "kvfs"
    try:
        got = spellings(src)
    finally:
        PKG = old
    assert sorted(g.split(" ", 1)[1] for g in got) == sorted([
        "spells 'meta.json'", "builds layer_<n>", "spells 'tokens'", "spells 'key_centroids'",
        "matches 'layer_(0|[1-9][0-9]*)'"]), got


@pytest.fixture(params=["dir", "mount"])
def cold_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "dir":
        (tmp_path / "cold" / "sessions").mkdir(parents=True)
        yield str(tmp_path / "cold")
        return
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    m = Mount(tmp_path / "vol.kvfs", tmp_path / "mnt", "64M").start()
    yield str(m.mountpoint)
    assert m.stop() == 0, m.log_text()


def test_a_new_append_only_session_file_is_one_entry_of_the_names(cold_root, tmp_path, monkeypatch) -> None:
    """Add a file to every session (here ``round_notes``) by one entry in
    ``kvfs.session.names``: the RAM tier stores, checksums and writes it behind, the mount
    holds it as a plain file, a fork and a new process read it back, a delete removes it.
    Nothing outside kvfs/session names it (the producer calls ``side_append``)."""
    new = "round_notes"
    monkeypatch.setitem(names.SIDE_STREAMS, new, names.SIDE_BASE + 1)
    monkeypatch.setitem(names._SIDE_NAMES, names.SIDE_BASE + 1, new)
    notes = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    with WarmTier(cold_root, str(tmp_path / "warm"), shards=4, writebehind=False) as w:
        w.append("s", 0, notes[:1000])
        assert w.side_append("s", new, notes[:3000]) == 3000
        assert w.side_append("s", new, notes[3000:]) == 5000
        w.put_meta("s", {"tokens": 1, "rounds": [[0, 1]]})
        w.sync("s")
        assert (Path(cold_root) / "sessions" / "s" / new).read_bytes() == notes.tobytes()
        w.fork("s", "t")
        assert np.array_equal(w.side_read("t", new, 0, 5000), notes)
    with WarmTier(cold_root, str(tmp_path / "warm2"), shards=4) as w:  # RAM empty: from the mount
        assert w.side_size("s", new) == 5000
        assert np.array_equal(w.side_read("s", new, 1000, 5000), notes[1000:])
        w.delete("s")
        assert not (Path(cold_root) / "sessions" / "s").exists()
        assert (Path(cold_root) / "sessions" / "t" / new).read_bytes() == notes.tobytes()
