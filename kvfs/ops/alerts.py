"""Alert rules with durations, evaluated continuously (the article's three rules).

A rule fires when the value observed for its signal has stayed above the threshold for
the rule's whole duration; it resolves as soon as an observation is at or below the
threshold. Firing logs a warning, sets ``kv_alert_firing{rule}`` to 1, counts
``kv_alerts_fired_total{rule}`` and runs the rule's action (e.g. migrate hot rounds out,
migrate a warm group to cold), repeated every ``repeat_s`` while it keeps firing.

The clock is injectable (``clock=``) so tests drive time; nothing here sleeps except the
optional background thread of :meth:`AlertEngine.start`. Never imports torch or pyfuse3.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfs.ops import metrics

log = logging.getLogger("kvfs.alerts")

Action = Callable[[], Any]

#: the signals the default rules watch (what a sampler reports)
DEVICE_SIGNAL = "device_memory_ratio"  # device memory reserved / budget, 0..1
WARM_SIGNAL = "warm_usage_ratio"  # warm bytes / warm cap, 0..1
COLD_WRITE_SIGNAL = "cold_write_ms"  # cold write latency over the last interval, ms


@dataclass
class Rule:
    """``signal > threshold`` held for ``duration_s`` seconds -> fire, run ``action``."""

    name: str
    threshold: float
    duration_s: float
    action: Action | None = None
    signal: str | None = None  # the observed name; defaults to the rule's name
    repeat_s: float | None = None  # re-run the action this often while still firing
    description: str = ""

    def __post_init__(self) -> None:
        if self.signal is None:
            self.signal = self.name
        if not self.duration_s >= 0:
            raise ValueError(f"rule {self.name}: duration_s must be >= 0, got {self.duration_s}")
        if self.repeat_s is not None and not self.repeat_s > 0:
            raise ValueError(f"rule {self.name}: repeat_s must be > 0, got {self.repeat_s}")


@dataclass
class _State:
    value: float | None = None
    observed_at: float | None = None
    since: float | None = None  # when the condition started holding (None: not holding)
    cleared: bool = False  # went at/below the threshold since the last evaluate
    firing: bool = False
    fired_at: float | None = None
    resolved_at: float | None = None
    action_at: float | None = None
    fired: int = 0
    actions: int = 0
    action_errors: int = 0
    last_error: str | None = None


class AlertEngine:
    """Holds the rules' states; ``observe`` records values, ``evaluate`` makes transitions."""

    def __init__(self, rules: list[Rule], clock: Callable[[], float] = time.monotonic) -> None:
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate rule names: {names}")
        self.rules = list(rules)
        self.clock = clock
        self._states = {r.name: _State() for r in self.rules}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for r in self.rules:
            metrics.alerts_firing.labels(rule=r.name).set(0)

    # --- inputs ---------------------------------------------------------------------------
    def observe(self, name: str, value: float | None) -> bool:
        """Record the current value of a signal (or of a rule, by its name).

        ``None`` or NaN means "no data" and changes nothing. Returns whether a rule
        watches ``name``.
        """
        matched = [r for r in self.rules if name in (r.signal, r.name)]
        if value is None or not matched:
            return bool(matched)
        value = float(value)
        if math.isnan(value):
            return True
        now = self.clock()
        with self._lock:
            for r in matched:
                st = self._states[r.name]
                st.value, st.observed_at = value, now
                if value > r.threshold:
                    if st.since is None:
                        st.since = now
                else:
                    st.since = None
                    st.cleared = st.cleared or st.firing
        return True

    def tick(self, samples: Mapping[str, float | None]) -> list[tuple[str, str]]:
        """Observe every sample (names no rule watches are ignored), then evaluate."""
        for name, value in samples.items():
            self.observe(name, value)
        return self.evaluate()

    # --- transitions ----------------------------------------------------------------------
    def evaluate(self) -> list[tuple[str, str]]:
        """Fire, repeat or resolve rules as of now; returns ``[(rule, event), ...]`` with
        event ``"firing"``, ``"repeat"`` or ``"resolved"``. Actions run after the lock."""
        now = self.clock()
        events: list[tuple[str, str]] = []
        to_run: list[Rule] = []
        with self._lock:
            for r in self.rules:
                st = self._states[r.name]
                if st.firing and (st.since is None or st.cleared):
                    st.firing, st.resolved_at = False, now
                    metrics.alerts_firing.labels(rule=r.name).set(0)
                    log.info("alert %s resolved: %s=%.4g <= %.4g", r.name, r.signal,
                             st.value if st.value is not None else math.nan, r.threshold)
                    events.append((r.name, "resolved"))
                st.cleared = False
                run = False
                if st.since is not None and not st.firing and now - st.since >= r.duration_s:
                    st.firing, st.fired_at = True, now
                    st.fired += 1
                    metrics.alerts_firing.labels(rule=r.name).set(1)
                    metrics.alerts_fired.labels(rule=r.name).inc()
                    log.warning("alert %s firing: %s=%.4g > %.4g for %.0f s%s", r.name, r.signal,
                                st.value, r.threshold, now - st.since,
                                " -> running action" if r.action else " (no action)")
                    events.append((r.name, "firing"))
                    run = r.action is not None
                elif (st.firing and r.action is not None and r.repeat_s is not None
                      and st.action_at is not None and now - st.action_at >= r.repeat_s):
                    log.warning("alert %s still firing: %s=%.4g > %.4g, running action again",
                                r.name, r.signal, st.value, r.threshold)
                    events.append((r.name, "repeat"))
                    run = True
                if run:
                    st.action_at = now
                    to_run.append(r)
        for r in to_run:
            self._run_action(r)
        return events

    def _run_action(self, r: Rule) -> None:
        st = self._states[r.name]
        try:
            assert r.action is not None
            r.action()
        except Exception as e:  # an action failing must not stop the rules
            log.exception("alert %s: action failed", r.name)
            with self._lock:
                st.action_errors += 1
                st.last_error = f"{type(e).__name__}: {e}"
        else:
            with self._lock:
                st.actions += 1

    # --- outputs --------------------------------------------------------------------------
    def firing(self) -> list[str]:
        with self._lock:
            return [n for n, st in self._states.items() if st.firing]

    def state(self) -> dict[str, Any]:
        """JSON-able view for ``/.kvfs/stats``: ``{"firing": [...], "rules": {name: {...}}}``."""
        now = self.clock()
        rules: dict[str, Any] = {}
        with self._lock:
            for r in self.rules:
                st = self._states[r.name]
                rules[r.name] = {
                    "signal": r.signal, "threshold": r.threshold, "for_s": r.duration_s,
                    "description": r.description, "value": st.value,
                    "firing": st.firing, "fired": st.fired,
                    "holding_s": None if st.since is None else round(now - st.since, 3),
                    "firing_s": round(now - st.fired_at, 3) if st.firing and st.fired_at is not None else None,
                    "actions": st.actions, "action_errors": st.action_errors,
                    "last_error": st.last_error,
                }
            firing = [n for n, st in self._states.items() if st.firing]
        return {"firing": firing, "rules": rules}

    # --- continuous evaluation ------------------------------------------------------------
    def start(self, sampler: Callable[[], Mapping[str, float | None]],
              interval_s: float = 5.0) -> None:
        """Every ``interval_s``: ``tick(sampler())`` on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("alert engine already started")
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.tick(sampler())
                except Exception:
                    log.exception("alert evaluation failed")
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="kvfs-alerts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class MetricsSampler:
    """Reads the default rules' signals from this process's registry (``kvfs.metrics``).

    ``device_memory_ratio`` from ``kv_hot_device_usage_ratio``, ``warm_usage_ratio`` from
    ``kv_warm_usage_ratio``, ``cold_write_ms`` = mean cold write latency since the previous
    call (``None`` when nothing was written in between: no new evidence either way).
    A ``device_ratio`` callable (e.g. ``torch.cuda.memory_reserved() / total``) replaces
    the gauge where the device is in this process.
    """

    def __init__(self, device_ratio: Callable[[], float | None] | None = None) -> None:
        self.device_ratio = device_ratio
        self._last = metrics.histogram_totals(metrics.cold_write_ms)

    def __call__(self) -> dict[str, float | None]:
        total, count = metrics.histogram_totals(metrics.cold_write_ms)
        last_total, last_count = self._last
        self._last = (total, count)
        write_ms = (total - last_total) / (count - last_count) if count > last_count else None
        device = self.device_ratio() if self.device_ratio else metrics.sample(metrics.hot_device_usage)
        return {DEVICE_SIGNAL: device, WARM_SIGNAL: metrics.sample(metrics.warm_usage_ratio),
                COLD_WRITE_SIGNAL: write_ms}


_ACTION_ALIASES = {"device_memory_high": ("device_memory_high", "migrate_hot"),
                   "warm_usage_high": ("warm_usage_high", "migrate_warm"),
                   "cold_write_slow": ("cold_write_slow",)}


def default_rules(profile: Any, actions: Mapping[str, Action] | None = None) -> list[Rule]:
    """The three rules with the profile's thresholds and durations.

    ``actions`` maps a rule name (or ``migrate_hot`` / ``migrate_warm``) to a callable:
    ``device_memory_high`` -> migrate hot rounds out, ``warm_usage_high`` -> migrate a warm
    group to cold, ``cold_write_slow`` -> alert only (an optional hook, e.g. paging).
    """
    actions = dict(actions or {})
    known = {a for names in _ACTION_ALIASES.values() for a in names}
    unknown = sorted(set(actions) - known)
    if unknown:
        raise ValueError(f"unknown alert actions {unknown}; allowed: {sorted(known)}")

    def pick(rule: str) -> Action | None:
        return next((actions[a] for a in _ACTION_ALIASES[rule] if actions.get(a)), None)

    p = profile
    return [
        Rule("device_memory_high", p.alert_device_pct, p.alert_device_for_s,
             pick("device_memory_high"), signal=DEVICE_SIGNAL, repeat_s=max(p.alert_device_for_s, 1.0),
             description=f"device memory > {p.alert_device_pct:.0%} for {p.alert_device_for_s:g} s"
                         " -> migrate hot rounds out"),
        Rule("warm_usage_high", p.alert_warm_pct, p.alert_warm_for_s,
             pick("warm_usage_high"), signal=WARM_SIGNAL, repeat_s=max(p.alert_warm_for_s, 1.0),
             description=f"warm usage > {p.alert_warm_pct:.0%} for {p.alert_warm_for_s:g} s"
                         " -> migrate warm to cold"),
        Rule("cold_write_slow", p.alert_cold_write_ms, p.alert_cold_write_for_s,
             pick("cold_write_slow"), signal=COLD_WRITE_SIGNAL,
             description=f"cold write latency > {p.alert_cold_write_ms:g} ms for "
                         f"{p.alert_cold_write_for_s:g} s -> alert (disk trouble)"),
    ]


def for_profile(profile: Any, actions: Mapping[str, Action] | None = None,
                clock: Callable[[], float] = time.monotonic) -> AlertEngine:
    """``AlertEngine(default_rules(profile, actions), clock)``."""
    return AlertEngine(default_rules(profile, actions), clock=clock)


# --- the same rules for a Prometheus server ---------------------------------------------------

#: what each default rule watches, in PromQL; ``{sel}`` is the target's label selector
PROMQL = {
    "device_memory_high": "kv_hot_device_usage_ratio{sel}",
    "warm_usage_high": "kv_warm_usage_ratio{sel}",
    # the mean write latency over the last minute, like MetricsSampler's per-interval mean
    "cold_write_slow": "rate(kv_cold_write_ms_sum{sel}[1m]) / rate(kv_cold_write_ms_count{sel}[1m])",
}
SEVERITY = {"device_memory_high": "warning", "warm_usage_high": "warning",
            "cold_write_slow": "critical"}


def prom_duration(seconds: float) -> str:
    """``30.0`` -> ``"30s"``, ``120.0`` -> ``"2m"``, ``0.25`` -> ``"250ms"`` (PromQL form)."""
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms"
    s = ms // 1000
    for unit, n in (("h", 3600), ("m", 60)):
        if s and s % n == 0:
            return f"{s // n}{unit}"
    return f"{s}s"


def prometheus_rules(profiles: list[Any], default: str = "gov") -> str:
    """``deploy/prometheus-rules.yml``: one group per profile with :func:`default_rules`'
    thresholds and durations, selecting targets by their ``profile`` label (targets
    without one get ``default``'s). Regenerate with ``python -m kvfs.ops.alerts``."""
    out = ["# kvfs alert rules for Prometheus, one group per profile (thresholds and durations",
           "# from kvfs/ops/profiles/*.json). Generated by `python -m kvfs.ops.alerts`; do not",
           "# edit: tests/test_deploy.py fails when this file and the profiles disagree.",
           "# Label each scrape target with its profile (profile: iot); a target without the",
           f"# label gets the {default} thresholds.",
           "groups:"]
    for p in profiles:
        sel = f'{{profile=~"{p.name}|"}}' if p.name == default else f'{{profile="{p.name}"}}'
        out += [f"  - name: kvfs-{p.name}", "    rules:"]
        for r in default_rules(p):
            expr = PROMQL[r.name].replace("{sel}", sel)
            what, _, action = r.description.partition(" -> ")
            out += [f"      - alert: {r.name}",
                    f"        expr: '{expr} > {r.threshold:.10g}'",
                    f"        for: {prom_duration(r.duration_s)}",
                    "        labels:",
                    f"          severity: {SEVERITY[r.name]}",
                    f"          profile: {p.name}",
                    "        annotations:",
                    f"          summary: '{what} on {{{{ $labels.instance }}}}'",
                    f"          description: 'now {{{{ $value }}}}; what kvfs does: {action}'"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from kvfs.ops import profiles as _profiles

    print(prometheus_rules([_profiles.load(n) for n in _profiles.PROFILE_NAMES]), end="")
