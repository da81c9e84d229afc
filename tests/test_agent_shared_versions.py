"""Node A remounted after a crash, its agent with the RAM tier it had before (two mounts
over one real 3 + 3 Redis Cluster): node B wrote both of A's sessions on meanwhile, so A's
RAM copies and its volume's files are stale. A's agent resumes S token-identically to a
run that never stopped, then resumes S2 with B's full token count; the stale copies are
dropped and logged, no error of one session surfaces in another's call or in ``flush``,
and A's mount serves B's ``.acked`` and meta.json, not its pre-crash ones."""

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
from kvfs.warm import WarmBusy

WINDOW, NEW, SEED = 8, 5, 11
LEASE_S = 2.0
WARM_OPTS = {"shards": 16, "writebehind_s": 0.2}
S, S2 = "chat-S", "chat-S2"

AGENT = r"""
import json, sys, time
import torch
from kvfs.torch import KVRouter
from kvfs.torch.reference import generate_turns, tiny_llama
a = json.loads(sys.argv[1])
r = KVRouter(mount=a["mount"], retrieval=False, warm_root=a["warm"], max_kv_len=a["window"],
             warm_options={"shards": 16})
m = tiny_llama(seed=a["seed"])
for sid, turns in a["sessions"].items():
    generate_turns(m, r.cache(sid, m), [torch.tensor([t]) for t in turns], a["new"])
r.flush()
print("FLUSHED", flush=True)
time.sleep(600)
"""


@pytest.fixture
def node(make_mount: Callable[..., Mount], cluster: Cluster) -> Callable[..., Mount]:
    def make(name: str) -> Mount:
        return make_mount(name, extra=(*cluster.mount_args(), "-o", f"shared_lease_s={LEASE_S}s",
                                       "-o", "shared_fsync_wait_s=5s"))
    return make






def tokens(turns: list) -> int:
    return sum(t.shape[1] for t in turns) + NEW * len(turns) - 1


def resume(r: KVRouter, sid: str, model, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return r.resume(sid, model)
        except WarmBusy:  # the other node's lease (a crash: until it expires)
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_remounted_node_drops_stale_ram_copies_per_session(node: Callable[..., Mount],
                                                          tmp_path: Path, caplog) -> None:
    a, b = node("a"), node("b")
    model = tiny_llama(seed=SEED)
    turns = {sid: [prompt(70 + 10 * i + j, 6) for j in range(6)] for i, sid in enumerate((S, S2))}
    ref = {sid: generate_turns(model, TieredCache(model, max_kv_len=WINDOW, **profile_rope()),
                               t, NEW) for sid, t in turns.items()}
    warm_a = tmp_path / "warm-a"  # A's RAM tier: it outlives A's crash
    args = {"mount": str(a.root), "warm": str(warm_a), "window": WINDOW, "new": NEW,
            "seed": SEED, "sessions": {sid: [x[0].tolist() for x in t[:2]]
                                       for sid, t in turns.items()}}
    p = subprocess.Popen([sys.executable, "-c", AGENT, json.dumps(args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "FLUSHED", p.stderr.read()[-3000:] if p.poll() is not None else line
        acked_before = (a.sessions / S2 / ".acked").read_bytes()
        a.kill()  # node A crashes: its mount, then its agent, both kill -9
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)

    # node B takes both sessions over and writes two more turns of each
    rb = KVRouter(mount=str(b.root), retrieval=False, warm_root=str(tmp_path / "warm-b"),
                  max_kv_len=WINDOW, warm_options=WARM_OPTS)
    try:
        for sid, t in turns.items():
            c = resume(rb, sid, model)
            assert c.seen == tokens(t[:2])
            continue_turns(model, c, conversation(t[:2], ref[sid][:2]), t[2:4], ref[sid][2:4], NEW)
        rb.flush()
    finally:
        rb.close()  # releases both: B's mount pushes them and hands the leases back
    acked_b = (b.sessions / S2 / ".acked").read_bytes()
    assert json.loads(acked_b)["tokens"] == tokens(turns[S2][:4])
    assert len(acked_b) == len(acked_before) and acked_b != acked_before  # rewritten in place
    deadline = time.monotonic() + 10
    while json.loads((b.root / ".kvfs" / "stats").read_text())["shared"]["queued_sessions"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    a.start()  # node A back after its crash: the same volume and RAM tier
    assert (a.sessions / S2 / ".acked").read_bytes() == acked_b  # B's, not A's pre-crash copy
    assert (a.sessions / S2 / "meta.json").read_bytes() == (b.sessions / S2 / "meta.json").read_bytes()
    ra = KVRouter(mount=str(a.root), retrieval=False, warm_root=str(warm_a), max_kv_len=WINDOW,
                  warm_options=WARM_OPTS)
    try:
        with caplog.at_level("WARNING"):
            c = resume(ra, S, model)  # turn 5 and 6 on A: token-identical
            assert c.seen == tokens(turns[S][:4])
            continue_turns(model, c, conversation(turns[S][:4], ref[S][:4]), turns[S][4:],
                           ref[S][4:], NEW)
            c2 = resume(ra, S2, model)  # another session: B's full count, no error of S's
            assert c2.seen == tokens(turns[S2][:4])
            continue_turns(model, c2, conversation(turns[S2][:4], ref[S2][:4]), turns[S2][4:],
                           ref[S2][4:], NEW)
            ra.flush()  # nothing of either stale copy surfaces here
        assert ra.warm.get_meta(S)["tokens"] == tokens(turns[S])
        assert ra.warm.get_meta(S2)["tokens"] == tokens(turns[S2])
    finally:
        ra.close()
    assert json.loads((a.sessions / S2 / "meta.json").read_bytes())["tokens"] == tokens(turns[S2])
    assert json.loads((a.sessions / S / ".acked").read_bytes())["tokens"] == tokens(turns[S])
    stale = [r.getMessage() for r in caplog.records if "stale" in r.getMessage().lower()
             or "dropped" in r.getMessage().lower()]
    assert stale, [r.getMessage() for r in caplog.records][-20:]
