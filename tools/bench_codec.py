#!/usr/bin/env python3
"""Figure 8 of the page: the engine's codec on real K/V, against plain zstd level 1.

``compression``: kvfs's codec (byte planes + zstd-1, per 32 KiB block of 96 KiB entries,
as the engine stores them, blocks on its thread pool) vs plain zstd level 1 per 96 KiB
entry, on fp16 and bf16 K/V taken from a small random-weight Llama; plus the ratio
``compression=auto`` stores (fp16 stays raw: 1.18x does not pay for the CPU). Takes
``quick`` and an optional ``workdir`` and returns ``{"results": [...], "info": {...}}``
(see ``bench_common``); ``python tools/bench_codec.py [--quick]`` prints it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from bench_common import KiB, MiB, Result, interleave, kv_bytes

ROUND = 96 * KiB  # one agent round of one layer: the unit an entry holds


def model_kv(tokens: int) -> tuple[dict[str, bytes], str]:
    """Token-major K/V layer bytes (fp16 and bf16) from a small random Llama's cache."""
    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except ImportError as e:  # torch/transformers missing: scaled random normal instead
        return {"float16": kv_bytes(tokens * 8192, 3), "bfloat16": kv_bytes(tokens * 8192, 3, "bfloat16")}, (
            f"random normal activations ({e})")
    cfg = LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                      intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(ids, cache=cache)
    layers = []
    for i in range(cfg.num_hidden_layers):
        lay = cache.layers[i]
        k, v = lay.keys[0].transpose(0, 1), lay.values[0].transpose(0, 1)  # [T, H, D]
        layers.append(torch.cat([k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=1))
    kv = torch.cat(layers, dim=0).contiguous()  # layer files one after another, token-major
    data = {"float16": kv.to(torch.float16).view(torch.int16).numpy().tobytes(),
            "bfloat16": kv.to(torch.bfloat16).view(torch.int16).numpy().tobytes()}
    desc = (f"K/V cache of a random-weight Llama (hidden 512, 4 layers, 8 KV heads x 64) after "
            f"{tokens} random tokens, cast to each dtype, token-major per layer")
    return data, desc


def _codec_speeds(chunks: list[bytes], codec: Any, cctx: Any, dctx: Any,
                  reps: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """MiB/s of kvfs's block codec and plain zstd, compressing and decompressing, interleaved."""
    from kvfs.engine.blocks import decode_payload, encode_entries
    from kvfs.engine.format import T_DATA, Header

    mib = sum(len(c) for c in chunks) / MiB
    stored: dict[str, list] = {}

    def kv_c() -> float:
        t0 = time.perf_counter()
        stored["kvfs"] = [encode_entries(codec, memoryview(c), len(c))[0] for c in chunks]
        return mib / (time.perf_counter() - t0)

    def z_c() -> float:
        t0 = time.perf_counter()
        stored["zstd"] = [cctx.compress(c) for c in chunks]
        return mib / (time.perf_counter() - t0)

    def kv_d() -> float:
        hdrs = [(Header(T_DATA, 0, 0, 0, 0, 0, 0, e.stored_len, e.raw_len, e.table_crc, 0, e.nblocks),
                 b"".join(bytes(p) for p in e.parts)) for e in stored["kvfs"]]
        t0 = time.perf_counter()
        stored["kvfs_raw"] = [decode_payload(h, p) for h, p in hdrs]
        return mib / (time.perf_counter() - t0)

    def z_d() -> float:
        t0 = time.perf_counter()
        for c, s in zip(chunks, stored["zstd"], strict=True):
            dctx.decompress(s, max_output_size=len(c))
        return mib / (time.perf_counter() - t0)

    vals = interleave([("kc", kv_c), ("zc", z_c), ("kd", kv_d), ("zd", z_d)], reps, warmup=1)
    return vals, stored


def compression(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 8: kvfs codec (byte planes + zstd-1 per 32 KiB block) vs plain zstd level 1."""
    import zstandard

    from kvfs.engine.blocks import encode_entries
    from kvfs.engine.codec import Codec

    data, desc = model_kv(512 if quick else 2048)
    reps = 2 if quick else 5
    codec = Codec("zstd", 1, 1.0, True)  # always compress: measure the codec, not "auto"'s back-off
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    results, info = [], {"source": desc, "chunk": ROUND}
    for dtype, buf in data.items():
        chunks = [buf[i: i + ROUND] for i in range(0, len(buf), ROUND)]
        mib = len(buf) / MiB
        vals, stored = _codec_speeds(chunks, codec, cctx, dctx, reps)
        if stored["kvfs_raw"] != chunks:
            raise RuntimeError("kvfs codec round trip changed the bytes")
        r_kv = len(buf) / sum(e.stored_len for e in stored["kvfs"])
        r_z = len(buf) / sum(len(s) for s in stored["zstd"])
        auto = Codec("auto")  # what a volume with the default settings stores
        r_auto = len(buf) / sum(encode_entries(auto, memoryview(c), len(c), dtype)[0].stored_len
                                for c in chunks)
        info[dtype] = {"bytes": len(buf), "ratio_kvfs": round(r_kv, 4), "ratio_zstd1": round(r_z, 4),
                       "ratio_auto": round(r_auto, 4)}
        common = dict(figure="8", peer="zstd level 1", better="higher")
        results += [
            Result(name=f"{dtype} KV compression ratio (raw/stored)", subject="kvfs codec (planes + zstd-1)",
                   unit="x", values={"subject": [r_kv], "peer": [r_z]}, goal=1.0,
                   note=f"{mib:g} MiB in {ROUND // KiB} KiB entries of 32 KiB blocks (block tables "
                        f"included); compression=auto stores {r_auto:.3f}x; {desc}", **common).to_dict(),
            Result(name=f"{dtype} KV compression speed", subject="kvfs codec (planes + zstd-1)",
                   unit="MiB/s", values={"subject": vals["kc"], "peer": vals["zc"]}, **common).to_dict(),
            Result(name=f"{dtype} KV decompression speed", subject="kvfs codec (planes + zstd-1)",
                   unit="MiB/s", values={"subject": vals["kd"], "peer": vals["zd"]}, **common).to_dict(),
        ]
    return {"results": results, "info": info}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    print(json.dumps(compression(quick=a.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
