"""The FUSE read path's read-ahead policy (``read_path.ReadAhead``), without a kernel: what
it answers from a handle's window, which range read ahead it hands back, what it asks to
read ahead next, and that a truncate or a close forgets it. Real mounts read through it in
test_mount_cache.py and test_mount_io.py."""

from __future__ import annotations

import pytest

pytest.importorskip("pyfuse3")

from kvfs.fuse.nodes import Node  # noqa: E402
from kvfs.fuse.read_path import ReadAhead, Window  # noqa: E402

KiB = 1 << 10


def _node(ino: int = 16) -> Node:
    return Node(ino, ("s", "f"))


def test_a_small_sequential_read_gets_a_window_and_the_next_small_reads_are_answered_from_it() -> None:
    ra, node = ReadAhead(), _node()
    s = ra.stream(1, node.ino)
    assert ra.window_size(s, 0, 4 * KiB, None) == ra.WINDOW  # at seq_end 0: sequential
    assert ra.window_size(s, 0, 4 * KiB, 100 * KiB) == 100 * KiB  # only what the engine holds
    assert ra.window_size(s, 0, 4 * KiB, 2 * KiB) == 0  # the read reaches past it
    assert ra.window_size(s, 8 * KiB, 4 * KiB, None) == 0  # not where the last read ended
    assert ra.window_size(s, 0, ra.SMALL, None) == 0  # not small
    data = bytes(range(256)) * (ra.WINDOW // 256)
    s.window = Window(0, data, node.cuts)
    assert ra.window_hit(s, node, 4 * KiB, 4 * KiB) == data[4 * KiB:8 * KiB]
    assert s.seq_end == 8 * KiB
    assert ra.window_hit(s, node, ra.WINDOW - KiB, 2 * KiB) is None  # past its end
    node.cuts += 1  # truncated since the window was read
    assert ra.window_hit(s, node, 4 * KiB, 4 * KiB) is None


def test_a_large_sequential_reader_gets_the_next_range_read_ahead_and_only_where_it_goes() -> None:
    ra = ReadAhead()
    s = ra.stream(1, 16)
    size = ra.MIN
    new = ra.next_ranges(s, 0, size, size, None, background=True)
    assert [(a.off, a.size) for a in new] == [((1 + i) * size, size) for i in range(ra.DEPTH)]
    assert s.seq_end == size and s.ahead == new
    a = ra.take_ahead(s, size, size)
    assert a is new[0] and s.ahead == new[1:]
    # a reader that jumps elsewhere drops what was read ahead
    s.ahead = [a]
    assert ra.take_ahead(s, 5 * size, size) is None and s.ahead is None
    # nothing read ahead past what the engine holds, nor without a nursery, nor for a short read
    s.seq_end = 0
    assert ra.next_ranges(s, 0, size, size, stored=size + size // 2, background=True) == []
    s.seq_end = 0
    assert ra.next_ranges(s, 0, size, size, None, background=False) == []
    s.seq_end = 0
    assert ra.next_ranges(s, 0, size, size - 1, None, background=True) == []


def test_a_truncate_forgets_what_was_read_ahead_of_that_file_and_a_close_its_stream() -> None:
    ra = ReadAhead()
    s1, s2 = ra.stream(1, 16), ra.stream(2, 17)
    for s in (s1, s2):
        s.window = Window(0, b"x" * KiB, 0)
        s.seq_end = ra.MIN
        s.ahead = ra.next_ranges(s, ra.MIN, ra.MIN, ra.MIN, None, background=True)
    ra.forget(16)
    assert s1.window is None and s1.ahead is None
    assert s2.window is not None and s2.ahead
    ra.closed(2)
    assert ra.stream(2, 17) is not s2  # a new stream: nothing kept for a closed handle
