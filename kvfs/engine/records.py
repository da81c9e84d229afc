"""In-memory index records (sessions, files, extents) and their checkpoint encoding.

A file is append-only, so its extents are contiguous and in file order: extent i covers
[off[i], off[i] + len[i]) and off[i+1] == off[i] + len[i]. An extent points into a ring
entry: (pos, skip, length, esize) = entry position, offset inside the entry's raw payload,
bytes used, entry size on disk. Records are encoded as bytes for the B+ tree checkpoint and
split into chunks that fit a tree value.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from dataclasses import dataclass, field

from .errors import BadId, BadName, Corrupt, NameTooLong, TimeRange
from .format import ALIGN, FMETA_FMT, MAX_ENTRY_RAW, SMETA_FMT, TIME_MAX, TIME_MIN, U32_MAX
from .types import FileStat, SessionStat

CHUNK = 1000  # bytes of a record per B+ tree value
MAX_NAME = 255
MAX_FNO = 0xFFFFFFFF  # file numbers stay below it: a session's next one is a u32
MAX_RECORD = CHUNK * 0xFFFF  # a session record's chunks are numbered by a u16 in their key

_SESS = struct.Struct("<QQIIIIqqqqI")  # sno, name_hash, mode, uid, gid, next_fno, c/m/atime ns, meta_pos, nfiles
_FILE = struct.Struct("<IIIIqqqqI")  # fno, mode, uid, gid, c/m/atime ns, meta_pos, nextents
_EXT = struct.Struct("<QIII")  # pos, skip, length, esize


def check_name(name: str) -> bytes:
    """UTF-8 bytes of a valid single path component, else BadName/NameTooLong."""
    if not isinstance(name, str):
        raise BadName(f"name must be str, not {type(name).__name__}")
    try:
        b = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise BadName(f"name is not encodable: {e}") from None
    if not b or b in (b".", b"..") or b"/" in b or b"\0" in b:
        raise BadName(f"invalid name {name!r}: empty, '.', '..', or containing '/' or NUL")
    if len(b) > MAX_NAME:
        raise NameTooLong(f"name of {len(b)} bytes is over {MAX_NAME}")
    return b


def check_time(ns: int | None, what: str = "time") -> int | None:
    """``ns`` (nanoseconds since the epoch, None: unchanged) if a record can hold it, else
    TimeRange: checked before anything changes, so no time fails a record or a checkpoint."""
    if ns is None:
        return None
    if isinstance(ns, bool) or not isinstance(ns, int) or not TIME_MIN <= ns <= TIME_MAX:
        raise TimeRange(f"{what} {ns!r} ns is outside 1677-09-21..2262-04-11 "
                        f"([{TIME_MIN}, {TIME_MAX}] ns since the epoch)")
    return ns


def seconds_ns(t: float | None, what: str = "time") -> int | None:
    """Float seconds as checked nanoseconds (TimeRange for a time beyond, inf or NaN)."""
    if t is None:
        return None
    try:
        ns = int(t * 1e9)
    except (OverflowError, ValueError):
        raise TimeRange(f"{what} {t!r} s is not a time a record holds") from None
    return check_time(ns, what)


def check_id(v: int | None, what: str) -> int | None:
    """A uid, gid or mode that fits its u32 field (None: unchanged), else BadId."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= U32_MAX:
        raise BadId(f"{what} {v!r} does not fit 32 bits")
    return v


def check_attrs(mode: int | None, uid: int | None, gid: int | None, atime: float | None,
           mtime: float | None, atime_ns: int | None, mtime_ns: int | None
           ) -> tuple[int | None, int | None, int | None, int | None, int | None]:
    """Attribute changes checked before any is made: a value no record holds is refused
    (TimeRange, BadId), never left in memory to fail the next checkpoint."""
    a = check_time(atime_ns, "atime") if atime_ns is not None else seconds_ns(atime, "atime")
    m = check_time(mtime_ns, "mtime") if mtime_ns is not None else seconds_ns(mtime, "mtime")
    return check_id(mode, "mode"), check_id(uid, "uid"), check_id(gid, "gid"), a, m


def name_hash(name: str) -> int:
    """First 8 bytes of md5(name): the session's key prefix in the B+ tree."""
    return int.from_bytes(hashlib.md5(name.encode("utf-8", "surrogateescape")).digest()[:8], "big")


@dataclass(eq=False)
class FileRec:
    fno: int
    name: str
    mode: int
    uid: int
    gid: int
    ctime: int
    mtime: int
    atime: int
    meta_pos: int  # ring position of the newest FMETA entry for this file
    off: list[int] = field(default_factory=list)
    ext: list[tuple[int, int, int, int]] = field(default_factory=list)
    seq_end: int = field(default=-1, repr=False)  # in memory only: where the last read ended
    advised_to: int = field(default=0, repr=False)  # read-ahead advice given up to here

    @property
    def size(self) -> int:
        return self.off[-1] + self.ext[-1][2] if self.ext else 0

    def stored(self) -> int:
        return sum({e[0]: e[3] for e in self.ext}.values())

    def stat(self) -> FileStat:
        return FileStat(self.name, self.size, self.stored(), self.mode, self.uid, self.gid,
                        self.ctime / 1e9, self.mtime / 1e9, self.atime / 1e9, self.ctime,
                        self.mtime, self.atime)

    def add(self, pos: int, skip: int, length: int, esize: int) -> None:
        self.off.append(self.size)
        self.ext.append((pos, skip, length, esize))

    def truncate(self, length: int) -> None:
        """Cut the file to ``length`` bytes."""
        i = bisect.bisect_left(self.off, length)
        # extents starting at or after length go; the one straddling it is shortened
        del self.off[i:], self.ext[i:]
        if self.ext and self.size > length:
            pos, skip, _, esize = self.ext[-1]
            self.ext[-1] = (pos, skip, length - self.off[-1], esize)

    def replace_range(self, file_off: int, pos: int, length: int, esize: int) -> bool:
        """Make [file_off, file_off+length) read from entry ``pos`` (skip 0), keeping the rest.

        Recovery replays entries in ring order, and a copied-forward entry can land after
        entries that follow it in the file, so gaps are allowed here; ``close_gaps`` ends it.
        """
        end = file_off + length
        if file_off < 0 or length <= 0:
            return False
        new_off: list[int] = []
        new_ext: list[tuple[int, int, int, int]] = []
        placed = False
        for o, (p, s, n, es) in zip(self.off, self.ext, strict=True):
            e_end = o + n
            if e_end <= file_off or o >= end:  # untouched
                if o >= end and not placed:
                    new_off.append(file_off)
                    new_ext.append((pos, 0, length, esize))
                    placed = True
                new_off.append(o)
                new_ext.append((p, s, n, es))
                continue
            if o < file_off:  # head part survives
                new_off.append(o)
                new_ext.append((p, s, file_off - o, es))
            if not placed:
                new_off.append(file_off)
                new_ext.append((pos, 0, length, esize))
                placed = True
            if e_end > end:  # tail part survives
                new_off.append(end)
                new_ext.append((p, s + (end - o), e_end - end, es))
        if not placed:
            new_off.append(file_off)
            new_ext.append((pos, 0, length, esize))
        self.off, self.ext = new_off, new_ext
        return True

    def close_gaps(self) -> int:
        """Cut the file at its first hole (data lost to corruption); returns bytes dropped."""
        expect = 0
        for i, o in enumerate(self.off):
            if o != expect:
                lost = self.size - expect
                del self.off[i:], self.ext[i:]
                return lost
            expect = o + self.ext[i][2]
        return 0

    def find(self, offset: int) -> int:
        """Index of the extent holding byte ``offset``."""
        return bisect.bisect_right(self.off, offset) - 1


@dataclass(eq=False)
class Session:
    sno: int
    name: str
    name_hash: int
    mode: int
    uid: int
    gid: int
    ctime: int
    mtime: int
    atime: int
    meta_pos: int
    next_fno: int = 1
    files: dict[int, FileRec] = field(default_factory=dict)
    by_name: dict[str, int] = field(default_factory=dict)
    dirty: bool = False

    def stat(self) -> SessionStat:
        size = sum(f.size for f in self.files.values())
        stored = sum(f.stored() for f in self.files.values())
        return SessionStat(self.name, self.sno, self.mode, self.uid, self.gid, self.ctime / 1e9,
                           self.mtime / 1e9, self.atime / 1e9, len(self.files), size, stored,
                           self.ctime, self.mtime, self.atime)

    def file(self, name: str) -> FileRec | None:
        fno = self.by_name.get(name)
        return None if fno is None else self.files[fno]

    def add_file(self, f: FileRec) -> None:
        old = self.by_name.get(f.name)
        if old is not None and old != f.fno:
            self.files.pop(old, None)
        self.files[f.fno] = f
        self.by_name[f.name] = f.fno
        self.next_fno = max(self.next_fno, f.fno + 1)

    def drop_file(self, fno: int) -> None:
        f = self.files.pop(fno, None)
        if f is not None and self.by_name.get(f.name) == fno:
            del self.by_name[f.name]

    def last_use_ns(self) -> int:
        return max(self.atime, self.mtime)

    # ------------------------------------------------------------ encoding
    def encode(self) -> bytes:
        nb = self.name.encode("utf-8", "surrogateescape")
        parts = [_SESS.pack(self.sno, self.name_hash, self.mode, self.uid, self.gid, self.next_fno,
                            self.ctime, self.mtime, self.atime, self.meta_pos, len(self.files)),
                 struct.pack("<H", len(nb)), nb]
        for f in self.files.values():
            fb = f.name.encode("utf-8", "surrogateescape")
            parts += [_FILE.pack(f.fno, f.mode, f.uid, f.gid, f.ctime, f.mtime, f.atime, f.meta_pos,
                                 len(f.ext)), struct.pack("<H", len(fb)), fb]
            parts += [_EXT.pack(*e) for e in f.ext]
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes) -> Session:
        """A session from its checkpoint record; Corrupt unless every field is one the
        engine could have written: names valid exactly as on create, the name hash the
        name's, file numbers and names unique, extents of whole aligned entries."""
        try:
            v = _SESS.unpack_from(raw, 0)
            p = _SESS.size
            (nl,) = struct.unpack_from("<H", raw, p)
            p += 2
            name = loaded_name(raw[p: p + nl], "session")
            if name_hash(name) != v[1]:
                raise Corrupt(f"session record {name!r}: name hash {v[1]:x} is not its name's")
            s = cls(v[0], name, v[1], v[2], v[3], v[4], v[6], v[7], v[8], v[9], v[5])
            p += nl
            for _ in range(v[10]):
                fv = _FILE.unpack_from(raw, p)
                p += _FILE.size
                (fl,) = struct.unpack_from("<H", raw, p)
                p += 2
                f = FileRec(fv[0], loaded_name(raw[p: p + fl], "file"), fv[1], fv[2],
                            fv[3], fv[4], fv[5], fv[6], fv[7])
                if f.fno in s.files or f.name in s.by_name or f.fno >= MAX_FNO:
                    raise Corrupt(f"session record {name!r}: file {f.name!r} ({f.fno}) twice")
                p += fl
                for _ in range(fv[8]):
                    pos, skip, length, esize = _EXT.unpack_from(raw, p)
                    if not length or esize < ALIGN or esize % ALIGN or skip + length > MAX_ENTRY_RAW:
                        raise Corrupt(f"session record {name!r}: bad extent in {f.name!r}")
                    f.add(pos, skip, length, esize)
                    p += _EXT.size
                s.add_file(f)
            if p != len(raw):
                raise Corrupt("trailing bytes in session record")
            return s
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise Corrupt(f"bad session record: {e}") from e


def loaded_name(raw: bytes | memoryview, what: str) -> str:
    """A name read back from the volume, held to the rules ``check_name`` sets on create
    (a crafted or damaged record must not put ``..``, ``a/b`` or NUL in a listing);
    Corrupt otherwise."""
    name = bytes(raw).decode("utf-8", "surrogateescape")
    try:
        check_name(name)
    except BadName as e:
        raise Corrupt(f"{what} name {bytes(raw)[:64]!r} read back is not valid: {e}") from None
    return name


def smeta_payload(s: Session) -> bytes:
    """Payload of a T_SMETA entry for ``s`` (layout in format.py)."""
    return SMETA_FMT.pack(s.mode, s.uid, s.gid, s.next_fno, s.ctime, s.mtime) + s.name.encode(
        "utf-8", "surrogateescape")


def fmeta_payload(f: FileRec) -> bytes:
    """Payload of a T_FMETA entry for ``f``."""
    return FMETA_FMT.pack(f.mode, f.uid, f.gid, f.ctime, f.mtime) + f.name.encode(
        "utf-8", "surrogateescape")


def chunk0_name(val: bytes) -> str:
    """Session name from the first chunk of an encoded session record (Corrupt unless
    it is a valid name)."""
    p = _SESS.size
    n = int.from_bytes(val[p: p + 2], "little")
    if len(val) < p + 2 + n:
        raise Corrupt(f"session record chunk of {len(val)} bytes cut inside its name")
    return loaded_name(val[p + 2: p + 2 + n], "session")


def session_key_sno(key: bytes) -> int:
    """The session number of a session record key; Corrupt for a key of another shape."""
    if len(key) != 19:
        raise Corrupt(f"session record key {key!r} is not 19 bytes")
    return int.from_bytes(key[9:17], "big")


def chunk_key(nh: int, sno: int, i: int) -> bytes:
    return b"S" + nh.to_bytes(8, "big") + sno.to_bytes(8, "big") + i.to_bytes(2, "big")


def session_prefix(nh: int, sno: int | None = None) -> bytes:
    p = b"S" + nh.to_bytes(8, "big")
    return p if sno is None else p + sno.to_bytes(8, "big")


def split_chunks(raw: bytes) -> list[bytes]:
    return [raw[i: i + CHUNK] for i in range(0, len(raw), CHUNK)] or [b""]
