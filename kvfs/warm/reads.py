"""The warm tier's read calls: size, layer_sizes, layers, read, read_into, read_layers,
in_ram, side_size, side_read (a mixin of WarmTier).

A layer's range splits at its base: bytes below it come from the cold copy (always a
prefix of the content, tier.py), the rest from the shard's mapping. A checksum mismatch in
RAM is served from the cold copy when that holds the bytes. A read of a whole layer that is
partly on cold promotes the session back to RAM first (migrate.py). Separate from tier.py,
which owns the state, the locks and the writes; these only look up and copy out.
Never imports torch.
"""

from __future__ import annotations

import logging

import numpy as np

from kvfs.ops import metrics

from .cold import SIDE_BASE, ColdStore, layer_name, side_stream
from .ids import WarmCorrupt, WarmError, check_layer
from .records import WarmSession
from .shard import ShardFile

log = logging.getLogger("kvfs.warm")


class Reads:
    """WarmTier's read methods; its state, locks and helpers are the tier's (tier.py)."""

    cold: ColdStore | None
    stats: dict[str, int]

    def size(self, sid: str, layer: int) -> int:
        return self._size(sid, check_layer(layer))

    def in_ram(self, sid: str, layer: int, start: int, end: int) -> bool:
        """Whether bytes [start, end) of a layer are in this RAM tier now (a read of them
        touches no cold file). A hint: the session may migrate right after."""
        layer = check_layer(layer)
        with self._locked(sid) as slot:
            _, s = self._warm(slot, sid)
            if s is None:
                return False
            base, size = self._span(s, layer)
            return base <= start and end <= size

    def side_size(self, sid: str, name: str) -> int:
        """Bytes of side stream ``name`` (0 if none; see ``side_append``)."""
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
            _, s = self._warm(slot, sid)
            if s is not None:
                return self._span(s, layer)[1]
            return self.cold.size(sid, layer) if self.cold else 0

    def layer_sizes(self, sid: str) -> dict[int, int]:
        """{layer: size} of every layer the session has, in warm or cold (addition to the
        contract; one listing of the cold directory instead of a lookup per layer)."""
        with self._locked(sid) as slot:
            _, s = self._warm(slot, sid)
            if s is not None:
                return {n: self._span(s, n)[1] for n in sorted(set(s.layers) | set(s.cold or ()))
                        if n < SIDE_BASE}
            sizes = (self.cold.layer_sizes(sid) or {}) if self.cold else {}
            return {n: b for n, b in sorted(sizes.items()) if n < SIDE_BASE}

    def layers(self, sid: str) -> list[int]:
        """Layer numbers the session has, in warm or cold (addition to the contract)."""
        with self._locked(sid) as slot:
            _, s = self._warm(slot, sid)
            if s is not None:
                return sorted(n for n in set(s.layers) | set(s.cold or ()) if n < SIDE_BASE)
            return sorted(n for n in ((self.cold.layer_sizes(sid) or {}) if self.cold else ())
                          if n < SIDE_BASE)

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
            f, s = self._warm(slot, sid)
            if self.cold is not None and promote is not False:
                base, size = self._span(s, layer) if s is not None else (self.cold.size(sid, layer),) * 2
                whole = start == 0 and end == size and start < base  # a whole layer, partly cold
                if promote or whole:
                    promoted = self._promote_locked(slot, sid, soft=True)
                    f, s = self._warm(slot, sid)
            hit = self._fill(f, s, sid, layer, start, end, out)
            if s is not None:
                self._touch(f, s)
        self._count(hit)
        if promoted:
            self._maybe_migrate(exclude={sid})

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
            f, s = self._warm(slot, sid)
            if promote and self.cold is not None:
                promoted = self._promote_locked(slot, sid, soft=True)
                f, s = self._warm(slot, sid)
            hit = all([self._fill(f, s, sid, layer, start, end, out[k]) for k, layer in enumerate(layers)])
            if s is not None:
                self._touch(f, s)
        self._count(hit)
        if promoted:
            self._maybe_migrate(exclude={sid})
        return out

    def _fill(self, f: ShardFile | None, s: WarmSession | None, sid: str, layer: int,
              start: int, end: int, out: np.ndarray) -> bool:
        """Copy layer bytes [start, end) into ``out``; True when all came from warm."""
        if s is not None or self.cold is None or start == end:
            if s is not None:
                base, size = self._span(s, layer)
            else:
                base = size = self.cold.size(sid, layer) if self.cold else 0
            if end > size:
                raise ValueError(f"read [{start}, {end}) past the end ({size}) of {sid}/{layer_name(layer)}")
        else:  # all of it is on cold, whose read checks the end (one lookup less)
            base = end
        split = min(max(base, start), end)  # [start, split) from cold, [split, end) from warm
        if split > start:
            if self.cold is None:
                raise WarmError(f"{sid}/{layer_name(layer)}: bytes below {base} are on a cold tier not configured")
            self.cold.read_into(sid, layer, start, out[:split - start], missing_is_empty=s is None)
        if end > split:
            try:
                f.read_into(s, s.layers[layer], split, end, out[split - start:], f"layer {layer}")
            except WarmCorrupt as e:  # the cold copy is a prefix of the content: use it
                if self.cold is None or self.cold.size(sid, layer) < end:
                    raise
                log.error("%s; served from the cold copy", e)
                self.cold.read_into(sid, layer, split, out[split - start:])
                return False
        return split == start

    def _count(self, hit: bool) -> None:
        with self._lock:
            self.stats["hits" if hit else "misses"] += 1
        (metrics.warm_hits if hit else metrics.warm_misses).inc()
