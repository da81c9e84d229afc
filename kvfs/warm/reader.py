"""The warm tier's reads: size, layer_sizes, layers, read, read_into, read_many, read_layers,
in_ram, side_size, side_read.

A layer's range splits at its base: bytes below it come from the cold copy (always a
prefix of the content, resident.py), the rest from the shard's mapping; the cold parts of
many layers go to the ``ColdBackend`` as one batch. A checksum mismatch in RAM is served
from the cold copy when that holds the bytes. A read of a whole layer that is partly on
cold promotes the session back to RAM first (``promote``: the mover's, given at
construction). These only look up and copy out. Never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from kvfs.session import files
from kvfs.session.backend import ColdBackend
from kvfs.session.names import SIDE_BASE, layer_name, side_stream

from .ids import WarmCorrupt, WarmError, check_layer
from .resident import Resident
from .shard import ShardFile
from .shard_index import WarmSession
from .shards import Slot

log = logging.getLogger("kvfs.warm")


class Reader:
    """The reads, over the RAM copies (``Resident``); ``own`` takes a session for this
    process before a read (``Validator.own``), ``promote(slot, sid, soft)`` brings a
    session back from cold under its shard lock and ``after_promote(sid)`` lets the tier
    migrate what that pushed over the threshold (the mover's and the evictor's)."""

    def __init__(self, res: Resident, cold: ColdBackend | None, own: Callable[[str], None],
                 promote: Callable[[Slot, str, bool], bool],
                 after_promote: Callable[[str], None]) -> None:
        self.res, self.cold, self.own = res, cold, own
        self.promote, self.after_promote = promote, after_promote

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    def _locked(self, sid: str) -> AbstractContextManager[Slot]:
        self.own(sid)
        return self.res.locked(sid)

    def size(self, sid: str, layer: int) -> int:
        return self._size(sid, check_layer(layer))

    def in_ram(self, sid: str, layer: int, start: int, end: int) -> bool:
        """Whether bytes [start, end) of a layer are in this RAM tier now (a read of them
        touches no cold file). A hint: the session may migrate right after."""
        layer = check_layer(layer)
        with self._locked(sid) as slot:
            _, s = self.res.warm(slot, sid)
            if s is None:
                return False
            base, size = self.res.span(s, layer)
            return base <= start and end <= size

    def side_size(self, sid: str, name: str) -> int:
        """Bytes of side stream ``name`` (0 if none; see ``WarmTier.side_append``)."""
        return self._size(sid, side_stream(name))

    def side_read(self, sid: str, name: str, start: int, end: int) -> np.ndarray:
        """Bytes [start, end) of side stream ``name`` (a new array; never promotes)."""
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end})")
        out = np.empty(end - start, np.uint8)
        self._read_into(sid, side_stream(name), start, end, out, promote=False)
        return out

    def _size(self, sid: str, layer: int) -> int:
        with self._locked(sid) as slot:
            _, s = self.res.warm(slot, sid)
            if s is not None:
                return self.res.span(s, layer)[1]
            return files.stream_size(self._cold, sid, layer) if self.cold else 0

    def layer_sizes(self, sid: str) -> dict[int, int]:
        """{layer: size} of every layer the session has, in warm or cold (addition to the
        contract; one listing of the cold directory instead of a lookup per layer)."""
        with self._locked(sid) as slot:
            _, s = self.res.warm(slot, sid)
            if s is not None:
                return {n: self.res.span(s, n)[1] for n in sorted(set(s.layers) | set(s.cold or ()))
                        if n < SIDE_BASE}
            sizes = (files.layer_sizes(self._cold, sid) or {}) if self.cold else {}
            return {n: b for n, b in sorted(sizes.items()) if n < SIDE_BASE}

    def layers(self, sid: str) -> list[int]:
        """Layer numbers the session has, in warm or cold (addition to the contract)."""
        with self._locked(sid) as slot:
            _, s = self.res.warm(slot, sid)
            if s is not None:
                return sorted(n for n in set(s.layers) | set(s.cold or ()) if n < SIDE_BASE)
            return sorted(n for n in ((files.layer_sizes(self._cold, sid) or {}) if self.cold else ())
                          if n < SIDE_BASE)

    def prefetch(self, sid: str, layers: list[int] | range, start: int, end: int) -> int:
        """Ask the cold tier to read bytes [start, end) of these layers ahead (advisory: a
        resume about to read them one layer at a time); returns the files advised."""
        return self._cold.prefetch(sid, layers, start, end) if self.cold is not None else 0

    def read(self, sid: str, layer: int, start: int, end: int, *,
             promote: bool | None = None) -> np.ndarray:
        """Bytes [start, end) of a layer as a new uint8 array, copied out of the memmap
        and/or read from cold (ValueError past the end). Never a view: the extent may be
        reused once the session migrates. ``promote``: None = a read of a whole layer that
        is partly or wholly on cold promotes the session first, True = always, False =
        never."""
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end})")
        out = np.empty(end - start, np.uint8)
        self.read_into(sid, layer, start, end, out, promote=promote)
        return out

    def read_into(self, sid: str, layer: int, start: int, end: int, out: np.ndarray, *,
                  promote: bool | None = None) -> None:
        """``read`` into the caller's ``out`` (uint8, contiguous, ``end - start`` bytes;
        addition to the contract: a reader that reuses one buffer pays no page faults)."""
        self._read_into(sid, check_layer(layer), start, end, out, promote=promote)

    def _read_into(self, sid: str, layer: int, start: int, end: int, out: np.ndarray, *,
                   promote: bool | None) -> None:
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end})")
        if out.dtype != np.uint8 or out.shape != (end - start,) or not out.flags.c_contiguous:
            raise ValueError(f"out must be {end - start} contiguous uint8 bytes")
        promoted = False
        with self._locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if self.cold is not None and promote is not False:
                base, size = self.res.span(s, layer) if s is not None else (files.stream_size(self._cold, sid, layer),) * 2
                whole = start == 0 and end == size and start < base  # a whole layer, partly cold
                if promote or whole:
                    promoted = self.promote(slot, sid, True)
                    f, s = self.res.warm(slot, sid)
            hit = self._fill(f, s, sid, layer, start, end, out)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                self.res.touch(f, s)
        self.res.count(hit)
        if promoted:
            self.after_promote(sid)

    def read_layers(self, sid: str, layers: list[int] | range, start: int, end: int, *,
                    promote: bool = False) -> np.ndarray:
        """Bytes [start, end) of each of ``layers`` as uint8 [len(layers), end - start]:
        one round of every layer in one call (addition to the contract). ``promote=True``
        brings the session back to warm first."""
        layers = [check_layer(layer) for layer in layers]
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end})")
        out = np.empty((len(layers), end - start), np.uint8)
        promoted = hit = False
        with self._locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if promote and self.cold is not None:
                promoted = self.promote(slot, sid, True)
                f, s = self.res.warm(slot, sid)
            hit = self._fill_many(f, s, sid, [(layer, start, end, out[k]) for k, layer in enumerate(layers)])
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                self.res.touch(f, s)
        self.res.count(hit)
        if promoted:
            self.after_promote(sid)
        return out

    def read_many(self, sid: str, ranges: list[tuple[int, int, int, np.ndarray]], *,
                  promote: bool | None = False) -> None:
        """``read_into`` of many (layer, start, end, out) of one session in one call: what
        is on the cold tier is read in one batch (with the native channel: one request for
        every layer's extents, reads that run together), so a resume or a recall of many
        layers waits for the disk once, not once per layer (addition to the contract)."""
        jobs = []
        for layer, start, end, out in ranges:
            if not 0 <= start <= end:
                raise ValueError(f"bad range [{start}, {end})")
            if out.dtype != np.uint8 or out.shape != (end - start,) or not out.flags.c_contiguous:
                raise ValueError(f"out must be {end - start} contiguous uint8 bytes")
            jobs.append((check_layer(layer), start, end, out))
        promoted = False
        with self._locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if promote is None and self.cold is not None and s is not None:
                # as ``read_into``: a whole layer partly on cold brings the session back
                promote = any(start == 0 and end == self.res.span(s, layer)[1]
                              and start < self.res.span(s, layer)[0] for layer, start, end, _ in jobs)
            if promote and self.cold is not None:
                promoted = self.promote(slot, sid, True)
                f, s = self.res.warm(slot, sid)
            hit = self._fill_many(f, s, sid, jobs)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                self.res.touch(f, s)
        self.res.count(hit)
        if promoted:
            self.after_promote(sid)

    def _fill(self, f: ShardFile | None, s: WarmSession | None, sid: str, layer: int,
              start: int, end: int, out: np.ndarray) -> bool:
        """Copy layer bytes [start, end) into ``out``; True when all came from warm."""
        return self._fill_many(f, s, sid, [(layer, start, end, out)])

    def _fill_many(self, f: ShardFile | None, s: WarmSession | None, sid: str,
                   jobs: list[tuple[int, int, int, np.ndarray]]) -> bool:
        """Copy each (layer, start, end) into its ``out``: the parts below each layer's base
        from cold, in one batch, then the rest from the shard. True when all came from warm."""
        cold: list[tuple[int, int, np.ndarray]] = []
        warm: list[tuple[int, int, int, np.ndarray]] = []
        for layer, start, end, out in jobs:
            if s is not None or self.cold is None or start == end:
                if s is not None:
                    base, size = self.res.span(s, layer)
                else:
                    base = size = files.stream_size(self._cold, sid, layer) if self.cold else 0
                if end > size:
                    raise ValueError(f"read [{start}, {end}) past the end ({size}) of {sid}/{layer_name(layer)}")
            else:  # all of it is on cold, whose read checks the end (one lookup less)
                base = end
            split = min(max(base, start), end)  # [start, split) from cold, [split, end) from warm
            if split > start:
                if self.cold is None:
                    raise WarmError(f"{sid}/{layer_name(layer)}: bytes below {base} are on a cold tier not configured")
                cold.append((layer, start, out[:split - start]))
            if end > split:
                warm.append((layer, split, end, out[split - start:]))
        if len(cold) == 1:
            files.read_layer(self._cold, sid, *cold[0], missing_is_empty=s is None)
        elif cold:
            self._cold.read_ranges(sid, cold, missing_is_empty=s is None)
        hit = not cold
        for layer, split, end, out in warm:
            assert f is not None and s is not None  # warm parts: of a warm record
            try:
                f.read_into(s, s.layers[layer], split, end, out, f"layer {layer}")
            except WarmCorrupt as e:  # the cold copy is a prefix of the content: use it
                if self.cold is None or files.stream_size(self._cold, sid, layer) < end:
                    raise
                log.error("%s; served from the cold copy", e)
                files.read_layer(self._cold, sid, layer, split, out)
                hit = False
        return hit
