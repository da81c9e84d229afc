"""A full warm tier whose cold tier refuses one session's bytes: a write of another
session is refused with that fact, never with the failing session's own error as if it
were the writer's; the failing session's own write quotes its error."""

from __future__ import annotations

import errno
import itertools

import pytest
from conftest import blob

from kvfs.warm import WarmError, WarmTier
from kvfs.warm.coldfiles import ColdStore
from kvfs.warm.health import ColdHealth


def test_reason_names_the_writers_own_error_or_only_the_refused_sessions():
    h = ColdHealth(1.0, 8.0)
    assert "refused the last try" in h.reason("b")
    h.failed([("a", "quota: the secret 4711 is over")], "/cold", 0.9)
    assert h.reason("a") == "'a': quota: the secret 4711 is over"
    other = h.reason("b")
    assert "'a'" in other and "4711" not in other and "quota" not in other
    assert "4711" in (h.error or "")  # operators still see it (stats, the log line)
    h.ok("writing to", "/cold")
    assert h.failing == {} and h.error is None


def test_a_refused_write_quotes_only_its_own_sessions_cold_error(dirs, monkeypatch):
    cold, root = dirs
    clock = itertools.count(1000)
    real_append = ColdStore.append
    secret = "Disk quota exceeded for chat-A's owner (uid 4711)"

    def append(self, sid, name, *a, **kw):
        if sid == "chat-A":
            raise OSError(errno.EDQUOT, secret)
        return real_append(self, sid, name, *a, **kw)

    monkeypatch.setattr(ColdStore, "append", append)
    w = WarmTier(cold, root, cap_bytes=120_000, migrate_at=0.5, group=1, shards=4,
                 clock=lambda: float(next(clock)), writebehind=False)
    try:
        for r in range(5):  # chat-A, the least recently used, fills the tier
            w.append("chat-A", 0, blob(r, 20_000))
        refused_b = refused_a = None
        for r in range(10):  # chat-B's writes meet a full tier whose cold tier refuses chat-A
            try:
                w.append("chat-B", 0, blob(100 + r, 20_000))
            except WarmError as e:
                refused_b = e
                break
        assert refused_b is not None, "the tier never filled"
        assert "4711" not in str(refused_b) and "quota" not in str(refused_b), refused_b
        assert "'chat-A'" in str(refused_b) and "full" in str(refused_b)
        with pytest.raises(WarmError) as own:
            w.append("chat-A", 0, blob(200, 20_000))
        refused_a = own.value
        assert "4711" in str(refused_a), refused_a  # its own call tells it why
    finally:
        w.close()


def test_a_full_volume_is_said_to_every_writer():
    h = ColdHealth(1.0, 8.0)
    h.failed([("a", "a/layer_0: No space left on device"), ("b", "b/layer_0: No space left on device")],
             "/cold", 0.9)
    assert h.reason("c").endswith(": No space left on device") and "a/layer_0" not in h.reason("c")
