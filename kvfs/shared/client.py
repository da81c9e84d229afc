"""The connection to the Redis Cluster, with every wait bounded.

Wraps one ``redis.cluster.RedisCluster`` (thread-safe: a connection pool per node) and
turns "the cluster cannot answer" into ``SharedUnavailable``:

- each command waits at most ``timeout_s`` per attempt, with one retry;
- a topology refresh (redis-py asks node after node for ``CLUSTER SLOTS`` after a
  connection error, ``timeout_s`` each: seconds when every node hangs) runs on a helper
  thread, and the caller waits for it at most ``timeout_s``;
- a shard that failed is not tried again for ``retry_after_s``: calls for its sessions fail
  at once meanwhile, so a caller keeps serving from its local tiers without stalling.

Worst case for one call while every node hangs: about 4 x ``timeout_s``; a refused
connection (a dead process) fails in milliseconds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

from .errors import SharedError, SharedUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# errors that mean "the cluster or this shard cannot answer now"
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError,
               RedisClusterException, OutOfMemoryError, ReadOnlyError)


@dataclass(frozen=True)
class ClusterURL:
    """Where the cluster is and how to log in: ``redis[s]://[user[:password]@]host:port[,...]``.

    The password never appears in ``str``/``repr`` (``redacted``): it may be in the URL, but
    the mount takes it from a file or the environment when it can (docs/scale-out.md)."""

    addresses: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def redacted(self) -> str:
        who = ""
        if self.username or self.password:
            who = (self.username or "") + (":***" if self.password else "") + "@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.addresses)
        return f"{'rediss' if self.tls else 'redis'}://{who}{hosts}"

    def __str__(self) -> str:
        return self.redacted()


@dataclass(frozen=True)
class TLSFiles:
    """Certificates of a TLS cluster: the CA that signed the servers' certificates, and this
    node's client certificate and key when the servers ask for one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


def parse_urls(urls: str | Sequence[str], password: str | None = None) -> ClusterURL:
    """``redis[s]://[user[:password]@]h:p[,h:p...]`` (or a list of ``h:p`` / ``redis://h:p``)
    -> ``ClusterURL``. ``password`` (from a file or the environment) wins over the URL's.
    ``ValueError`` names the bad part, never the password."""
    parts = urls.split(",") if isinstance(urls, str) else list(urls)
    tls, user, pw = False, None, None
    out = []
    for i, raw in enumerate(parts):
        p = raw.strip()
        scheme, sep, rest = p.partition("://")
        if sep:
            if scheme not in ("redis", "rediss"):
                raise ValueError(f"bad cluster address scheme {scheme!r} (want redis:// or rediss://)")
            if i and (scheme == "rediss") != tls:
                raise ValueError("cluster addresses mix redis:// and rediss://")
            tls = tls or scheme == "rediss"
            p = rest
        who, at, p = p.rpartition("@")
        if at:
            if i:
                raise ValueError("give the user and password once, in the first address")
            u, colon, w = who.partition(":")
            user, pw = unquote(u) or None, (unquote(w) if colon else None)
        p = p.rstrip("/")
        host, sep, port = p.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            shown = p if not at else "(address with credentials)"
            raise ValueError(f"bad cluster address {shown!r} (want redis[s]://[user[:password]@]"
                             "host:port[,host:port...])")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no cluster address given")
    return ClusterURL(tuple(out), tls, user, password if password is not None else pw)


class ClusterClient:
    """One cluster connection: ``call``/``eval`` routed by key, guarded and bounded."""

    def __init__(self, url: ClusterURL, timeout_s: float, retry_after_s: float,
                 tls: TLSFiles | None = None) -> None:
        self.url = url
        self.addresses = list(url.addresses)
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.waitaof: bool | None = None  # the servers have WAITAOF (Redis 7.2+); None: unknown
        self._shas: dict[str, str] = {}  # script -> its SHA1
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, str]] = {}          # node -> (until, reason)
        self._refresh: threading.Thread | None = None
        self._refresh_error: BaseException | None = None
        self.unavailable = 0
        kw: dict[str, Any] = {"username": url.username, "password": url.password}
        if url.tls:
            t = tls or TLSFiles()
            kw.update(ssl=True, ssl_ca_certs=t.ca, ssl_certfile=t.cert, ssl_keyfile=t.key,
                      ssl_cert_reqs="required")
        try:
            self.rc = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.addresses],
                socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
                require_full_coverage=False, **kw)
        except (redis.RedisError, RedisClusterException) as e:
            raise SharedUnavailable(f"cannot reach the Redis Cluster at {url.redacted()}: "
                                    f"{type(e).__name__}: {e}") from e
        # redis-py refreshes the topology inline after every connection error; bound it
        self._initialize = self.rc.nodes_manager.initialize
        self.rc.nodes_manager.initialize = self._bounded_initialize  # type: ignore[method-assign]

    # -- topology ----------------------------------------------------------------
    def _bounded_initialize(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            th = self._refresh
            if th is None or not th.is_alive():
                self._refresh_error = None
                th = threading.Thread(target=self._run_initialize, args=args, kwargs=kwargs,
                                      name="kvfs-shared-topology", daemon=True)
                self._refresh = th
                th.start()
        th.join(self.timeout_s)
        if th.is_alive():
            raise RedisClusterException(f"topology refresh takes longer than {self.timeout_s} s")
        if self._refresh_error is not None:
            raise self._refresh_error

    def _run_initialize(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._initialize(*args, **kwargs)
        except BaseException as e:
            self._refresh_error = e

    def refresh(self) -> None:
        self.rc.nodes_manager.initialize()

    def node_of(self, key: str) -> str:
        nodes = self.rc.nodes_manager.slots_cache.get(self.rc.keyslot(key))
        return nodes[0].name if nodes else "?"

    def replicas_of(self, key: str) -> int:
        """Replicas the cluster lists (healthy ones) for ``key``'s slot."""
        return max(0, len(self.rc.nodes_manager.slots_cache.get(self.rc.keyslot(key), [])) - 1)

    # -- calls -------------------------------------------------------------------
    def guard(self, key: str, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (talking to ``key``'s shard) with the shard's breaker and error mapping."""
        node = self.node_of(key)
        with self._lock:
            until, why = self._down.get(node, (0.0, ""))
        if time.monotonic() < until:
            self.unavailable += 1
            raise SharedUnavailable(f"{what}: shard {node} failed just now ({why}); not retried "
                                    f"for {until - time.monotonic():.2f} s")
        try:
            out = fn()
        except UNAVAILABLE as e:
            reason = f"{type(e).__name__}: {e}"
            with self._lock:
                self._down[node] = (time.monotonic() + self.retry_after_s, reason)
                self.unavailable += 1
            raise SharedUnavailable(f"{what}: shard {node} unavailable: {reason}") from e
        except redis.RedisError as e:
            raise SharedError(f"{what}: {type(e).__name__}: {e}") from e
        if until:
            with self._lock:
                self._down.pop(node, None)
        return out

    def eval(self, what: str, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run a Lua script by its SHA1 (``EVALSHA``: the script's text is sent only the
        first time a node sees it, ``EVAL`` then loads it there)."""
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()

        def run() -> Any:
            try:
                return self.rc.evalsha(sha, len(keys), *keys, *args)
            except NoScriptError:
                return self.rc.eval(script, len(keys), *keys, *args)
        return self.guard(keys[0], what, run)

    def on_master(self, key: str, what: str, commands: list[tuple[Any, ...]],
                  transaction: bool) -> list[Any]:
        """Run ``commands`` on one connection to the master of ``key``'s slot (a pipeline;
        MULTI/EXEC when ``transaction``): for an atomic read without Lua's copy of each
        value, and for ``WAIT``, which counts the writes of its own connection. One retry
        after a MOVED or a connection error, with the topology refreshed."""
        def run() -> list[Any]:
            for attempt in (0, 1):
                node = self.rc.nodes_manager.get_node_from_slot(self.rc.keyslot(key))
                pipe = self.rc.get_redis_connection(node).pipeline(transaction=transaction)
                for cmd in commands:
                    pipe.execute_command(*cmd)
                try:
                    return pipe.execute()
                except redis.ResponseError as e:          # MOVED: the slot has a new master
                    if attempt or not (isinstance(e, MovedError) or "MOVED" in str(e)):
                        raise
                except (redis.ConnectionError, redis.TimeoutError):
                    if attempt:
                        raise
                self.refresh()
            raise AssertionError("unreachable")
        return self.guard(key, what, run)

    def healthy(self) -> bool:
        """Every shard's master answers PING (topology refreshed once after a failure)."""
        for attempt in (0, 1):
            try:
                if attempt:
                    self.refresh()
                for node in self.rc.get_primaries():
                    self.rc.get_redis_connection(node).ping()
                with self._lock:
                    self._down.clear()
                return True
            except (redis.RedisError, RedisClusterException) as e:
                log.debug("health check: %s", e)
        return False

    def close(self) -> None:
        self.rc.close()
