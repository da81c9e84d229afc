"""kvfs.shared: a tier shared by every host, in a Redis Cluster.

Each host keeps its own hot, warm and cold tiers; this tier holds recent sessions' files
and meta.json in a Redis Cluster so that any host can continue a session another host
served. ``SharedTier`` is the API (synchronous, thread-safe, every call bounded by a
timeout, every value sealed with the cluster's secret); ``kvfs.shared.local_cluster.Cluster``
starts a real local cluster for tests and benchmarks. Never imports pyfuse3, trio or torch; of kvfs it uses only the engine's
exception types. Design and guarantees: docs/scale-out.md.
"""

from .chunks import Owner, SessionInfo, check_name
from .client import ClusterURL, TLSFiles, parse_urls
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
from .seal import read_secret
from .tier import SharedTier

__all__ = ["BadName", "BadRange", "ClusterURL", "LeaseLost", "NotAppend", "NotFoundShared",
           "Owner", "SessionBusy", "SessionInfo", "SharedCorrupt", "SharedError", "SharedLost",
           "SharedTier", "SharedUnavailable", "TLSFiles", "check_name", "parse_urls",
           "read_secret"]
