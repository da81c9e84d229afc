"""Model-based test: random operations on a Store checked against a dict, with reopen,
crash-reopen and power cuts, on a ring small enough to wrap several times."""

from __future__ import annotations

import os
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfs.engine.errors import NoSpace, NotAppend
from kvfs.engine.faults import FaultyVolume, PowerCut
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

SESSIONS = ["a", "b", "c", "dd"]
FILES = ["layer_0", "layer_1", "meta.json"]
CFG = StoreConfig(write_buffer=64 << 10, hot_sessions=2)  # small: evictions and reloads happen


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvfs-model-")
        self.path = os.path.join(self.dir, "v.kvvol")
        self.store = Store.create(self.path, 8 << 20, CFG, volume=FaultyVolume)
        self.model: dict[str, dict[str, bytes]] = {}  # what reads must return
        self.synced: dict[str, dict[str, bytes]] = {}  # what must survive a crash
        self.hist: dict[tuple[str, str], list[bytes]] = {}  # states of each file since the sync
        self.shrunk: set[tuple[str, str]] = set()  # truncated or deleted since the sync
        self.total_written = 0

    def teardown(self) -> None:
        try:
            self.store.close()
        except Exception:
            pass
        for f in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, f))
        os.rmdir(self.dir)

    def _copy(self) -> dict[str, dict[str, bytes]]:
        return {s: dict(fs) for s, fs in self.model.items()}

    def _record(self, n: str, f: str, shrunk: bool = False) -> None:
        self.hist.setdefault((n, f), []).append(self.model.get(n, {}).get(f, b""))
        if shrunk:
            self.shrunk.add((n, f))

    def _synced_now(self) -> None:
        self.synced = self._copy()
        self.hist = {(n, f): [d] for n, fs in self.model.items() for f, d in fs.items()}
        self.shrunk = set()

    def _reopen(self) -> None:
        self.store = Store.open(self.path, CFG, volume=FaultyVolume)

    @rule(name=st.sampled_from(SESSIONS))
    def create_session(self, name: str) -> None:
        if name in self.model:
            return
        self.store.create_session(name)
        self.model[name] = {}

    @rule(name=st.sampled_from(SESSIONS), f=st.sampled_from(FILES))
    def create_file(self, name: str, f: str) -> None:
        if name not in self.model or f in self.model[name]:
            return
        self.store.create_file(name, f)
        self.model[name][f] = b""
        self._record(name, f)

    @rule(name=st.sampled_from(SESSIONS), f=st.sampled_from(FILES),
          n=st.integers(1, 300_000), seed=st.integers(0, 255), compressible=st.booleans())
    def append(self, name: str, f: str, n: int, seed: int, compressible: bool) -> None:
        if f not in self.model.get(name, {}):
            return
        cur = self.model[name][f]
        if len(cur) + n > 600_000:  # keep live data well under the ring so wrap copies forward
            self.store.truncate(name, f, 0)
            self.model[name][f] = cur = b""
            self._record(name, f, shrunk=True)
        data = (bytes([seed]) * 7 + bytes(range(seed, 256)))[:1] * n if compressible else os.urandom(n)
        try:
            self.store.append(name, f, len(cur), data)
        except NoSpace:
            return
        self.model[name][f] = cur + data
        self._record(name, f)
        self.total_written += n

    @rule(name=st.sampled_from(SESSIONS), f=st.sampled_from(FILES), off=st.integers(1, 10))
    def bad_append(self, name: str, f: str, off: int) -> None:
        if f not in self.model.get(name, {}):
            return
        try:
            self.store.append(name, f, len(self.model[name][f]) + off, b"zz")
            raise AssertionError("non-append accepted")
        except NotAppend:
            pass

    @rule(name=st.sampled_from(SESSIONS), f=st.sampled_from(FILES), frac=st.floats(0, 1))
    def truncate(self, name: str, f: str, frac: float) -> None:
        if f not in self.model.get(name, {}):
            return
        n = int(len(self.model[name][f]) * frac)
        self.store.truncate(name, f, n)
        self.model[name][f] = self.model[name][f][:n]
        self._record(name, f, shrunk=True)

    @rule(name=st.sampled_from(SESSIONS))
    def delete_session(self, name: str) -> None:
        if name not in self.model:
            return
        self.store.delete_session(name)
        for f in self.model[name]:
            self.shrunk.add((name, f))
        del self.model[name]

    @rule(name=st.sampled_from(SESSIONS), f=st.sampled_from(FILES))
    def delete_file(self, name: str, f: str) -> None:
        if f not in self.model.get(name, {}):
            return
        self.store.delete_file(name, f)
        del self.model[name][f]
        self.shrunk.add((name, f))

    @rule()
    def sync(self) -> None:
        self.store.sync()
        self._synced_now()

    @rule()
    def checkpoint(self) -> None:
        self.store.checkpoint()
        self._synced_now()

    @rule()
    def close_reopen(self) -> None:
        self.store.close()
        self._synced_now()
        self._reopen()

    @rule()
    def crash_after_sync(self) -> None:
        """kill -9 right after a sync: everything must be there."""
        self.store.sync()
        self._synced_now()
        self.store.crash()
        self._reopen()

    @rule(keep=st.integers(0, 50), tear=st.integers(0, 4096))
    def power_cut(self, keep: int, tear: int) -> None:
        """Unsynced writes are partly kept, one torn, the rest lost: the state after
        reopen is the synced state plus some prefix of later operations per file."""
        vol = self.store.vol
        assert isinstance(vol, FaultyVolume)
        self.store.ring.flush()
        keep = min(keep, vol.unsynced_writes())
        vol.power_cut(keep, tear)
        self._check_after_cut()

    @rule(at_sync=st.integers(0, 2), keep=st.integers(0, 8), tear=st.integers(0, 3 * 4096))
    def power_cut_in_checkpoint(self, at_sync: int, keep: int, tear: int) -> None:
        """Power fails inside a checkpoint: at the ring's fsync (0), after the B+ tree pages
        were written but before their fsync (1: they are kept in part, torn or lost), or
        before the superblock's fsync (2: it tears). The previous checkpoint must hold."""
        vol = self.store.vol
        assert isinstance(vol, FaultyVolume)
        vol.fail_at_sync = at_sync
        try:
            self.store.checkpoint()
        except PowerCut:
            pass
        else:  # fewer syncs than that (nothing to commit): cut after it anyway
            vol.fail_at_sync = None
        vol.power_cut(min(keep, vol.unsynced_writes()), tear)
        self._check_after_cut()

    def _check_after_cut(self) -> None:
        self._reopen()
        # Every file must hold a prefix of some state it had since the sync (never bytes it
        # never had), and synced bytes survive unless the file shrank since.
        actual = {n: {f: self.store.read(n, f, 0, 10**9) for f in self.store.list_files(n)}
                  for n in self.store.list_sessions()}
        for n, files in actual.items():
            for f, got in files.items():
                states = self.hist.get((n, f))
                assert states is not None, f"{n}/{f} appeared from nowhere"
                assert any(st[: len(got)] == got for st in states), f"{n}/{f}: bytes it never had"
                base = self.synced.get(n, {}).get(f)
                if base is not None and (n, f) not in self.shrunk:
                    assert got.startswith(base), f"{n}/{f}: synced bytes lost"
        for n, files in self.synced.items():
            for f in files:
                if (n, f) not in self.shrunk and f in self.model.get(n, {}):
                    assert f in actual.get(n, {}), f"synced file {n}/{f} lost"
        self.model = actual
        self._synced_now()

    @invariant()
    def reads_match(self) -> None:
        assert self.store.list_sessions() == sorted(self.model)
        for n, files in self.model.items():
            assert self.store.list_files(n) == sorted(files)
            for f, data in files.items():
                assert self.store.file_stat(n, f).size == len(data)
                assert self.store.read(n, f, 0, 10**9) == data

    @precondition(lambda self: self.total_written > 0)
    @invariant()
    def ring_bounds(self) -> None:
        r = self.store.ring
        assert 0 <= r.used() <= r.size and r.durable_tail <= r.tail <= r.head


StoreMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreModel = StoreMachine.TestCase


def test_model_wraps_the_ring() -> None:
    """A long deterministic run: enough data to wrap the ring several times."""
    m = StoreMachine()
    try:
        for n in SESSIONS:
            m.create_session(n)
            for f in FILES[:2]:
                m.create_file(n, f)
        i = 0
        while m.total_written < 40 << 20:
            n = SESSIONS[i % 4]
            m.append(n, FILES[i % 2], 50_000 + (i * 7919) % 200_000, i % 256, i % 3 == 0)
            if i % 17 == 0:
                m.truncate(n, FILES[i % 2], 0.5)
            if i % 41 == 0:
                m.crash_after_sync()
            if i % 53 == 0:
                m.power_cut(i % 5, (i * 31) % 600)
            if i % 29 == 0:
                m.power_cut_in_checkpoint(i % 3, i % 4, (i * 977) % 9000)
            i += 1
        m.reads_match()
        assert m.store.ring.head > 4 * m.store.ring.size
    finally:
        m.teardown()
