"""An agent's session moves to another node through the shared tier: node A's agent writes a
session through its mount (``--shared``, a real local 3 + 3 Redis Cluster) and flushes;
the agent and A's mount are killed -9; an agent on node B resumes the session by name and
continues token-identically to a run that never stopped. A's lease outlives A: until it
expires, B's writes to the session are refused with EBUSY (a clear WarmError from the
router), and after it B's flush succeeds."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.shared.testing import HAVE_REDIS, Cluster
from kvfs.testing import Mount
from kvfs.torch import KVRouter, TieredCache
from kvfs.torch.testing import generate_turns, profile_rope, prompt, tiny_llama
from kvfs.warm import WarmError

WINDOW, NEW, SEED = 8, 5, 11
LEASE_S = 4.0  # node A's lease: long enough to see B refused, short enough to wait out
WARM_OPTS = {"shards": 16, "writebehind_s": 0.2}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if not HAVE_REDIS:
        pytest.skip("redis-server/redis-cli not installed (apt-get install redis-server "
                    "redis-tools)")
    with Cluster(masters=3, replicas=1, node_timeout_ms=1000) as c:
        yield c


@pytest.fixture
def node(make_mount: Callable[..., Mount], cluster: Cluster) -> Callable[..., Mount]:
    def make(name: str, lease_s: float) -> Mount:
        return make_mount(name, extra=(*cluster.mount_args(), "-o", f"shared_lease_s={lease_s}s",
                                       "-o", "shared_fsync_wait_s=5s"))
    return make


AGENT = r"""
import json, os, sys, time
import torch
from kvfs.torch import KVRouter
from kvfs.torch.testing import generate_turns, tiny_llama
a = json.loads(sys.argv[1])
r = KVRouter(mount=a["mount"], warm_root=a["warm"], max_kv_len=a["window"],
             warm_options={"shards": 16})
m = tiny_llama(seed=a["seed"])
generate_turns(m, r.cache(a["sid"], m), [torch.tensor([t]) for t in a["turns"]], a["new"])
r.flush()
# a write in flight when the agent dies: the mount holds the session's lease for it
fd = os.open(os.path.join(a["mount"], "sessions", a["sid"], "layer_0"), os.O_WRONLY | os.O_APPEND)
print("FLUSHED", flush=True)
time.sleep(600)
"""


def conversation(turns: list, outs: list) -> torch.Tensor:
    return torch.cat([x for t, o in zip(turns, outs, strict=True) for x in (t, o)], 1)


def continue_turns(model, c: TieredCache, ids: torch.Tensor, turns: list,
                   want: list) -> torch.Tensor:
    """Greedy turns on a resumed cache, each compared with the reference's tokens."""
    for t, w in zip(turns, want, strict=True):
        ids = torch.cat([ids, t], 1)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=c,
                              max_new_tokens=NEW, do_sample=False)
        assert torch.equal(full[:, ids.shape[1]:], w)
        ids = full
        c.end_round()
    return ids


def test_session_resumes_on_another_node_after_a_is_killed(node: Callable[..., Mount],
                                                           tmp_path: Path) -> None:
    a, b = node("a", LEASE_S), node("b", 2.0)
    sid = "moved-1"
    before = [prompt(50 + i, 6) for i in range(3)]
    after = [prompt(60 + i, 5) for i in range(3)]
    model = tiny_llama(seed=SEED)
    ref = generate_turns(model, TieredCache(model, max_kv_len=WINDOW, **profile_rope()),  # the profile's setting
                         before + after, NEW)

    args = {"mount": str(a.root), "warm": str(tmp_path / "warm-a"), "window": WINDOW,
            "new": NEW, "seed": SEED, "sid": sid, "turns": [t[0].tolist() for t in before]}
    p = subprocess.Popen([sys.executable, "-c", AGENT, json.dumps(args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "FLUSHED", p.stderr.read()[-3000:] if p.poll() is not None else line
        shared = json.loads((a.root / ".kvfs" / "stats").read_text())["shared"]
        assert shared["queued_bytes"] == 0 and shared["pushed_bytes"] > 0, shared
        assert shared["tier_leases_held"] == 1, shared
        # node A crashes: its mount first (were the agent to die first, the kernel would
        # close its file and A would hand the lease back), then the agent, both kill -9
        a.kill()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    killed = time.monotonic()

    rb = KVRouter(mount=str(b.root), warm_root=str(tmp_path / "warm-b"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        c = rb.resume(sid, model)  # read through from the cluster by name
        assert c.seen == sum(t.shape[1] for t in before) + NEW * len(before) - 1
        st = json.loads((b.root / ".kvfs" / "stats").read_text())["shared"]
        assert st["hits"] >= 1 and st["fetched_bytes"] > 0, st
        ids = conversation(before, ref[:len(before)])
        ids = continue_turns(model, c, ids, after[:1], ref[len(before):len(before) + 1])
        # A's lease has not expired yet: B's write path is refused, with the reason
        assert time.monotonic() - killed < LEASE_S - 1, "resume on B ran past A's lease"
        with pytest.raises(WarmError) as e:
            rb.flush()
        assert os.strerror(errno.EBUSY) in str(e.value), e.value
        assert "EBUSY" in b.log_text() and "leased by node" in b.log_text()
        deadline = killed + LEASE_S + 10
        while True:  # after expiry B takes the lease over and the flush goes through
            try:
                rb.flush()
                break
            except WarmError as e:
                assert os.strerror(errno.EBUSY) in str(e), e
                assert time.monotonic() < deadline, "A's lease never expired"
                time.sleep(0.25)
        assert time.monotonic() - killed >= LEASE_S - 2.5  # not before the lease could end
        continue_turns(model, c, ids, after[1:], ref[len(before) + 1:])
        rb.flush()
    finally:
        rb.close()
    st = json.loads((b.root / ".kvfs" / "stats").read_text())["shared"]
    assert st["tier_lease_takeovers"] >= 1, st
    meta = json.loads((b.sessions / sid / "meta.json").read_bytes())
    total = sum(t.shape[1] for t in before + after) + NEW * len(before + after) - 1
    assert meta["tokens"] == total

    # a third agent on B, fresh RAM tier, resumes what B wrote: the mount has every token
    r2 = KVRouter(mount=str(b.root), warm_root=str(tmp_path / "warm-b2"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        assert r2.resume(sid, model).seen == total
    finally:
        r2.close()
