"""Session leases: which node may write a session in the cluster.

A lease is ``kvfs:{<session>}:lease = <node id>`` with a TTL of ``lease_ms``. ``Leases``
keeps the set this node holds and renews them from one daemon thread every third of the
lease; a renew that finds another owner drops the lease from the set (the session's next
append then fails with ``LeaseLost``). The append script checks the owner itself, so a node
whose lease ran out (a long pause, a partition) can never write, whatever this set says.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .errors import LeaseLost, SharedUnavailable

log = logging.getLogger(__name__)


class Leases:
    """The leases held by one node and the thread that renews them."""

    def __init__(self, renew: Callable[[str], None], lease_ms: int, auto_renew: bool = True) -> None:
        self._renew = renew
        self.interval_s = lease_ms / 3000.0
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.auto_renew = auto_renew
        self.lost = 0

    def add(self, session: str) -> None:
        with self._lock:
            self._held.add(session)
            if self.auto_renew and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvfs-shared-lease",
                                                daemon=True)
                self._thread.start()

    def discard(self, session: str) -> None:
        with self._lock:
            self._held.discard(session)

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def __contains__(self, session: str) -> bool:
        with self._lock:
            return session in self._held

    def renew_all(self) -> None:
        """One round of renewals (the thread's body; callable directly)."""
        for s in self.held():
            try:
                self._renew(s)
            except LeaseLost as e:
                self.discard(s)
                self.lost += 1
                log.warning("lease lost: %s", e)
            except SharedUnavailable as e:
                # the cluster is away: the lease may run out; the append script decides
                log.debug("lease renew of %s failed: %s", s, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.renew_all()

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout=max(5.0, self.interval_s * 2))
