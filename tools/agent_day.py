#!/usr/bin/env python3
"""A day of agent traffic per profile, compressed into minutes: the end-to-end check.

    python tools/agent_day.py --profile gov|ecommerce|iot|all [--minutes M] [--sessions N]
                              [--out DIR] [--no-mount] [--json PATH] [--seed S] [--verbose]

Per profile: a temp volume mounted by ``mount.py --profile P`` (``agentlib.Volume``), a tiny
random Llama, a ``KVRouter`` with the profile's tiers and alert rules live, and a closed-loop
traffic generator whose concurrency follows the profile's daily load curve, for one simulated
day in ``--minutes`` real minutes (``docs/agent-day.md`` says what a run does and checks). Owns
the workloads, the day loop (turns, recalls, return visits, restarts, alert drills), the
byte-exact checks against what each session's model produced, the samples and the report:
stdout, the profile's section of ``DIR/agent-day.md`` and ``DIR/img/agent-day-<profile>.png``.
Exit status 0 when every goal is met.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agentlib as lib
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("kvfs.agent_day")

DAY_S = 86400.0
SAMPLE_S = 600.0  # simulated seconds between two samples of the time series
RESTARTS_H = (9.5, 17.5)  # simulated hours of the two restarts
RESUME_CHECKS = 3  # sessions per restart checked against a copy that never stopped
DRILLS_H = {"device": (10.0, 2.0), "warm": (14.0, 4.0)}  # start hour, longest hours
DRILL_AFTER_FIRE_S = 1800.0  # a drill ends this long after its alert first fired
DRILL_RULES = {"device": "device_memory_high", "warm": "warm_usage_high"}  # the alert a drill wakes
MODEL_SEED = 7
DEFAULT_HEAD = "# A day of agent traffic\n\nWritten by `tools/agent_day.py` (see docs/agent-day.md)."


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """The traffic of one profile. Token counts are per turn; a round is one turn."""

    name: str
    peak: int  # concurrent sessions at the busiest hour (--sessions)
    rounds: tuple[int, int]  # turns per visit
    question: tuple[int, int]  # user tokens per turn
    answer: int  # tokens generated per turn
    recall_p: float  # a turn (once the window has moved on) is a follow-up that recalls
    return_p: float  # a new visit continues a retired session (resumed from storage)
    switch_p: float  # the user changes topic (ecommerce)
    warm_cap: int  # bytes (scaled down: the warm tier migrates groups to the mount daily)
    budget_windows: float  # device budget in full hot windows of concurrent sessions
    pool: int  # retired sessions remembered for return visits (bounds the generator's RAM)
    load: tuple[float, ...]  # share of ``peak`` active at each hour 0..23 (iot: see _load)
    story: str


WORKLOADS = {
    "gov": Workload(
        "gov", 24, (10, 14), (3, 5), 4, 0.15, 0.1, 0.0, 4 << 20, 0.95, 256,
        (.08, .06, .05, .05, .05, .08, .15, .4, .8, 1, 1, .95, .6, .85, 1, .95, .8, .55, .3,
         .2, .15, .12, .1, .08),
        "long case-worker sessions (~12 rounds of ~8 tokens: 3-5 question + 4 answer tokens); "
        "from the 5th round on, 15 % of questions are deep follow-ups that recall an old round "
        "(half by summary similarity to the question, half by round number); 10 % of visits "
        "reopen an earlier case; office-hours load"),
    "ecommerce": Workload(
        "ecommerce", 48, (2, 6), (5, 7), 6, 1.0, 0.2, 0.35, 4 << 20, 0.7, 1024,
        (.3, .2, .12, .1, .08, .1, .15, .25, .4, .5, .55, .65, .75, .65, .55, .55, .6, .7, .8,
         .95, 1, 1, .8, .5),
        "many short shopping sessions (2-6 rounds of ~12 tokens); 35 % of turns switch topic "
        "and half of the switches go back to an earlier topic, recalling its round by summary "
        "similarity; 20 % of visits are returning customers (resumed carts); evening peak"),
    "iot": Workload(
        "iot", 96, (1, 2), (3, 5), 3, 0.0, 0.1, 0.0, 4 << 20, 0.35, 2048, (),
        "very many tiny command sessions '<device>-cmd-<n>' from 5,000 devices (1-2 commands "
        "of 3-5 tokens, 3-token replies; warm sharded by device id); 10 % are follow-ups that "
        "reopen the device's earlier session; flat load with a burst in the first 10 minutes "
        "of every hour"),
}
IOT_DEVICES = (1000, 6000)
TOPICS = 8


def load_at(w: Workload, h: float) -> float:
    """Share of the peak concurrency at simulated hour ``h`` (linear between hours)."""
    if not w.load:  # iot: devices report in a burst at the top of every hour
        return 1.0 if h % 1.0 < 1 / 6 else 0.45 + 0.1 * math.sin(h / 24 * 2 * math.pi)
    i = int(h) % 24
    f = h - int(h)
    return w.load[i] * (1 - f) + w.load[(i + 1) % 24] * f


@dataclass(slots=True, eq=False)
class Sess:
    """One conversation as the generator sees it: its tokens and its reference K/V bytes
    (while it is active; a retired one keeps a digest per layer, see ``Day._retire``)."""

    sid: str
    seed: int
    conv: Any  # [1, T] token ids so far (int32 bytes while retired)
    rec: lib.KVRecord | None
    rng: random.Random | None
    topic: int
    digest: list[bytes] | None = None
    topics: list[int] = field(default_factory=list)  # topic of each closed round
    left: int = 0  # turns left in this visit
    cache: Any = None  # the TieredCache object whose layers feed ``rec``
    forced: Any = None  # next question, fixed by a restart check
    expect: list[int] | None = None  # answer a copy that never stopped gave to ``forced``


# --------------------------------------------------------------------------- the day
class SimClock:
    """Simulated seconds since midnight: ``speed`` of them per real second."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.t0 = time.perf_counter()
        self.epoch = time.time()

    def __call__(self) -> float:
        return (time.perf_counter() - self.t0) * self.speed

    def wall(self) -> float:
        """A ``time.time()``-like clock on simulated time (for the warm tier's LRU stamps)."""
        return self.epoch + self()


class Day:
    """One profile's day over a cold root (a mount or a directory) and a warm root."""

    def __init__(self, w: Workload, args: argparse.Namespace, vol: lib.Volume, warm_root: Path) -> None:
        import torch

        from kvfs.ops import alerts, profiles
        from kvfs.torch import geometry
        from kvfs.torch.testing import tiny_llama

        torch.set_num_threads(1)
        self.torch = torch
        self.w, self.args, self.vol, self.warm_root = w, args, vol, warm_root
        self.prof = profiles.load(w.name)
        self.model = tiny_llama(MODEL_SEED)
        self.geo = geometry(self.model)
        self.vocab = self.model.config.vocab_size
        self.rng = random.Random(args.seed)
        self.peak = args.sessions or w.peak
        self.clock = SimClock(DAY_S / (args.minutes * 60.0))
        W = self.prof.max_kv_len
        held = W + self.prof.sink_tokens + 1  # what one session keeps on the device at a step
        self.budget = int(w.budget_windows * self.peak * held * self.geo.session_token_bytes)
        self.rec_tokens = 1 << (w.rounds[1] * (w.question[1] + w.answer + 1) - 1).bit_length()
        self.router = self._open_router()
        self.alerts = alerts.for_profile(
            self.prof, {"migrate_hot": self._migrate_hot, "migrate_warm": self._migrate_warm},
            clock=self.clock)
        self.active: list[Sess] = []
        self.pool: deque[Sess] = deque(maxlen=w.pool)
        self.serial = 0
        self.device_serial: dict[int, int] = {}
        self.c: dict[str, float] = dict.fromkeys((
            "interactions", "steps", "hits", "misses", "miss_recall", "miss_resume", "miss_refill",
            "recalls", "recall_topic_ok", "recall_topic_checks", "returns", "retired", "sessions",
            "oom", "errors", "check_recall", "check_window", "check_stored", "check_resume_gen",
            "bad_recall", "bad_window", "bad_stored", "bad_resume_gen", "restarts", "restart_ms",
            "alerts_in_drill", "alerts_outside"), 0)
        self.cold_lat = lib.Latencies()
        self.rows: list[dict[str, Any]] = []
        self.drill: str | None = None
        self.drill_start = self.drill_end = self.drill_peak = 0.0
        self.drill_fired = False
        self.drills: list[tuple[str, float, float]] = []  # (kind, start h, end h)
        self.drill_log: list[str] = []
        self.outside: dict[str, list[float]] = {}  # alerts outside the drills: rule -> hours
        self._mark: dict[str, Any] = {}
        self.offs = {"moves": 0, "migrations": 0, "promotions": 0}  # routers closed by restarts
        self.m0 = self._mount_metrics() or {}
        self.ev0 = lib.local_histogram("warm_evict_latency")

    # --- the tiers ------------------------------------------------------------------------
    def _open_router(self) -> Any:
        from kvfs.torch import KVRouter

        r = KVRouter(mount=str(self.vol.mnt), device="cpu", profile=self.prof, warm_root=str(self.warm_root),
                     device_budget_bytes=self.budget,
                     warm_options={"cap_bytes": self.w.warm_cap, "clock": self.clock.wall})
        cold = r.warm.cold
        if cold is not None:  # time every read of a layer file through the mount
            orig = cold.read_into

            def timed(sid: str, layer: int, off: int, out: Any, **kw: Any) -> None:
                t = time.perf_counter()
                orig(sid, layer, off, out, **kw)
                self.cold_lat.add((time.perf_counter() - t) * 1e3)

            cold.read_into = timed
        return r

    def _migrate_hot(self) -> None:
        """Alert action: the router's watermark move, down to the profile's watermark."""
        r = self.router
        saved, r.watermark = r.watermark, self.prof.device_watermark
        try:
            r._move_out(0, exclude=None)  # noqa: SLF001 - the router's own watermark move
        finally:
            r.watermark = saved

    def _migrate_warm(self) -> None:
        """Alert action: ``warm.migrate()``, the least recently used group to the mount
        (the rule repeats it every ``alert_warm_for_s`` while it keeps firing)."""
        self.router.warm.migrate()

    def _mount_metrics(self) -> dict[str, float] | None:
        return lib.mount_metrics(self.vol.mnt) if self.vol.use_mount else None

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        events = sorted([(h * 3600, "restart") for h in RESTARTS_H]
                        + [(a * 3600, kind) for kind, (a, _) in DRILLS_H.items()])
        next_sample, next_alert = 0.0, 0.0
        self._sample(0.0)
        while (now := self.clock()) < DAY_S:
            while events and events[0][0] <= now:
                what = events.pop(0)[1]
                self._restart() if what == "restart" else self._drill(what, now)
            if self.drill and now >= self.drill_end:
                self._drill(None, now)
            self._fill(now)
            self._serve(self.rng.choice(self.active))
            if now >= next_alert:
                next_alert = now + self.prof.alert_interval_s
                self._tick_alerts(None)
            if now >= next_sample:
                next_sample += SAMPLE_S
                self._sample(now)
        self._sample(DAY_S)
        for s in list(self.active):  # closing time: every session's history is checked
            self._retire(s)
        self.router.close()
        return self._results()

    def _fill(self, now: float) -> None:
        target = max(1, round(self.peak * load_at(self.w, now / 3600)))
        while len(self.active) < target:
            self.active.append(self._visit())

    def _visit(self) -> Sess:
        torch = self.torch
        w, rng = self.w, self.rng
        # the first return as soon as one is possible (a short day may offer few), then
        # return_p of the visits; half the time the oldest: on the mount by now
        if self.pool and (not self.c["returns"] or rng.random() < w.return_p):
            s = self.pool.popleft() if rng.random() < 0.5 else self.pool[rng.randrange(len(self.pool))]
            if s in self.pool:
                self.pool.remove(s)
            s.rng = random.Random(s.seed + 7919 * len(s.topics))
            s.conv = torch.frombuffer(bytearray(s.conv), dtype=torch.int32).to(torch.long).view(1, -1)
            self.c["returns"] += 1
        else:
            if w.name == "iot":
                dev = rng.randrange(*IOT_DEVICES)
                n = self.device_serial[dev] = self.device_serial.get(dev, -1) + 1
                sid = f"{dev}-cmd-{n}"
            else:
                sid = f"{'case' if w.name == 'gov' else 'cart'}-{self.serial:05d}"
                self.serial += 1
            seed = zlib.crc32(f"{self.args.seed}/{sid}".encode())
            s = Sess(sid, seed, torch.empty(1, 0, dtype=torch.long),
                     lib.KVRecord(self.geo.num_layers, self.geo.token_bytes, self.rec_tokens), random.Random(seed),
                     topic=seed % TOPICS)
            self.c["sessions"] += 1
        s.left = rng.randint(*w.rounds)
        return s

    def _question(self, s: Sess) -> Any:
        """The next user turn: tokens of the session's current topic plus a few generic ones."""
        if s.forced is not None:
            q, s.forced = s.forced, None
            return q
        n = s.rng.randint(*self.w.question)
        span = self.vocab // TOPICS
        toks = [s.topic * span + s.rng.randrange(span) if s.rng.random() < 0.7
                else s.rng.randrange(self.vocab) for _ in range(n)]
        return self.torch.tensor([toks])

    def _plan_recall(self, s: Sess, c: Any) -> tuple[str, Any] | None:
        """Whether this turn recalls an old round: ("query", topic) or ("round", index)."""
        w, rng = self.w, s.rng
        old = [i for i, (_, b) in enumerate(c.rounds) if b <= c.attended_start]
        if not old or s.expect is not None:
            return None
        if w.name == "gov" and len(c.rounds) >= 4 and rng.random() < w.recall_p:
            return ("query", None) if rng.random() < 0.5 else ("round", rng.choice(old))
        if w.name == "ecommerce" and rng.random() < w.switch_p:
            back = sorted({s.topics[i] for i in old} - {s.topic})
            if back and rng.random() < 0.5:
                s.topic = rng.choice(back)
                return ("query", s.topic)
            s.topic = rng.randrange(TOPICS)
        return None

    def _cache(self, s: Sess) -> Any:
        c = self.router.cache(s.sid, self.model)
        if c is not s.cache:  # new, or resumed from storage (return visit, restart)
            if c.seen:
                self._check_resumed(c, s)
            lib.record_into(c, s.rec)
            s.cache = c
        return c

    def _serve(self, s: Sess) -> None:
        torch, ans = self.torch, self.w.answer
        try:
            c = self._cache(s)
            h0, m0, r0 = c.hits, c.misses, c.refills
            resumed = c.steps == 0 and c.seen > 0
            plan = self._plan_recall(s, c)
            ids = torch.cat([s.conv, self._question(s)], 1)
            if plan is not None:
                with torch.no_grad():  # the question first: its summary is the recall query
                    self.model(input_ids=ids[:, c.seen:-1], cache=c, use_cache=True)
                ws = c.attended_start
                got = (c.recall(query=c.current_summary(), k=1) if plan[0] == "query"
                       else c.recall(rounds=[plan[1]]))
                self._check_recall(c, s, got, ws)
                if plan[1] is not None and plan[0] == "query" and got:
                    self.c["recall_topic_checks"] += 1
                    self.c["recall_topic_ok"] += s.topics[got[0]] == plan[1]
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=c,
                                      max_new_tokens=ans, do_sample=False)
            c.end_round()
            if s.expect is not None:
                self.c["check_resume_gen"] += 1
                self.c["bad_resume_gen"] += out[0, -ans:].tolist() != s.expect
                s.expect = None
            s.conv = out
            s.topics.append(s.topic)
            s.left -= 1
            self._check_window(c, s)
        except (torch.OutOfMemoryError, MemoryError):
            log.exception("OOM serving %s", s.sid)
            self.c["oom"] += 1
            return self._drop(s)
        except Exception:
            log.exception("error serving %s", s.sid)
            self.c["errors"] += 1
            return self._drop(s)
        dh, dm = c.hits - h0, c.misses - m0
        self.c["interactions"] += 1
        self.c["steps"] += dh + dm
        self.c["hits"] += dh
        self.c["misses"] += dm
        self.c["recalls"] += plan is not None
        self.c["miss_refill"] += min(dm, c.refills - r0)
        self.c["miss_resume"] += min(dm, int(resumed))
        self.c["miss_recall"] += min(dm - min(dm, c.refills - r0) - int(resumed), int(plan is not None))
        if s.left <= 0:
            self.c["retired"] += 1  # during the day (closing time retires the rest)
            self._retire(s)

    def _drop(self, s: Sess) -> None:
        self.active.remove(s)
        self.router.release(s.sid, flush=False)

    def _retire(self, s: Sess) -> None:
        """The visit is over: the session leaves the device and its stored history is
        checked; for a later return visit only a digest of each layer is kept."""
        self.active.remove(s)
        if s.rec is None:  # a return visit that was never served: nothing changed
            return self._to_pool(s)
        self.router.release(s.sid)
        self._check_stored(s)
        s.digest = lib.digests([s.rec.layer(i) for i in range(self.geo.num_layers)])
        self._to_pool(s)

    def _to_pool(self, s: Sess) -> None:
        s.conv = s.conv.to(self.torch.int32).numpy().tobytes()  # small while it waits
        s.rec = s.rng = s.cache = None
        self.pool.append(s)

    # --- exactness ------------------------------------------------------------------------
    def _check_recall(self, c: Any, s: Sess, got: list[int], ws: int) -> None:
        ok = lib.recall_exact(c, s.rec, got, ws)
        if ok is not None:
            self._count("recall", ok, s.sid)

    def _check_window(self, c: Any, s: Sess) -> None:
        self._count("window", lib.window_exact(c, s.rec), s.sid)

    def _check_resumed(self, c: Any, s: Sess) -> None:
        """A resumed session: its whole stored history and its new window are exact."""
        if s.rec is None:  # a return visit: the history must match the digests taken at retirement
            data = self._stored(s.sid, c.seen)
            self._count("stored", lib.digests(data) == s.digest, s.sid)
            s.rec, s.digest = lib.KVRecord.of(data, self.geo.token_bytes), None
        else:  # a restart: compare with the live record
            self._check_stored(s)
        self._check_window(c, s)

    def _stored(self, sid: str, tokens: int) -> list[Any]:
        return lib.stored_layers(self.router.warm, sid, self.geo.num_layers, self.geo.token_bytes, tokens)

    def _check_stored(self, s: Sess) -> None:
        """Every stored byte of the session (warm and/or cold) equals what was produced."""
        if s.rec.tokens:
            data = self._stored(s.sid, s.rec.tokens)
            self._count("stored", all(np.array_equal(d, s.rec.layer(i)) for i, d in enumerate(data)), s.sid)

    def _count(self, what: str, ok: bool, sid: str) -> None:
        self.c[f"check_{what}"] += 1
        if not ok:
            self.c[f"bad_{what}"] += 1
            log.error("%s: %s bytes differ from what the model produced", sid, what)

    # --- restarts and drills --------------------------------------------------------------
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
            ref = TieredCache(self.model, max_kv_len=W, sink_tokens=s.cache.sink_tokens,
                              rope_rerotate=s.cache.rope_mode or False, rope_reach=s.cache.rope_reach)
            for lay, src in zip(ref.layers, s.cache.layers, strict=True):
                src.copy_to(lay)
            s.forced = self._question(s)
            ids = torch.cat([s.conv, s.forced], 1)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=ref,
                                      max_new_tokens=self.w.answer, do_sample=False)
            s.expect = out[0, -self.w.answer:].tolist()
        t = time.perf_counter()
        old = self.router
        old.close()
        wu = old.warm.usage()
        self.offs["moves"] += old.watermark_moves
        self.offs["migrations"] += wu["migrations"]
        self.offs["promotions"] += wu["promotions"]
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

    # --- sampling -------------------------------------------------------------------------
    def _sample(self, now: float) -> None:
        from kvfs.ops import metrics

        r, mk = self.router, self._mark
        wu = r.warm.usage()
        ev_sum, ev_n = metrics.histogram_totals(metrics.warm_evict_latency)
        mm = self._mount_metrics()
        st = lib.mount_stats(self.vol.mnt) if self.vol.use_mount else None
        cold_write = None
        if mm and "w_n" in mk and mm.get("kv_cold_write_ms_count", 0) > mk["w_n"]:
            cold_write = (mm["kv_cold_write_ms_sum"] - mk["w_sum"]) / (mm["kv_cold_write_ms_count"] - mk["w_n"])
        p50, p99 = self.cold_lat.quantiles(mk.get("reads", 0))
        steps = self.c["steps"] - mk.get("steps", 0)
        row = {
            "h": now / 3600, "active": len(self.active), "interactions": self.c["interactions"],
            "hit_rate": (self.c["hits"] - mk.get("hits", 0)) / steps if steps else None,
            "hot_ratio": r.hot_total / r.budget, "warm_ratio": wu["ratio"],
            "cold_used": st["usage"]["used"] if st else None,
            "evict_ms": (ev_sum - mk["ev_sum"]) / (ev_n - mk["ev_n"]) if "ev_n" in mk and ev_n > mk["ev_n"] else None,
            "cold_p50": p50, "cold_p99": p99, "engine_p99": mm.get("kv_cold_read_p99_ms") if mm else None,
            "moves": r.watermark_moves + self.offs["moves"],
            "migrations": wu["migrations"] + self.offs["migrations"],
            "promotions": wu["promotions"] + self.offs["promotions"],
            "alerts": self.c["alerts_in_drill"] + self.c["alerts_outside"],
            "rss": lib.rss_bytes(), "mount_rss": lib.rss_bytes(self.vol.pid) if self.vol.pid else None,
        }
        self.rows.append(row)
        mk.update(steps=self.c["steps"], hits=self.c["hits"], reads=len(self.cold_lat), ev_sum=ev_sum, ev_n=ev_n)
        if mm:
            mk.update(w_sum=mm.get("kv_cold_write_ms_sum", 0.0), w_n=mm.get("kv_cold_write_ms_count", 0.0))
        if now > 0:
            self._tick_alerts(cold_write)

    # --- figures --------------------------------------------------------------------------
    def _results(self) -> dict[str, Any]:
        c, rows, MiB = self.c, self.rows, 1 << 20
        m1 = self._mount_metrics()
        eng: dict[str, Any] = {}
        if m1:  # the day's reads inside the mount (kv_cold_read_ms); exact at the 1 ms bound
            b0 = lib.histogram_buckets(self.m0, "kv_cold_read_ms")
            d = {k: v - b0.get(k, 0.0) for k, v in lib.histogram_buckets(m1, "kv_cold_read_ms").items()}
            n = d.get(math.inf, 0.0)
            gauge = [r["engine_p99"] for r in rows if r["engine_p99"]]
            eng = {"reads": n, "p50": lib.histogram_quantile(0.5, d), "p99": lib.histogram_quantile(0.99, d),
                   "within_1ms": d.get(1.0, 0.0) / n if n else None,
                   "gauge_end": m1.get("kv_cold_read_p99_ms"), "gauge_max": max(gauge, default=None)}
        ev: dict[str, Any] = dict.fromkeys(("n", "mean", "p99"))
        evb, ev_sum, ev_n = lib.local_histogram("warm_evict_latency")
        d = {k: v - self.ev0[0].get(k, 0.0) for k, v in evb.items()}
        n = ev_n - self.ev0[2]
        if n:
            ev = {"n": int(n), "mean": (ev_sum - self.ev0[1]) / n, "p99": lib.histogram_quantile(0.99, d)}
        base = rows[max(1, len(rows) // 10)]  # after the first ~2.4 simulated hours (warm-up)
        later = [r["rss"] for r in rows if r["h"] >= base["h"] and r["rss"]]
        rss = {"start": base["rss"], "end": rows[-1]["rss"], "max": max(later),
               "first": rows[0]["rss"], "at_h": base["h"]}
        rss["growth"] = rss["max"] - rss["start"]
        rss["flat"] = rss["growth"] <= max(0.05 * rss["start"], 16 * MiB)
        mrss = [r["mount_rss"] for r in rows if r["mount_rss"]]
        p50, p99 = self.cold_lat.quantiles()
        steps = c["steps"]
        res: dict[str, Any] = {
            "profile": self.w.name, "minutes": self.args.minutes, "speed": self.clock.speed,
            "real_s": time.perf_counter() - self.clock.t0, "peak_sessions": self.peak,
            "budget_bytes": self.budget, "warm_cap": self.w.warm_cap, "counts": c,
            "hit_rate": c["hits"] / steps if steps else None,
            "cold_reads": len(self.cold_lat), "cold_read_p50_ms": p50, "cold_read_p99_ms": p99,
            "engine_cold_read": eng, "warm_evict": ev,
            "hot_peak": max(r["hot_ratio"] for r in rows), "warm_peak": max(r["warm_ratio"] for r in rows),
            "cold_used_end": rows[-1]["cold_used"],
            "moves": rows[-1]["moves"], "migrations": rows[-1]["migrations"],
            "promotions": rows[-1]["promotions"], "rss": rss,
            "mount_rss": {"start": mrss[0], "end": mrss[-1], "max": max(mrss)} if mrss else None,
            "mismatches": sum(c[k] for k in ("bad_recall", "bad_window", "bad_stored", "bad_resume_gen")),
            "events": self.drill_log + [f"{rule} fired {len(hs)} times outside the drills ({hs[0]:05.2f} h to "
                                        f"{hs[-1]:05.2f} h)" for rule, hs in self.outside.items()],
            "drills": self.drills, "rows": rows,
        }
        res["goals"] = [
            ("OOMs", c["oom"] == 0), ("errors", c["errors"] == 0),
            ("byte mismatches", res["mismatches"] == 0),
            ("resumed sessions continue identically", c["check_resume_gen"] > 0 and c["bad_resume_gen"] == 0),
            ("hot hit rate >= 95 %", res["hit_rate"] is not None and res["hit_rate"] >= 0.95),
            ("cold read p99 < 1 ms", eng["within_1ms"] >= 0.99 if eng.get("within_1ms") is not None
             else p99 is not None and p99 < 1.0),
            ("flat RSS", rss["flat"]),
        ]
        return res


# --------------------------------------------------------------------------- main
def run_profile(name: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import os
    import platform

    import torch

    from kvfs.ops import profiles

    w, prof = WORKLOADS[name], profiles.load(name)
    use_mount = not args.no_mount
    if use_mount and not (avail := lib.mount_available())[0]:
        print(f"NOTE: cannot mount ({avail[1]}); using a plain directory as the cold tier")
        use_mount = False
    base = Path(tempfile.mkdtemp(prefix=f"kvfs-day-{name}-"))
    warm = lib.warm_dir(base, prefix=f"kvfs-day-{name}-warm-")
    ckpt = max(0.05, prof.checkpoint_interval_s * args.minutes * 60 / DAY_S)
    opts = ["--profile", name, "-o", f"checkpoint_interval_s={ckpt:.3f}"]
    print(f"[{name}] a simulated day in {args.minutes:g} min ...", flush=True)
    try:
        with lib.Volume(base, use_mount, size=args.volume_size, options=opts,
                        say=print if args.verbose else None) as vol:
            day = Day(w, args, vol, warm)
            res = day.run()
        g = day.geo
        res["geo"] = (f"tiny random Llama ({g.num_layers} layers × {g.num_kv_heads} KV heads × {g.head_dim}, fp32, "
                      f"{g.session_token_bytes} KV bytes per token)")
        res["story"], res["budget_windows"] = w.story, w.budget_windows
        res["cold"] = (f"a {args.volume_size} volume mounted with `mount.py --profile {name}` (index checkpoint "
                       f"every {ckpt:.2f} s real = {prof.checkpoint_interval_s:g} s simulated)"
                       if use_mount else "a plain directory (--no-mount)")
        if use_mount and vol.returncode != 0:
            res["goals"].append(("clean unmount", False))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(warm, ignore_errors=True)
    res["ok"] = all(ok for _, ok in res["goals"])
    res["cpus"] = os.cpu_count()
    res["notes"] = lib.day_notes(res, prof)
    res["date"] = time.strftime("%Y-%m-%d")
    res["host"] = (f"{os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}, "
                   f"torch {torch.__version__}")
    out = Path(args.out)
    img = out / "img" / f"agent-day-{name}.png"
    lib.plot_day(res["rows"], img, f"kvfs agent day: {name}", drills=res["drills"], restarts_h=RESTARTS_H,
                 device_line=prof.device_watermark, warm_line=prof.warm_migrate_at)
    page = out / "agent-day.md"
    lib.write_sections(page, list(WORKLOADS), "agent-day", name, lib.day_section(res, prof, argv, f"img/{img.name}"),
                       default_head=DEFAULT_HEAD)
    for fig, value, goal, ok in lib.day_figures(res, prof):
        print(f"  {fig}: {value}" + {"": "", "yes": "  [met]", "**NO**": f"  [MISSED: {goal}]"}.get(ok, f"  [{ok}]"))
    for note in res["notes"]:
        print(f"  NOTE: {note}")
    print(f"[{name}] {'every goal met' if res['ok'] else 'GOALS MISSED'}; wrote {page} and {img}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, choices=[*WORKLOADS, "all"])
    p.add_argument("--minutes", type=float, default=3.0, help="real minutes for the simulated day")
    p.add_argument("--sessions", type=int, help="concurrent sessions at the busiest hour")
    p.add_argument("--out", default=str(ROOT / "docs"), help="where agent-day.md and img/ go")
    p.add_argument("--no-mount", action="store_true", help="cold tier in a plain directory")
    p.add_argument("--volume-size", default="1G")
    p.add_argument("--json", help="also write the figures (without the time series) here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.minutes <= 0 or (args.sessions is not None and args.sessions < 1):
        p.error("--minutes and --sessions must be > 0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    names = list(WORKLOADS) if args.profile == "all" else [args.profile]
    results = {n: run_profile(n, args, argv) for n in names}
    if args.json:
        slim = {n: {k: v for k, v in r.items() if k != "rows"} for n, r in results.items()}
        Path(args.json).write_text(json.dumps(slim, indent=2, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
