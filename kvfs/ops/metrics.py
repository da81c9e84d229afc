"""One Prometheus registry for every tier of this process.

Each process (the mount, an agent) has its own registry; the mount serves its text in
``/.kvfs/metrics``, and either can serve it over HTTP (``serve(port)``: one bounded thread,
``metrics_server``). Metric names are what dashboards and alert rules (deploy/) query; add
new ones here so they stay in one list. Gauges that describe other processes (the mount's
hot and RAM-tier figures, summed from its agents) are set by hooks run at every scrape
(``on_scrape``), so a scrape never shows a process that is gone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .metrics_server import MetricsServer

log = logging.getLogger("kvfs.metrics")
REGISTRY = CollectorRegistry(auto_describe=True)
_SCRAPE_HOOKS: list[Callable[[], None]] = []

_MS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)

# hot tier
hot_hits = Counter("kv_hot_hits", "Attention steps served entirely from the hot window", registry=REGISTRY)
hot_misses = Counter("kv_hot_misses", "Steps that needed a recall from warm/cold", registry=REGISTRY)
hot_hit_rate = Gauge("kv_hot_hit_rate", "hits / (hits + misses) since start", registry=REGISTRY)
hot_bytes = Gauge("kv_hot_bytes", "KV bytes held on the device", registry=REGISTRY)
hot_sessions = Gauge("kv_hot_sessions", "Sessions with a hot window", registry=REGISTRY)
hot_spills = Counter("kv_hot_spilled_bytes", "Bytes handed from hot to warm", registry=REGISTRY)
hot_watermark_moves = Counter("kv_hot_watermark_migrations", "Rounds moved out by the device watermark", registry=REGISTRY)
hot_device_usage = Gauge("kv_hot_device_usage_ratio", "Device memory reserved (or CPU budget used) / budget", registry=REGISTRY)

# warm tier
warm_bytes = Gauge("kv_warm_bytes", "Bytes in warm .kvmap shards", registry=REGISTRY)
warm_sessions = Gauge("kv_warm_sessions", "Sessions in the warm tier", registry=REGISTRY)
warm_usage_ratio = Gauge("kv_warm_usage_ratio", "warm bytes / cap", registry=REGISTRY)
warm_hits = Counter("kv_warm_hits", "Reads served from warm", registry=REGISTRY)
warm_misses = Counter("kv_warm_misses", "Reads that went to cold", registry=REGISTRY)
warm_migrations = Counter("kv_warm_migrations", "Sessions migrated warm -> cold", registry=REGISTRY)
warm_migration_failures = Counter("kv_warm_migration_failures", "Group migrations to cold the cold tier refused (ENOSPC, EIO...): each starts a back-off", registry=REGISTRY)
warm_promotions = Counter("kv_warm_promotions", "Sessions promoted cold -> warm", registry=REGISTRY)
warm_evict_latency = Histogram("kv_warm_evict_latency_ms", "Latency of one group migration (ms)", buckets=_MS_BUCKETS, registry=REGISTRY)

# cold tier (engine, as seen by the mount)
cold_bytes = Gauge("kv_cold_bytes", "Ring bytes in use (head - tail)", registry=REGISTRY)
cold_capacity = Gauge("kv_cold_capacity_bytes", "Ring capacity", registry=REGISTRY)
cold_sessions = Gauge("kv_cold_sessions", "Live sessions on the volume", registry=REGISTRY)
cold_read_ms = Histogram("kv_cold_read_ms", "Cold read latency (ms)", buckets=_MS_BUCKETS, registry=REGISTRY)
cold_read_p99 = Gauge("kv_cold_read_p99_ms", "p99 of recent cold reads (ms)", registry=REGISTRY)
cold_write_ms = Histogram("kv_cold_write_ms", "Cold write (flush) latency (ms)", buckets=_MS_BUCKETS, registry=REGISTRY)
cold_write_p99 = Gauge("kv_cold_write_p99_ms", "p99 of recent cold writes (ms)", registry=REGISTRY)
cold_compression = Gauge("kv_cold_compression_ratio", "raw / stored bytes written", registry=REGISTRY)
cold_checkpoint_age = Gauge("kv_cold_checkpoint_age_s", "Seconds since the last checkpoint", registry=REGISTRY)
cold_errors = Counter("kv_cold_errors", "Corrupt reads and internal errors answered with EIO", registry=REGISTRY)

# shared tier (Redis Cluster), as the mount uses it
shared_hits = Counter("kv_shared_hits", "Local misses the shared tier answered (sessions, files and newer bytes read through)", registry=REGISTRY)
shared_misses = Counter("kv_shared_misses", "Local misses the shared tier did not hold either", registry=REGISTRY)
shared_pushed = Counter("kv_shared_pushed_bytes", "Bytes replicated to the shared tier", registry=REGISTRY)
shared_fetched = Counter("kv_shared_fetched_bytes", "Bytes read through from the shared tier", registry=REGISTRY)
shared_takeovers = Counter("kv_shared_lease_takeovers", "Session leases taken over from a node whose lease expired", registry=REGISTRY)
shared_queue = Gauge("kv_shared_queue_bytes", "Bytes stored locally and waiting to be replicated", registry=REGISTRY)
shared_up = Gauge("kv_shared_up", "1 while the shared tier answers, 0 while replication is paused", registry=REGISTRY)
shared_p99 = Gauge("kv_shared_latency_p99_ms", "p99 of recent shared-tier calls (ms)", ["op"], registry=REGISTRY)

alerts_firing = Gauge("kv_alert_firing", "1 while an alert rule fires", ["rule"], registry=REGISTRY)
alerts_fired = Counter("kv_alerts_fired", "Times an alert rule started firing", ["rule"], registry=REGISTRY)


class Recent:
    """A bounded window of recent samples with quantiles (for p99 gauges)."""

    def __init__(self, n: int = 2048) -> None:
        self._d: deque[float] = deque(maxlen=n)
        self._lock = threading.Lock()

    def add(self, v: float) -> None:
        with self._lock:
            self._d.append(v)

    def quantile(self, q: float) -> float:
        with self._lock:
            if not self._d:
                return 0.0
            s = sorted(self._d)
        return s[min(len(s) - 1, int(q * len(s)))]

    def __len__(self) -> int:
        return len(self._d)


cold_read_recent = Recent()
cold_write_recent = Recent()
# computed when scraped, not on every write (a quantile sorts the whole window)
cold_write_p99.set_function(lambda: cold_write_recent.quantile(0.99))
cold_read_p99.set_function(lambda: cold_read_recent.quantile(0.99))


def observe_cold_read(ms: float) -> None:
    cold_read_ms.observe(ms)
    cold_read_recent.add(ms)


def observe_cold_write(ms: float) -> None:
    cold_write_ms.observe(ms)
    cold_write_recent.add(ms)


def sample(metric: Counter | Gauge | Histogram, suffix: str = "") -> float:
    """The value of an unlabelled metric's sample ``<name><suffix>`` (``"_total"`` for a
    counter, ``"_sum"``/``"_count"`` for a histogram), through the public ``collect()``
    (0.0 when absent). Cheaper than ``REGISTRY.get_sample_value``, which collects every
    metric, including the p99 gauges that sort their window."""
    for fam in metric.collect():
        want = fam.name + suffix
        for s in fam.samples:
            if s.name == want and not s.labels:
                return float(s.value)
    return 0.0


class EngineObserver:
    """The storage engine's reports (``kvfs.engine.types.Observer``) as cold-tier metrics."""

    def cold_read(self, ms: float) -> None:
        observe_cold_read(ms)

    def cold_write(self, ms: float) -> None:
        observe_cold_write(ms)

    def cold_error(self) -> None:
        cold_errors.inc()


def update_hot_hit_rate() -> None:
    h, m = sample(hot_hits, "_total"), sample(hot_misses, "_total")
    hot_hit_rate.set(h / (h + m) if h + m else 1.0)


def on_scrape(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` before every scrape (``text``): gauges set from outside the process."""
    _SCRAPE_HOOKS.append(fn)
    return fn


def off_scrape(fn: Callable[[], None]) -> None:
    if fn in _SCRAPE_HOOKS:
        _SCRAPE_HOOKS.remove(fn)


def text() -> bytes:
    """The registry in Prometheus text exposition format (scrape hooks run first; a
    failing hook is logged and its gauges keep their last values)."""
    for fn in list(_SCRAPE_HOOKS):
        try:
            fn()
        except Exception:  # noqa: BLE001 - a scrape still answers
            log.exception("metrics: a scrape hook failed")
    return generate_latest(REGISTRY)


def set_agent_gauges(totals: dict[str, dict[str, Any]]) -> None:
    """The hot and RAM-tier gauges from ``kvfs.ops.agents.totals`` of the live agents:
    zero for a tier no live agent reports (never an exited agent's last figures)."""
    warm, hot = totals.get("warm") or {}, totals.get("hot") or {}
    warm_bytes.set(warm.get("bytes") or 0)
    warm_sessions.set(warm.get("sessions") or 0)
    warm_usage_ratio.set(warm["bytes"] / warm["cap"] if warm.get("cap") else 0.0)
    hot_bytes.set(hot.get("bytes") or 0)
    hot_sessions.set(hot.get("sessions") or 0)


def histogram_totals(h: Histogram) -> tuple[float, float]:
    """``(sum, count)`` of an unlabelled histogram (for rates between two samples)."""
    return sample(h, "_sum"), sample(h, "_count")


def parse(text: str | bytes) -> dict[str, float]:
    """Prometheus text -> ``{sample name (with labels): value}``, e.g.
    ``{"kv_hot_hit_rate": 0.97, "kv_hot_hits_total": 12.0, 'kv_alert_firing{rule="x"}': 1.0}``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def serve(port: int, addr: str = "127.0.0.1", *, start: bool = True, **bounds: Any) -> MetricsServer:
    """Serve this process's metrics over HTTP on ``addr:port`` (``--metrics-addr``,
    ``--metrics-port``); loopback unless told otherwise. Binds at once: ``OSError`` when it
    cannot (``socket.gaierror`` for an address that does not resolve). ``start=False``
    binds only (``MetricsServer.start`` later); ``bounds``: ``MetricsServer``'s limits."""
    srv = MetricsServer(addr, port, text, **bounds)
    return srv.start() if start else srv
