"""Restarts, alert drills and alert ticks of an agent day: :class:`DayEvents`, a part of
``agent_day_sim.Day``.
"""

from __future__ import annotations

import time

from agent_day_workloads import DRILLS_H

RESUME_CHECKS = 3  # sessions per restart checked against a copy that never stopped
DRILL_AFTER_FIRE_S = 1800.0  # a drill ends this long after its alert first fired
DRILL_RULES = {"device": "device_memory_high", "warm": "warm_usage_high"}  # the alert a drill wakes


class DayEvents:
    """The day's events, mixed into ``Day``: its router, profile, clock, counters and active
    sessions, and the drill state it sets up."""

    def _drill(self, kind: str | None, now: float) -> None:
        """Start a drill (``kind``: "device" or "warm") or end the current one (None).

        device: the router stops moving rounds out before 100 % of its budget; warm: the
        warm tier stops migrating before it is full. It ends ``DRILL_AFTER_FIRE_S`` after
        its alert fired, or after the drill's longest duration.
        """
        r, warm = self.router, self.router.warm
        if kind is None:
            r.watermark, warm.migrate_at = self.prof.device_watermark, self.prof.warm_migrate_at
            self.drills.append((self.drill, self.drill_start / 3600, now / 3600))
            quiet = "" if self.drill_fired else f" (its alert did not fire: usage peaked at {self.drill_peak:.0%})"
            self.drill_log.append(f"{now / 3600:05.2f} h {self.drill} drill ends{quiet}")
            self.drill = None
            return
        self.drill, self.drill_start, self.drill_end = kind, now, now + DRILLS_H[kind][1] * 3600
        self.drill_fired, self.drill_peak = False, 0.0
        self._drill_settings()
        self.drill_log.append(f"{now / 3600:05.2f} h {kind} drill starts")

    def _drill_settings(self) -> None:
        if self.drill == "device":
            self.router.watermark = 1.0
        elif self.drill == "warm":
            self.router.warm.migrate_at = 1.0

    def _restart(self) -> None:
        """Close the router (flush), reopen it over the same tiers; check a few sessions
        continue exactly as a copy of their live window that never stopped."""
        from kvfs.torch import TieredCache

        torch, W = self.torch, self.prof.max_kv_len
        picks = [s for s in self.active if s.cache is not None and s.cache.seen
                 and s.cache.stored == min(s.cache.seen, W)][:RESUME_CHECKS]
        for s in picks:
            fork = None
            if s.cache.retrieval is not None:  # a fork attends the blocks the live session would
                fork = f"{s.sid}-ref"
                ref = self.router.fork(s.sid, fork, self.model)
            else:
                ref = TieredCache(self.model, max_kv_len=W, sink_tokens=s.cache.sink_tokens,
                                  rope_rerotate=s.cache.rope_mode or False, rope_reach=s.cache.rope_reach)
                for lay, src in zip(ref.layers, s.cache.layers, strict=True):
                    src.copy_to(lay)
            s.forced = self._question(s)
            ids = torch.cat([s.conv, s.forced], 1)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=ref,
                                      max_new_tokens=self.w.answer, do_sample=False)
            s.expect = out[0, -self.w.answer:].tolist()
            if fork is not None:
                self.router.delete(fork)
        t = time.perf_counter()
        old = self.router
        old.close()
        wu = old.warm.usage()
        self.offs["moves"] += old.watermark_moves
        self.offs["migrations"] += wu["migrations"]
        self.offs["promotions"] += wu["promotions"]
        self._add_heap(old)
        self.router = self._open_router()
        self._drill_settings()
        ms = (time.perf_counter() - t) * 1e3
        self.c["restarts"] += 1
        self.c["restart_ms"] = max(self.c["restart_ms"], ms)
        self.drill_log.append(f"{self.clock() / 3600:05.2f} h restart ({ms:.0f} ms, {len(picks)} checked)")
        for s in picks:
            self._serve(s)

    def _tick_alerts(self, cold_write_ms: float | None) -> None:
        from kvfs.ops import alerts

        r = self.router
        signals = {alerts.DEVICE_SIGNAL: r.hot_total / r.budget, alerts.WARM_SIGNAL: r.warm.usage()["ratio"],
                   alerts.COLD_WRITE_SIGNAL: cold_write_ms}
        if self.drill:
            self.drill_peak = max(self.drill_peak, signals[alerts.DEVICE_SIGNAL if self.drill == "device"
                                                          else alerts.WARM_SIGNAL])
        events = self.alerts.tick(signals)
        for rule, ev in events:
            if ev != "firing":
                continue
            now = self.clock()
            if self.drill and rule == DRILL_RULES[self.drill]:  # the drill's alert: it ends soon
                self.c["alerts_in_drill"] += 1
                self.drill_fired = True
                self.drill_log.append(f"{now / 3600:05.2f} h alert {rule} fired")
                self.drill_end = min(self.drill_end, now + DRILL_AFTER_FIRE_S)
            else:
                self.c["alerts_outside"] += 1
                self.outside.setdefault(rule, []).append(now / 3600)
