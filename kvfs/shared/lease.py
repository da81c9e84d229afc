"""Session leases: which node may write a session in the cluster.

A lease is ``kvfs:{<session>}:lease = <sealed lease value>`` (``seal.Sealer.lease``: the
node id, the lease time and a MAC) with a TTL of ``lease_ms``. ``Leases`` takes, renews and
gives back this node's leases, keeps the set it holds and renews them from one daemon
thread every third of the lease. A renew that finds another owner drops the lease from the
set and remembers the session as ``taken`` (until this node acquires it again); the
writing scripts check the owner themselves, so a node whose lease ran out (a long pause, a
partition) can never write, whatever this set says.

A lease value that was not sealed by a node of this cluster, or that has more time to live
than the lease it names (a genuine value replayed with a long life), is reported
(``forged_leases``) and replaced with a compare-and-set script, never obeyed. Takeovers of a
dead node's expired lease are counted and logged with the previous node's id.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .chunks import SessionKeys
from .client import ClusterClient
from .errors import LeaseLost, SessionBusy, SharedUnavailable
from .scripts import ACQUIRE, RELEASE, RENEW, SEIZE, status, text
from .seal import Sealer, SealError
from .stats import Stats

log = logging.getLogger(__name__)
REPLAY_MARGIN_MS = 1000  # a lease may live this much longer than it says (clock steps)


class Leases:
    """The leases of one node (see the module docstring)."""

    def __init__(self, client: ClusterClient, sealer: Sealer, node_id: str, lease_ms: int,
                 retention_ms: int, stats: Stats, auto_renew: bool = True) -> None:
        self._c, self._sealer, self.node_id = client, sealer, node_id
        self.lease_ms, self.retention_ms, self._stats = lease_ms, retention_ms, stats
        self.interval_s = lease_ms / 3000.0
        self._held: set[str] = set()
        self._taken: set[str] = set()  # sessions whose lease another node took from this one
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.auto_renew = auto_renew

    # -- values --------------------------------------------------------------------------
    def value(self, session: str) -> str:
        """This node's lease value for ``session`` (what the scripts compare)."""
        return self._sealer.lease(session, self.node_id, self.lease_ms)

    def _holder(self, session: str, value: Any, pttl: int | None = None) -> str | None:
        """The node named by a lease value found in the cluster; None when the value was not
        set by a node of this cluster (no seal, or a time to live beyond the lease it names),
        or is this node's own from an earlier mount with other settings: either may be
        replaced (``_seize``)."""
        try:
            node, ms = self._sealer.check_lease(session, text(value))
        except SealError as e:
            self._stats.add("forged_leases")
            log.error("session %s: the lease in the shared tier was not set by a kvfs node "
                      "(%s); replacing it", session, e)
            return None
        if pttl is not None and pttl > ms + REPLAY_MARGIN_MS:
            self._stats.add("forged_leases")
            log.error("session %s: the lease of node %r has %d ms to live, more than its own "
                      "%d ms: a replayed value, replacing it", session, node, pttl, ms)
            return None
        return None if node == self.node_id else node

    def _eval(self, k: SessionKeys, what: str, script: str, keys: list[str], args: list[Any]) -> Any:
        return self._c.eval(f"{what} {k.session}", script, keys, args)

    def _seize(self, k: SessionKeys, seen: Any) -> bool:
        """Replace the lease value ``seen`` by this node's, unless it changed meanwhile."""
        res = self._eval(k, "seize", SEIZE, [k.lease, k.holder],
                         [seen, self.value(k.session), self.lease_ms, self.retention_ms])
        if int(res):
            self._add(k.session)
            return True
        return False

    # -- the calls -----------------------------------------------------------------------
    def acquire(self, k: SessionKeys, wait_s: float = 0.0) -> bool:
        """Take the lease: True when newly taken, False when held already (renewed);
        ``SessionBusy`` naming the owner if another node still holds it after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            res = self._eval(k, "acquire", ACQUIRE, [k.lease, k.holder],
                             [self.value(k.session), self.lease_ms, self.retention_ms])
            st = status(res)
            if st != "BUSY":
                self._add(k.session)
                if st == "TAKEOVER":
                    self._stats.add("lease_takeovers")
                    log.warning("session %s: took over the lease of node %r (it expired: that "
                                "node stopped renewing it)", k.session,
                                text(res[1]).partition("|")[0])
                return st != "RENEWED"
            owner, seized = self.contend(k, res[1], int(res[2]))
            if seized:
                return True
            if owner is None:
                continue  # it changed meanwhile: look again
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionBusy(k.session, owner, int(res[2]))
            time.sleep(min(left, 0.05, max(int(res[2]), 1) / 1000))

    def contend(self, k: SessionKeys, value: Any, pttl: int | None) -> tuple[str | None, bool]:
        """A lease value stood in this node's way: (the node holding it, False), or (None,
        True) once a value no node of this cluster set (or this node's own older one) was
        replaced by this node's, or (None, False) when it changed meanwhile."""
        owner = self._holder(k.session, value, pttl)
        if owner is not None:
            return owner, False
        return None, self._seize(k, value)

    def owner(self, k: SessionKeys) -> str | None:
        """The node that holds the lease now (None: nobody, or a value no node set)."""
        value, pttl = self._c.on_master(k.lease, f"lease_owner {k.session}",
                                        [("GET", k.lease), ("PTTL", k.lease)], transaction=True)
        if value is None:
            return None
        try:
            node, ms = self._sealer.check_lease(k.session, text(value))
        except SealError:
            return None
        return node if int(pttl) <= ms + REPLAY_MARGIN_MS else None

    def renew(self, k: SessionKeys) -> None:
        """Extend this node's lease; ``LeaseLost`` if another node holds it now (a value no
        node set is replaced instead)."""
        res = self._eval(k, "renew", RENEW, [k.lease, k.holder], [self.value(k.session), self.lease_ms])
        if status(res) == "LOST":
            err = self.refused(k, res)
            if err is not None:
                raise err

    def refused(self, k: SessionKeys, res: list[Any]) -> LeaseLost | None:
        """A script found another lease value: ``LeaseLost`` (the session is ``taken``), or
        None when the value was no node's and is now replaced by ours (try again)."""
        if res[1] and self.contend(k, res[1], None)[1]:
            return None
        with self._lock:
            self._held.discard(k.session)
            self._taken.add(k.session)
        self._stats.add("lease_lost")
        return LeaseLost(k.session, text(res[1]).partition("|")[0] or None)

    def release(self, k: SessionKeys, chunk_bytes: int) -> bool:
        """Give the lease up (a clean hand-over: the next owner's acquire is no takeover);
        the last partial chunk of each file is trimmed to an exact allocation."""
        self.discard(k.session)
        return bool(self._eval(k, "release", RELEASE, [k.lease, k.holder, k.files],
                               [self.value(k.session), chunk_bytes, k.prefix]))

    def taken(self, session: str) -> bool:
        """Another node took this node's lease of ``session`` (seen by a renewal or a
        write), and this node has not acquired it again since."""
        with self._lock:
            return session in self._taken

    # -- the set held and its renewals -----------------------------------------------------
    def _add(self, session: str) -> None:
        with self._lock:
            self._held.add(session)
            self._taken.discard(session)
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
                self.renew(SessionKeys(s))
            except LeaseLost as e:
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
