"""Whether the cold tier takes the warm tier's writes, and when to try again if not.

A cold tier that refuses (full, I/O errors, a session directory that is not ours) is not
retried on every append: after a failure the tier backs off (``retry_s``, doubling up to
``retry_max_s``), counts kv_warm_migration_failures and logs one line per back-off
period; the first success after it logs that it works again. Write-behind passes and
group migrations share one ``ColdHealth``.

Each failing session's reason is kept apart (``failing``): a write of one session that the
full tier refuses quotes its own session's error, or names the sessions the cold tier
refuses without their messages, never another session's error as if it were its own.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from kvfs.ops import metrics

log = logging.getLogger("kvfs.warm")

# errors of the volume, not of a session: the same for every writer
_VOLUME_WIDE = tuple(os.strerror(e) for e in (errno.ENOSPC, errno.EROFS, errno.EIO))


class ColdHealth:
    def __init__(self, retry_s: float, retry_max_s: float) -> None:
        self.retry_s, self.retry_max_s = float(retry_s), float(retry_max_s)
        self.backoff = 0.0  # current retry interval after failures; 0: healthy
        self.retry_at = 0.0  # time.monotonic() before which no background try is made
        self.error: str | None = None  # why the last try failed (operators: stats, logs)
        self.failing: dict[str, str] = {}  # session -> why the cold tier refused its bytes

    def due(self) -> bool:
        return time.monotonic() >= self.retry_at

    def wait_s(self) -> float:
        return max(0.0, self.retry_at - time.monotonic())

    def reason(self, sid: str | None) -> str:
        """Why a write of ``sid`` meets a cold tier that refuses: its own session's error
        when it is one of those refused, else the refused sessions by name only."""
        if sid is not None and sid in self.failing:
            return f"{sid!r}: {self.failing[sid]}"
        names = sorted(self.failing)
        if not names:
            return "the cold tier refused the last try"
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        # a fault of the whole volume is everyone's and is said; anything else is private
        common = [t for t in _VOLUME_WIDE if all(t in why for why in self.failing.values())]
        return (f"the cold tier refuses other sessions' bytes ({shown})"
                + (f": {common[0]}" if common else ""))

    def failed(self, errors: list[tuple[str, str]], where: str, warm_ratio: float) -> None:
        """Start a back-off period: one metric increment and one log line per period.
        ``errors`` holds (session, why) for each session the cold tier refused."""
        self.failing = dict(errors)
        first = f"{errors[0][0]!r}: {errors[0][1]}"
        reason = first + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
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
        self.failing = {}
