#!/usr/bin/env python3
"""kvfs demo: agents over a mounted volume, KV moving hot -> warm -> cold, and a resume.

    python tools/demo.py [--no-mount] [--sessions N] [--rounds N] [--keep] [--verbose]

The story, in order:

1. create a volume in a temp dir and mount it (``mount.py VOLUME MNT --size 256M
   --foreground`` in a subprocess; ``--no-mount`` uses a plain directory instead);
2. build a small random-weight Llama-style model (no downloads) and a ``KVRouter`` over the
   mount with a small device budget and a small warm tier, so every tier is used;
3. run several agent sessions for many rounds (question, greedy answer, ``end_round``),
   now and then recalling an old round by summary, with a progress bar of tier movement;
4. print a summary table per session and per tier, and ``ls -l`` the mount;
5. take one session, compute how it would continue in this process, close everything,
   resume it in a *new process* from the mount and check it continues identically;
6. unmount (``fusermount3 -u``) and clean up.

Exit status 0 when the resumed session continued identically. ``--resume-child`` is the
second process of step 5 (internal).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from agentlib import Volume, mount_available, warm_dir

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("kvfs.demo")

MODEL_SEED = 1234
QUESTION = (10, 20)  # tokens per user turn (min, max)
ANSWER = 16  # tokens generated per turn


# --------------------------------------------------------------------------- the model
def build_model():
    """A small random Llama-style model: 4 layers, 4 KV heads of 32 dims, fp32, CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=512, vocab_size=2048,
                      max_position_embeddings=8192, initializer_range=0.2,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    # a model this small gains nothing from intra-op threads, and they thrash on a busy host
    torch.set_num_threads(1)
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def question(sid: str, rnd: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{sid}/{rnd}".encode()))
    n = int(torch.randint(QUESTION[0], QUESTION[1] + 1, (1,), generator=g))
    return torch.randint(0, vocab, (1, n), generator=g)


# --------------------------------------------------------------------------- the agents
def make_router(cold: Path, warm: Path, budget: int | None, warm_cap: int):
    from kvfs.torch import KVRouter

    # gov profile (24-token hot window); the warm tier is shrunk so groups migrate to cold
    return KVRouter(mount=str(cold), device="cpu", profile="gov", warm_root=str(warm),
                    device_budget_bytes=budget,
                    warm_options={"cap_bytes": warm_cap, "group": 2, "shards": 256})


def run_agents(args: argparse.Namespace, cold: Path, warm: Path) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from kvfs.torch import TieredCache, geometry

    model = build_model()
    geo = geometry(model)
    stb = geo.session_token_bytes
    tokens_per_session = args.rounds * (sum(QUESTION) // 2 + ANSWER)
    budget = 3 * 25 * stb  # room for about three full 24-token windows
    warm_cap = 4 * tokens_per_session * stb // 2  # about two sessions' history
    router = make_router(cold, warm, budget, warm_cap)
    print(f"model: random Llama, {geo.num_layers} layers x {geo.num_kv_heads} KV heads x "
          f"{geo.head_dim} ({geo.dtype}), {stb} KV bytes per token")
    print(f"router: hot window {router.max_kv_len} tokens, device budget {budget / 1024:.0f} KiB "
          f"(watermark {router.watermark:.0%}), warm cap {warm_cap / 1024:.0f} KiB, "
          f"{args.sessions} sessions x {args.rounds} rounds")
    sids = [f"agent-{i:02d}" for i in range(args.sessions)]
    convs = {s: torch.empty(1, 0, dtype=torch.long) for s in sids}
    recalls = 0
    t0 = time.perf_counter()
    bar = tqdm(total=args.sessions * args.rounds, unit="turn", desc="agents", dynamic_ncols=True)
    for rnd in range(args.rounds):
        for j, sid in enumerate(sids):
            cache = router.cache(sid, model)
            ids = torch.cat([convs[sid], question(sid, rnd, model.config.vocab_size)], 1)
            if rnd >= 4 and (rnd + j) % 5 == 0:
                # "what did you say earlier?": prefill the question, then recall the most
                # similar old round by summary; the answer attends to it
                with torch.no_grad():
                    model(input_ids=ids[:, cache.seen:-1], cache=cache, use_cache=True)
                if cache.recall(query=cache.current_summary(), k=1):
                    recalls += 1
            convs[sid] = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                                        max_new_tokens=ANSWER, do_sample=False)
            cache.end_round()
            st = router.stats()
            w = st["warm"]
            bar.set_postfix_str(
                f"hot {st['hot_bytes'] / 1024:.0f}K peak {st['peak_hot_bytes'] / 1024:.0f}K "
                f"moves {st['watermark_moves']} | warm {w.get('bytes', 0) / 1024:.0f}K "
                f"sess {w.get('sessions', 0)} -> cold {w.get('migrations', 0)}", refresh=False)
            bar.update()
    bar.close()
    elapsed = time.perf_counter() - t0
    router.flush()
    st = router.stats()
    print_table(router, st, sids, stb, elapsed, recalls)

    # the session to resume: the most recently served one whose window is full
    pick = next(s for s in reversed(router.sessions())
                if router.cache(s, model).stored == min(router.cache(s, model).seen, router.max_kv_len))
    live = router.cache(pick, model)
    nxt = question(pick, args.rounds, model.config.vocab_size)
    ref = TieredCache(model, max_kv_len=router.max_kv_len)  # a copy of the live state
    for lay, src in zip(ref.layers, live.layers, strict=True):
        lay.set_window(src.keys.clone(), src.values.clone(), src.seen)
    ids = torch.cat([convs[pick], nxt], 1)
    expected = model.generate(ids, cache=ref, max_new_tokens=ANSWER, do_sample=False)[0, -ANSWER:]
    router.close(to_cold=True)  # shutting down: every session complete on the mount
    return {"sid": pick, "conv": ids[0].tolist(), "expected": expected.tolist(),
            "seen": live.seen, "warm_cap": warm_cap}


def print_table(router, st: dict[str, Any], sids: list[str], stb: int, elapsed: float,
                recalls: int) -> None:
    print()
    hdr = f"{'session':<10} {'tokens':>7} {'rounds':>6} {'hot tok':>7} {'moved':>5} {'refill':>6} " \
          f"{'recall':>6} {'hit rate':>8}  {'below':<6}"
    print(hdr)
    print("-" * len(hdr))
    total_tokens = 0
    for sid in sids:
        p = st["per_session"][sid]
        total_tokens += p["seen"]
        where = router.warm.where(sid) or "-"
        print(f"{sid:<10} {p['seen']:>7} {p['rounds']:>6} {p['hot_tokens']:>7} {p['evicted_rounds']:>5} "
              f"{p['refills']:>6} {p['recalls']:>6} {p['hit_rate']:>8.1%}  {where:<6}")
    print("(hot tok: tokens on the device now; moved: rounds the budget watermark moved to warm; "
          "refill: times the window was read back before a step; below: warm and/or cold)")
    w = st["warm"]
    sp = st["spill"]
    print()
    print(f"hot   peak {st['peak_hot_bytes'] / 1024:8.1f} KiB of a {st['budget_bytes'] / 1024:.1f} KiB "
          f"budget (all KV in DynamicCache: {total_tokens * stb / 1024:.1f} KiB, "
          f"{total_tokens * stb / max(st['budget_bytes'], 1):.1f}x the budget); "
          f"{st['watermark_moves']} rounds moved out by the watermark; "
          f"kv_hot_hit_rate {st['kv_hot_hit_rate']:.1%} ({recalls} recalls)")
    print(f"spill {sp['written_bytes'] / 1024:8.1f} KiB hot -> warm in {sp['appends']} appends, "
          f"back-pressure stalls {sp['stalls']}, peak queue {sp['peak_pending_bytes'] / 1024:.1f} KiB")
    print(f"warm  {w.get('bytes', 0) / 1024:8.1f} KiB in {w.get('sessions', 0)} sessions "
          f"(cap {w.get('cap', 0) / 1024:.0f} KiB), {w.get('migrations', 0)} sessions migrated to cold, "
          f"{w.get('promotions', 0)} promoted back")
    print(f"time  {elapsed:.1f} s for {len(sids) * st['per_session'][sids[0]]['rounds']} turns")


def list_mount(cold: Path, sid: str) -> None:
    print()
    for cmd in (["ls", "-l", str(cold / "sessions")], ["ls", "-ls", str(cold / "sessions" / sid)]):
        print("$ " + " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = r.stdout.rstrip().splitlines()
        print("\n".join(lines[:14] + (["..."] if len(lines) > 14 else [])) or r.stderr.strip())
    meta = cold / "sessions" / sid / "meta.json"
    if meta.exists():
        print(f"$ cat {meta}")
        m = json.loads(meta.read_text())
        m["rounds"] = m["rounds"][:3] + [["..."]] if len(m["rounds"]) > 3 else m["rounds"]
        print(json.dumps(m))


# --------------------------------------------------------------------------- the resume
def resume_child(spec: dict[str, Any]) -> None:
    """Second process: resume the session from the mount and continue one turn."""
    import torch

    from kvfs.torch import KVRouter

    model = build_model()
    router = KVRouter(mount=spec["cold"], device="cpu", profile="gov", warm_root=spec["warm"],
                      warm_options={"cap_bytes": spec["warm_cap"], "group": 2, "shards": 256})
    t0 = time.perf_counter()
    cache = router.resume(spec["sid"], model)
    resume_ms = (time.perf_counter() - t0) * 1e3
    ids = torch.tensor([spec["conv"]])
    out = model.generate(ids, cache=cache, max_new_tokens=ANSWER, do_sample=False)[0, -ANSWER:]
    cache.end_round()
    router.close()
    print(json.dumps({"tokens": out.tolist(), "seen": cache.seen, "resume_ms": resume_ms}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-mount", action="store_true", help="cold tier in a plain directory")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--keep", action="store_true", help="keep the temp dir (and print it)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--resume-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.resume_child:
        resume_child(json.loads(args.resume_child))
        return 0
    use_mount = not args.no_mount
    if use_mount:
        ok, why = mount_available()
        if not ok:
            print(f"NOTE: cannot mount ({why}); using a plain directory as the cold tier")
            use_mount = False
    base = Path(tempfile.mkdtemp(prefix="kvfs-demo-"))
    warm = warm_dir(base)
    t_start = time.perf_counter()
    ok = False
    try:
        with Volume(base, use_mount) as vol:
            res = run_agents(args, vol.mnt, warm)
            list_mount(vol.mnt, res["sid"])
            print(f"\nresuming {res['sid']} ({res['seen']} tokens) in a new process ...")
            spec = {"cold": str(vol.mnt), "warm": str(warm), "sid": res["sid"], "conv": res["conv"],
                    "warm_cap": res["warm_cap"]}
            r = subprocess.run([sys.executable, __file__, "--resume-child", json.dumps(spec)],
                               capture_output=True, text=True, cwd=ROOT, timeout=300)
            if r.returncode != 0:
                print(r.stderr[-3000:])
                raise SystemExit("the resume process failed")
            child = json.loads(r.stdout.strip().splitlines()[-1])
            ok = child["tokens"] == res["expected"]
            print(f"resumed in {child['resume_ms']:.1f} ms; next answer in the new process: "
                  f"{child['tokens'][:8]}...")
            print(f"same as the process that never stopped: {'YES' if ok else 'NO'}"
                  + ("" if ok else f" (expected {res['expected']})"))
    finally:
        if args.keep:
            print(f"kept {base} and {warm}")
        else:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(warm, ignore_errors=True)
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
