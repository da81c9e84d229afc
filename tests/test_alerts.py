"""Alert rules: fire only after the whole duration, resolve, run actions (fake clock)."""

from __future__ import annotations

import json
import logging
import math
import threading

import pytest

from kvfs.ops import alerts, metrics, profiles, units
from kvfs.ops.alerts import AlertEngine, MetricsSampler, Rule, default_rules
from kvfs.ops.profiles import load


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _value(name: str, rule: str) -> float:
    v = metrics.REGISTRY.get_sample_value(name, {"rule": rule})
    return 0.0 if v is None else v


def _engine(actions: dict | None = None, **overrides):
    clock = FakeClock()
    prof = load("gov", overrides or None)
    return AlertEngine(default_rules(prof, actions or {}), clock=clock), clock


# (rule, signal, value above, value below, duration, action key)
RULES = [
    ("device_memory_high", "device_memory_ratio", 0.95, 0.80, 30.0, "migrate_hot"),
    ("warm_usage_high", "warm_usage_ratio", 0.90, 0.50, 120.0, "migrate_warm"),
    ("cold_write_slow", "cold_write_ms", 8.0, 1.0, 60.0, "cold_write_slow"),
]


@pytest.mark.parametrize("rule,signal,high,low,duration,action_key", RULES)
def test_rule_fires_after_duration_not_before(caplog, rule, signal, high, low, duration,
                                              action_key) -> None:
    calls: list[float] = []
    eng, clock = _engine({action_key: lambda: calls.append(clock.t)})
    fired0 = _value("kv_alerts_fired_total", rule)
    eng.observe(signal, high)
    start = clock.t
    for dt in (0.0, duration / 2, duration - 0.01):
        clock.t = start + dt
        eng.observe(signal, high)  # keeps holding; the duration counts from the first
        assert eng.evaluate() == []
        assert not calls and eng.firing() == []
        assert _value("kv_alert_firing", rule) == 0
    clock.t = start + duration
    with caplog.at_level(logging.WARNING, logger="kvfs.alerts"):
        assert eng.evaluate() == [(rule, "firing")]
    assert calls == [start + duration]
    assert eng.firing() == [rule]
    assert _value("kv_alert_firing", rule) == 1
    assert _value("kv_alerts_fired_total", rule) == fired0 + 1
    assert any(rule in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    st = eng.state()
    assert st["firing"] == [rule] and st["rules"][rule]["fired"] == 1
    json.dumps(st)  # goes into /.kvfs/stats as is

    clock.t += 1
    assert eng.evaluate() == []  # still firing, not fired again
    eng.observe(signal, low)
    assert eng.evaluate() == [(rule, "resolved")]
    assert eng.firing() == [] and _value("kv_alert_firing", rule) == 0
    assert eng.state()["rules"][rule]["fired"] == 1
    assert len(calls) == 1


def test_other_rules_stay_quiet() -> None:
    eng, clock = _engine()
    eng.observe("warm_usage_ratio", 0.99)
    clock.t += 30
    assert eng.evaluate() == []  # warm needs 120 s
    eng.observe("device_memory_ratio", 0.5)
    clock.t += 90
    assert eng.evaluate() == [("warm_usage_high", "firing")]
    assert eng.firing() == ["warm_usage_high"]


def test_threshold_is_strict_and_dip_resets_duration() -> None:
    eng, clock = _engine()
    eng.observe("device_memory_ratio", 0.92)  # equal is not above
    clock.t += 100
    assert eng.evaluate() == []
    eng.observe("device_memory_ratio", 0.93)
    clock.t += 20
    eng.observe("device_memory_ratio", 0.10)  # a dip: starts over
    eng.observe("device_memory_ratio", 0.93)
    clock.t += 20
    assert eng.evaluate() == []
    clock.t += 10
    assert eng.evaluate() == [("device_memory_high", "firing")]


def test_clear_and_rearm_between_evaluations_resolves() -> None:
    eng, clock = _engine(alert_device_for_s=0)
    eng.observe("device_memory_ratio", 0.99)
    assert eng.evaluate() == [("device_memory_high", "firing")]
    eng.observe("device_memory_ratio", 0.10)
    eng.observe("device_memory_ratio", 0.99)
    assert eng.evaluate() == [("device_memory_high", "resolved"), ("device_memory_high", "firing")]
    assert eng.state()["rules"]["device_memory_high"]["fired"] == 2


def test_action_repeats_while_firing_and_counts_fires() -> None:
    calls: list[str] = []
    eng, clock = _engine({"warm_usage_high": lambda: calls.append("migrate")})
    eng.observe("warm_usage_ratio", 0.95)
    clock.t += 120
    assert eng.evaluate() == [("warm_usage_high", "firing")]
    clock.t += 60
    assert eng.evaluate() == []
    clock.t += 60
    assert eng.evaluate() == [("warm_usage_high", "repeat")]
    assert calls == ["migrate", "migrate"]
    eng.observe("warm_usage_ratio", 0.2)
    eng.evaluate()
    eng.observe("warm_usage_ratio", 0.95)
    clock.t += 120
    eng.evaluate()
    st = eng.state()["rules"]["warm_usage_high"]
    assert st["fired"] == 2 and st["actions"] == 3 and calls == ["migrate"] * 3


def test_cold_write_slow_is_alert_only() -> None:
    eng, clock = _engine()
    rule = next(r for r in eng.rules if r.name == "cold_write_slow")
    assert rule.action is None
    eng.observe("cold_write_ms", 9.0)
    clock.t += 60
    assert eng.evaluate() == [("cold_write_slow", "firing")]
    clock.t += 600
    assert eng.evaluate() == []  # no action to repeat


def test_failing_action_is_logged_not_fatal(caplog) -> None:
    def boom() -> None:
        raise RuntimeError("disk gone")

    eng, clock = _engine({"migrate_hot": boom}, alert_device_for_s=0)
    eng.observe("device_memory_ratio", 1.0)
    with caplog.at_level(logging.ERROR, logger="kvfs.alerts"):
        assert eng.evaluate() == [("device_memory_high", "firing")]
    st = eng.state()["rules"]["device_memory_high"]
    assert st["action_errors"] == 1 and "disk gone" in st["last_error"]
    assert "action failed" in caplog.text


def test_no_data_changes_nothing_and_unknown_names() -> None:
    eng, clock = _engine(alert_device_for_s=0)
    assert eng.observe("device_memory_ratio", None) is True
    assert eng.observe("device_memory_ratio", math.nan) is True
    assert eng.observe("no_such_signal", 1.0) is False
    assert eng.evaluate() == []
    assert eng.observe("device_memory_high", 0.99)  # by rule name works too
    assert eng.evaluate() == [("device_memory_high", "firing")]


def test_thresholds_and_durations_come_from_the_profile() -> None:
    eng, clock = _engine(alert_warm_pct=0.5, alert_warm_for_s="10s")
    eng.observe("warm_usage_ratio", 0.6)
    clock.t += 9.9
    assert eng.evaluate() == []
    clock.t += 0.1
    assert eng.evaluate() == [("warm_usage_high", "firing")]


def test_default_rules_actions_and_validation() -> None:
    prof = load("iot")
    hot, warm = (lambda: None), (lambda: None)
    rules = {r.name: r for r in default_rules(prof, {"device_memory_high": hot,
                                                     "migrate_warm": warm})}
    assert set(rules) == {"device_memory_high", "warm_usage_high", "cold_write_slow"}
    assert rules["device_memory_high"].action is hot and rules["warm_usage_high"].action is warm
    assert (rules["device_memory_high"].threshold, rules["device_memory_high"].duration_s) == (0.92, 30)
    assert (rules["warm_usage_high"].threshold, rules["warm_usage_high"].duration_s) == (0.95, 120)
    assert (rules["cold_write_slow"].threshold, rules["cold_write_slow"].duration_s) == (5.0, 60)
    with pytest.raises(ValueError, match="migrate_cold"):
        default_rules(prof, {"migrate_cold": hot})
    with pytest.raises(ValueError):
        AlertEngine([Rule("a", 1, 1), Rule("a", 2, 2)])
    with pytest.raises(ValueError):
        Rule("a", 1, -1)


def test_metrics_sampler_reads_the_registry() -> None:
    sample = MetricsSampler()
    assert sample()["cold_write_ms"] is None  # nothing written since the sampler started
    for ms in (4.0, 8.0):
        metrics.observe_cold_write(ms)
    metrics.warm_usage_ratio.set(0.42)
    metrics.hot_device_usage.set(0.33)
    s = sample()
    assert s == {"device_memory_ratio": pytest.approx(0.33), "warm_usage_ratio": pytest.approx(0.42),
                 "cold_write_ms": pytest.approx(6.0)}
    assert sample()["cold_write_ms"] is None
    assert MetricsSampler(device_ratio=lambda: 0.7)()["device_memory_ratio"] == 0.7


def test_continuous_evaluation_thread() -> None:
    fired = threading.Event()
    eng = AlertEngine([Rule("r", 0.5, 0.0, fired.set, signal="s")])
    eng.start(lambda: {"s": 0.9, "other": 1.0}, interval_s=0.01)
    try:
        assert fired.wait(5)
    finally:
        eng.stop()
    assert eng.firing() == ["r"]
    assert alerts.for_profile(load("gov")).firing() == []


@pytest.mark.parametrize("seconds,text", [(30.0, "30s"), (120.0, "2m"), (60.0, "1m"),
                                          (7200.0, "2h"), (90.0, "90s"), (0.25, "250ms"),
                                          (0.0, "0s")])
def test_prom_duration(seconds: float, text: str) -> None:
    assert alerts.prom_duration(seconds) == text
    assert units.parse_duration(text) == seconds


def test_prometheus_rules_follow_the_profile() -> None:
    p = profiles.load("gov", {"alert_warm_pct": "0.8", "alert_warm_for_s": "90s"})
    text = alerts.prometheus_rules([p])
    assert "kv_warm_usage_ratio{profile=~\"gov|\"} > 0.8'" in text and "for: 90s" in text
    custom = alerts.prometheus_rules([profiles.load("iot")])
    assert 'kv_warm_usage_ratio{profile="iot"} > 0.95' in custom
