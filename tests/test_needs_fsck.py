"""Failure states that survive a remount: superblock decoding, the needs-fsck mark, fsck
on a mounted volume, and the mount's refusal (S3QL's needs_fsck)."""

from __future__ import annotations

import errno
import os
import struct
import threading
from pathlib import Path
from types import SimpleNamespace

import crc32c
import pytest
import trio
from conftest import HAVE_FUSE, Mount, run_mount
from pyfuse3 import FUSEError

from kvfs.cli import fsck as fsck_cli
from kvfs.engine import codec
from kvfs.engine.errors import BadSuperblock, Corrupt, FormatError, NeedsFsck
from kvfs.engine.format import SB_CLEAN, SB_NEEDS_FSCK, SB_SIZE, SB_SLOT, VERSION, Superblock
from kvfs.engine.fsck import CLEAN, PROBLEMS, UNUSABLE, check_volume
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig
from kvfs.engine.volume import VolumeFile
from kvfs.fuse.nodes import SESSIONS
from kvfs.fuse.ops import Operations

MB = 1 << 20
CTX = SimpleNamespace(uid=0, gid=0, pid=1, umask=0o022)


@pytest.fixture
def vol(tmp_path: Path) -> str:
    path = str(tmp_path / "v.kvfs")
    s = Store.create(path, 8 * MB, StoreConfig(compression="none"))
    s.create_session("s")
    s.create_file("s", "f")
    s.append("s", "f", 0, b"x" * 5000)
    s.close()
    return path


def slots(path: str) -> list:
    v = VolumeFile.open(path, readonly=True)
    try:
        return v.read_slots()
    finally:
        v.close()


def newest_flags(path: str) -> int:
    return max((s for s in slots(path) if isinstance(s, Superblock)), key=lambda s: s.seq).flags


def rewrite_slot(path: str, slot: int, raw: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, raw, slot * SB_SLOT)
    finally:
        os.close(fd)


def raw_slot(path: str, slot: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(slot * SB_SLOT)
        return f.read(SB_SLOT)


def with_version(raw: bytes, version: int) -> bytes:
    """The slot as a kvfs of ``version`` would write it (checksum valid)."""
    body = bytearray(raw[:SB_SIZE - 4])
    struct.pack_into("<I", body, 8, version)
    return bytes(body) + struct.pack("<I", crc32c.crc32c(bytes(body))) + raw[SB_SIZE:]


# ---------------------------------------------------------------- superblock decoding
def test_superblock_decoding_tells_magic_version_and_checksum_apart(vol: str) -> None:
    raw = raw_slot(vol, 0)
    assert isinstance(Superblock.unpack(raw), Superblock)
    cases = {
        "magic": b"NOTKVFS!" + raw[8:],
        "version": with_version(raw, VERSION + 1),
        "checksum": raw[:40] + bytes([raw[40] ^ 1]) + raw[41:],
    }
    for kind, bad in cases.items():
        with pytest.raises(BadSuperblock) as e:
            Superblock.unpack(bad)
        assert e.value.kind == kind
    with pytest.raises(BadSuperblock, match=f"created by a newer kvfs \\(version {VERSION + 1}\\)"):
        Superblock.unpack(with_version(raw, VERSION + 1))
    with pytest.raises(BadSuperblock, match="unsupported version 0") as e:
        Superblock.unpack(with_version(raw, 0))
    assert e.value.kind == "version" and e.value.version == 0
    with pytest.raises(BadSuperblock) as e:
        Superblock.unpack(raw[:SB_SIZE - 1])
    assert e.value.kind == "magic"


def test_newer_version_volume_is_named_as_such(vol: str) -> None:
    for slot in (0, 1):
        rewrite_slot(vol, slot, with_version(raw_slot(vol, slot), VERSION + 1))
    with pytest.raises(FormatError) as e:
        Store.open(vol)
    assert f"created by a newer kvfs (version {VERSION + 1})" in str(e.value)
    assert "corrupt" not in str(e.value)
    res = check_volume(vol)
    assert res.status == UNUSABLE and "newer kvfs" in res.problems[0]


def test_version_1_volume_is_refused_with_what_to_do(vol: str) -> None:
    """Version 1 stored data entries without blocks: refused, never misread."""
    for slot in (0, 1):
        rewrite_slot(vol, slot, with_version(raw_slot(vol, slot), 1))
    for opener in (lambda: Store.open(vol), lambda: Store.open(vol, readonly=True)):
        with pytest.raises(FormatError) as e:
            opener()
        msg = str(e.value)
        assert f"created by an older kvfs (version 1); this kvfs reads version {VERSION}" in msg
        assert "copy the sessions out" in msg and "corrupt" not in msg
    res = check_volume(vol, repair=True)
    assert res.status == UNUSABLE and "older kvfs (version 1)" in res.problems[0]
    assert raw_slot(vol, 0)[8:12] == struct.pack("<I", 1)  # nothing written


def test_both_checksums_bad_says_corrupt_and_names_fsck(vol: str) -> None:
    for slot in (0, 1):
        raw = raw_slot(vol, slot)
        rewrite_slot(vol, slot, raw[:50] + bytes([raw[50] ^ 0x10]) + raw[51:])
    with pytest.raises(FormatError) as e:
        Store.open(vol)
    msg = str(e.value)
    assert "both superblocks are corrupt" in msg and "checksum" in msg
    assert f"run kvfs-fsck {vol}" in msg and "tools/" not in msg


def test_one_bad_slot_is_reported_by_fsck_with_its_reason(vol: str) -> None:
    rewrite_slot(vol, 0, with_version(raw_slot(vol, 0), VERSION + 3))
    res = check_volume(vol)
    assert res.status == PROBLEMS
    assert any("slot 0" in p and "newer kvfs" in p for p in res.problems)


# ---------------------------------------------------------------- the mark
def test_old_volumes_without_the_bit_read_as_clean(vol: str) -> None:
    assert newest_flags(vol) == SB_CLEAN  # what version 1 always wrote
    s = Store.open(vol)
    assert not s.needs_fsck and s.stats()["volume"]["needs_fsck"] is False
    s.close()
    assert check_volume(vol).status == CLEAN


def test_mark_survives_remount_until_repair(vol: str) -> None:
    s = Store.open(vol)
    s.mark_needs_fsck("test: corruption seen")
    s.list_sessions()  # the next engine call writes the mark
    assert newest_flags(vol) & SB_NEEDS_FSCK
    s.crash()  # even without a clean close
    with pytest.raises(NeedsFsck, match=f"run kvfs-fsck {vol}"):
        Store.open(vol)
    r = Store.open(vol, readonly=True)  # reading is always allowed
    assert r.needs_fsck and r.read("s", "f", 0, 10) == b"x" * 10
    r.crash()
    forced = Store.open(vol, force=True)
    assert forced.needs_fsck
    forced.close()
    assert newest_flags(vol) == SB_CLEAN | SB_NEEDS_FSCK  # a forced mount keeps the mark

    res = check_volume(vol)
    assert res.status == PROBLEMS and any("needing fsck" in p for p in res.problems)
    assert newest_flags(vol) & SB_NEEDS_FSCK  # a plain check changes nothing
    res = check_volume(vol, repair=True)
    assert res.status == PROBLEMS and "needs-fsck mark cleared" in res.repaired
    assert not newest_flags(vol) & SB_NEEDS_FSCK
    assert check_volume(vol).status == CLEAN
    s = Store.open(vol)
    assert s.read("s", "f", 0, 10**6) == b"x" * 5000
    s.close()


def test_mark_from_another_thread_is_written_by_the_next_call(vol: str) -> None:
    s = Store.open(vol)
    t = threading.Thread(target=s.mark_needs_fsck, args=("from the FUSE thread",))
    t.start()
    t.join()
    assert s.needs_fsck and not newest_flags(vol) & SB_NEEDS_FSCK  # no I/O off the engine
    s.maybe_checkpoint()
    assert newest_flags(vol) & SB_NEEDS_FSCK
    assert s.stats()["volume"]["needs_fsck_reason"] == "from the FUSE thread"
    s.close()


def test_unexpected_exception_in_an_operation_marks_the_volume(vol: str, monkeypatch) -> None:
    s = Store.open(vol, StoreConfig(compress_on_copy=False))  # the codec runs at append

    def broken(self, raw):  # noqa: ANN001, ANN202
        raise RuntimeError("bug in the codec")

    monkeypatch.setattr(codec.Codec, "compress", broken)
    with pytest.raises(RuntimeError):
        s.append("s", "f", 5000, b"y" * 4096)
    assert newest_flags(vol) & SB_NEEDS_FSCK  # written at once: the process may die next
    assert "RuntimeError" in s.fsck_mark.reason
    s.crash()
    with pytest.raises(NeedsFsck):
        Store.open(vol)


def test_expected_errors_do_not_mark(vol: str) -> None:
    s = Store.open(vol)
    for bad in (lambda: s.append("s", "f", 1, b"z"), lambda: s.read("nope", "f", 0, 1),
                lambda: s.create_session("s"), lambda: s.truncate("s", "f", 10**9),
                lambda: s.append("s", "f", b"z"), lambda: s.read("s", "f", offset=0)):  # bad calls
        with pytest.raises(Exception):  # noqa: B017, PT011 - each its own KVFSError
            bad()
    assert not s.needs_fsck
    s.close()
    assert newest_flags(vol) == SB_CLEAN


def test_corruption_found_at_run_time_marks_the_volume(vol: str) -> None:
    s = Store.open(vol, readonly=True)
    pos = s._file("s", "f")[1].ext[0][0]
    off = s.ring.phys(pos) + 100  # inside the payload
    s.crash()
    fd = os.open(vol, os.O_RDWR)
    os.pwrite(fd, b"\xee", off)
    os.close(fd)
    s = Store.open(vol)
    with pytest.raises(Corrupt):
        s.read("s", "f", 0, 100)
    assert newest_flags(vol) & SB_NEEDS_FSCK
    s.crash()
    res = check_volume(vol, repair=True)
    assert res.status == PROBLEMS and "needs-fsck mark cleared" in res.repaired
    assert check_volume(vol).status == CLEAN


def test_fuse_internal_error_marks_the_store(vol: str, monkeypatch) -> None:
    s = Store.open(vol)
    ops = Operations(s)

    def boom(*a):  # noqa: ANN002, ANN202
        raise RuntimeError("bug")

    async def main() -> None:
        ino = (await ops.lookup(SESSIONS, b"s", CTX)).st_ino
        ino = (await ops.lookup(ino, b"f", CTX)).st_ino
        fh = (await ops.open(ino, os.O_RDONLY, CTX)).fh
        monkeypatch.setattr(s, "read", boom)  # past the engine's own guard
        with pytest.raises(FUSEError) as e:
            await ops.read(fh, 0, 4)
        assert e.value.errno == errno.EIO
        monkeypatch.undo()
        await ops.release(fh)

    trio.run(main)
    assert ops.needs_fsck and s.needs_fsck
    s.list_sessions()
    s.crash()
    with pytest.raises(NeedsFsck):
        Store.open(vol)


# ---------------------------------------------------------------- fsck on a mounted volume
@pytest.mark.parametrize("repair", [False, True], ids=["check", "repair"])
def test_fsck_on_a_locked_volume_says_unmount_first(vol: str, repair: bool, capsys) -> None:
    s = Store.open(vol)  # holds the lock, as a mount does
    try:
        res = check_volume(vol, repair=repair)
        assert res.status == UNUSABLE and res.in_use and "unmount it first" in res.problems[0]
        argv = [vol, "--quiet"] + (["--repair"] if repair else [])
        assert fsck_cli.main(argv) == 2
        # one clear thing, not "unmount first" and then "unusable: 0 sessions ..."
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1, out
        assert out.err == f"kvfs-fsck: {vol} is in use (mounted): unmount it first\n"
    finally:
        s.close()
    assert check_volume(vol, repair=repair).status == CLEAN


def test_mount_cannot_start_during_a_check(vol: str) -> None:
    v = VolumeFile.open(vol, readonly=True)
    v.lock(shared=True)  # what a read-only fsck holds
    try:
        with pytest.raises(Exception, match="in use"):  # noqa: PT011
            Store.open(vol)
    finally:
        v.close()


# ---------------------------------------------------------------- the mount
@pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")
def test_mount_refuses_a_marked_volume_unless_forced(vol: str, tmp_path: Path) -> None:
    s = Store.open(vol)
    s.mark_needs_fsck("test")
    s.close()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_mount(vol, str(mnt), "--foreground")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert f"run kvfs-fsck {vol}" in lines[0] and "--force" in lines[0]
    assert not os.path.ismount(mnt)
    assert newest_flags(vol) == SB_CLEAN | SB_NEEDS_FSCK  # the refusal wrote nothing

    m = Mount(Path(vol), mnt, size=None, extra=("--force",)).start()
    try:
        assert (m.sessions / "s" / "f").read_bytes() == b"x" * 5000
        assert fsck_cli.main([vol, "--quiet"]) == 2  # mounted: unmount first
    finally:
        assert m.stop() == 0, m.log_text()
    assert newest_flags(vol) & SB_NEEDS_FSCK  # still marked after the forced mount
    assert fsck_cli.main([vol, "--quiet", "--repair"]) == 1
    assert fsck_cli.main([vol, "--quiet"]) == 0
    m = Mount(Path(vol), mnt, size=None).start()  # mounts again without --force
    assert m.stop() == 0, m.log_text()
