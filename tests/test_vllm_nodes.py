"""Two serving nodes over one shared tier: a conversation held through node A's server is
continued through node B's, from the KV that A stored.

Two mounts with ``--shared`` over a real local Redis Cluster (the fixture of
tests/test_agent_shared.py), the tiny model of tests/test_vllm.py, ``kvfs-serve`` on each
node with the same server key (``key_file``: session names map to the same directories),
the stock ``openai`` client naming the conversation by ``user``, as a load balancer in front
of two servers would pass it through.

- Turns go to A and B in turn, each continuing from the KV the other stored.
- One turn sent to both at once is stored by the node whose mount holds the session's
  lease; the other's store is refused (EBUSY, logged; its reply is unchanged).
- A exits (its drain stores its last turn and its mount hands the lease back), and B's
  next turn continues from a whole session.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from kvfs.fuse.remote import REFRESH_S
from kvfs.mount_runner import HAVE_FUSE, Mount
from kvfs.shared.local_cluster import Cluster
from kvfs.vllm.server_runner import VLLMServer, have_vllm, model_dir

pytestmark = [
    pytest.mark.mount, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse"),
    pytest.mark.skipif(not have_vllm(), reason="no .venv-vllm: make vllm-env builds it"),
]

BLOCK = 32
USER = ["Tell me about the harbour at dawn.", "What did the fishermen bring back?",
        "And the price of the catch that morning?", "Who bought most of it?",
        "Was the weather good for fishing?", "Summarise all of it in one line."]


def chat(server: VLLMServer, messages: list[dict], user: str | None = None) -> tuple[list[int], str, dict]:
    """One greedy turn: output ids, text, the reply's kv_transfer_params."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=120)
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True},
                                       **({"user": user} if user else {}))
    choice = r.choices[0]
    return (list(choice.model_extra["token_ids"]), choice.message.content or "",
            (r.model_extra or {}).get("kv_transfer_params") or {})


def stored(m: Mount, sid: str, tokens: int, timeout: float = 60.0) -> dict:
    """meta.json of ``sid`` on ``m`` once it claims ``tokens``, and pushed to the tier."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            meta = json.loads((m.sessions / sid / "meta.json").read_text())
        except (FileNotFoundError, ValueError):
            meta = {}
        if meta.get("tokens") == tokens and m.stats()["shared"]["queued_bytes"] == 0:
            return meta
        if time.monotonic() > deadline:
            return meta
        time.sleep(0.2)


def test_turns_alternate_between_two_live_servers(make_mount: Callable[..., Mount],
                                                  cluster: Cluster, tmp_path: Path) -> None:
    opts = (*cluster.mount_args(), "-o", "shared_lease_s=4s", "-o", "shared_fsync_wait_s=5s")
    mounts = {n: make_mount(n, size="256M", extra=opts) for n in ("a", "b")}
    model = model_dir(tmp_path / "model")
    key = str(tmp_path / "state" / "vllm.key")
    servers = {n: VLLMServer(model, tmp_path / f"{n}.log", block_size=BLOCK, dev_mode=True,
                             kvfs_serve={"mount": m.mountpoint, "key_file": key})
               for n, m in mounts.items()}
    try:
        for s in servers.values():
            s.start()
        messages: list[dict] = []
        for turn, text in enumerate(USER[:4]):
            node = "ab"[turn % 2]
            messages.append({"role": "user", "content": text})
            out, reply, params = chat(servers[node], messages, user="agent-9")
            ref, _, _ = chat(servers[node], messages)  # the uninterrupted run, no session
            assert out == ref, f"turn {turn} on node {node}: other tokens than without kvfs"
            if turn:  # every turn after the first continues from the other node's KV
                assert params["kvfs_loaded_tokens"] > 0, (turn, node, params)
            stored(mounts[node], "agent-9", params["kvfs_stored_tokens"])
            # a mount re-checks a session another node writes at most every REFRESH_S: a
            # turn sent sooner may find the turn before it missing (and recompute it)
            time.sleep(REFRESH_S + 0.2)
            messages.append({"role": "assistant", "content": reply})

        # one turn sent to both nodes at once: one store wins the lease, the other is refused
        messages.append({"role": "user", "content": USER[4]})
        got: dict[str, tuple[list[int], str, dict]] = {}
        threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, chat(servers[n], messages,
                                                                               user="agent-9")))
                   for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert set(got) == {"a", "b"} and got["a"][0] == got["b"][0]  # the same reply on both
        for n in "ab":
            mounts[n].pushed()
        refused = sum(m.stats()["shared"]["busy_refusals"] for m in mounts.values())
        logs = "".join((tmp_path / f"{n}.log").read_text(errors="replace") for n in "ab")
        # at most one store lost the race, and it said so; none was cut or mixed (below)
        assert refused <= 1 and (refused == 0 or "storing its KV in session" in logs), refused
        messages.append({"role": "assistant", "content": got["a"][1]})
        messages.append({"role": "user", "content": USER[5]})

        assert servers["a"].stop() == 0, servers["a"].log_tail()
        stats = mounts["a"].pushed()
        assert stats["queued_bytes"] == 0 and stats["tier_leases_held"] == 0, stats
        time.sleep(REFRESH_S + 0.2)
        servers["b"].reset_prefix_cache()  # b served the last turn itself: only kvfs has it now
        out, _, params = chat(servers["b"], messages, user="agent-9")
        ref, _, _ = chat(servers["b"], messages)
        assert out == ref and params["kvfs_loaded_tokens"] > 0, params
        meta = stored(mounts["b"], "agent-9", params["kvfs_stored_tokens"])
        assert meta.get("tokens") == params["kvfs_stored_tokens"], meta  # whole, nothing cut
        assert mounts["b"].stats()["shared"]["fetched_bytes"] > 0  # A's turns came from the tier
    finally:
        for s in servers.values():
            s.stop()
