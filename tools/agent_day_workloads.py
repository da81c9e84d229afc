"""The traffic of an agent day (``tools/agent_day.py``): each profile's workload, its load
curve, the schedule of the simulated day, and one conversation as the generator sees it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from agent_exact import KVRecord

DAY_S = 86400.0
SAMPLE_S = 600.0  # simulated seconds between two samples of the time series
RESTARTS_H = (9.5, 17.5)  # simulated hours of the two restarts
DRILLS_H = {"device": (10.0, 2.0), "warm": (14.0, 4.0)}  # start hour, longest hours


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
    rec: KVRecord | None
    rng: random.Random | None
    topic: int
    digest: list[bytes] | None = None
    topics: list[int] = field(default_factory=list)  # topic of each closed round
    left: int = 0  # turns left in this visit
    cache: Any = None  # the TieredCache object whose layers feed ``rec``
    forced: Any = None  # next question, fixed by a restart check
    expect: list[int] | None = None  # answer a copy that never stopped gave to ``forced``
