"""In-memory index of a shard file: sessions, their streams and the segments of those."""

from __future__ import annotations

from .kvmap_format import K_SUMMARY


class ShardCorrupt(Exception):
    """The file failed a structural check; its sessions are treated as missing."""


class Seg:
    """One extent of a stream: stream bytes [start, start + used), capacity ``cap``."""

    __slots__ = ("idx", "start", "off", "cap", "used")

    def __init__(self, idx: int, start: int, off: int, cap: int, used: int) -> None:
        self.idx, self.start, self.off, self.cap, self.used = idx, start, off, cap, used


class Stream:
    """The warm part of one layer (or of the summaries): contiguous segments by start."""

    __slots__ = ("segs",)

    def __init__(self) -> None:
        self.segs: list[Seg] = []

    @property
    def base(self) -> int:
        return self.segs[0].start if self.segs else 0

    @property
    def end(self) -> int:
        return self.segs[-1].start + self.segs[-1].used if self.segs else 0

    @property
    def held(self) -> int:
        return sum(s.used for s in self.segs)


class WarmSession:
    """In-memory index of one session in a shard. ``cold`` is WarmTier's: the cold copy's
    layer sizes (None: no cold copy), cached because only this process writes them."""

    __slots__ = ("name", "uid", "idx", "last_used", "flags", "layers", "summary", "meta",
                 "meta_seq", "tokens", "cold", "gen", "inc", "csumm", "cmeta", "unsynced")

    def __init__(self, name: str, uid: int, idx: int, last_used: float, flags: int,
                 inc: int = 0) -> None:
        self.name, self.uid, self.idx = name, uid, idx
        self.last_used, self.flags = last_used, flags
        self.layers: dict[int, Stream] = {}
        self.summary = Stream()
        self.meta: Seg | None = None
        self.meta_seq = 0
        self.tokens = 0
        self.cold: dict[int, int] | None = None
        self.gen = 0  # bumped by every change of content: a migration checks it before dropping
        self.inc = inc  # incarnation id (0: not known yet)
        # write-behind's knowledge of the cold copy: summaries and meta.json bytes last
        # written or read there (None: unknown, read them), files written but not fsynced
        self.csumm: bytes | None = None
        self.cmeta: bytes | None = None
        self.unsynced: set[str] = set()

    def stream(self, kind: int, layer: int) -> Stream:
        if kind == K_SUMMARY:
            return self.summary
        st = self.layers.get(layer)
        if st is None:
            st = self.layers[layer] = Stream()
        return st

    @property
    def held(self) -> int:
        n = sum(st.held for st in self.layers.values()) + self.summary.held
        return n + (self.meta.used if self.meta else 0)
