#!/usr/bin/env python3
"""Held-out chats of the memory benchmark: ``python tools/bench_memory.py --chats ...``.

Customer-service conversations from :mod:`memory_chats` (a fixed dev/test split, five
families, ChatML and plain; see its docstring), fed as :mod:`bench_memory` feeds its
dialogues: one forward step per round, ``end_round()`` after it. Family d closes the session
and resumes it through a fresh router over the same mount (a directory here) between the
fact and the question, family e forks it there and asks in the fork. Answers are at least 12
tokens (a 6-digit number is six of SmolLM2's tokens) and scored correct / stale / wrong by
``memory_chats.score``; the table gives per family, length, format and configuration the
share of the full cache's correct answers that the configuration also answers correctly,
with a 95 % Wilson interval.

Configurations are :class:`bench_memory.Configs` names: ``full``, a profile, and variants
``profile+sel=S+block=N+bytes=M`` (:func:`bench_memory.variant`). ``--merge A.json B.json``
(``--json`` files, or the ``--records`` JSONL a run appends to as each chat ends)
prints the table of earlier runs' records together (runs of the same chats, split and
lengths under different configurations: each record names its chat and configuration).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bench_memory import Configs, variant

log = logging.getLogger("bench.memory")


def answer_ids(tok: Any, prefix: str, want: str) -> list[int]:
    """The token ids of `` want`` after ``prefix`` (as the tokenizer cuts the two together)."""
    enc = lambda x: tok.encode(x, add_special_tokens=False)  # noqa: E731
    head, both = enc(prefix), enc(f"{prefix} {want}")
    return both[len(head):] if both[:len(head)] == head else enc(f" {want}")


def fact_cover(cache: Any, rendered: Any, fact_round: int) -> list[int] | None:
    """Where each layer's keys hold the fact's round when the answer begins (after the
    question's step): 2 in the sinks or the window (a part of it), 1 among the blocks
    chosen for the next step, 0 in neither; None without retrieval."""
    ret = getattr(cache, "retrieval", None)
    if ret is None:
        return None
    start = sum(map(len, rendered.rounds[:fact_round]))
    end = start + len(rendered.rounds[fact_round])
    lay = ret.layout
    first, last = (max(start, lay.origin) - lay.origin) // lay.block, (end - 1 - lay.origin) // lay.block
    out = []
    for layer, chosen in enumerate(ret.chosen):
        if end <= lay.origin or last >= ret.count[layer]:  # in the sinks, or not all out of the window
            out.append(2)
        else:
            out.append(int(any(first <= b <= last for b in chosen)))
    return out


def run_chat(model: Any, tok: Any, configs: Configs, name: str, chat: Any, rendered: Any,
             new_tokens: int, forced: bool = False, covers: list[Any] | None = None) -> list[Any]:
    """Feed ``rendered`` round by round under configuration ``name``; families d and e
    resume or fork the session after round ``chat.break_after``; the answer to each question
    (``forced``: instead of generating, the prefix and the wanted answer are fed one token a
    step, and each question gives ``(log-probability of the answer's tokens, whether each
    was the most likely)``: what greedy decoding would have written, and how close it was).
    ``covers`` gains, per question, :func:`fact_cover` of the fact it asks about and of its
    correction (family c; else None)."""
    import torch

    cache, sid = configs.session(name)
    sids = [sid]
    live = variant(name)[1].get("live", False) if name != "full" else True
    ids: list[int] = []
    answers: list[Any] = []

    def cover(k: int) -> None:
        if covers is not None:
            fix = chat.info.get("correction_round") if k == 0 else None
            covers.append((fact_cover(cache, rendered, chat.fact_rounds[k]),
                           None if fix is None else fact_cover(cache, rendered, fix)))

    def feed(x: list[int], end: bool = True) -> torch.Tensor:
        out = model(input_ids=torch.tensor([x]), cache=cache, use_cache=True)
        ids.extend(x)
        if end and hasattr(cache, "end_round"):
            cache.end_round()
        return out.logits[0, -1]
    try:
        with torch.no_grad():
            for i, rnd in enumerate(rendered.rounds):
                feed(rnd)
                if live or i != chat.break_after:
                    continue
                if chat.family == "d":
                    cache = configs.resume(name, sid) or cache
                elif chat.family == "e":
                    got = configs.fork(name, sid)
                    if got is not None:
                        cache, new = got
                        sids.append(new)
            for k, (q, prefix) in enumerate(rendered.questions):
                if forced:  # the prefix as generate feeds it (one step), then the answer
                    feed((rendered.after_answer if k else []) + q)
                    cover(k)
                    logits = feed(prefix, end=False)
                    lp, ok = 0.0, True
                    for t in answer_ids(tok, chat.questions[k].prefix, chat.questions[k].want[0]):
                        logp = torch.log_softmax(logits.float(), -1)
                        lp += float(logp[t])
                        ok = ok and int(logp.argmax()) == t
                        logits = feed([t], end=False)
                    answers.append((lp, ok))
                    if hasattr(cache, "end_round"):
                        cache.end_round()
                    continue
                feed((rendered.after_answer if k else []) + q)
                cover(k)
                x = torch.tensor([ids + prefix])
                out = model.generate(x, attention_mask=torch.ones_like(x), cache=cache,
                                     max_new_tokens=new_tokens, do_sample=False)
                answers.append(tok.decode(out[0, x.shape[1]:].tolist(), skip_special_tokens=True))
                ids[:] = out[0].tolist()[:-1]  # generate does not feed its last token
                if hasattr(cache, "end_round"):
                    cache.end_round()
    finally:
        if sid is not None:
            configs.delete(name, *sids)
    return answers


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of ``k`` successes in ``n``."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return (max(0.0, c - h), min(1.0, c + h))


def mean_logprob(rs: list[dict[str, Any]]) -> float | None:
    """Mean log-probability of the wanted answers (``--forced`` records; else None)."""
    lps = [r["logprob"] for r in rs if r.get("logprob") is not None]
    return sum(lps) / len(lps) if lps else None


def chat_rows(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per family, length, format and configuration: correct, stale, and the share of the
    full cache's correct answers it also answers correctly (with its Wilson interval)."""
    cells: dict[tuple, dict[str, list]] = {}
    for r in records:
        cells.setdefault((r["family"], r["length"], r["format"]), {}).setdefault(
            r["config"], []).append(r)
    rows = []
    for (fam, n, fmt), by in sorted(cells.items()):
        ref = {(r["chat"], r["question"]): r["verdict"] == "correct" for r in by.get("full", [])}
        base = sum(ref.values())
        for name in names:
            rs = by.get(name, [])
            if not rs:  # runs merged: a configuration that did not run this cell
                continue
            both = sum(r["verdict"] == "correct" and ref.get((r["chat"], r["question"]), False)
                       for r in rs)
            lo, hi = wilson(both, base)
            rows.append({"family": fam, "length": n, "format": fmt, "config": name,
                         "questions": len(rs),
                         "correct": sum(r["verdict"] == "correct" for r in rs),
                         "stale": sum(r["verdict"] == "stale" for r in rs),
                         "full_correct": base, "of_full": both / base if base else None,
                         "logprob": mean_logprob(rs),
                         "ci95": [lo, hi] if base else None})
    return rows


def twin_rows(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per configuration ``X`` run beside its twin ``X+live``, family and length: of the
    questions of resumed (d) or forked (e) chats, how many got the very answer the session
    that stayed live got on the same chat, and each one's correct count."""
    by: dict[tuple[str, str, int, int], dict[str, Any]] = {}
    for r in records:
        by[(r["config"], r["chat"], r["format"] == "plain", r["question"])] = r
    rows = []
    for name in names:
        twin = f"{name}+live"
        if name == "full" or twin not in names:
            continue
        cells: dict[tuple[str, int, str], list[int]] = {}
        for (cfg, chat, plain, q), r in by.items():
            t = by.get((twin, chat, plain, q))
            if cfg != name or t is None or r["family"] not in ("d", "e"):
                continue
            c = cells.setdefault((r["family"], r["length"], r["format"]), [0, 0, 0, 0])
            c[0] += 1
            c[1] += r["answer"] == t["answer"]
            c[2] += r["verdict"] == "correct"
            c[3] += t["verdict"] == "correct"
        rows += [{"config": name, "family": f, "length": n, "format": fmt, "questions": c[0],
                  "same_answer": c[1], "correct": c[2], "correct_live": c[3]}
                 for (f, n, fmt), c in sorted(cells.items())]
    return rows


def cover_rows(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per configuration with retrieval, of the questions the full cache answers correctly
    whose fact had left the window: for those it also answers (``hit``) and those it misses,
    how many layers attended the fact's round when the answer began, and each layer's share
    of those questions in which it did (:func:`fact_cover`). Family c is left out: its fact's
    round is the statement the correction made stale."""
    ref = {(r["chat"], r["format"], r["question"]) for r in records
           if r["config"] == "full" and r["verdict"] == "correct"}
    rows = []
    for name in names:
        groups: dict[str, list[list[int]]] = {"hit": [], "miss": []}
        for r in records:
            cov = r.get("cover")
            if (r["config"] != name or not cov or r["family"] == "c"
                    or (r["chat"], r["format"], r["question"]) not in ref):
                continue
            if all(c == 2 for c in cov):  # still in the window: nothing to choose
                continue
            groups["hit" if r["verdict"] == "correct" else "miss"].append(cov)
        for g, covs in groups.items():
            if covs:
                layers = len(covs[0])
                rows.append({"config": name, "group": g, "questions": len(covs),
                             "layers_attending": sum(sum(c > 0 for c in cov) for cov in covs) / len(covs),
                             "of_layers": layers,
                             "per_layer": [sum(cov[i] > 0 for cov in covs) / len(covs) for i in range(layers)]})
    return rows


def print_covers(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print("\nlayers attending the fact's round as the answer begins (questions the full cache "
          "answers, fact out of the window; family c left out)")
    for r in rows:
        per = " ".join(f"{i}:{100 * s:.0f}" for i, s in enumerate(r["per_layer"]))
        print(f"  {r['config']:>20} {r['group']:>4}: {r['questions']:>3} questions, "
              f"{r['layers_attending']:.1f} of {r['of_layers']} layers; % of them per layer: {per}")


def miss_rows(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per cell and configuration other than the full cache: each question the full cache
    answers correctly and it does not, with the fact's depth, the answer's verdict and the
    layers attending the fact's round (and, family c, the correction's) as the answer began."""
    ref = {(r["chat"], r["format"], r["question"]) for r in records
           if r["config"] == "full" and r["verdict"] == "correct"}
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r["config"] in names and r["config"] != "full" and r["verdict"] != "correct" \
                and (r["chat"], r["format"], r["question"]) in ref:
            cells.setdefault((r["family"], r["length"], r["format"], r["config"]), []).append(r)
    rows = []
    for (fam, n, fmt, name), rs in sorted(cells.items()):
        rows.append({"family": fam, "length": n, "format": fmt, "config": name, "misses": [
            {"chat": r["chat"], "question": r["question"], "depth": r["depth"], "verdict": r["verdict"],
             "answer": r["answer"], "want": r["want"], "layers": _attending(r.get("cover")),
             "correction_depth": r.get("correction_depth"),
             "correction_layers": _attending(r.get("correction_cover"))} for r in rs]})
    return rows


def _attending(cover: list[int] | None) -> str | None:
    """``k/L`` layers attending a round (chosen or in the window), ``window`` when all hold
    it in the window; None without a record of it."""
    if not cover:
        return None
    if all(c == 2 for c in cover):
        return "window"
    return f"{sum(c > 0 for c in cover)}/{len(cover)}"


def print_misses(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print("\nwhere the full cache's correct answers are missed (the fact's depth, the answer, the "
          "layers attending the fact's round as the answer began; c: the correction's too)")
    for r in rows:
        print(f"  {r['family']} {r['length']} {r['format']} {r['config']}: {len(r['misses'])} missed")
        for m in sorted(r["misses"], key=lambda m: m["depth"]):
            fix = "" if m["correction_depth"] is None else \
                f"; correction at {m['correction_depth']:.2f}, {m['correction_layers'] or '?'} layers"
            print(f"    {m['chat']}:{m['question']} depth {m['depth']:.2f} {m['verdict']:>5} "
                  f"{m['layers'] or '?'} layers{fix}: {m['answer'].strip()[:24]!r} for {m['want']!r}")


def print_twins(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print("\nresumed (d) and forked (e) sessions against their live twins (the same chats)")
    print(f"  {'family':>6} {'tokens':>6} {'format':>6} {'config':>28}  same answer  correct  live twin")
    for r in rows:
        print(f"  {r['family']:>6} {r['length']:>6} {r['format']:>6} {r['config']:>28}  "
              f"{r['same_answer']:>4}/{r['questions']:<6} {r['correct']:>7}  {r['correct_live']:>9}")


def chat_plot(records: list[dict[str, Any]], names: list[str], path: str) -> None:
    """Accuracy by the fact's depth, a line per length, a panel per configuration and a row
    per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in records})
    formats = sorted({r["format"] for r in records})
    fig, axes = plt.subplots(len(formats), len(names), figsize=(3.2 * len(names), 3 * len(formats)),
                             sharey=True, squeeze=False)
    for row, fmt in zip(axes, formats, strict=True):
        for ax, name in zip(row, names, strict=True):
            for i, n in enumerate(lengths):
                pts: dict[float, list[bool]] = {}
                for r in records:
                    if r["config"] == name and r["length"] == n and r["format"] == fmt:
                        pts.setdefault(round(r["depth"], 1), []).append(r["verdict"] == "correct")
                xs = sorted(pts)
                if xs:
                    ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", color=f"C{i}",
                            label=f"{n} tokens")
            ax.set_title(f"{name}, {fmt}")
            ax.set_xlabel("depth of the fact")
            ax.set_xlim(0, 1)
            ax.set_ylim(-0.05, 1.05)
        row[0].set_ylabel("correct")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_chats(model: Any, tok: Any, names: list[str], split: str, families: list[str],
              lengths: list[int], trials: int, formats: list[str], new_tokens: int,
              forced: bool = False, jsonl: str | None = None, first: int = 0) -> list[dict[str, Any]]:
    """Every chat of the cells, in every format, under every configuration: one record a
    question (also appended to ``jsonl`` as each chat ends, when given)."""
    import json

    import memory_chats as mc

    configs = Configs(model, names, mounted=True)
    records = []
    try:
        for chat in mc.chats(tok, split, families, lengths, trials, first):
            for fmt in formats:
                rendered = mc.render(tok, chat, fmt)
                verdicts = []
                for name in names:
                    t0 = time.perf_counter()
                    covers: list[Any] = []
                    answers = run_chat(model, tok, configs, name, chat, rendered, new_tokens, forced, covers)
                    for k, (q, a) in enumerate(zip(chat.questions, answers, strict=True)):
                        lp = None
                        if forced:
                            lp, a = round(a[0], 3), q.want[0] if a[1] else ""
                        v = mc.score(a, q.want, q.stale)
                        verdicts.append(f"{name} {v}" + ("" if lp is None else f" {lp:.1f}"))
                        records.append({"chat": chat.name, "family": chat.family, "length": chat.target,
                                        "format": fmt, "config": name, "question": k,
                                        "depth": chat.depths[k], "tokens": rendered.tokens,
                                        "answer": a, "want": q.want[0], "verdict": v, "logprob": lp,
                                        "cover": covers[k][0] if k < len(covers) else None,
                                        "correction_cover": covers[k][1] if k < len(covers) else None,
                                        "correction_depth": chat.info.get("correction_depth") if k == 0 else None,
                                        "seconds": round(time.perf_counter() - t0, 1)})
                log.info("chat %s %s (%d tokens): %s", chat.name, fmt, rendered.tokens, ", ".join(verdicts))
                if jsonl:
                    with open(jsonl, "a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in records[-len(verdicts):])
    finally:
        configs.close()
    return records



def add_arguments(p: Any) -> None:
    """bench_memory's options for the chats."""
    p.add_argument("--chats", action="store_true",
                   help="only the held-out customer-service chats (tools/memory_chats.py)")
    p.add_argument("--split", choices=["dev", "test"], default="dev",
                   help="chats: dev (choose on it) or test (report only)")
    p.add_argument("--trials", type=int, default=40, help="chats per family and length")
    p.add_argument("--first-trial", type=int, default=0,
                   help="chats: start at this trial of each cell (split a run over processes; "
                        "--merge their --records)")
    p.add_argument("--lengths", default="500,1000,1900", help="chats: target tokens")
    p.add_argument("--families", default="a,b,c,d,e", help="chats: families (a-e)")
    p.add_argument("--format", choices=["chatml", "plain", "both"], default="both")
    p.add_argument("--plot", help="chats: write the accuracy plot here (PNG)")
    p.add_argument("--records", help="chats: append each chat's records to this JSONL file")
    p.add_argument("--forced", action="store_true",
                   help="chats: feed the wanted answer instead of generating; log-probability "
                        "and whether greedy decoding would write it (faster, finer)")


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title} (share of the full cache's correct answers, 95 % Wilson interval)")
    print(f"  {'family':>6} {'tokens':>6} {'format':>6} {'config':>28}  correct  stale  logprob  of full")
    for r in rows:
        of = "n/a" if r["of_full"] is None else (
            f"{100 * r['of_full']:.0f}% [{100 * r['ci95'][0]:.0f}-{100 * r['ci95'][1]:.0f}]")
        lp = "" if r.get("logprob") is None else f"{r['logprob']:.2f}"
        print(f"  {r['family']:>6} {r['length']:>6} {r['format']:>6} {r['config']:>28}  "
              f"{r['correct']:>3}/{r['questions']:<3} {r['stale']:>5}  {lp:>7}  {of}")


def chats_report(model: Any, tok: Any, names: list[str], args: Any) -> dict[str, Any]:
    """Run the chats of ``args`` (bench_memory's options), print the table, plot; the
    results (rows and one record a question)."""
    formats = ["chatml", "plain"] if args.format == "both" else [args.format]
    lengths = [int(x) for x in args.lengths.split(",")]
    t0 = time.time()
    records = run_chats(model, tok, names, args.split, args.families.split(","), lengths,
                        args.trials, formats, max(args.new_tokens, 12), args.forced, args.records,
                        args.first_trial)
    rows = chat_rows(records, names)
    print_rows(rows, f"held-out chats, {args.split} split, {args.trials} per cell, "
                     f"{time.time() - t0:.0f} s")
    twins = twin_rows(records, names)
    print_twins(twins)
    print_covers(cover_rows(records, names))
    print_misses(miss_rows(records, names))
    if args.plot:
        chat_plot(records, names, args.plot)
        log.info("plot written to %s", args.plot)
    return {"split": args.split, "rows": rows, "twins": twins, "records": records}


def merge(paths: list[str], plot: str | None = None, configs: list[str] | None = None
          ) -> list[dict[str, Any]]:
    """The rows of the records of several runs' JSON files (``--json``), printed; only
    ``configs`` when given (the full cache's records are kept: the shares are of its)."""
    import json

    records: list[dict[str, Any]] = []
    names: list[str] = []
    for p in paths:
        text = open(p).read()
        got = [json.loads(x) for x in text.splitlines() if x] if p.endswith(".jsonl") else \
            json.loads(text)["chats"]["records"]
        if configs is not None:
            got = [r for r in got if r["config"] in configs or r["config"] == "full"]
        records += got
        names += [n for n in dict.fromkeys(r["config"] for r in got) if n not in names]
    rows = chat_rows(records, names)
    print_rows(rows, f"held-out chats, {len(paths)} runs merged")
    print_twins(twin_rows(records, names))
    print_covers(cover_rows(records, names))
    print_misses(miss_rows(records, names))
    if plot:
        chat_plot(records, names, plot)
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the table of earlier runs of bench_memory.py --chats")
    ap.add_argument("--merge", nargs="+", required=True, metavar="RECORDS",
                    help="--json files or --records JSONL files of runs of the same chats")
    ap.add_argument("--plot", help="write the accuracy plot here (PNG)")
    ap.add_argument("--configs", help="only these configurations (the full cache is always kept)")
    a = ap.parse_args()
    merge(a.merge, a.plot, a.configs.split(",") if a.configs else None)
