"""The buffer a layer's chosen blocks live in: what a decode step attends from it is exactly
the sinks, the blocks in slot order and the window, joined; blocks keep their bytes when
the choice changes around them; a block taken out is a copy its slot's next block cannot
change."""

import pytest
import torch

from kvfs.torch.attended import AttendedBlocks
from kvfs.torch.blocks import next_slots

H, D, BLOCK, SINKS, TAIL = 2, 8, 4, 3, 10


def block_kv(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(1, H, BLOCK, D, generator=g), torch.randn(1, H, BLOCK, D, generator=g)


def joined(order, full_k, full_v, p):
    ks, vs = zip(*(block_kv(b) for b in order), strict=True)
    return (torch.cat([full_k[..., :p, :], *ks, full_k[..., p:, :]], -2),
            torch.cat([full_v[..., :p, :], *vs, full_v[..., p:, :]], -2))


def choose(a: AttendedBlocks, top: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """What the retrieval does when its choice changes; returns the blocks taken out."""
    order = next_slots(a.order, top)
    out = {b: a.pop(b) for b in a.order if b not in top and b in a}
    a.arrange(order)
    for b in order:
        if b not in a:
            a.put(b, block_kv(b))
    return out


@pytest.mark.parametrize("window", [5, TAIL - 1, TAIL + 7])
def test_a_decode_step_attends_exactly_the_joined_pieces_as_the_choice_changes(window):
    a = AttendedBlocks(BLOCK, SINKS, TAIL)
    g = torch.Generator().manual_seed(99)
    for top in ({0, 1, 2}, {0, 5, 2}, {0, 5, 2, 7, 9}, {5, 9}, {1, 3, 5, 9, 11, 12}, {12}):
        taken = choose(a, top)
        for b, (k, v) in taken.items():  # a copy: the slot was written again since
            assert torch.equal(k, block_kv(b)[0]) and torch.equal(v, block_kv(b)[1])
        assert a.complete and set(a) == top
        for p in (SINKS, SINKS - 1):
            full_k = torch.randn(1, H, p + window, D, generator=g)
            full_v = torch.randn(1, H, p + window, D, generator=g)
            got = a.around(full_k, full_v, p)
            assert got is not None
            want = joined(a.order, full_k, full_v, p)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ks, vs = a.pieces()
        assert all(torch.equal(k, block_kv(b)[0]) for k, b in zip(ks, a.order, strict=True))


def test_what_a_step_cannot_take_from_the_buffer_is_refused_not_guessed():
    a = AttendedBlocks(BLOCK, SINKS, TAIL)
    full = torch.zeros(1, H, SINKS + 5, D)
    assert a.around(full, full, SINKS) is None  # nothing chosen
    a.arrange((4, 6))
    a.put(4, block_kv(4))
    assert not a.complete and a.around(full, full, SINKS) is None  # block 6 not written
    a.put(6, block_kv(6))
    assert a.around(full, full, SINKS + 1) is None  # more sinks than the room for them
    with pytest.raises(AssertionError):
        a.arrange((6,))  # block 4 is written and would lose its slot: pop it first
    fork = a.copy()
    a.clear()
    assert len(a) == 0 and a.nbytes == 0 and a.order == (4, 6)
    assert torch.equal(fork.get(6)[0], block_kv(6)[0])
