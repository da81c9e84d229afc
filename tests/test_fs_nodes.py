"""The FUSE layer's pure pieces: names, errno mapping, the inode table (no kernel)."""

from __future__ import annotations

import errno

import pytest

from kvfs.engine import errors
from kvfs.fuse.errnos import Refused, Stale, errno_of
from kvfs.fuse.nodes import FIRST_DYNAMIC, InodeTable, check_name, shown


@pytest.mark.parametrize("raw, code", [
    (b"", errno.EINVAL),
    (b".", errno.EINVAL),
    (b"..", errno.EINVAL),
    (b"a/b", errno.EINVAL),
    (b"a\0b", errno.EINVAL),
    (b"x" * 256, errno.ENAMETOOLONG),
    ("é".encode() * 128, errno.ENAMETOOLONG),  # 256 bytes, 128 characters
])
def test_bad_names(raw: bytes, code: int) -> None:
    with pytest.raises(Refused) as e:
        check_name(raw)
    assert e.value.errno == code


def test_good_names() -> None:
    assert check_name(b"layer_0") == "layer_0"
    assert check_name(b"x" * 255) == "x" * 255
    assert check_name("sess-é".encode()) == "sess-é"
    # bytes that are not UTF-8 survive the round trip, like os.fsdecode/os.fsencode
    assert check_name(b"\xff\xfe").encode("utf-8", "surrogateescape") == b"\xff\xfe"


@pytest.mark.parametrize("exc, code", [
    (errors.NotFound, errno.ENOENT),
    (errors.Exists, errno.EEXIST),
    (errors.BadName, errno.EINVAL),
    (errors.NameTooLong, errno.ENAMETOOLONG),
    (errors.NotAppend, errno.EPERM),
    (errors.BadRange, errno.EINVAL),
    (errors.NotEmpty, errno.ENOTEMPTY),
    (errors.NoSpace, errno.ENOSPC),
    (errors.Corrupt, errno.EIO),
    (errors.FormatError, errno.EIO),
])
def test_errno_of(exc: type[errors.KVFSError], code: int) -> None:
    assert errno_of(exc("x")) == code


def test_inode_lifecycle() -> None:
    t = InodeTable()
    a = t.looked_up(("s",))
    f = t.looked_up(("s", "layer_0"))
    assert a >= FIRST_DYNAMIC and f != a
    assert t.looked_up(("s",)) == a  # stable while known
    t.forget(a, 2)
    assert t.get(a) is None and len(t) == 1
    b = t.looked_up(("s",))
    assert b != a  # a new number after the kernel forgot the old one

    t.opened(f)
    t.forget(f, 1)
    assert t.get(f) is not None  # still open
    t.closed(f)
    assert t.get(f) is None


def test_unlink_detaches_name_but_keeps_open_inode() -> None:
    t = InodeTable()
    f = t.looked_up(("s", "x"))
    t.opened(f)
    t.unlink(("s", "x"))
    node = t.get(f)
    assert node is not None and node.unlinked
    g = t.looked_up(("s", "x"))  # a new file of the same name
    assert g != f
    t.closed(f)
    t.forget(f, 1)
    assert t.get(f) is None and t.get(g) is not None


def test_unlink_session_detaches_its_files() -> None:
    t = InodeTable()
    s = t.looked_up(("s",))
    f = t.looked_up(("s", "a"))
    other = t.looked_up(("t", "a"))
    t.unlink_session("s")
    assert t.get(s).unlinked and t.get(f).unlinked and not t.get(other).unlinked
    assert t.ino_of(("s",)) not in (s, f)


def test_layer_refusals_have_their_errno() -> None:
    assert errno_of(Stale("gone")) == errno.ESTALE
    assert errno_of(Refused(errno.ENAMETOOLONG, "long")) == errno.ENAMETOOLONG
    assert errno_of(RuntimeError("bug")) == errno.EIO


def test_shown_names_cannot_split_log_lines() -> None:
    assert shown(("s\nERROR forged", "layer_0")) == "'s\\nERROR forged/layer_0'"
    assert "\r" not in shown("a\rb") and "\x1b" not in shown("a\x1b[2Jb")


def test_unlink_keeps_last_stat_and_detaches() -> None:
    t = InodeTable()
    f = t.looked_up(("s", "x"))
    t.opened(f)
    t.unlink(("s", "x"), last="stat")
    node = t.get(f)
    assert node.unlinked and node.last == "stat"
    t.unlink(("s", "x"))  # nothing named any more: a no-op
    assert t.get(f).last == "stat"
