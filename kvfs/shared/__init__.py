"""kvfs.shared: a tier shared by every host, in a Redis Cluster.

Each host keeps its own hot, warm and cold tiers; this tier holds recent sessions' files
and meta.json in a Redis Cluster so that any host can continue a session another host
served. ``SharedTier`` is the API (synchronous, thread-safe, every call bounded by a
timeout); ``kvfs.shared.testing.Cluster`` starts a real local cluster for tests and
benchmarks. Never imports pyfuse3, trio or torch; of kvfs it uses only the engine's
exception types. Design and guarantees: docs/scale-out.md.
"""

from .client import parse_urls
from .errors import (
                     BadName,
                     BadRange,
                     LeaseLost,
                     NotAppend,
                     NotFoundShared,
                     SessionBusy,
                     SharedCorrupt,
                     SharedError,
                     SharedLost,
                     SharedUnavailable,
)
from .tier import SharedTier

__all__ = ["BadName", "BadRange", "LeaseLost", "NotAppend", "NotFoundShared", "SessionBusy",
           "SharedCorrupt", "SharedError", "SharedLost", "SharedTier", "SharedUnavailable",
           "parse_urls"]
