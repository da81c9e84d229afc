"""The metrics registry's text, its names, values that move; kvfs-stat over a fake mount."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfs.ops import metrics

ROOT = Path(__file__).resolve().parents[1]


def _families() -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.text().decode())}


def _v(name: str, labels: dict | None = None) -> float:
    v = metrics.REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


def test_text_parses_and_has_the_documented_names() -> None:
    fams = _families()
    for name in ("kv_hot_hit_rate", "kv_warm_evict_latency_ms", "kv_cold_read_p99_ms"):
        assert name in fams, name
    # per-tier bytes and sessions, hits/misses, compression, migrations, write latency, checkpoint age
    for name in ("kv_hot_bytes", "kv_warm_bytes", "kv_cold_bytes", "kv_hot_sessions",
                 "kv_warm_sessions", "kv_cold_sessions", "kv_hot_hits", "kv_hot_misses",
                 "kv_warm_hits", "kv_warm_misses", "kv_cold_compression_ratio",
                 "kv_warm_migrations", "kv_warm_promotions", "kv_hot_watermark_migrations",
                 "kv_cold_write_ms", "kv_cold_write_p99_ms", "kv_cold_checkpoint_age_s",
                 "kv_hot_device_usage_ratio", "kv_warm_usage_ratio", "kv_alerts_fired",
                 "kv_alert_firing"):
        assert name in fams, name
    assert fams["kv_warm_evict_latency_ms"].type == "histogram"
    assert fams["kv_hot_hit_rate"].type == "gauge"


def test_values_move() -> None:
    h0, m0 = _v("kv_hot_hits_total"), _v("kv_hot_misses_total")
    metrics.hot_hits.inc(9)
    metrics.hot_misses.inc(1)
    metrics.update_hot_hit_rate()
    assert _v("kv_hot_hit_rate") == pytest.approx((h0 + 9) / (h0 + 9 + m0 + 1))

    n0 = _v("kv_warm_evict_latency_ms_count")
    metrics.warm_evict_latency.observe(3.5)
    assert _v("kv_warm_evict_latency_ms_count") == n0 + 1

    for _ in range(300):
        metrics.observe_cold_read(0.3)
    metrics.observe_cold_read(40.0)
    for _ in range(3000):  # the window forgets the outlier
        metrics.observe_cold_read(0.3)
    assert _v("kv_cold_read_p99_ms") == pytest.approx(0.3)
    for _ in range(50):
        metrics.observe_cold_read(9.0)
    assert _v("kv_cold_read_p99_ms") == pytest.approx(9.0)

    for _ in range(2048):  # fills the window
        metrics.observe_cold_write(7.0)
    assert _v("kv_cold_write_p99_ms") == 7.0
    total, count = metrics.histogram_totals(metrics.cold_write_ms)
    metrics.observe_cold_write(1.0)
    assert metrics.histogram_totals(metrics.cold_write_ms) == (total + 1.0, count + 1)

    text = metrics.text().decode()
    parsed = metrics.parse(text)
    assert parsed["kv_hot_hit_rate"] == _v("kv_hot_hit_rate")
    metrics.alerts_firing.labels(rule="t_rule").set(1)
    assert metrics.parse(metrics.text())['kv_alert_firing{rule="t_rule"}'] == 1.0
    metrics.alerts_firing.labels(rule="t_rule").set(0)


def test_sample_reads_through_the_public_api() -> None:
    metrics.hot_misses.inc(2)
    assert metrics.sample(metrics.hot_misses, "_total") == _v("kv_hot_misses_total")
    metrics.warm_usage_ratio.set(0.25)
    assert metrics.sample(metrics.warm_usage_ratio) == 0.25
    metrics.cold_write_ms.observe(2.5)
    assert metrics.sample(metrics.cold_write_ms, "_count") == _v("kv_cold_write_ms_count")
    assert metrics.sample(metrics.hot_misses, "_nope") == 0.0
    metrics.hot_hits.inc(3)
    metrics.update_hot_hit_rate()
    h, m = _v("kv_hot_hits_total"), _v("kv_hot_misses_total")
    assert _v("kv_hot_hit_rate") == pytest.approx(h / (h + m))


# prometheus_client's private state: reading it breaks on a library update
PRIVATE = re.compile(r"\._(value|sum|count|buckets|created|metrics|child_samples|labelnames|"
                     r"names_to_collectors|collector_to_names)\b")


def test_no_private_prometheus_access() -> None:
    assert PRIVATE.search("h = hot_hits._value.get()")  # what it catches
    hits = []
    for top in ("kvfs", "tools", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text(errors="replace")
            if "metrics" not in text and "prometheus" not in text:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if PRIVATE.search(line) and "self._" not in line and "PRIVATE" not in line:
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


# --- kvfs-stat ---------------------------------------------------------------------------

def _stat_tool():
    from kvfs.cli import stat

    return stat


STATS = {
    "profile": "gov",
    "volume": {"capacity": 512 << 20, "used": 128 << 20, "live": 100 << 20, "head": 10,
               "tail": 2, "sessions": 42, "raw_bytes_written": 1180,
               "stored_bytes_written": 1000, "checkpoint_age_s": 12.0},
    "warm": {"bytes": 900 << 20, "cap": 1 << 30, "sessions": 7},
    "counters": {"reads": 10, "writes": 5},
    "alerts": {"firing": ["warm_usage_high"],
               "rules": {"warm_usage_high": {"firing": True, "value": 0.91,
                                             "description": "warm usage > 88% for 120 s"},
                         "cold_write_slow": {"firing": False}}},
}


def _fake_mount(tmp_path: Path, stats: object = STATS, metrics_text: bytes | None = None) -> Path:
    (tmp_path / ".kvfs").mkdir()
    (tmp_path / ".kvfs" / "stats").write_text(json.dumps(stats))
    (tmp_path / ".kvfs" / "metrics").write_bytes(metrics.text() if metrics_text is None
                                                 else metrics_text)
    return tmp_path


def test_stat_summary(tmp_path, capsys) -> None:
    tool = _stat_tool()
    mp = _fake_mount(tmp_path)
    assert tool.main([str(mp)]) == 0
    out = capsys.readouterr().out
    for want in ("profile gov", "hot", "warm", "cold", "128.0 MiB", "512.0 MiB", "25.0%",
                 "87.9%", "42", "live 100.0 MiB", "hit rate", "cold read p99", "1.18x",
                 "checkpoint age 12 s", "reads 10", "ALERT FIRING  warm_usage_high"):
        assert want in out, want
    assert "[######" in out  # a usage bar


def test_stat_json_and_tolerance(tmp_path, capsys) -> None:
    tool = _stat_tool()
    mp = _fake_mount(tmp_path, stats={}, metrics_text=b"garbage{")
    assert tool.main([str(mp), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["summary"]
    assert s["tiers"]["cold"]["bytes"] is None and s["alerts"]["firing"] == []
    assert tool.main([str(mp)]) == 0  # renders with every value unknown
    assert "none firing" in capsys.readouterr().out


def test_stat_not_a_mount(tmp_path, capsys) -> None:
    tool = _stat_tool()
    assert tool.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a kvfs mount" in err
    assert tool.main([str(tmp_path / "missing")]) == 2
    (tmp_path / ".kvfs").mkdir()
    (tmp_path / ".kvfs" / "stats").write_text("{oops")
    assert tool.main([str(tmp_path)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_stat_watch_until_ctrl_c(tmp_path, capsys, monkeypatch) -> None:
    tool = _stat_tool()
    mp = _fake_mount(tmp_path)
    sleeps: list[float] = []

    def fake_sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:
            (mp / ".kvfs" / "stats").unlink()  # unmounted meanwhile
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(tool.time, "sleep", fake_sleep)
    assert tool.main([str(mp), "--watch", "0.5"]) == 0
    out = capsys.readouterr().out
    assert sleeps == [0.5, 0.5, 0.5]
    assert out.count("\x1b[H\x1b[2J") == 3 and "not a kvfs mount" in out


MOUNT_STATS = {  # the layout kvfs.fsfiles.stats_body writes
    "store": {"volume": {"path": "/data/kv.vol", "capacity": 64 << 20, "used": 16 << 20,
                         "sessions": 3, "checkpoint_age_s": 4.2},
              "counters": {"appends": 7, "raw_written": 2360, "stored_written": 2000},
              "compression_ratio": 1.18},
    "usage": {"capacity": 64 << 20, "used": 16 << 20, "live": 8 << 20, "sessions": 3},
    "fs": {"reads": 2, "writes": 9, "direct_io": True},
    "needs_fsck": True,
    "alerts": None,
}


def test_stat_reads_the_mount_layout(tmp_path, capsys) -> None:
    tool = _stat_tool()
    mp = _fake_mount(tmp_path, stats=MOUNT_STATS, metrics_text=b"")
    assert tool.main([str(mp)]) == 0
    out = capsys.readouterr().out
    for want in ("volume /data/kv.vol", "16.0 MiB", "64.0 MiB", "25.0%", "live 8.0 MiB",
                 "1.18x", "checkpoint age 4 s", "appends 7", "direct_io yes", "NEEDS FSCK",
                 "not reported here", "hit rate      hot -"):
        assert want in out, want
