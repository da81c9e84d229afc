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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    MovedError,
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


def parse_urls(urls: str | Sequence[str]) -> list[tuple[str, int]]:
    """``redis://h:p[,h:p...]`` or a list of ``h:p`` / ``redis://h:p`` -> [(host, port)]."""
    parts = urls.split(",") if isinstance(urls, str) else list(urls)
    out = []
    for raw in parts:
        p = raw.strip().removeprefix("redis://").rstrip("/")
        host, sep, port = p.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad cluster address {raw!r} (want redis://host:port[,host:port...])")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no cluster address given")
    return out


class ClusterClient:
    """One cluster connection: ``call``/``eval`` routed by key, guarded and bounded."""

    def __init__(self, urls: str | Sequence[str], timeout_s: float, retry_after_s: float) -> None:
        self.addresses = parse_urls(urls)
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, str]] = {}          # node -> (until, reason)
        self._refresh: threading.Thread | None = None
        self._refresh_error: BaseException | None = None
        self.unavailable = 0
        try:
            self.rc = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.addresses],
                socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
                require_full_coverage=False)
        except (redis.RedisError, RedisClusterException) as e:
            where = ",".join(f"{h}:{p}" for h, p in self.addresses)
            raise SharedUnavailable(f"cannot reach the Redis Cluster at {where}: {e}") from e
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
        return self.guard(keys[0], what, lambda: self.rc.eval(script, len(keys), *keys, *args))

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
