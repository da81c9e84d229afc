"""Crafted volumes: every decoded field is checked before it is used.

A crafted volume has right checksums (whoever made it computed them), so only the field
checks stand between its bytes and the code. Each case here was a reproduction: a spin of
minutes, a 12 GB allocation, a write past the end of the file, a division by zero, a
traceback with the wrong exit status, names that broke ``ls``, escape sequences printed to
root's terminal. Now each ends in a clear message and fsck's documented exit status (0
clean, 1 problems, 2 unusable) within seconds. ``tools/fuzz_volumes.py`` (run below for a
fixed budget) tries such changes at random."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import volcraft
from conftest import HAVE_FUSE, ROOT, run_mount

from kvfs.cli import dump as dump_cli
from kvfs.cli import fsck as fsck_cli
from kvfs.engine.btree_page import Node, TreeRoot, encode_page
from kvfs.engine.errors import FormatError
from kvfs.engine.format import T_DATA, T_PAD
from kvfs.engine.fsck import CLEAN, PROBLEMS, UNUSABLE
from kvfs.engine.store import Store

MB = 1 << 20


def make_volume(path: Path, sessions: int = 30, size: int = 16 * MB) -> dict[str, bytes]:
    s = Store.create(str(path), size)
    want = {}
    for i in range(sessions):
        name = f"sess-{i:03d}"
        s.create_session(name, uid=1000)
        s.create_file(name, "layer_0")
        want[name] = os.urandom(2000 + i)
        s.append(name, "layer_0", 0, want[name])
    s.close()
    return want


def fsck(path: Path, *args: str) -> tuple[int, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fsck_cli.main([str(path), "--quiet", *args])
    return rc, out.getvalue() + err.getvalue(), time.monotonic() - t0


def dump(path: Path, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dump_cli.main([str(path), *args])
    return rc, out.getvalue(), err.getvalue()


def read_all(path: Path) -> dict[str, bytes]:
    s = Store.open(str(path), readonly=True)
    try:
        return {n: s.read(n, "layer_0", 0, 1 << 20) for n in s.list_sessions()}
    finally:
        s.crash()


@pytest.fixture
def vol(tmp_path: Path) -> Path:
    return tmp_path / "v.kvfs"


# ------------------------------------------------------------------ tree pages
def test_branches_whose_children_all_point_to_one_page(vol: Path) -> None:
    """Three levels of branches, each with 150 children that are all one page: 150^3 leaf
    visits (minutes) before; now the second visit of a page is corruption, and the ring
    rebuilds the index."""
    want = make_volume(vol)
    _, sb = volcraft.newest(vol)
    root = TreeRoot.unpack(sb.tree_root)
    half = sb.tree_pages // 2
    other = 1 - root.half  # build the crafted tree in the unused half
    base = other * half
    leaf = Node(0, [b"B" + bytes(4)], vals=[b"\xff" * 4])
    keys = [b"S" + i.to_bytes(8, "big") for i in range(1, 150)]
    pages = {0: leaf, 1: Node(1, keys, kids=[0] * 150), 2: Node(2, keys, kids=[1] * 150),
             3: Node(3, keys, kids=[2] * 150)}
    fd = os.open(vol, os.O_RDWR)
    try:
        for p, node in pages.items():
            os.pwrite(fd, encode_page(node, base + p, root.generation + 1, 4096),
                      sb.tree_offset + (base + p) * 4096)
    finally:
        os.close(fd)
    volcraft.set_root(vol, root=3, height=4, half=other, alloc=4, prev_half=-1,
                      generation=root.generation + 1, count=150 ** 3)
    rc, out, took = fsck(vol)
    assert rc == PROBLEMS and took < 10, (rc, took, out)
    assert "reached twice" in out or "full ring scan" in out, out
    assert read_all(vol) == want  # the ring still holds every session
    rc, out, took = fsck(vol, "--repair")
    assert rc == PROBLEMS and took < 10
    assert fsck(vol)[0] == CLEAN and read_all(vol) == want


@pytest.mark.parametrize("index", [4_000_000, 0xFFFFFFFF])
def test_bitmap_chunk_index_far_past_the_sessions(vol: Path, index: int) -> None:
    """Before: a 4 GB (12 GB with fsck's copies) bitmap, then "clean"; 0xFFFFFFFF raised
    MemoryError."""
    want = make_volume(vol, sessions=5)
    for ap in volcraft.reachable_pages(vol):
        buf = volcraft.read_page(vol, ap)
        at = buf.find(b"B\0\0\0\0")
        if at > 0:
            buf[at + 1:at + 5] = index.to_bytes(4, "big")
            volcraft.write_page(vol, ap, buf)
            break
    else:
        pytest.fail("no bitmap key found")
    rc, out, took = fsck(vol)
    assert rc == PROBLEMS and took < 10, out
    assert "bitmap chunk" in out, out
    assert read_all(vol) == want


# ------------------------------------------------------------------ the superblock
@pytest.mark.parametrize("fields,why", [
    ({"ring_size": 1 << 40}, "ring ends at"),
    ({"volume_size": 0}, "volume_size 0"),
    ({"ring_offset": 1 << 40}, "ring ends at"),
    ({"tree_pages": 1 << 20}, "tree region ends"),
    ({"head": 1 << 63, "tail": 0}, "do not fit a ring"),
    ({"ckpt_pos": 5, "tail": 100, "head": 200}, "ckpt_pos 5"),
    ({"next_sno": 0}, "next_sno 0"),
], ids=["ring-2^40", "size-0", "ring-past-eof", "tree-past-ring", "head", "ckpt", "sno"])
def test_superblock_layout_is_checked_against_the_file(vol: Path, tmp_path: Path,
                                                       fields: dict, why: str) -> None:
    make_volume(vol, sessions=3)
    volcraft.set_superblock(vol, **fields)
    size = vol.stat().st_size
    rc, out, took = fsck(vol)
    assert rc == UNUSABLE and took < 10, out  # before: "clean", or a traceback with exit 1
    assert why in out and "Traceback" not in out, out
    rc, text, err = dump(vol)
    assert rc == 2 and why in err and not text, (text, err)  # before: ZeroDivisionError
    with pytest.raises(FormatError, match="layout is impossible"):
        Store.open(str(vol))
    assert vol.stat().st_size == size


@pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")
def test_mount_refuses_a_ring_past_the_end_of_the_file(vol: Path, tmp_path: Path) -> None:
    """Before: the mount took ring_size = 2^40 and wrote past the end: 64 -> 108 MiB."""
    make_volume(vol, sessions=3, size=64 * MB)
    volcraft.set_superblock(vol, ring_size=1 << 40)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_mount(str(vol), str(mnt), "--foreground")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "not a usable kvfs volume" in lines[0], r.stderr
    assert vol.stat().st_size == 64 * MB and not os.path.ismount(mnt)


def test_one_crafted_slot_falls_back_to_the_other(vol: Path) -> None:
    want = make_volume(vol, sessions=4)
    volcraft.set_superblock(vol, both=False, ring_size=1 << 40)
    rc, out, _ = fsck(vol)
    assert rc == PROBLEMS and "layout is impossible" in out
    assert read_all(vol) == want


# ------------------------------------------------------------------ names
@pytest.mark.parametrize("bad", [b"..", b"a/b", b"x\0y"], ids=["dotdot", "slash", "nul"])
def test_names_from_a_ring_entry_are_validated_as_on_create(vol: Path, bad: bytes) -> None:
    """A session entry with a valid CRC (and a name hash that matches) named ``..``,
    ``a/b`` or ``x<NUL>y`` loaded before, and listing /sessions then failed for every
    session. Now the entry is corrupt: the others list and read."""
    s = Store.create(str(vol), 16 * MB)
    victim = "v" * len(bad)
    for name in ("keep-1", victim, "keep-2"):
        s.create_session(name)
        s.create_file(name, "layer_0")
        s.append(name, "layer_0", 0, name.encode() * 100)
    s.sync()
    s.crash()  # no checkpoint: the names come from the ring
    assert volcraft.rename_session_entry(vol, victim, bad)
    rc, out, took = fsck(vol)
    assert rc == PROBLEMS and took < 10 and "corrupt ring region" in out, out
    got = read_all(vol)
    assert sorted(got) == ["keep-1", "keep-2"] and got["keep-1"] == b"keep-1" * 100


@pytest.mark.parametrize("bad", [b"..", b"a/b", b"x\0y"], ids=["dotdot", "slash", "nul"])
def test_names_from_the_checkpoint_are_validated_as_on_create(vol: Path, bad: bytes) -> None:
    want = make_volume(vol, sessions=3)
    victim = "sess-001"
    crafted = bad.ljust(len(victim), b"z") if b"/" in bad or b"\0" in bad else None
    for ap in volcraft.reachable_pages(vol):
        buf = volcraft.read_page(vol, ap)
        at = buf.find(victim.encode())
        if at > 0:
            if crafted is None:  # ".." must stay the whole name: shorten the record's name
                buf[at - 2:at] = len(bad).to_bytes(2, "little")
                buf[at:at + len(bad)] = bad
            else:
                buf[at:at + len(victim)] = crafted
            volcraft.write_page(vol, ap, buf)
            break
    rc, out, _ = fsck(vol)
    assert rc == PROBLEMS, out
    assert read_all(vol) == want  # rebuilt from the ring: the real name is back


def test_dump_escapes_names(vol: Path) -> None:
    s = Store.create(str(vol), 16 * MB)
    evil = "\x1b]0;owned\x07\x1b[2J\nfake line"
    s.create_session(evil)
    s.create_file(evil, "\x1b[31mred")
    s.close()
    rc, out, _ = dump(vol)
    assert rc == 0 and "\x1b" not in out and "\\x1b]0;owned\\x07" in out
    assert "\nfake line" not in out
    rc, out, _ = dump(vol, "--session", evil)
    assert rc == 0 and "\x1b" not in out and "\\x1b[31mred" in out


def test_fuzz_crafted_volumes_for_a_fixed_budget(tmp_path: Path) -> None:
    """``tools/fuzz_volumes.py``: crafted superblocks, tree roots, tree pages and ring
    entries through fsck, a read-only open and read of everything, kvfs-dump, fsck
    --repair and a writable open: no traceback, no hang (30 s a case; the slowest takes
    about 0.5 s alone), memory bounded (1 GiB of address space over the start, and a peak
    RSS far below it)."""
    seconds = float(os.environ.get("KVFS_FUZZ_SECONDS", "25"))
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz_volumes.py"), "--seconds",
                        str(seconds), "--seed", "30", "--case-timeout", "30", "--json", str(out),
                        "--workdir", str(tmp_path / "work")], capture_output=True, text=True,
                       timeout=seconds + 240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["cases"] >= 20 and not res["failures"]
    assert set(res["kinds"]) >= {"superblock", "tree", "page", "entry"}
    assert res["max_rss_mb"] < 256, res  # alone: about 50 MiB (8 MiB volumes)


def test_a_pad_entry_in_the_middle_of_a_lap(vol: Path) -> None:
    """Found by the fuzzer: an entry's type changed to "pad" (checksum right) sent the
    reader to the end of the lap, so the whole ring read as live; repair then failed with
    "volume full". A pad only stands where the next entry did not fit: this one is read as
    no entry, and what follows it is found again."""
    s = Store.create(str(vol), 16 * MB)
    want = {}
    for i in range(30):
        name = f"sess-{i:03d}"
        s.create_session(name)
        s.create_file(name, "layer_0")
        want[name] = os.urandom(2000 + i)
        s.append(name, "layer_0", 0, want[name])
    s.sync()
    s.crash()  # no checkpoint: recovery scans over the crafted pad
    ents = [e for e in volcraft.entries(vol) if e[2].type == T_DATA]
    pos, off, h = ents[len(ents) // 2]
    volcraft.write_entry(vol, off, h._replace(type=T_PAD))
    rc, out, took = fsck(vol)
    assert rc == PROBLEMS and took < 10 and "corrupt ring region" in out, out
    s = Store.open(str(vol), readonly=True)
    try:
        assert s.ring.used() < s.ring.size // 2
        got = {n: s.read(n, "layer_0", 0, 1 << 20) for n in s.list_sessions()}
    except Exception:
        s.crash()
        raise
    s.crash()
    # the file of the lost entry is cut before it, every other is whole: never wrong bytes
    assert sum(got[n] != want[n] for n in got) == 1 and all(want[n].startswith(got[n]) for n in got)
    rc, out, _ = fsck(vol, "--repair")
    assert rc == PROBLEMS and "internal error" not in out, out
    assert fsck(vol)[0] == CLEAN
