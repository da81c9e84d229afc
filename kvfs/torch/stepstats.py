"""A session's step counters: steps, hot hits and misses, published to the process metrics.

A step that had to read from the warm/cold tier first (refill, a fresh recall, the first
step after resume, a retrieval fetch it waited for) is a hot miss; every other step is a
hot hit. Hits reach the process-wide counter in batches (a counter update costs as much as
a layer's cache work at decode).
"""

from __future__ import annotations

from kvfs.ops import metrics


class StepStats:
    """Steps, hits and misses of one session (module docstring)."""

    #: hot hits are added to the process-wide counter every this many steps, at round ends
    #: and at stats
    PUBLISH_HITS_EVERY = 64

    def __init__(self) -> None:
        self.steps = 0
        self.hits = 0
        self.misses = 0
        self._unpublished = 0  # hot hits not yet added to the process-wide counter
        self._pending = False  # the next step has to read from below first
        self._miss = False  # the running step read from below first

    def miss_next(self) -> None:
        """The next step runs on bytes read from below (refill, recall, resume)."""
        self._pending = True

    def begin(self) -> None:
        self.steps += 1
        self._miss, self._pending = self._pending, False

    def waited(self) -> None:
        """The running step waited for a read from below."""
        self._miss = True

    def end(self) -> None:
        if self._miss:
            self._miss = False
            self.misses += 1
            metrics.hot_misses.inc()
        else:
            self.hits += 1
            self._unpublished += 1
            if self._unpublished >= self.PUBLISH_HITS_EVERY:
                self.publish()

    def publish(self) -> None:
        if self._unpublished:
            metrics.hot_hits.inc(self._unpublished)
            self._unpublished = 0
