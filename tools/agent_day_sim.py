"""The day loop of ``tools/agent_day.py``: a simulated clock and :class:`Day`, which opens the
tiers and serves the traffic (turns, recalls, return visits) with the byte-exact checks against
what each session's model produced. Restarts and drills are in ``agent_day_events.py``, the
samples and figures in ``agent_day_samples.py``.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

import agent_exact as exact
import agentlib as lib
import numpy as np
from agent_day_events import DayEvents
from agent_day_samples import DaySamples
from agent_day_workloads import (
    DAY_S,
    DRILLS_H,
    IOT_DEVICES,
    RESTARTS_H,
    SAMPLE_S,
    TOPICS,
    Sess,
    Workload,
    load_at,
)

log = logging.getLogger("kvfs.agent_day")

MODEL_SEED = 7
#: KV bytes per token of SmolLM2-135M in fp32 (30 layers x 3 KV heads x 64 x K and V x 4 B),
#: the model the profiles' retrieval budgets are sized for
SMOLLM2_TOKEN_BYTES = 30 * 3 * 64 * 2 * 4


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


class Day(DayEvents, DaySamples):
    """One profile's day over a cold root (a mount or a directory) and a warm root (restarts
    and drills: ``DayEvents``; samples and figures: ``DaySamples``)."""

    def __init__(self, w: Workload, args: argparse.Namespace, vol: lib.Volume, warm_root: Path) -> None:
        import torch

        from kvfs.ops import alerts, profiles
        from kvfs.torch import geometry
        from kvfs.torch.reference import tiny_llama

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
        # the profile's retrieval budget is sized in bytes for SmolLM2 (blocks of KV per layer);
        # the tiny model gets the same blocks, in tokens, as the window keeps its tokens
        stb = self.geo.session_token_bytes
        self.retrieval_bytes = self.prof.retrieval_bytes * stb // SMOLLM2_TOKEN_BYTES
        self.retrieval_tokens = self.retrieval_bytes // stb if self.prof.retrieval else 0
        held = W + self.prof.sink_tokens + 1  # what one session keeps on the device at a step
        self.budget = int(w.budget_windows * self.peak * (held + self.retrieval_tokens) * stb)
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
        self.cold_kind = "files"  # how the agent reaches the cold tier (the warm tier's choice)
        self.rows: list[dict[str, Any]] = []
        self.drill: str | None = None
        self.drill_start = self.drill_end = self.drill_peak = 0.0
        self.drill_fired = False
        self.drills: list[tuple[str, float, float]] = []  # (kind, start h, end h)
        self.drill_log: list[str] = []
        self.outside: dict[str, list[float]] = {}  # alerts outside the drills: rule -> hours
        self._mark: dict[str, Any] = {}
        self.offs = {"moves": 0, "migrations": 0, "promotions": 0}  # routers closed by restarts
        self.trims = {"trims": 0, "ms": 0.0, "max_ms": 0.0, "returned": 0}  # the routers' heap trims
        self.m0 = self._mount_metrics() or {}
        self.ev0 = lib.local_histogram("warm_evict_latency")

    # --- the tiers ------------------------------------------------------------------------
    def _open_router(self) -> Any:
        from kvfs.torch import KVRouter

        r = KVRouter(mount=str(self.vol.mnt), device="cpu", profile=self.prof, warm_root=str(self.warm_root),
                     device_budget_bytes=self.budget, retrieval_bytes=self.retrieval_bytes,
                     warm_options={"cap_bytes": self.w.warm_cap, "clock": self.clock.wall})
        cold = r.warm.cold
        if cold is not None:  # time every cold read the agent makes (one call: one read)
            self.cold_kind = cold.kind
            cold.read_ranges = self._timed(cold.read_ranges)  # every cold read is one call
        return r

    def _timed(self, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> None:
            t = time.perf_counter()
            fn(*a, **kw)
            self.cold_lat.add((time.perf_counter() - t) * 1e3)

        return timed

    def _migrate_hot(self) -> None:
        """Alert action: the router's watermark move, down to the profile's watermark."""
        r = self.router
        saved, r.watermark = r.watermark, self.prof.device_watermark
        try:
            r.hot_budget.move_out(0)  # the router's own watermark move
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
        self._add_heap(self.router)
        return self._results()

    def _add_heap(self, r: Any) -> None:
        """Count a closed router's heap trims (``KVRouter.heap``) in the day's."""
        h, t = r.heap, self.trims
        t["trims"] += h.trims
        t["ms"] += h.trim_s * 1e3
        t["max_ms"] = max(t["max_ms"], h.max_trim_s * 1e3)
        t["returned"] += h.returned_bytes

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
                     exact.KVRecord(self.geo.num_layers, self.geo.token_bytes, self.rec_tokens), random.Random(seed),
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
            exact.record_into(c, s.rec)
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
        s.digest = exact.digests([s.rec.layer(i) for i in range(self.geo.num_layers)])
        self._to_pool(s)

    def _to_pool(self, s: Sess) -> None:
        s.conv = s.conv.to(self.torch.int32).numpy().tobytes()  # small while it waits
        s.rec = s.rng = s.cache = None
        self.pool.append(s)

    # --- exactness ------------------------------------------------------------------------
    def _check_recall(self, c: Any, s: Sess, got: list[int], ws: int) -> None:
        ok = exact.recall_exact(c, s.rec, got, ws)
        if ok is not None:
            self._count("recall", ok, s.sid)

    def _check_window(self, c: Any, s: Sess) -> None:
        self._count("window", exact.window_exact(c, s.rec), s.sid)

    def _check_resumed(self, c: Any, s: Sess) -> None:
        """A resumed session: its whole stored history and its new window are exact."""
        if s.rec is None:  # a return visit: the history must match the digests taken at retirement
            data = self._stored(s.sid, c.seen)
            self._count("stored", exact.digests(data) == s.digest, s.sid)
            s.rec, s.digest = exact.KVRecord.of(data, self.geo.token_bytes), None
        else:  # a restart: compare with the live record
            self._check_stored(s)
        self._check_window(c, s)

    def _stored(self, sid: str, tokens: int) -> list[Any]:
        return exact.stored_layers(self.router.warm, sid, self.geo.num_layers, self.geo.token_bytes, tokens)

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
