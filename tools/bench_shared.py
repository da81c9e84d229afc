"""Shared-tier benchmark: reading 1 MiB chunks through ``SharedTier`` vs ``redis-benchmark``
GETs of 1 MiB values against the same cluster (the engine's own figure, the ceiling).

* ``redis-benchmark -c C -n N -d 1048576 -t set,get --cluster --csv``: its GET line
  (the SET fills the keys GET reads); requests/s x 1 MiB = MiB/s.
* ``SharedTier.read`` of one whole chunk, ``C`` threads sharing one tier (the way the mount's
  worker threads would), ``N`` reads over sessions written beforehand; every chunk is
  checksummed on the way back, so this is the price of the checks and of Python.

Prints JSON with both figures and the ratio (shared / redis-benchmark). Starts its own local
3 + 3 cluster unless ``--urls`` is given; ``--footprint`` adds the measured cluster memory of
agent-shaped sessions (docs/scale-out.md sizes the fleet from it).
``--resume`` measures an agent session moving between nodes instead: a 2k-token session of
a random Llama written through mount A (``--shared``) and flushed, then ``KVRouter.resume``
on node B (every byte fetched from the cluster through mount B), on node A (its own volume)
and recomputing the prefill with the model, each with a fresh RAM tier.
``--flush-cost`` counts what an agent's flush costs the cluster: an agent of SmolLM2-135M's KV
shape (30 layers x 768 bytes a token) on the gov profile, 13 rounds of 8 tokens, one
``router.flush()`` a round, through a ``--shared`` mount; the Redis commands (by kind) and the
bytes the masters received, per flush, from their ``INFO`` counters.
``python tools/bench_shared.py [-c 8] [-n 2000] [--footprint] [--resume [--reps 5]]
[--flush-cost]``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import subprocess
import threading
import time

from kvfs.shared import SharedTier
from kvfs.shared.local_cluster import REDIS_BENCHMARK, Cluster

MIB = 1 << 20
SECRET = os.urandom(48)  # the cluster secret of this run's own cluster
log = logging.getLogger("bench_shared")


def redis_benchmark_get(urls: str, clients: int, requests: int) -> float:
    """MiB/s of ``redis-benchmark``'s GET of 1 MiB values (cluster mode, then one node)."""
    if REDIS_BENCHMARK is None:
        raise SystemExit("redis-benchmark not found (apt-get install redis-tools)")
    host, port = urls.removeprefix("redis://").split(",")[0].rsplit(":", 1)
    base = [REDIS_BENCHMARK, "-h", host, "-p", port, "-c", str(clients), "-n", str(requests),
            "-d", str(MIB), "-t", "set,get", "--csv"]
    r = subprocess.run([*base, "--cluster"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or "GET" not in r.stdout:       # an old redis-benchmark: one node
        log.warning("redis-benchmark --cluster failed (%s); measuring one node", r.stderr.strip()[-200:])
        r = subprocess.run(base, capture_output=True, text=True, timeout=600, check=True)
    for row in csv.reader(io.StringIO(r.stdout)):
        if row and row[0] == "GET":
            return float(row[1])          # requests/s of 1 MiB values = MiB/s
    raise RuntimeError(f"no GET line in redis-benchmark's output:\n{r.stdout}")


def shared_read(urls: str, clients: int, requests: int, sessions: int = 8,
                chunks: int = 16) -> dict[str, float]:
    with SharedTier(urls, node_id="bench", secret=SECRET, chunk_bytes=MIB, timeout_s=5.0) as t:
        t0 = time.perf_counter()
        for i in range(sessions):
            s = f"bench-{i}"
            t.acquire(s)
            if t.list_files(s).get("layer_0") != chunks * MIB:
                t.delete_session(s)
                t.acquire(s)
                t.append(s, "layer_0", 0, os.urandom(chunks * MIB))
            t.sync(s)
        write_s = time.perf_counter() - t0
        per = requests // clients

        def reader(k: int) -> None:
            for j in range(per):
                n = (k * per + j) % (sessions * chunks)
                data = t.read(f"bench-{n % sessions}", "layer_0", (n // sessions) * MIB, MIB)
                assert len(data) == MIB

        ths = [threading.Thread(target=reader, args=(k,)) for k in range(clients)]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        elapsed = time.perf_counter() - t0
        st = t.stats()
        for i in range(sessions):
            t.delete_session(f"bench-{i}")
    return {"read_mib_s": per * clients / elapsed, "read_ms_p50": st["read_ms_p50"],
            "read_ms_p99": st["read_ms_p99"],
            "write_synced_mib_s": sessions * chunks / write_s}


def session_footprint(cluster: Cluster, sessions: int = 50, layers: int = 30, rounds: int = 13,
                      tokens: int = 8, layer_token_bytes: int = 768) -> dict[str, float]:
    """Cluster memory of sessions shaped like an agent's (``rounds`` appends of ``tokens``
    tokens to each of ``layers`` layer files, meta.json after each round), written and then
    released: ``MEMORY USAGE`` summed over every key on the masters, per session, while
    leased and after release (the last partial chunk of each file trimmed)."""
    with SharedTier(cluster.urls, node_id="footprint", secret=SECRET, timeout_s=5.0,
                    auto_renew=False) as t:
        for i in range(sessions):
            s, piece = f"fp-{i}", tokens * layer_token_bytes
            t.acquire(s)
            for r in range(rounds):
                for layer in range(layers):
                    t.append(s, f"layer_{layer}", r * piece, os.urandom(piece))
                t.put_meta(s, b'{"format": 1, "tokens": %d}' % ((r + 1) * tokens) + b" " * 200)

        def usage() -> int:
            total = 0
            for i in range(sessions):
                r = cluster.client(cluster.master_of_key(f"kvfs:{{fp-{i}}}:files"))
                total += sum(r.memory_usage(k, samples=0) for k in r.scan_iter(f"kvfs:{{fp-{i}}}:*"))
            return total

        raw = layers * rounds * tokens * layer_token_bytes
        leased = usage() / sessions
        for i in range(sessions):
            t.release(f"fp-{i}")
        released = usage() / sessions
        for i in range(sessions):
            t.delete_session(f"fp-{i}")
    return {"session_raw_bytes": raw, "session_bytes_leased": round(leased),
            "session_bytes_released": round(released),
            "overhead_released": round(released / raw, 3), "overhead_leased": round(leased / raw, 3)}


def resume_figure(cluster: Cluster, tokens: int = 2048, reps: int = 5) -> dict:
    """Seconds to get a ``tokens``-token session back onto the device: resumed on another node
    (cold read-through), on the same node, or recomputed; medians over ``reps``."""
    import shutil
    import statistics
    import tempfile
    from pathlib import Path

    import torch

    from kvfs.mount_runner import Mount
    from kvfs.torch import KVRouter
    from kvfs.torch.reference import tiny_llama

    model = tiny_llama(seed=0, hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, intermediate_size=688, vocab_size=2048)
    ids = torch.randint(0, 2048, (1, tokens), generator=torch.Generator().manual_seed(0))
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    ext = (*cluster.mount_args(), "-o", "shared_lease_s=5s")
    a = Mount(work / "a.kvfs", work / "a.mnt", "512M", ext).start()
    b = Mount(work / "b.kvfs", work / "b.mnt", "512M", ext).start()
    times: dict[str, list[float]] = {"other_node_s": [], "same_node_s": [], "recompute_s": []}
    try:
        for rep in range(reps):
            sid = f"resume-{rep}"  # a new session each time: B's first read is always cold
            with KVRouter(mount=str(a.root), warm_root=str(work / f"wa{rep}"), max_kv_len=None) as r:
                with torch.no_grad():
                    model(input_ids=ids, cache=r.cache(sid, model), use_cache=True)
                r.release(sid)  # flushed to mount A and fsync'd (cluster + one replica)
            for key, m in (("other_node_s", b), ("same_node_s", a)):
                with KVRouter(mount=str(m.root), warm_root=str(work / f"w{key}{rep}"),
                              max_kv_len=None) as r:
                    t0 = time.perf_counter()
                    c = r.resume(sid, model)
                    times[key].append(time.perf_counter() - t0)
                    assert c.seen == tokens
                    r.release(sid, flush=False)
            with torch.no_grad():
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True)
                times["recompute_s"].append(time.perf_counter() - t0)
    finally:
        for m in (b, a):
            m.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    kv = tokens * model.config.num_hidden_layers * 2 * 4 * 32 * 4  # K+V, 4 heads of 32, fp32
    return {"tokens": tokens, "reps": reps, "kv_bytes": kv, **med,
            "other_vs_same": round(med["other_node_s"] / med["same_node_s"], 2),
            "recompute_vs_other": round(med["recompute_s"] / med["other_node_s"], 2)}


def _masters_counters(cluster: Cluster) -> dict[str, int]:
    """Command calls (by name) and input bytes summed over the cluster's masters."""
    out: dict[str, int] = {}
    for p in cluster.alive():
        with cluster.client(p) as r:
            if r.info("replication")["role"] != "master":
                continue
            for name, st in r.info("commandstats").items():
                key = name.removeprefix("cmdstat_")
                out[key] = out.get(key, 0) + int(st["calls"])
            out["_bytes_in"] = out.get("_bytes_in", 0) + int(r.info("stats")["total_net_input_bytes"])
    return out


def flush_cost(cluster: Cluster, rounds: int = 13, tokens: int = 8) -> dict:
    """What one agent flush costs the cluster (see the module docstring)."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from kvfs.mount_runner import Mount
    from kvfs.torch import KVRouter
    from kvfs.torch.reference import tiny_llama

    model = tiny_llama(seed=0, dtype=torch.bfloat16, hidden_size=576, num_attention_heads=9,
                       num_key_value_heads=3, num_hidden_layers=30, intermediate_size=64,
                       vocab_size=256)
    work = Path(tempfile.mkdtemp(prefix="bench-flush-"))
    m = Mount(work / "a.kvfs", work / "a.mnt", "256M", tuple(cluster.mount_args())).start()
    gen = torch.Generator().manual_seed(1)
    try:
        with KVRouter(mount=str(m.root), warm_root=str(work / "warm"), profile="gov") as r:
            c = r.cache("agent-1", model)
            before = _masters_counters(cluster)
            for _ in range(rounds):
                with torch.no_grad():
                    model(input_ids=torch.randint(0, 256, (1, tokens), generator=gen), cache=c,
                          use_cache=True)
                c.end_round()
                r.flush()
            after = _masters_counters(cluster)
            r.release("agent-1")
            released = _masters_counters(cluster)
    finally:
        m.stop()
        shutil.rmtree(work, ignore_errors=True)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    scripts = sum(v for k, v in delta.items() if k.startswith(("eval", "fcall")))
    commands = sum(v for k, v in delta.items() if not k.startswith("_"))
    trims = delta.get("copy", 0) + delta.get("rename", 0)
    kv = rounds * tokens * 30 * 768
    return {"rounds": rounds, "tokens_per_round": tokens, "kv_bytes": kv,
            "commands_per_flush": round(commands / rounds, 1),
            "scripts_per_flush": round(scripts / rounds, 1),
            "copy_rename_per_flush": round(trims / rounds, 2),
            "bytes_in_per_flush": round(delta.get("_bytes_in", 0) / rounds),
            "bytes_in_per_kv_byte": round(delta.get("_bytes_in", 0) / kv, 3),
            "commands_by_kind": {k: v for k, v in sorted(delta.items()) if v and not k.startswith("_")},
            "release_commands": sum(v - after.get(k, 0) for k, v in released.items()
                                    if not k.startswith("_"))}


def run(urls: str, clients: int, requests: int) -> dict:
    ours = shared_read(urls, clients, requests)
    theirs = redis_benchmark_get(urls, clients, requests)
    return {"clients": clients, "requests": requests, "value_bytes": MIB,
            "redis_benchmark_get_mib_s": round(theirs, 1),
            "shared_read_mib_s": round(ours["read_mib_s"], 1),
            "ratio": round(ours["read_mib_s"] / theirs, 3),
            "shared_read_ms_p50": round(ours["read_ms_p50"], 2),
            "shared_read_ms_p99": round(ours["read_ms_p99"], 2),
            "shared_write_synced_mib_s": round(ours["write_synced_mib_s"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--urls", help="an existing cluster (default: start a local 3 + 3 one)")
    ap.add_argument("-c", "--clients", type=int, default=8)
    ap.add_argument("-n", "--requests", type=int, default=2000)
    ap.add_argument("--footprint", action="store_true",
                    help="also measure the cluster memory of 50 agent-shaped sessions (SmolLM2-135M: "
                         "30 layers x 768 bytes per token, 13 rounds of 8 tokens)")
    ap.add_argument("--resume", action="store_true",
                    help="only time resuming a 2k-token session on another node, on the same "
                         "node and by recomputing its prefill")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--flush-cost", action="store_true",
                    help="only count the Redis commands and bytes of an agent's flushes")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.flush_cost:
        with Cluster(masters=3, replicas=1) as c:
            out = flush_cost(c)
    elif a.resume:
        with Cluster(masters=3, replicas=1) as c:
            out = resume_figure(c, reps=a.reps)
    elif a.urls:
        out = run(a.urls, a.clients, a.requests)
    else:
        with Cluster(masters=3, replicas=1) as c:
            out = run(c.urls, a.clients, a.requests)
            if a.footprint:
                out["footprint"] = session_footprint(c)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
