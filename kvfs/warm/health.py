"""Whether the cold tier takes the warm tier's writes, and when to try again if not.

A cold tier that refuses (full, I/O errors, a session directory that is not ours) is not
retried on every append: after a failure the tier backs off (``retry_s``, doubling up to
``retry_max_s``), counts kv_warm_migration_failures and logs one line per back-off
period; the first success after it logs that it works again. Write-behind passes and
group migrations share one ``ColdHealth``.
"""

from __future__ import annotations

import logging
import time

from kvfs.ops import metrics

log = logging.getLogger("kvfs.warm")


class ColdHealth:
    def __init__(self, retry_s: float, retry_max_s: float) -> None:
        self.retry_s, self.retry_max_s = float(retry_s), float(retry_max_s)
        self.backoff = 0.0  # current retry interval after failures; 0: healthy
        self.retry_at = 0.0  # time.monotonic() before which no background try is made
        self.error: str | None = None  # why the last try failed

    def due(self) -> bool:
        return time.monotonic() >= self.retry_at

    def wait_s(self) -> float:
        return max(0.0, self.retry_at - time.monotonic())

    def failed(self, errors: list[str], where: str, warm_ratio: float) -> None:
        """Start a back-off period: one metric increment and one log line per period."""
        reason = errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
        self.backoff = min(self.retry_max_s, 2 * self.backoff) if self.backoff else self.retry_s
        self.retry_at = time.monotonic() + self.backoff
        self.error = reason
        metrics.warm_migration_failures.inc()
        log.error("writing %d session(s) to cold tier %s failed: %s; they stay in warm, "
                  "next try in %.1f s (warm at %.0f%% of its cap)", len(errors), where,
                  reason, self.backoff, 100 * warm_ratio)

    def ok(self, what: str, where: str) -> None:
        if self.error is not None:
            log.info("%s cold tier %s works again", what, where)
        self.backoff, self.error = 0.0, None
