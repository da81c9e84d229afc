"""``SharedTier``: session files replicated to a Redis Cluster, shared by every host.

Synchronous and thread-safe (one cluster client with a connection pool per node, a lock
around this object's own state); every call is bounded (``client``: ``timeout_s`` per
attempt, a failed shard not retried for ``retry_after_s``), so a caller gets
``SharedUnavailable`` quickly and keeps serving from its local tiers. Never imports pyfuse3,
trio or torch. The format is in ``chunks``, the seals (MACs, encryption, lease values) in
``seal``, the scripts in ``scripts``, the leases in ``lease``, the content versions in
``versions``; the guarantees are in docs/scale-out.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .capacity import Capacity
from .chunks import (
    META_FILE,
    ChunkError,
    Codec,
    Owner,
    SessionInfo,
    SessionKeys,
    check_name,
    chunks_of,
)
from .client import ClusterClient, ClusterURL, TLSFiles, parse_urls
from .errors import (
    BadRange,
    NotAppend,
    NotFoundShared,
    SessionBusy,
    SharedCorrupt,
    SharedError,
    SharedLost,
    SharedUnavailable,
)
from .lease import Leases
from .scripts import APPEND, DELETE, PUT_META, REWRITE, SYNC, status, text
from .seal import Sealer
from .stats import Stats
from .versions import Stamps

log = logging.getLogger(__name__)

# 1 MiB - 16 KiB of data: a full chunk with its piece headers (up to ~800 of them) stays
# within jemalloc's 1 MiB size class; 1 MiB of data would take the 1.25 MiB class
CHUNK_BYTES = (1 << 20) - (16 << 10)
BATCH_CHUNKS = 16          # chunks per script call: one call moves at most ~16 MiB
COMPACT_PIECES = 256       # a chunk of more pieces than this, each small, is rewritten as one


def _pairs(reply: Any) -> dict[str, Any]:
    """An HGETALL reply (a flat list inside MULTI, a dict outside) as str -> value."""
    if isinstance(reply, dict):
        return {text(f): v for f, v in reply.items()}
    return {text(f): v for f, v in zip(reply[::2], reply[1::2], strict=True)}


def _offset(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRange(f"{what} must be a non-negative int, not {v!r}")
    return v


class SharedTier:
    """Session files and meta.json of many hosts in one Redis Cluster (see module doc).

    ``secret`` is the cluster's shared secret (``seal.read_secret``): every value is sealed
    with it, and one that does not verify is never served. ``encrypt`` also encrypts them.
    ``urls`` may carry a user and password (``redis://user:pw@h:p,...``; ``password`` wins)
    and ``rediss://`` for TLS (``tls``: the CA and client certificate files)."""

    def __init__(self, urls: str | Sequence[str] | ClusterURL, *, node_id: str, secret: bytes,
                 encrypt: bool = False, password: str | None = None, tls: TLSFiles | None = None,
                 chunk_bytes: int = CHUNK_BYTES,
                 lease_ms: int = 15_000, retention_s: float = 48 * 3600,
                 max_bytes: int | None = None, replicas_ack: int = 1, timeout_s: float = 1.0,
                 retry_after_s: float = 1.0, auto_renew: bool = True) -> None:
        self.node_id = check_name(node_id, "node id")
        if "|" in self.node_id:
            raise ValueError(f"node id {node_id!r} may not contain '|'")
        if chunk_bytes < 4096 or lease_ms < 100 or timeout_s <= 0 or replicas_ack < 0:
            raise ValueError("chunk_bytes >= 4096, lease_ms >= 100, timeout_s > 0, replicas_ack >= 0")
        self.codec = Codec(Sealer.from_secret(secret, encrypt))
        self.stats_ = Stats()
        self.stamps = Stamps(self.codec, self.node_id, self.stats_)
        self.chunk_bytes, self.lease_ms = chunk_bytes, lease_ms
        self.retention_ms = int(retention_s * 1000) if retention_s else 0
        self.max_bytes, self.replicas_ack, self.timeout_s = max_bytes, replicas_ack, timeout_s
        self._lock = threading.Lock()
        self._written: dict[str, dict[str, int]] = {}          # session -> file -> size
        self._meta_head: dict[str, bytes] = {}                 # session -> head of our meta
        url = urls if isinstance(urls, ClusterURL) else parse_urls(urls, password)
        if password is not None and url.password != password:
            url = ClusterURL(url.addresses, url.tls, url.username, password)
        self.url = url
        self._c = ClusterClient(url, timeout_s, retry_after_s, tls)
        self.addresses = self._c.addresses
        self._leases = Leases(self._c, self.codec.sealer, self.node_id, lease_ms,
                              self.retention_ms, self.stats_, auto_renew)
        self._capacity = Capacity(self._c, self._leases, max_bytes, self.retention_ms,
                                  chunk_bytes, self.stats_)

    # -- plumbing ----------------------------------------------------------------
    def _eval(self, k: SessionKeys, what: str, script: str, keys: list[str], args: list[Any]) -> Any:
        return self._c.eval(f"{what} {k.session}", script, keys, args)

    def _get(self, key: str, what: str, fn: Any) -> Any:
        return self._c.guard(key, what, fn)

    def _keys(self, session: str) -> SessionKeys:
        return SessionKeys(check_name(session, "session"))

    # -- content versions (versions.Stamps) -------------------------------------
    def made_here(self, version: str | None) -> bool:
        """Whether ``version`` was made by this node (its id is stable across remounts)."""
        return self.stamps.made_here(version)

    def take_version(self, session: str, file: str) -> str | None:
        """The version this node's last append or cut of ``file`` left in the cluster
        (None: removed, or not written here since the last call)."""
        return self.stamps.take(session, file)

    def file_versions(self, session: str) -> dict[str, tuple[int, str | None]]:
        """file -> (size, content version) of every file the cluster holds of the session
        (meta.json aside), as of one instant. A version changes whenever a file is made or
        rewritten (cut, removed and made again) and stays while it is only appended to, so
        a node whose copy has the same version holds a prefix of the cluster's bytes."""
        k = self._keys(session)
        index, vers = self._c.on_master(k.files, f"file_versions {session}",
                                        [("HGETALL", k.files), ("HGETALL", k.vers)],
                                        transaction=True)
        sizes, tokens = _pairs(index), _pairs(vers)
        return {f: (int(n), self.stamps.decode(session, f, tokens.get(f))) for f, n in sizes.items()}

    # -- leases (lease.Leases) ---------------------------------------------------
    def _lease(self, session: str) -> str:
        return self._leases.value(session)

    def acquire(self, session: str, wait_s: float = 0.0) -> bool:
        """Take the session's lease: True when newly taken (a dead owner's expired lease is
        a takeover, counted and logged), False when this node held it already (renewed).
        Raises ``SessionBusy`` naming the owner if another node still holds it after
        ``wait_s``. A lease value no node of this cluster set is reported and replaced."""
        return self._leases.acquire(self._keys(session), wait_s)

    def renew(self, session: str) -> None:
        """Extend this node's lease; ``LeaseLost`` if another node holds it now."""
        self._leases.renew(self._keys(session))

    def release(self, session: str) -> bool:
        """Give the lease up (a clean hand-over: the next owner's acquire is no takeover).
        What this node wrote is no longer its to vouch for: the next owner may rewrite it,
        and a later ``sync`` of this node's next tenure must not call that a lost write."""
        done = self._leases.release(self._keys(session), self.chunk_bytes)
        self._forget_writes(session)
        return done

    def _forget_writes(self, session: str) -> None:
        """This node no longer vouches for what it wrote to ``session`` (``sync``'s check)."""
        with self._lock:
            self._written.pop(session, None)
            self._meta_head.pop(session, None)

    def lease_owner(self, session: str) -> str | None:
        """The node that holds the session's lease now (None: nobody, or a value no node
        set)."""
        return self._leases.owner(self._keys(session))

    def taken(self, session: str) -> bool:
        """Another node took this node's lease of ``session`` and this node has not
        acquired it again since."""
        return self._leases.taken(session)

    def _scripted(self, k: SessionKeys, what: str, script: str, keys: list[str],
                  args: list[Any]) -> list[Any]:
        """A writing script, run again once if a forged lease stood in its way."""
        for _ in (0, 1):
            res = self._eval(k, what, script, keys, args)
            if status(res) != "LEASE":
                return res
            err = self._leases.refused(k, res)
            if err is not None:
                raise err
        return res

    # -- writes ------------------------------------------------------------------
    def append(self, session: str, file: str, offset: int, data: bytes | bytearray | memoryview) -> int:
        """Append ``data`` at ``offset`` == the stored size (a new file starts at 0); needs
        the lease. Returns the new size. ``NotAppend`` (nothing changed) when the offset is
        not the size. An append of more than 16 chunks is applied 16 chunks at a time, each
        step atomic, like a short write."""
        k = self._keys(session)
        check_name(file, "file")
        pos = _offset(offset, "offset")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRange(f"data must be bytes-like, not {type(data).__name__}")
        if not len(data):
            return pos
        t0 = time.perf_counter()
        pieces = self.codec.split_append(session, file, pos, data, self.chunk_bytes)
        over = self.codec.overhead
        added, last_len = 0, 0
        for i in range(0, len(pieces), BATCH_CHUNKS):
            batch = pieces[i:i + BATCH_CHUNKS]
            end = pos + sum(len(p) - over for _, p in batch)
            keys = [k.files, k.lease, k.vers, *(k.chunk(file, n) for n, _ in batch)]
            args = [self._lease(session), file, pos, end, self.retention_ms, self.chunk_bytes,
                    k.prefix, self.lease_ms, "A" if pos % self.chunk_bytes else "S",
                    self.stamps.new(session, file), *(p for _, p in batch)]
            res = self._scripted(k, "append", APPEND, keys, args)
            st = status(res)
            if st == "SIZE":
                raise NotAppend(session, file, pos, int(res[1]))
            last_len = int(res[1])
            added += sum(len(p) for _, p in batch)
            pos = end
            self.stamps.left(session, file, self.stamps.decode(session, file, res[2]))
            with self._lock:
                self._written.setdefault(session, {})[file] = pos
        self.stats_.add("appends")
        self.stats_.add("bytes_in", len(data))
        self.stats_.time("append", (time.perf_counter() - t0) * 1000)
        self._capacity.wrote(session, added)
        last = (pos - 1) // self.chunk_bytes
        data_in_last = pos - last * self.chunk_bytes
        pieces_in_last = (last_len - data_in_last) // over
        if pieces_in_last > COMPACT_PIECES and pieces_in_last * over * 4 > data_in_last:
            self._compact(k, file, last, pos)
        return pos

    def _compact(self, k: SessionKeys, file: str, n: int, size: int) -> None:
        """Rewrite chunk ``n`` (the last) as one piece: many tiny appends cost a header each."""
        start = n * self.chunk_bytes
        data = self._chunk(k, file, n, size, None)
        value = self.codec.encode_piece(k.session, file, start, data)
        keys = [k.files, k.lease, k.vers, k.chunk(file, n)]
        res = self._eval(k, "compact", REWRITE, keys,
                         [self._lease(k.session), file, size, size, value, self.retention_ms,
                          self.chunk_bytes, k.prefix, ""])  # same bytes: same version
        if status(res) == "OK":
            self.stats_.add("compactions")
            self._capacity.wrote(k.session, -int(res[1]))

    def truncate(self, session: str, file: str, size: int) -> None:
        """Cut ``file`` to ``size`` bytes (<= its size; an agent retrying a turn). Needs the lease."""
        self._rewrite(session, file, _offset(size, "size"))

    def remove_file(self, session: str, file: str) -> None:
        """Remove one file of the session. Needs the lease."""
        self._rewrite(session, file, -1)

    def _rewrite(self, session: str, file: str, size: int) -> None:
        k = self._keys(session)
        check_name(file, "file")
        cur = self.size(session, file)
        if size > cur:
            raise BadRange(f"{session}/{file}: truncate to {size} beyond its size {cur}")
        if size == cur:
            return
        keep = max(size, 0)
        n, cut = divmod(keep, self.chunk_bytes)
        value = b""
        if cut:
            value = self.codec.encode_piece(session, file, n * self.chunk_bytes,
                                            self._chunk(k, file, n, cur, None)[:cut])
        keys = [k.files, k.lease, k.vers,
                *(k.chunk(file, c) for c in range(n, max(n + 1, chunks_of(cur, self.chunk_bytes))))]
        token = self.stamps.new(session, file)  # a cut is a rewrite: a new version
        res = self._scripted(k, "truncate", REWRITE, keys,
                             [self._lease(session), file, cur, size, value, self.retention_ms,
                              self.chunk_bytes, k.prefix, token])
        st = status(res)
        if st == "SIZE":
            raise NotAppend(session, file, cur, int(res[1]))
        with self._lock:
            files = self._written.setdefault(session, {})
            if size < 0:
                files.pop(file, None)
            else:
                files[file] = size
        self.stamps.left(session, file, None if size < 0 else self.stamps.decode(session, file, token))
        self._capacity.wrote(session, -int(res[1]))

    def put_meta(self, session: str, data: bytes, owner: Owner | None = None) -> None:
        """Store meta.json (replacing it), and the session's owner when given. Write it after
        the files it describes: a session becomes visible to readers (``has_session``) only
        once its meta is there."""
        k = self._keys(session)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRange(f"meta must be bytes-like, not {type(data).__name__}")
        value = self.codec.encode_meta(session, data)
        rec = self.codec.encode_owner(session, owner) if owner is not None else b""
        res = self._scripted(k, "put_meta", PUT_META, [k.files, k.lease, k.meta, k.owner],
                             [self._lease(session), value, self.retention_ms, self.chunk_bytes,
                              k.prefix, rec])
        with self._lock:
            self._meta_head[session] = value[:self.codec.overhead]
        self.stats_.add("bytes_in", len(data))
        self._capacity.wrote(session, int(res[1]))

    def delete_session(self, session: str) -> bool:
        """Remove the session from the cluster (never from any volume). Refused with
        ``SessionBusy`` while another node holds its lease. True if anything was there."""
        k = self._keys(session)
        for attempt in (0, 1, 2):
            res = self._eval(k, "delete", DELETE,
                             [k.files, k.lease, k.meta, k.holder, k.sync, k.owner, k.vers],
                             [self._lease(session), self.chunk_bytes, k.prefix, "delete"])
            if status(res) != "BUSY":
                break
            owner, _ = self._leases.contend(k, res[1], int(res[2]))
            if owner is not None or attempt == 2:
                raise SessionBusy(session, owner or "?", int(res[2]))
        self._leases.discard(session)
        self._forget_writes(session)
        self.stamps.forget(session)
        self._capacity.forget(session)
        return int(res[1]) > 0

    # -- reads -------------------------------------------------------------------
    def has_session(self, session: str) -> bool:
        k = self._keys(session)
        return bool(self._get(k.meta, f"has_session {session}", lambda: self._c.rc.exists(k.meta)))

    def get_meta(self, session: str) -> bytes | None:
        """meta.json, checked; None if the cluster has no such session."""
        info = self.open_session(session)
        return None if info is None else info.meta

    def open_session(self, session: str) -> SessionInfo | None:
        """Files, meta.json and owner of a session as of one instant (one ``MULTI``); None
        when the cluster does not hold it (no meta.json: not visible yet). A meta or owner
        record that does not verify is fetched once more, then ``SharedCorrupt``."""
        k = self._keys(session)
        for attempt in (0, 1):
            index, meta, owner, vers = self._c.on_master(
                k.files, f"open_session {session}",
                [("HGETALL", k.files), ("GET", k.meta), ("GET", k.owner), ("HGETALL", k.vers)],
                transaction=True)
            if meta is None:
                self.stats_.add("misses")
                return None
            try:
                data = self.codec.decode_meta(session, meta)
                who = self.codec.decode_owner(session, owner) if owner is not None else None
            except ChunkError as e:
                self.stats_.add("refetches" if attempt == 0 else "corrupt")
                if attempt:
                    raise SharedCorrupt(f"{session}: meta.json or owner record: {e}") from e
                continue
            self.stats_.add("hits")
            self.stats_.add("bytes_out", len(data))
            files = {f: int(n) for f, n in _pairs(index).items()}
            tokens = _pairs(vers)
            return SessionInfo(files, data, who,
                               {f: self.stamps.decode(session, f, tokens.get(f)) for f in files})
        raise AssertionError("unreachable")

    def list_files(self, session: str) -> dict[str, int]:
        """file -> size of every file of the session the cluster holds (meta.json aside)."""
        k = self._keys(session)
        raw = self._get(k.files, f"list_files {session}", lambda: self._c.rc.hgetall(k.files))
        return {f.decode(): int(s) for f, s in raw.items()}

    def size(self, session: str, file: str) -> int:
        k = self._keys(session)
        check_name(file, "file")
        s = self._get(k.files, f"size {session}", lambda: self._c.rc.hget(k.files, file))
        if s is None:
            raise NotFoundShared(f"{session}/{file}: not in the shared tier")
        return int(s)

    def read(self, session: str, file: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (short at the end of the file, like pread).
        Every chunk is checked; a bad one is fetched again once, then ``SharedCorrupt``.
        ``NotFoundShared`` (a miss) if the cluster does not hold the file."""
        return self.read_versioned(session, file, offset, length)[0]

    def read_versioned(self, session: str, file: str, offset: int,
                       length: int) -> tuple[bytes, str | None]:
        """``read``, and the content version the bytes are of: all of one version (a file
        rewritten between two batches of a long read is read again)."""
        k = self._keys(session)
        check_name(file, "file")
        off, length = _offset(offset, "offset"), _offset(length, "length")
        t0 = time.perf_counter()
        c = self.chunk_bytes
        end = off + length
        if length and (end - 1) // c - off // c >= BATCH_CHUNKS:
            end = min(end, self.size(session, file))          # clamp a long read first
        first = off // c
        last = (end - 1) // c if end > off else first - 1
        for _attempt in range(3):
            out: list[bytes] = []
            n, size, version, torn = first, 0, None, False
            while True:
                batch = list(range(n, min(last + 1, n + BATCH_CHUNKS)))
                # one MULTI/EXEC: the size, the version and the chunks as of one instant
                cmds = [("HGET", k.files, file), *(("GET", k.chunk(file, i)) for i in batch),
                        ("HGET", k.vers, file)]
                res = self._c.on_master(k.files, f"read {session}", cmds, transaction=True)
                if res[0] is None:
                    self.stats_.add("misses")
                    raise NotFoundShared(f"{session}/{file}: not in the shared tier")
                if n > first and res[-1] != version:
                    torn = True  # rewritten since the first batch: read it all again
                    break
                size, version = int(res[0]), res[-1]
                for i, value in zip(batch, res[1:-1], strict=False):
                    if i * c >= size:
                        break
                    out.append(self._chunk(k, file, i, size, value))
                n += len(batch)
                if n > last or n * c >= size:
                    break
            if not torn:
                break
        else:
            raise SharedUnavailable(f"read {session}/{file}: rewritten during every attempt")
        lo, n = off - first * c, max(0, min(end, size) - off)
        whole = out[0] if len(out) == 1 else b"".join(out)
        data = whole if lo == 0 and n == len(whole) else whole[lo:lo + n]
        self.stats_.add("hits")
        self.stats_.add("reads")
        self.stats_.add("bytes_out", len(data))
        self.stats_.time("read", (time.perf_counter() - t0) * 1000)
        return data, self.stamps.decode(session, file, version)

    def _chunk(self, k: SessionKeys, file: str, n: int, size: int, value: bytes | None) -> bytes:
        """The checked bytes of chunk ``n`` of a file of ``size`` bytes (``value`` as read,
        or None to fetch it). A chunk that fails is fetched once more, then reported."""
        c = self.chunk_bytes
        want = min(c, size - n * c)
        key = k.chunk(file, n)
        for attempt in (0, 1):
            if value is None or attempt:
                value = self._get(key, f"read {k.session}", lambda: self._c.rc.get(key))
            try:
                if value is None:
                    raise ChunkError("chunk missing")
                data, _ = self.codec.decode_pieces(k.session, file, value, n * c)
                if len(data) < want:
                    raise ChunkError(f"{len(data)} bytes where {want} were expected")
                return data if len(data) == want else data[:want]
            except ChunkError as e:
                self.stats_.add("refetches" if attempt == 0 else "corrupt")
                if attempt:
                    log.error("%s/%s chunk %d corrupt: %s", k.session, file, n, e)
                    raise SharedCorrupt(f"{k.session}/{file}: chunk {n} (bytes {n * c}.."
                                        f"{n * c + want}) is corrupt: {e}") from e
        raise AssertionError("unreachable")

    # -- durability --------------------------------------------------------------
    def sync(self, session: str) -> None:
        """Return once every byte this node appended to the session (and its meta) is held
        by the shard's master and acknowledged by ``replicas_ack`` replica(s) when the shard
        has any (``WAITAOF``: in their fsynced AOF, on Redis 7.2+; ``WAIT``: in their
        memory, before). ``SharedLost`` if a failover lost acknowledged writes,
        ``SharedUnavailable`` if the replicas do not acknowledge within ``timeout_s``."""
        k = self._keys(session)
        t0 = time.perf_counter()
        wait_ms = max(1, int(self.timeout_s * 800))
        out = self._sync_cmds(k, session, wait_ms)
        (index, meta_head), acked = out[0], 0
        if self.replicas_ack:
            acked = int(out[1][1]) if isinstance(out[1], list) else int(out[1])
        have = {f.decode(): int(s) for f, s in zip(index[::2], index[1::2], strict=True)}
        with self._lock:
            mine = dict(self._written.get(session, {}))
            meta_crc = self._meta_head.get(session)
        lost = {f: (want, have.get(f, 0)) for f, want in mine.items() if have.get(f, 0) < want}
        if meta_crc is not None and meta_head != meta_crc:
            lost[META_FILE] = (1, 0)
        if lost:
            with self._lock:   # reset: the caller re-appends from its copy at the new sizes
                for f, (_, now) in lost.items():
                    self._written.get(session, {})[f] = now
                self._meta_head.pop(session, None)
            raise SharedLost(session, lost)
        if self.replicas_ack and acked < self.replicas_ack:
            if self._c.replicas_of(k.files) > 0:
                self.stats_.add("unavailable")
                raise SharedUnavailable(f"sync {session}: {acked} of {self.replicas_ack} replica(s) "
                                        f"acknowledged within {wait_ms} ms")
            self.stats_.add("sync_unreplicated")   # a shard without replicas: master only
        self.stats_.add("syncs")
        self.stats_.time("sync", (time.perf_counter() - t0) * 1000)

    def _sync_cmds(self, k: SessionKeys, session: str, wait_ms: int) -> list[Any]:
        """The marker write, then ``WAITAOF 1 n`` where the servers have it (Redis 7.2+: the
        write is in the master's and ``n`` replicas' fsynced AOF), else ``WAIT n`` (in their
        memory), on one connection."""
        cmds: list[tuple[Any, ...]] = [("EVAL", SYNC, 3, k.files, k.sync, k.meta,
                                        self.node_id, self.retention_ms, self.codec.overhead)]
        if self.replicas_ack:
            if self._c.waitaof is not False:
                cmds.append(("WAITAOF", 1, self.replicas_ack, wait_ms))
            else:
                cmds.append(("WAIT", self.replicas_ack, wait_ms))
        try:
            out = self._c.on_master(k.files, f"sync {session}", cmds, transaction=False)
        except SharedError as e:
            if "WAITAOF" not in cmds[-1] or "unknown command" not in str(e).lower():
                raise
            if self._c.waitaof is not False:  # Redis before 7.2: replicas' memory, not AOF
                self._c.waitaof = False
                log.info("the cluster has no WAITAOF (Redis < 7.2): sync waits for replicas' "
                         "memory (WAIT)")
            return self._sync_cmds(k, session, wait_ms)
        if self.replicas_ack and self._c.waitaof is None:
            self._c.waitaof = True
        return out

    # -- health and life cycle ---------------------------------------------------
    def healthy(self) -> bool:
        """True when every shard's master answers PING within ``timeout_s`` (the topology is
        refreshed once after a failure); never raises. Clears the failed-shard marks."""
        return self._c.healthy()

    def stats(self) -> dict[str, float]:
        out = self.stats_.snapshot()
        out["unavailable"] += self._c.unavailable
        out["leases_held"] = len(self._leases.held())
        return out

    def close(self) -> None:
        """Stop renewing, hand held leases back (best effort), close the connections."""
        self._leases.close()
        for s in self._leases.held():
            try:
                self.release(s)
            except SharedError as e:
                log.debug("release of %s at close: %s", s, e)
        self._c.close()

    def __enter__(self) -> SharedTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
