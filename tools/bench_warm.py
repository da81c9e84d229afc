"""Warm-tier benchmarks. Plain functions returning plain dicts, for tools/bench.py.

* ``bench_migration(cold_root, tmp)``: one group migration of 10 sessions (~87 MB) from a
  RAM-backed warm root to ``cold_root`` (the mount, or any directory), against ``dd`` of
  the same number of bytes to the same filesystem with ``conv=fsync``. Goal: >= 80 % of
  dd's bandwidth; the article's figure is < 200 ms for the move.
* ``bench_memmap_vs_torch_load(tmp)``: reading one round (all layers) out of the warm
  memmap into a tensor vs ``torch.load`` of the same round saved with ``torch.save``;
  medians of several runs. The article reports memmap 3.2x faster.

Alone: ``python tools/bench_warm.py COLD_ROOT [--tmp DIR]`` prints both as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

from kvfs.warm import WarmTier


def _ram_dir(tmp: str) -> str:
    """A scratch directory on tmpfs when there is one (the warm tier's medium), else tmp."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tmp
    return tempfile.mkdtemp(prefix="kvfs-bench-warm-", dir=base)


def bench_migration(cold_root: str, tmp: str, *, sessions: int = 10, total_bytes: int = 87_000_000,
                    layers: int = 24, repeats: int = 3, seed: int = 0) -> dict:
    """Group migration of ``sessions`` sessions vs dd of the same bytes (MB = 10**6 B);
    medians over ``repeats`` alternating runs (a shared VM disk is noisy)."""
    warm_root = _ram_dir(tmp)
    per_layer = total_bytes // (sessions * layers)
    total = per_layer * sessions * layers
    rng = np.random.default_rng(seed)
    dd_dir = os.path.join(cold_root, "sessions", f"bench-dd-{os.getpid()}")
    src = os.path.join(warm_root, "dd-src")
    cmd = ["dd", f"if={src}", f"of={os.path.join(dd_dir, 'layer_0')}", "bs=4M", "conv=fsync",
           "status=none"]
    mig, dd = [], []
    w = WarmTier(cold_root, warm_root, cap_bytes=1 << 40, group=sessions)
    try:
        with open(src, "wb") as f:
            f.write(rng.bytes(total))
        for rep in range(repeats):
            sids = [f"bench-warm-{os.getpid()}-{rep}-{i}" for i in range(sessions)]
            for sid in sids:
                for layer in range(layers):
                    w.append(sid, layer, np.frombuffer(rng.bytes(per_layer), np.uint8))
                w.put_meta(sid, {"format": 1, "tokens": per_layer // 512, "rounds": []})
            t0 = time.perf_counter()
            moved = w.migrate(sessions)
            mig.append(time.perf_counter() - t0)
            if sorted(moved) != sorted(sids):
                raise RuntimeError(f"migrated {len(moved)} of {sessions} sessions")
            for sid in sids:
                w.delete(sid)
            os.mkdir(dd_dir)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            dd.append(time.perf_counter() - t0)
            shutil.rmtree(dd_dir)
    finally:
        w.close()
        shutil.rmtree(dd_dir, ignore_errors=True)
        shutil.rmtree(warm_root, ignore_errors=True)
    mig_s, dd_s = statistics.median(mig), statistics.median(dd)
    mig_mbps, dd_mbps = total / 1e6 / mig_s, total / 1e6 / dd_s
    return {"sessions": sessions, "layers": layers, "bytes": total, "repeats": repeats,
            "migrate_ms": round(mig_s * 1000, 1), "migrate_MBps": round(mig_mbps, 1),
            "dd_ms": round(dd_s * 1000, 1), "dd_MBps": round(dd_mbps, 1),
            "ratio": round(mig_mbps / dd_mbps, 3), "goal_ratio": 0.8, "article_ms": 200,
            "migrate_ms_all": [round(x * 1000, 1) for x in mig],
            "dd_ms_all": [round(x * 1000, 1) for x in dd], "command": " ".join(cmd)}


def bench_memmap_vs_torch_load(tmp: str, *, layers: int = 24, tokens: int = 8, kv_heads: int = 2,
                               head_dim: int = 64, rounds: int = 32, runs: int = 50) -> dict:
    """One round (every layer, K and V, fp16): warm memmap read vs torch.load, medians."""
    import torch

    warm_root = _ram_dir(tmp)
    shape = (tokens, 2, kv_heads, head_dim)  # token-major: K then V per token
    round_bytes = int(np.prod(shape)) * 2
    rng = np.random.default_rng(1)
    data = rng.standard_normal((layers, rounds, *shape)).astype(np.float16)
    r = rounds // 2
    path = os.path.join(tmp, f"kvfs-bench-round-{os.getpid()}.pt")
    w = WarmTier(None, warm_root, cap_bytes=1 << 40)
    try:
        for layer in range(layers):
            w.append("bench", layer, data[layer])
        torch.save(torch.from_numpy(data[:, r].copy()), path)

        def via_memmap() -> torch.Tensor:  # one call: the same byte range of every layer
            got = w.read_layers("bench", range(layers), r * round_bytes, (r + 1) * round_bytes)
            return torch.from_numpy(got.view(np.float16).reshape(layers, *shape))

        def via_memmap_per_layer() -> torch.Tensor:  # one read() per layer
            parts = [w.read("bench", layer, r * round_bytes, (r + 1) * round_bytes)
                     for layer in range(layers)]
            return torch.from_numpy(np.stack(parts).view(np.float16).reshape(layers, *shape))

        def via_torch_load() -> torch.Tensor:
            return torch.load(path)

        ref = via_torch_load()
        if not (torch.equal(via_memmap(), ref) and torch.equal(via_memmap_per_layer(), ref)):
            raise RuntimeError("memmap and torch.load disagree")
        times = {}
        for name, fn in (("memmap", via_memmap), ("memmap_per_layer", via_memmap_per_layer),
                         ("torch_load", via_torch_load)):
            fn()  # warm-up: page cache, imports
            samples = []
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            times[name] = statistics.median(samples) * 1e6
    finally:
        w.close()
        shutil.rmtree(warm_root, ignore_errors=True)
        if os.path.exists(path):
            os.unlink(path)
    return {"round_bytes": round_bytes * layers, "layers": layers, "runs": runs,
            "memmap_us": round(times["memmap"], 1),
            "memmap_per_layer_us": round(times["memmap_per_layer"], 1),
            "torch_load_us": round(times["torch_load"], 1),
            "ratio": round(times["torch_load"] / times["memmap"], 2), "article_ratio": 3.2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cold_root", help="the mounted volume (or a directory with a sessions/ layout)")
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    a = ap.parse_args()
    print(json.dumps({"migration": bench_migration(a.cold_root, a.tmp),
                      "memmap_vs_torch_load": bench_memmap_vs_torch_load(a.tmp)}, indent=2))


if __name__ == "__main__":
    main()
