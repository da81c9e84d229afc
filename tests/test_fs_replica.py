"""kvfs.fuse.replica's Replicator against a stand-in tier: the order of a lease's release
and the next writer's hold."""

from __future__ import annotations

import threading

from kvfs.fuse.replica import Replicator


def test_a_new_writer_waits_for_the_lease_release_in_flight() -> None:
    """The last writer closed and the replicator is giving the lease back when a new
    writer opens: ``hold`` returns only once that release is done, so the new writer's
    acquire comes after it (not before, which would leave it writing without a lease)."""
    calls: list[str] = []
    in_release, finish = threading.Event(), threading.Event()

    class Tier:
        def release(self, session: str) -> None:
            calls.append("release")
            in_release.set()
            finish.wait(10)
            calls.append("released")

        def __getattr__(self, name: str):  # anything else the thread may call: a no-op
            return lambda *a, **kw: None

    r = Replicator(Tier(), store=None, engine_lock=None, queue_max=1 << 20)
    try:
        r.release_when_done("s")
        assert in_release.wait(10)
        held = threading.Event()
        t = threading.Thread(target=lambda: (r.hold("s"), calls.append("held"), held.set()))
        t.start()
        assert not held.wait(0.3)  # the release is still in flight
        finish.set()
        assert held.wait(10)
        t.join(10)
        assert calls == ["release", "released", "held"]
    finally:
        finish.set()
        r.close()
