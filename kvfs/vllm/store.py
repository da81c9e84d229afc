"""Sessions on the kvfs mount as the vLLM connector reads and writes them.

The files are a session's as :mod:`kvfs.session` keeps them (docs/format.md): per layer
the token-major K/V in the model's dtype, the claim (fingerprint, geometry, ``tokens``,
``rounds``), one summary vector per round (for recall) and the token ids. One request's
turn is one round, written through the cold tier's ``ColdBackend`` in the session's commit
order (:mod:`kvfs.session.commit`: layers, ids, summaries, then the claim; an edited
history is cut first), so a reader that checks the ids before and after reading layer
bytes sees any rewrite, and a crash at any point leaves the last complete turn.

Sessions a ``KVRouter`` process has open are left alone: the connector takes the warm
tier's per-session lock (:class:`kvfs.warm.owners.SessionLocks`) around each write.

Tenants: a request's ``cache_salt`` is its tenant, part of the session's identity. The
default tenant (no salt) keeps ``sessions/<id>/``, the name a ``KVRouter`` uses; a salted
tenant's session ``<id>`` is ``sessions/tenant-<HMAC(server key, [salt, id])>/``, so two
tenants may use one name without seeing or changing each other's KV, and no one without
the server's key (:func:`server_key`) can predict or pre-create a tenant's directory.

Prefix entries (requests without a session): ``sessions/prefix-<hash>/``, one per run of
``chunk`` tokens, keyed by a chain of HMACs under the server's key over the model
fingerprint, the salt and every token id up to the run's end (so another user of a shared
mount cannot pre-create the name the server will store a prefix under); the same files,
one round each. A directory that is not the server's (another uid, or writable by group or
other) is never read or written (:mod:`kvfs.warm.checked`): it is logged and skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfs.session import RoundWrite, SessionError, commit, cut_history, files
from kvfs.session.backend import ColdBackend
from kvfs.session.formats import dump_meta, put_summary_row
from kvfs.session.names import layer_name
from kvfs.session.tokens import common_prefix
from kvfs.torch.fingerprint import KVCorrupt, KVGeometry, KVMismatch, build_meta, check_meta
from kvfs.warm import WarmError, summarize_keys
from kvfs.warm.coldopen import open_cold
from kvfs.warm.owners import SessionLocks

log = logging.getLogger("kvfs.vllm.store")

#: what a request may call its session: the mount's name rules, no dot first, and not a
#: prefix entry's or a salted tenant's directory name
SESSION_RE = re.compile(r"(?!prefix-|tenant-)[A-Za-z0-9_][A-Za-z0-9_.@:+=-]{0,199}")
KEY_BYTES = 32


@dataclass(frozen=True)
class Stored:
    """What the mount holds for one session: usable tokens and their ids."""

    sid: str
    tokens: int  # tokens whose KV and ids are stored
    ids: np.ndarray  # uint32 [tokens]
    meta: dict[str, Any]


class SessionStore:
    """Reads and writes sessions of one model (fingerprint + geometry) on one mount."""

    def __init__(self, mount: str, fp: str, geo: KVGeometry, summary_dim: int = 128,
                 locks: SessionLocks | None = None, key: bytes | None = None) -> None:
        self.cold: ColdBackend = open_cold(mount)
        self.mount, self.fp, self.geo, self.dim = mount, fp, geo, summary_dim
        self.locks = locks  # a SessionLocks, or None (a plain directory)
        self.key = key if key is not None else server_key()

    # --- names --------------------------------------------------------------------------
    def session_dir(self, sid: str, salt: str | None) -> str:
        """The directory under ``sessions/`` of tenant ``salt``'s session ``sid``."""
        return session_dir(self.key, sid, salt)

    def prefix_entries(self, salt: str | None, ids: list[int] | np.ndarray, chunk: int) -> list[str]:
        """The entry names of the full ``chunk``-token runs of ``ids`` (:func:`prefix_keys`
        under this server's key)."""
        return prefix_keys(self.fp, salt, ids, chunk, key=self.key)

    # --- reads --------------------------------------------------------------------------
    def lookup(self, sid: str, sizes: bool = True) -> Stored | None:
        """The session's usable tokens: the stored ids, cut to what meta.json claims and
        (``sizes``) every layer file holds. None when nothing usable is stored (a session
        of another model is logged and treated as absent). The scheduler skips the sizes
        (one stat per layer, in the engine's loop): meta.json is written after the layers,
        and a layer cut behind its back fails the load, which vLLM then recomputes."""
        try:
            meta = files.load_meta_doc(self.cold, sid)[1]
            if meta is None:
                return None
            check_meta(meta, self.fp, self.geo, sid)
            ids = files.read_ids(self.cold, sid)
            n = min(int(meta["tokens"]), ids.size)  # ids are optional (a KVRouter's session)
            if sizes:
                have = files.layer_sizes(self.cold, sid) or {}
                n = min(n, min(have.get(i, 0) for i in range(self.geo.num_layers))
                        // self.geo.token_bytes)
        except (KVMismatch, KVCorrupt, SessionError) as e:
            log.warning("session %r is not reusable here: %s", sid, e)
            return None
        return Stored(sid, n, ids[:n], meta) if n > 0 else None

    def present(self, entries: list[str]) -> int:
        """How many of ``entries`` (prefix entries, in order) are stored, from the first."""
        n = 0
        for name in entries:
            if self.lookup(name, sizes=False) is None:
                break
            n += 1
        return n

    def read(self, sid: str, layer: int, start: int, end: int) -> np.ndarray:
        """Token-major bytes of tokens ``[start, end)`` of one layer."""
        tb = self.geo.token_bytes
        out = np.empty((end - start) * tb, dtype=np.uint8)
        files.read_layer(self.cold, sid, layer, start * tb, out)
        return out

    # --- writes -------------------------------------------------------------------------
    @contextlib.contextmanager
    def owned(self, sid: str) -> Iterator[bool]:
        """Hold the session's lock while writing; yields False when another process (a
        KVRouter) has the session open: the write is then skipped."""
        if self.locks is None:
            yield True
            return
        fd = self.locks.try_take(sid)
        if fd is None:
            log.warning("session %r is open in process %s; not stored", sid, self.locks.holder(sid))
            yield False
            return
        try:
            yield True
        finally:
            self.locks.drop(sid, fd)

    def append_turn(self, sid: str, ids: np.ndarray, kv: list[np.ndarray], start: int,
                    summary_keys: np.ndarray | None) -> int:
        """Store a request's turn: ``ids`` (every token of the request whose KV was
        computed), ``kv[layer]`` the token-major bytes of tokens ``[start, len(ids))``.
        Tokens before ``start`` must already be stored with the same ids (the caller read
        them with :meth:`lookup`); a stored history that differs from ``start`` on is cut
        there first. ``summary_keys``: the last layer's keys of the new tokens ``[T, H, D]``
        for the round's summary. Returns the session's token count."""
        n = int(ids.size)
        try:
            raw, meta = files.load_meta_doc(self.cold, sid)
        except SessionError as e:  # a claim that does not parse: none (nothing reused)
            log.warning("%s; treated as empty", e)
            raw, meta = files.read_meta_bytes(self.cold, sid) or b"", None
        if meta is not None:
            check_meta(meta, self.fp, self.geo, sid)
        have = int(meta["tokens"]) if meta else 0
        rounds = [list(r) for r in meta["rounds"]] if meta else []
        if start > have:
            raise KVCorrupt(f"session {sid!r}: a turn from token {start} after {have} stored")
        if n <= start:
            return have
        files.ensure_dir(self.cold, sid)
        tb, layers, row = self.geo.token_bytes, self.geo.num_layers, 4 * self.dim
        if start < have:  # an edited history: cut at the first differing token
            rounds = [r for r in rounds if r[1] <= start]
            cut = dump_meta(build_meta(self.fp, self.geo, start, rounds))
            cut_history(self.cold, sid, cut, raw, ids, range(layers), start * tb, len(rounds) * row)
            raw = cut
            log.info("session %r: history differs from token %d; %d stored tokens replaced",
                     sid, start, have - start)
        sizes = files.layer_sizes(self.cold, sid) or {}
        plan = RoundWrite(sid)
        for layer in range(layers):
            data = kv[layer]
            if data.size != (n - start) * tb:
                raise ValueError(f"layer {layer}: {data.size} bytes for {n - start} tokens")
            have_b = sizes.get(layer, 0)
            if have_b < start * tb:
                raise KVCorrupt(f"session {sid!r} {layer_name(layer)}: {have_b} bytes, shorter "
                                f"than the {start} tokens the turn continues")
            if have_b > start * tb:  # bytes past the claim (a crash): drop them
                files.truncate_stream(self.cold, sid, layer, start * tb)
                have_b = start * tb
            plan.stream(layer, have_b, [data])
        plan.set_ids(self.cold, ids)
        rounds.append([rounds[-1][1] if rounds else 0, n])  # the turn (and an open round)
        if summary_keys is not None and summary_keys.size:
            old = files.read_summaries(self.cold, sid)
            vec = summarize_keys(summary_keys, self.dim).astype("<f4").tobytes()
            plan.summaries = (put_summary_row(old, len(rounds) - 1, vec), old)
        plan.meta = dump_meta(build_meta(self.fp, self.geo, n, rounds))
        if plan.meta == raw:
            plan.meta = None
        for w in commit(self.cold, [plan], claim_last=True):
            if w.error is not None:
                raise WarmError(f"session {sid!r}: the turn is not durable: {w.error}") from w.error
        return n

    def delete(self, sid: str) -> None:
        files.delete(self.cold, sid)


def agreed(stored: Stored | None, prompt: list[int] | np.ndarray) -> int:
    """How many leading prompt tokens the stored session holds with the same ids."""
    return 0 if stored is None else common_prefix(stored.ids, prompt)


def prefix_keys(fp: str, salt: str | None, ids: list[int] | np.ndarray, chunk: int,
                key: bytes) -> list[str]:
    """The entry names of the full ``chunk``-token runs of ``ids``: entry ``j`` is an HMAC
    under ``key`` chained over the model fingerprint, the request's cache salt (its tenant)
    and every id up to the run's end, so it names the whole prefix, stably across processes
    (vLLM's own block hashes are seeded per process unless PYTHONHASHSEED is set), and only
    the key's holder can tell which name a prefix will be stored under."""
    h = hmac.new(key, f"{fp}\0{salt or ''}".encode(), hashlib.sha256).digest()
    arr = np.asarray(ids, dtype="<u4")
    out = []
    for j in range(arr.size // chunk):
        h = hmac.new(key, h + arr[j * chunk:(j + 1) * chunk].tobytes(), hashlib.sha256).digest()
        out.append("prefix-" + h.hex()[:40])
    return out


def session_dir(key: bytes, sid: str, salt: str | None) -> str:
    """The directory under ``sessions/`` of tenant ``salt``'s session ``sid`` for a server
    with ``key``: ``sid`` itself for the default tenant (no salt), else ``tenant-`` and 40
    hex digits of an HMAC over both."""
    if not salt:
        return sid
    doc = json.dumps([salt, sid]).encode()  # unambiguous: no two (salt, id) pairs share it
    return "tenant-" + hmac.new(key, doc, hashlib.sha256).hexdigest()[:40]


def default_key_file() -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "kvfs", "vllm.key")


def server_key(path: str | None = None) -> bytes:
    """The server's secret that names salted sessions and prefix entries: ``path`` (default
    ``$XDG_STATE_HOME/kvfs/vllm.key``), made once (0600, in a 0700 directory) and read by
    every later server of this uid, so names survive restarts. A key file or directory
    another uid owns or others may read is refused: names made with a known key could be
    pre-created. Servers that share sessions (one volume, several nodes) share the file."""
    path = path or default_key_file()
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    _check_private(d, os.lstat(d), True)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # whole or absent; a concurrent server's key wins if it was first
        log.info("kvfs.vllm: new server key %s", path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        _check_private(path, st, False)
        raw = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) != KEY_BYTES:
        raise PermissionError(f"kvfs.vllm: server key {path!r} holds {len(raw)} bytes, not "
                              f"{KEY_BYTES}: remove it to make a new one")
    return raw


def _check_private(path: str, st: os.stat_result, want_dir: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    mode = stat.S_IMODE(st.st_mode)
    if not kind_ok or st.st_uid != os.getuid() or mode & (0o022 if want_dir else 0o077):
        raise PermissionError(
            f"kvfs.vllm: server key {'directory' if want_dir else 'file'} {path!r} (uid "
            f"{st.st_uid}, mode {mode:04o}) is not private to uid {os.getuid()}: refused "
            "(names made with a key others can read or replace could be pre-created)")


def session_locks(mount: str) -> SessionLocks | None:
    """The warm tier's per-session locks of the volume mounted at ``mount`` (the ones a
    KVRouter over that mount takes), or None when ``mount`` is a plain directory."""
    from kvfs.torch.router import mount_info, mount_profile  # noqa: PLC0415
    from kvfs.warm.rootdir import open_root  # noqa: PLC0415

    info = mount_info(mount)
    uuid = (((info or {}).get("store") or {}).get("volume") or {}).get("uuid")
    if info is None or not uuid:
        return None
    root = os.path.expanduser(mount_profile(info).warm_root)
    # the root the warm tier uses: a per-uid root squatted by another user falls back to the
    # same private one, so the server and a KVRouter over the mount share their locks
    return SessionLocks(open_root(root).sub(uuid).sub("locks"))
