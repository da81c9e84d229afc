"""Reads of a session's chosen blocks from the tiers below: exact bytes up to the device.

:class:`~kvfs.torch.retrieval.Retrieval` decides which blocks each layer attends; what is
neither attended nor kept on the device already is read here. Blocks in the RAM tier are
copied at once on the caller's thread (a copy costs less than a hand-over to a thread);
blocks only on the mount, or still on their way to the warm tier, are read on a reader
thread while the rest of the step and the sampling run. The step that attends them waits
only for a read still running: a hot miss, counted here and reported to the cache.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvfs.torch.recall import layer_pool, read_runs

if TYPE_CHECKING:
    from kvfs.torch.attended import KV
    from kvfs.torch.blocks import BlockLayout
    from kvfs.torch.seams import RetrievalHost


class BlockReads:
    """One session's reads of old blocks, at most one in flight per layer."""

    def __init__(self, host: RetrievalHost, layout: BlockLayout) -> None:
        self.c = host
        self.layout = layout
        self._pending: list[Future | None] = [None] * host.geo.num_layers
        self._ram: bool | None = None  # the session's blocks are in the RAM tier (asked once a step)
        self.fetched_blocks = 0
        self.background_reads = 0  # reads that went to a reader thread (the mount, in flight)
        self.fetch_waits = 0  # layer steps that had to wait for a read still running
        self.fetch_wait_s = 0.0

    def step_begin(self) -> None:
        """A new step: where the session's blocks are is asked again."""
        self._ram = None

    def in_flight(self, layer: int) -> bool:
        return self._pending[layer] is not None

    def fetch(self, layer: int, blocks: list[int]) -> dict[int, KV] | None:
        """``blocks`` of ``layer``: read now from RAM, or on a reader thread (``None``: the
        blocks come from :meth:`settle` or :meth:`wait`). At most one read per layer."""
        if self._pending[layer] is not None:
            raise AssertionError(f"layer {layer} already has a read in flight")
        if self._in_ram(layer, blocks):
            return self.read(layer, blocks, in_ram=True)
        self._pending[layer] = layer_pool().submit(self.read, layer, blocks)
        self.background_reads += 1
        return None

    def settle(self, layer: int) -> dict[int, KV] | None:
        """The blocks of ``layer``'s read in flight (waiting for it), or ``None``."""
        fut, self._pending[layer] = self._pending[layer], None
        return None if fut is None else fut.result()

    def wait(self, layer: int) -> dict[int, KV] | None:
        """As :meth:`settle`, for a step about to attend them: a read still running is a
        wait, counted and reported to the cache (a hot miss)."""
        fut = self._pending[layer]
        if fut is None or fut.done():
            return self.settle(layer)
        t0 = time.perf_counter()
        got = self.settle(layer)
        self.fetch_wait_s += time.perf_counter() - t0
        self.fetch_waits += 1
        self.c.step_waited()
        return got

    def drop(self) -> None:
        """Wait for every read in flight and forget its blocks (nothing may land in what the
        caller is dropping)."""
        for layer in range(len(self._pending)):
            self.settle(layer)

    def _in_ram(self, layer: int, blocks: list[int]) -> bool:
        """Whether ``blocks`` can be copied from the RAM tier: the session's blocks are there
        (asked of layer 0 once a step: the warm tier moves sessions whole) and written."""
        c, tb = self.c, self.c.geo.token_bytes
        warm = c.warm
        assert warm is not None  # retrieval is built only over a warm tier
        if self._ram is None:  # nothing of the blocks' range only on the mount
            in_ram = getattr(warm, "in_ram", None)
            at = self.layout.origin * tb
            self._ram = bool(in_ram and in_ram(c.session_id, 0, at, at))
        return self._ram and warm.size(c.session_id, layer) >= self.layout.span(max(blocks))[1] * tb

    def read(self, layer: int, blocks: list[int], in_ram: bool = False) -> dict[int, KV]:
        """Read ``blocks`` of ``layer`` from the warm tier (or the mount through it), now.
        ``in_ram`` (the caller checked): every run of neighbouring blocks in one call of the
        warm tier; else one call a run, so that a read from the mount stays one request of
        its own size."""
        c = self.c
        warm = c.warm
        assert warm is not None  # retrieval is built only over a warm tier
        dev = c.device or torch.device("cpu")
        tb, block = c.geo.token_bytes, self.layout.block
        if c.spiller is not None and warm.size(c.session_id, layer) < self.layout.span(max(blocks))[1] * tb:
            c.spiller.wait()  # still on its way to the warm tier
        runs: list[list[int]] = []  # neighbouring blocks are read as one span
        for b in sorted(blocks):
            if runs and runs[-1][1] == b - 1:
                runs[-1][1] = b
            else:
                runs.append([b, b])
        spans = [(self.layout.span(first)[0], self.layout.span(last)[1]) for first, last in runs]
        calls = [spans] if in_ram else [[span] for span in spans]  # one call, or one a run
        out, blocks_in_order = {}, (b for first, last in runs for b in range(first, last + 1))
        for call in calls:
            k, v = read_runs(warm, c.session_id, layer, c.geo, call, dev)
            for at in range(0, k.shape[-2], block):
                out[next(blocks_in_order)] = (k[..., at:at + block, :], v[..., at:at + block, :])
        self.fetched_blocks += len(blocks)
        return out

    def stats(self) -> dict[str, Any]:
        return {"fetched_blocks": self.fetched_blocks, "background_reads": self.background_reads,
                "fetch_waits": self.fetch_waits, "fetch_wait_ms": round(self.fetch_wait_s * 1e3, 3)}
