"""Torture scenarios of the native channel (``torture.py`` runs them; docs/reliability.md).

- ``nrace``: reader threads read random ranges through the channel (the volume read
  directly, with the extents they keep) while a writer, through the mount's files, keeps
  the small ring lapping, cuts files back and removes and remakes whole sessions. Every
  4 KiB block says which file, block and generation it is, so any byte from another lap,
  file, offset or an older generation is seen: 0 wrong bytes.
- ``nkill9``: a writer sends rounds of every layer through the channel, one durability
  point each; the mount is killed (SIGKILL) at a random moment; ``kvfs-fsck`` must find the
  volume clean and, after a remount, every acknowledged round is there, byte for byte.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import struct
import threading
import time
from pathlib import Path

from torture_common import Mount, Result, alive, fsck, mounted, start, stop

BLOCK = 4096
LAPS = 3  # nrace runs until the ring has lapped this often
_HEAD = struct.Struct("<IIII")  # file id, block index, generation, check


def block(fid: int, i: int, gen: int) -> bytes:
    """A self-describing block: its file, index and generation, then bytes drawn from them."""
    head = _HEAD.pack(fid, i, gen, (fid * 2654435761 + i * 40503 + gen * 97) & 0xFFFFFFFF)
    body = random.Random(fid << 40 | i << 16 | gen).randbytes(BLOCK - _HEAD.size)
    return head + body


def _check_blocks(data: bytes, fid: int, first: int, gens: list[set[int]]) -> str | None:
    """None when every block of ``data`` is block ``first + k`` of file ``fid`` in one of
    the generations it had during the read, else what is wrong."""
    for k in range(len(data) // BLOCK):
        b = data[k * BLOCK:(k + 1) * BLOCK]
        f, i, g, _ = _HEAD.unpack_from(b)
        if (f, i) != (fid, first + k):
            return f"block {first + k}: holds block {i} of file {f}"
        if g not in gens[k]:
            return f"block {first + k}: generation {g}, expected one of {sorted(gens[k])}"
        if b != block(f, i, g):
            return f"block {first + k}: its bytes are not generation {g}'s"
    return None


def nrace(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n`` native reads racing a lapping ring, cuts and removals (module doc)."""
    from kvfs.channel import Channel

    res = Result("nrace", n)
    m = Mount(work / "nrace.kvfs", work / "nrace.mnt", "24M")
    nfiles = 6
    lock = threading.Lock()
    gens: list[list[int]] = [[] for _ in range(nfiles)]  # per file: generation of each block
    seen: list[list[list[int]]] = [[] for _ in range(nfiles)]  # per block: generations, in order
    live = [False] * nfiles
    stop_ = threading.Event()
    with mounted(m):
        ch = Channel.open(str(m.root))
        if ch is None:
            res.fail("the mount serves no native channel")
            stop(m, res)
            return res

        def path(fid: int) -> Path:
            return m.sessions / f"s{fid}" / "layer_0"

        def writer() -> None:
            wr = random.Random(rng.random())
            gen = 1
            try:
                while not stop_.is_set():
                    fid = wr.randrange(nfiles)
                    act = wr.random()
                    gen += 1
                    if not live[fid] or act < 0.05:  # remove and remake the whole session
                        if live[fid]:
                            shutil.rmtree(m.sessions / f"s{fid}")
                            with lock:
                                live[fid], gens[fid] = False, []
                            res.add("sessions_removed")
                        os.mkdir(m.sessions / f"s{fid}")
                        with lock:
                            live[fid] = True
                        continue
                    size = len(gens[fid])
                    if act < 0.2 and size:  # an agent retrying turns: cut back
                        cut = wr.randrange(size)
                        os.truncate(path(fid), cut * BLOCK)
                        with lock:
                            del gens[fid][cut:]
                        res.add("truncates")
                        continue
                    if size > 400:  # keep files small: the ring laps, reclaim copies forward
                        os.truncate(path(fid), 0)
                        with lock:
                            gens[fid] = []
                        continue
                    k = wr.randint(1, 64)
                    data = b"".join(block(fid, size + j, gen) for j in range(k))
                    with lock:  # the blocks are this generation's from now on
                        gens[fid] += [gen] * k
                        for j in range(k):
                            if size + j < len(seen[fid]):
                                seen[fid][size + j].append(gen)
                            else:
                                seen[fid].append([gen])
                    with open(path(fid), "ab", buffering=0) as f:
                        f.write(data)
                    res.add("appends")
            except Exception as e:  # noqa: BLE001 - reported
                res.fail(f"writer: {e!r}")
                stop_.set()

        def reader(seed: float) -> None:
            rr = random.Random(seed)
            while not stop_.is_set():
                fid = rr.randrange(nfiles)
                with lock:
                    size = len(gens[fid])
                    if not live[fid] or size == 0:
                        continue
                    a = rr.randrange(size)
                    b = min(size, a + rr.randint(1, 40))
                    # what each block may hold: its generation now, or one written during the read
                    allowed = [{g} for g in gens[fid][a:b]]
                    mark = [len(s) for s in seen[fid][a:b]]
                out = bytearray((b - a) * BLOCK)
                try:
                    ch.read(f"s{fid}", [("layer_0", a * BLOCK, memoryview(out))])
                except (FileNotFoundError, ValueError):
                    res.add("reads_gone")  # removed or cut meanwhile: a clear answer
                    continue
                except OSError as e:
                    res.fail(f"read s{fid} [{a}, {b}): {e!r}")
                    continue
                with lock:  # generations written there while the read ran
                    for k in range(a, b):
                        allowed[k - a].update(seen[fid][k][mark[k - a]:])
                res.done += 1
                bad = _check_blocks(bytes(out), fid, a, allowed)
                if bad:
                    res.fail(f"s{fid}/layer_0 [{a}, {b}): {bad}")
                else:
                    res.add("bytes_verified", len(out))

        threads = [threading.Thread(target=writer)] + [
            threading.Thread(target=reader, args=(rng.random(),)) for _ in range(2)]
        for t in threads:
            t.start()
        try:  # until n reads are checked and the ring lapped three times (or time is up)
            while time.monotonic() < deadline and not stop_.is_set():
                time.sleep(0.2)
                if not alive(m, res, "nrace"):
                    break
                st = _stats(m)
                if res.done >= n and st["head"] >= LAPS * st["capacity"]:
                    break
        finally:
            stop_.set()
            for t in threads:
                t.join(timeout=60)
            st = ch.reader.stats
            res.counts.update(stale_retries=st["stale"], direct_reads=st["reads"])
            ch.close()
        stats = _stats(m)
        res.counts.update(ring_laps=round(stats["head"] / stats["capacity"], 1),
                          copied_forward=stats["copied_forward"])
        if stats["head"] < LAPS * stats["capacity"]:
            res.fail(f"the ring lapped only {stats['head'] / stats['capacity']:.1f} times")
        stop(m, res)
    return res


def _stats(m: Mount) -> dict:
    import json

    s = json.loads((m.root / ".kvfs" / "stats").read_bytes())
    v = s["store"]["volume"]
    return {"head": v["head"], "capacity": v["capacity"],
            "copied_forward": s["store"]["counters"]["copied_forward"]}


# ============================================================================ nkill9
LAYERS = 8
ROUND = 32 << 10


def _round_bytes(sid: str, layer: int, r: int) -> bytes:
    return random.Random(f"{sid}:{layer}:{r}").randbytes(ROUND)


def nkill9(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n`` kills of the mount while rounds go through the channel (module doc)."""
    from kvfs.channel import APPEND, Channel, Item

    res = Result("nkill9", n)
    m = Mount(work / "nk9.kvfs", work / "nk9.mnt", "128M")
    acked: dict[str, int] = {}  # session -> rounds acknowledged durable
    start(m)
    try:
        for trial in range(n):
            if time.monotonic() > deadline:
                break
            sid = f"s{trial % 4}"
            if sid not in acked:
                os.mkdir(m.sessions / sid)
                acked[sid] = 0
            ch = Channel.open(str(m.root))
            if ch is None:
                res.fail(f"trial {trial}: no native channel")
                break
            killed = threading.Event()

            def writer(sid: str = sid, ch: Channel = ch, killed: threading.Event = killed) -> None:
                r = acked[sid]
                while not killed.is_set():
                    items = [Item(APPEND, f"layer_{k}", r * ROUND, _round_bytes(sid, k, r))
                             for k in range(LAYERS)]
                    try:
                        ch.write(sid, items, sync=True)
                    except OSError:
                        return  # the mount went away mid-round: not acknowledged
                    r += 1  # answered: durable, whenever the kill comes
                    acked[sid] = r
                    res.add("rounds_acked")

            t = threading.Thread(target=writer, daemon=True)
            t.start()
            time.sleep(rng.uniform(0.05, 0.8))
            m.kill()
            killed.set()
            t.join(timeout=30)
            if t.is_alive():
                res.fail(f"trial {trial}: the writer is stuck after the kill")
            ch.close()
            res.add("kills")
            rc, out = fsck(m.volume)
            if rc:
                res.fail(f"trial {trial}: fsck exit {rc} after kill -9:\n{out}")
            else:
                res.add("fsck_clean")
            start(m)
            for s, rounds in acked.items():
                have = []
                for k in range(LAYERS):
                    p = m.sessions / s / f"layer_{k}"
                    try:
                        got = p.read_bytes() if p.exists() or rounds else b""
                    except OSError as e:
                        res.fail(f"trial {trial}: {p}: {e!r}")
                        got = b""
                    if len(got) < rounds * ROUND or len(got) % ROUND:
                        res.fail(f"trial {trial}: {s}/layer_{k} holds {len(got)} bytes, "
                                 f"{rounds} rounds of {ROUND} were acknowledged")
                    for r in range(len(got) // ROUND):  # acknowledged or not: whole and right
                        if got[r * ROUND:(r + 1) * ROUND] != _round_bytes(s, k, r):
                            res.fail(f"trial {trial}: {s}/layer_{k} round {r} differs")
                            break
                    res.add("bytes_verified", len(got))
                    have.append(len(got))
                # a round not yet acknowledged may have landed in some layers: cut back to
                # the rounds every layer holds, as an agent resuming from meta.json would
                keep = min(have)
                for k, size in enumerate(have):
                    if size > keep:
                        os.truncate(m.sessions / s / f"layer_{k}", keep)
                acked[s] = keep // ROUND
            res.done += 1
        if m.proc is not None:
            stop(m, res)
        rc, out = fsck(m.volume)
        if rc:
            res.fail(f"fsck exit {rc} after the final clean unmount:\n{out}")
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise
        res.fail(f"the mount went away: {e!r}")
    finally:
        if m.proc is not None:
            m.kill()
    return res
