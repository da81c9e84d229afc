"""Crafting kvfs volumes: change decoded fields and write them back with valid checksums.

A bit flip is caught by a checksum; a crafted volume is not (whoever made it computed the
checksums again). These helpers do what such a person does -- rewrite superblock fields,
B+ tree pages and ring entries, each with its CRC fixed -- so tests and the fuzzer
(``tools/fuzz_volumes.py``) can check that every decoded field is checked before use.
Works on an unmounted volume file, through plain ``os.pread``/``os.pwrite``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import crc32c

from kvfs.engine.btree_page import CRC, CRC_OFF, HDR, ROOT, TreeRoot, decode_page
from kvfs.engine.format import (
    BLOCK_ENTRY,
    HDR_SIZE,
    PAGE,
    SB_SLOT,
    SMETA_FMT,
    T_DATA,
    T_PAD,
    T_SMETA,
    Header,
    Superblock,
    unpack_header,
)

Path_ = str | Path


# ------------------------------------------------------------------ superblock
def slots(path: Path_) -> list[Superblock | None]:
    """Both superblock slots (None for a slot that does not decode)."""
    out: list[Superblock | None] = []
    with open(path, "rb") as f:
        for i in (0, 1):
            f.seek(i * SB_SLOT)
            try:
                out.append(Superblock.unpack(f.read(SB_SLOT)))
            except Exception:  # noqa: BLE001 - a crafting tool reads what it can
                out.append(None)
    return out


def newest(path: Path_) -> tuple[int, Superblock]:
    good = [(i, s) for i, s in enumerate(slots(path)) if s is not None]
    return max(good, key=lambda x: x[1].seq)


def write_slot(path: Path_, slot: int, sb: Superblock) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, sb.pack(), slot * SB_SLOT)
    finally:
        os.close(fd)


def set_superblock(path: Path_, both: bool = True, **fields: object) -> None:
    """Rewrite the newest slot (and the other with ``both``) with ``fields`` changed."""
    i, sb = newest(path)
    new = dataclasses.replace(sb, **fields)
    write_slot(path, i, new)
    if both:
        write_slot(path, 1 - i, dataclasses.replace(new, seq=new.seq - 1))


def root_of(sb: Superblock) -> TreeRoot:
    """The tree root a superblock records, unchecked (a crafted one included)."""
    root, height, half, prev, count, alloc, gen = ROOT.unpack_from(sb.tree_root)
    return TreeRoot(root, height, count, half, alloc, prev, gen)


def set_root(path: Path_, **fields: object) -> None:
    _, sb = newest(path)
    root = dataclasses.replace(root_of(sb), **fields)
    set_superblock(path, tree_root=root.pack())


# ------------------------------------------------------------------ tree pages
def page_offset(sb: Superblock, abs_page: int) -> int:
    return sb.tree_offset + abs_page * PAGE


def reachable_pages(path: Path_) -> list[int]:
    """Absolute page numbers reachable from the newest root (best effort)."""
    _, sb = newest(path)
    root = root_of(sb)
    if root.root < 0 or root.half not in (0, 1):
        return []
    half = sb.tree_pages // 2
    out, stack, seen = [], [root.root], set()
    fd = os.open(path, os.O_RDONLY)
    try:
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            ap = root.half * half + p
            try:
                node = decode_page(os.pread(fd, PAGE, page_offset(sb, ap)), ap, PAGE, half)
            except Exception:  # noqa: BLE001
                continue
            out.append(ap)
            if node.level:
                stack += node.kids
    finally:
        os.close(fd)
    return out


def read_page(path: Path_, abs_page: int) -> bytearray:
    _, sb = newest(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return bytearray(os.pread(fd, PAGE, page_offset(sb, abs_page)))
    finally:
        os.close(fd)


def write_page(path: Path_, abs_page: int, buf: bytearray | bytes) -> None:
    """Write a page with its checksum made right."""
    buf = bytearray(buf)
    buf[CRC_OFF:HDR.size] = b"\0\0\0\0"
    CRC.pack_into(buf, CRC_OFF, crc32c.crc32c(bytes(buf)))
    _, sb = newest(path)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(buf), page_offset(sb, abs_page))
    finally:
        os.close(fd)


# ------------------------------------------------------------------ ring entries
def entries(path: Path_) -> Iterator[tuple[int, int, Header]]:
    """(pos, file offset, header) of the entries from the newest tail on, as long as they
    follow each other (past the recorded head too: entries recovery would replay)."""
    _, sb = newest(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = sb.tail
        while pos < sb.tail + sb.ring_size:
            off = sb.ring_offset + pos % sb.ring_size
            h = unpack_header(os.pread(fd, HDR_SIZE, off))
            if h is None or h.pos != pos:
                return
            yield pos, off, h
            pos += sb.ring_size - pos % sb.ring_size if h.type == T_PAD else h.size
    finally:
        os.close(fd)


def read_payload(path: Path_, off: int, h: Header) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, h.stored_len, off + HDR_SIZE)
    finally:
        os.close(fd)


def write_entry(path: Path_, off: int, h: Header, payload: bytes | None = None) -> None:
    """Write header ``h`` (its CRC made right) and, if given, a payload of the same length
    (a non-data entry's ``payload_crc`` made right; a data entry's table CRC too)."""
    if payload is not None:
        if h.type == T_DATA:
            table = payload[:h.nblocks * BLOCK_ENTRY.size]
            h = h._replace(payload_crc=crc32c.crc32c(table))
        else:
            h = h._replace(payload_crc=crc32c.crc32c(payload))
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, h.pack(), off)
        if payload is not None:
            os.pwrite(fd, payload, off + HDR_SIZE)
    finally:
        os.close(fd)


def rename_session_entry(path: Path_, old: str, new: bytes, fix_hash: bool = True) -> bool:
    """Give the smeta entries of session ``old`` the name ``new`` (same length), checksums
    right and, with ``fix_hash``, the header's name hash that of ``new``."""
    import hashlib

    done = False
    for _, off, h in list(entries(path)):
        if h.type != T_SMETA:
            continue
        p = read_payload(path, off, h)
        if p[SMETA_FMT.size:] != old.encode():
            continue
        assert len(new) == len(old.encode())
        if fix_hash:
            h = h._replace(name_hash=int.from_bytes(hashlib.md5(new).digest()[:8], "big"))
        write_entry(path, off, h, p[:SMETA_FMT.size] + new)
        done = True
    return done


# ------------------------------------------------------------------ the fuzzer's mutations
_SB_FIELDS = ("flags", "volume_size", "ring_offset", "ring_size", "tree_offset", "tree_pages",
              "head", "tail", "ckpt_pos", "next_sno")
_ROOT_FIELDS = ("root", "height", "count", "half", "alloc", "prev_half", "generation")
_HDR_FIELDS = ("type", "flags", "pos", "name_hash", "sno", "file_off", "fno", "stored_len",
               "raw_len", "nblocks")
_LIMITS = {"type": 0xFF, "flags": 0xFF, "fno": 0xFFFFFFFF, "stored_len": 0xFFFFFFFF,
           "raw_len": 0xFFFFFFFF, "nblocks": 0xFFFFFFFF, "height": 0xFFFFFFFF,
           "half": 127, "prev_half": 127}


def _interesting(rng: random.Random, old: int, limit: int, file_size: int, lo: int = 0) -> int:
    v = rng.choice((0, 1, limit, limit - 1, old + rng.choice((-1, 1)) * rng.randint(1, 4096),
                    old * rng.choice((2, 3, 1024)), 1 << rng.randrange(64),
                    file_size + rng.randint(-4096, 4096), rng.randrange(max(1, limit))))
    return max(lo, min(limit, v))


def mutate(path: Path_, rng: random.Random) -> str:
    """One crafted change to the volume at ``path`` (checksums right); what it did. A
    change this tool cannot make (a volume already past reading) is skipped."""
    try:
        return _mutate(path, rng)
    except Exception as e:  # noqa: BLE001 - the tool's own limits, not the reader's
        return f"skipped ({type(e).__name__}: {e})"


def _mutate(path: Path_, rng: random.Random) -> str:
    size = os.path.getsize(path)
    kind = rng.choice(("superblock", "root", "page", "page", "entry", "entry", "payload"))
    if kind == "superblock":
        f = rng.choice(_SB_FIELDS)
        _, sb = newest(path)
        v = _interesting(rng, getattr(sb, f), (1 << 64) - 1 if f != "flags" else 0xFFFFFFFF, size)
        set_superblock(path, both=rng.random() < 0.7, **{f: v})
        return f"superblock {f}={v}"
    if kind == "root":
        f = rng.choice(_ROOT_FIELDS)
        _, sb = newest(path)
        old = getattr(root_of(sb), f)
        limit = _LIMITS.get(f, (1 << 63) - 1 if f == "root" else (1 << 64) - 1)
        v = _interesting(rng, old, limit, size, -(1 << 63) if f == "root" else 0)
        if f in ("half", "prev_half"):
            v = rng.choice((-1, 0, 1, 2, v))
        if f == "root":
            v = rng.choice((-1, v, old + 1))
        set_root(path, **{f: v})
        return f"tree root {f}={v}"
    if kind == "page":
        pages = reachable_pages(path)
        if not pages:
            return "no tree page"
        ap = rng.choice(pages)
        buf = read_page(path, ap)
        how = rng.randrange(5)
        if how == 0:  # a child pointer, or every child, to one page
            nkeys = struct.unpack_from("<H", buf, 6)[0]
            if buf[5]:  # a branch: child0 at HDR.size
                target = struct.unpack_from("<I", buf, HDR.size)[0] if rng.random() < 0.7 else rng.randrange(1 << 32)
                off = HDR.size + 4
                for _ in range(nkeys):
                    klen = buf[off]
                    struct.pack_into("<I", buf, off + 1 + klen, target)
                    off += 1 + klen + 4
                desc = f"page {ap}: every child -> {target}"
            else:
                desc = f"page {ap}: leaf left as it is"
        elif how == 1:  # header fields
            fld = rng.choice((4, 5, 6))
            buf[fld] = rng.randrange(256) if fld != 6 else buf[fld]
            if fld == 6:
                struct.pack_into("<H", buf, 6, rng.randrange(1 << 16))
            desc = f"page {ap}: header byte {fld}"
        elif how == 2:  # a bitmap or usage key's number
            i = buf.find(b"B", HDR.size)
            j = buf.find(b"U", HDR.size)
            at = i if i > 0 and (j < 0 or rng.random() < 0.5) else j
            if at > 0:
                struct.pack_into(">I", buf, min(at + 1, len(buf) - 4), rng.choice((4_000_000, 0xFFFFFFFF, rng.randrange(1 << 32))))
            desc = f"page {ap}: key number at {at}"
        else:  # bytes of the body
            for _ in range(rng.randint(1, 8)):
                k = rng.randrange(HDR.size, PAGE)
                buf[k] = rng.choice((0, 0xFF, ord("/"), ord("."), rng.randrange(256)))
            desc = f"page {ap}: body bytes"
        write_page(path, ap, buf)
        return desc
    ents = [e for e in entries(path) if e[2].type != T_PAD]
    if not ents:
        return "no entry"
    pos, off, h = rng.choice(ents)
    if kind == "entry":
        f = rng.choice(_HDR_FIELDS)
        v = _interesting(rng, getattr(h, f), _LIMITS.get(f, (1 << 64) - 1), size)
        write_entry(path, off, h._replace(**{f: v}))
        return f"entry {pos} {f}={v}"
    p = bytearray(read_payload(path, off, h))
    if not p:
        return f"entry {pos}: empty payload"
    for _ in range(rng.randint(1, 6)):
        k = rng.randrange(len(p))
        p[k] = rng.choice((0, 0xFF, ord("/"), ord("."), 0x1B, rng.randrange(256)))
    write_entry(path, off, h, bytes(p))
    return f"entry {pos}: payload bytes"
