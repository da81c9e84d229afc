"""One writer per session, at the agent level, through the shared tier (mounts with
``--shared`` over a real local 3 + 3 Redis Cluster):

- an agent serving a session holds its lease from ``cache()``/``resume()`` to
  ``release()``/``close()``, also between turns when no file is open: another node's
  ``resume()`` is refused with ``WarmBusy`` naming the owner node, the owner's turns stay
  token-identical, and its flushes copy no chunk (no COPY per flush); after the owner
  releases it the other node resumes at once (a hand-over, no takeover);
- an agent whose session was taken over meanwhile gets an error from its next flush, never
  a normal return;
- node A (agent and mount) killed -9: node B's resume is refused until A's lease expires,
  then takes the session over and continues token-identically to a run that never stopped.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.mount_runner import Mount
from kvfs.shared.chunks import SessionKeys
from kvfs.shared.local_cluster import Cluster
from kvfs.torch import KVRouter, TieredCache
from kvfs.torch.reference import (
    continue_turns,
    conversation,
    generate_turns,
    profile_rope,
    prompt,
    tiny_llama,
)
from kvfs.warm import WarmBusy, WarmError

WINDOW, NEW, SEED = 8, 5, 11
LEASE_S = 4.0  # node A's lease: long enough to see B refused, short enough to wait out
WARM_OPTS = {"shards": 16, "writebehind_s": 0.2}


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
from kvfs.torch.reference import generate_turns, tiny_llama
a = json.loads(sys.argv[1])
r = KVRouter(mount=a["mount"], retrieval=False, warm_root=a["warm"], max_kv_len=a["window"],
             warm_options={"shards": 16})
m = tiny_llama(seed=a["seed"])
generate_turns(m, r.cache(a["sid"], m), [torch.tensor([t]) for t in a["turns"]], a["new"])
r.flush()  # the router keeps serving the session: its mount keeps the lease
print("FLUSHED", flush=True)
time.sleep(600)
"""






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
        assert shared["tier_leases_held"] == 1, shared  # held between turns: no file is open
        a_node = shared["node"]
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

    rb = KVRouter(mount=str(b.root), retrieval=False, warm_root=str(tmp_path / "warm-b"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        # A's lease has not expired yet: B's resume is refused, naming A's node
        with pytest.raises(WarmBusy) as e:
            rb.resume(sid, model)
        assert e.value.owner == a_node and a_node in str(e.value), e.value
        assert time.monotonic() - killed < LEASE_S - 1, "resume on B ran past A's lease"
        deadline = killed + LEASE_S + 10
        while True:  # after expiry B takes the session over (logged, counted)
            try:
                c = rb.resume(sid, model)  # read through from the cluster by name
                break
            except WarmBusy:
                assert time.monotonic() < deadline, "A's lease never expired"
                time.sleep(0.25)
        assert time.monotonic() - killed >= LEASE_S - 2.5  # not before the lease could end
        assert c.seen == sum(t.shape[1] for t in before) + NEW * len(before) - 1
        st = json.loads((b.root / ".kvfs" / "stats").read_text())["shared"]
        assert st["hits"] >= 1 and st["fetched_bytes"] > 0, st
        assert "took over the lease of node" in b.log_text()
        ids = conversation(before, ref[:len(before)])
        continue_turns(model, c, ids, after, ref[len(before):], NEW)
        rb.flush()
    finally:
        rb.close()
    st = json.loads((b.root / ".kvfs" / "stats").read_text())["shared"]
    assert st["tier_lease_takeovers"] >= 1, st
    meta = json.loads((b.sessions / sid / "meta.json").read_bytes())
    total = sum(t.shape[1] for t in before + after) + NEW * len(before + after) - 1
    assert meta["tokens"] == total

    # a third agent on B, fresh RAM tier, resumes what B wrote: the mount has every token
    r2 = KVRouter(mount=str(b.root), retrieval=False, warm_root=str(tmp_path / "warm-b2"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        assert r2.resume(sid, model).seen == total
    finally:
        r2.close()


def copies(cluster: Cluster) -> int:
    """COPY commands the cluster's masters have run (chunk trims)."""
    n = 0
    for p in cluster.alive():
        with cluster.client(p) as r:
            if r.info("replication")["role"] == "master":
                n += int(r.info("commandstats").get("cmdstat_copy", {}).get("calls", 0))
    return n


def test_second_node_is_refused_while_the_first_serves(node: Callable[..., Mount],
                                                       cluster: Cluster, tmp_path: Path) -> None:
    a, b = node("a", 5.0), node("b", 5.0)
    sid = "held-1"
    turns = [prompt(80 + i, 6) for i in range(5)]
    model = tiny_llama(seed=SEED)
    ref = generate_turns(model, TieredCache(model, max_kv_len=WINDOW, **profile_rope()),
                         turns, NEW)
    ra = KVRouter(mount=str(a.root), retrieval=False, warm_root=str(tmp_path / "warm-a"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    rb = KVRouter(mount=str(b.root), retrieval=False, warm_root=str(tmp_path / "warm-b"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        ca = ra.cache(sid, model)
        ids = continue_turns(model, ca, torch.empty(1, 0, dtype=torch.long), turns[:1], ref[:1], NEW)
        ra.flush()
        a_node = json.loads((a.root / ".kvfs" / "stats").read_text())["shared"]["node"]
        copied = copies(cluster)
        for call in (rb.resume, rb.cache):  # between A's turns no file of it is open
            with pytest.raises(WarmBusy) as e:
                call(sid, model)
            assert e.value.owner == a_node, e.value
        # A goes on undisturbed, token for token, and its flushes trim no chunk
        for i in (1, 2):
            ids = continue_turns(model, ca, ids, turns[i:i + 1], ref[i:i + 1], NEW)
            ra.flush()
        assert copies(cluster) == copied, "a flush copied chunks (a lease released per flush)"
        ra.release(sid)  # a hand-over: B resumes at once
        cb = rb.resume(sid, model)
        continue_turns(model, cb, ids, turns[3:4], ref[3:4], NEW)
        rb.flush()
        st = json.loads((b.root / ".kvfs" / "stats").read_text())["shared"]
        assert st["tier_lease_takeovers"] == 0, st
        with pytest.raises(WarmBusy):
            ra.resume(sid, model)  # now B serves it
    finally:
        ra.close()
        rb.close()


def test_flush_raises_once_the_session_was_taken_over(node: Callable[..., Mount],
                                                       cluster: Cluster, tmp_path: Path) -> None:
    """Node B loses the session's lease while its agent serves it (a partition longer than
    the lease, made here by removing the lease key) and node A's agent takes it over and
    writes a turn: B's next flush raises; it never returns normally."""
    a, b = node("a", 5.0), node("b", 5.0)
    sid = "taken-1"
    turns = [prompt(90 + i, 6) for i in range(3)]
    model = tiny_llama(seed=SEED)
    rb = KVRouter(mount=str(b.root), retrieval=False, warm_root=str(tmp_path / "warm-b"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    ra = KVRouter(mount=str(a.root), retrieval=False, warm_root=str(tmp_path / "warm-a"), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        cb = rb.cache(sid, model)
        outs = generate_turns(model, cb, turns[:1], NEW)
        rb.flush()
        key = SessionKeys(sid).lease
        with cluster.client(cluster.master_of_key(key)) as r:
            assert r.delete(key) == 1
        ca = ra.resume(sid, model)  # A takes it (nobody holds the lease now)
        ids = torch.cat([turns[0], outs[0], turns[1]], 1)
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=ca, max_new_tokens=NEW,
                       do_sample=False)
        ca.end_round()
        ra.flush()
        ids = torch.cat([turns[0], outs[0], turns[2]], 1)  # B goes on, unaware
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cb, max_new_tokens=NEW,
                       do_sample=False)
        cb.end_round()
        with pytest.raises(WarmError) as e:
            rb.flush()
        print("B's flush:", e.value)
    finally:
        ra.close()
        try:
            rb.close()
        except WarmError:
            pass  # its last write-behind is refused too: the session is A's now
