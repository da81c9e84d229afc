#!/usr/bin/env python3
"""Memory on a real model: pass keys and facts asked rounds later (SmolLM2-135M-Instruct).

    python tools/bench_memory.py [--quick] [--json OUT]   (docs/quality.md, "Memory")
    python tools/bench_memory.py --chats --split dev|test [--trials N] [--lengths 500,1000,1900]
        [--families a,b,c,d,e] [--format chatml|plain|both] [--plot OUT.png] [--forced]
    python tools/bench_memory_chats.py --merge RUN.json|RUN.jsonl ...

Each conversation is fed round by round, as an agent feeds its model: one forward step per
round, ``end_round()`` after it (a cache cannot change the prefill mask, so a single long
prompt would be attended in full during its own prefill). Then the question is one more
round and the answer is generated greedily after a forced prefix. Every configuration sees
the same rounds:

* ``full``: transformers' ``DynamicCache`` (the reference);
* ``gov`` / ``ecommerce`` / ``iot``: a ``KVRouter`` with the profile's defaults (window,
  sinks, retrieval and its budget), the product as shipped;
* ``<profile>-window``: the same with ``retrieval=False``: the sinks and the window only
  (StreamingLLM), which shows the tests measure memory.

Pass keys (the test of Landmark Attention, InfLLM): the filler "The grass is green. The sky is
blue. The sun is yellow. Here we go. There and back again." two sentences a round, "The pass key
is 12345. Remember it. 12345 is the pass key." at a depth of 0-100 %, then the round "What is
the pass key?" and the answer after "The pass key is": correct when it holds the five digits.

Facts: a dialogue ("User: ... / Assistant: ..." lines, one exchange a round) whose first three
rounds give a name, a city and a number, then 30 rounds of small talk (none of it names a
person, a city or a number; ~700 tokens in all, so that the blocks a profile attends hold a
fraction of it), then the three questions, each a round, answered after "Your name is" / "You
live in" / "Your favorite number is": correct when the answer's first line holds the fact.

Held-out chats (``--chats``, only this part): tools/bench_memory_chats.py.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.memory")

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again."]
NAMES = ["Alice", "Marco", "Priya", "Johan", "Fatima", "Kenji", "Olga", "Diego", "Amara", "Liam",
         "Sofia", "Hamid", "Greta", "Tomas", "Nadia", "Oscar", "Leila", "Victor", "Mei", "Rafael",
         "Ingrid", "Pablo", "Yusuf", "Elena"]
CITIES = ["Lisbon", "Toronto", "Nairobi", "Oslo", "Melbourne", "Kyoto", "Denver", "Madrid", "Cairo",
          "Dublin", "Seoul", "Prague", "Lima", "Vienna", "Chicago", "Athens", "Hanoi", "Boston",
          "Zurich", "Manila", "Helsinki", "Bogota", "Perth", "Dakar"]
SMALL_TALK = [
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What do bees make?", "Bees make honey."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Can you name a primary color?", "Red is a primary color."),
    ("What animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("What do plants need to grow?", "Plants need sunlight, water and soil to grow."),
    ("What is a good breakfast?", "Oatmeal with fruit is a good breakfast."),
    ("Why do leaves change color in autumn?", "Leaves change color because they stop making chlorophyll."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What do cows eat?", "Cows eat grass."),
    ("How do fish breathe?", "Fish breathe through their gills."),
    ("What is rain made of?", "Rain is made of water droplets."),
]
FACT_QUESTIONS = (("name", "What is my name?", "Your name is"),
                  ("city", "Which city do I live in?", "You live in"),
                  ("number", "What is my favorite number?", "Your favorite number is"))


@dataclass
class Trial:
    """One conversation: its rounds (token ids), and per question its round, the forced
    answer prefix and what a correct answer contains."""

    name: str
    rounds: list[list[int]]
    questions: list[tuple[list[int], list[int], str]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rounds)


def passkey_trials(tok: Any, lengths: list[int], depths: list[float], seed: int = 0,
                   per_round: int = 2) -> list[Trial]:
    """Per length and depth one conversation of about ``length`` tokens, ``per_round``
    filler sentences a round."""
    out = []
    for n in lengths:
        for d in depths:
            rng = random.Random(f"{seed}-{n}-{d}")
            key = rng.randint(10000, 99999)
            first = tok.encode(FILLER[0])
            rounds, i = [first], 1
            while sum(map(len, rounds)) < n:
                rounds.append(tok.encode(" " + " ".join(FILLER[(i + j) % len(FILLER)]
                                                        for j in range(per_round))))
                i += per_round
            at = min(len(rounds), max(1, round(d * len(rounds))))
            rounds.insert(at, tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key."))
            q = tok.encode("\nWhat is the pass key?")
            out.append(Trial(f"pk-{n}-{d:.2f}", rounds, [(q, tok.encode(" The pass key is"), str(key))],
                             {"length": n, "depth": d, "key": key}))
    return out


def _small_talk(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` rounds of small talk: the exchanges shuffled, reshuffled when used up (no
    exchange twice in a row)."""
    out: list[tuple[str, str]] = []
    while len(out) < n:
        more = rng.sample(SMALL_TALK, len(SMALL_TALK))
        if out and more[0] == out[-1]:
            more.append(more.pop(0))
        out += more
    return out[:n]


def fact_trials(tok: Any, n: int, small_talk: int = 30, seed: int = 0) -> list[Trial]:
    """``n`` dialogues: name, city, number in the first three rounds, ``small_talk`` rounds,
    then the three questions (each ``small_talk`` + 1 or more rounds after its fact)."""
    out = []
    for t in range(n):
        rng = random.Random(f"{seed}-facts-{t}")
        name, city, num = rng.choice(NAMES), rng.choice(CITIES), rng.randint(10, 99)
        lines = [(f"Hi! My name is {name}.", "Nice to meet you! How can I help you today?"),
                 (f"I live in {city}.", "That sounds like a lovely place to live."),
                 (f"My favorite number is {num}.", "Thanks for telling me."),
                 *_small_talk(rng, small_talk)]
        rounds = [tok.encode(f"User: {u}\nAssistant: {a}\n") for u, a in lines]
        facts = {"name": name, "city": city, "number": str(num)}
        qs = [(tok.encode(f"User: {q}\n"), tok.encode(f"Assistant: {pre}"), facts[kind])
              for kind, q, pre in FACT_QUESTIONS]
        out.append(Trial(f"facts-{t}", rounds, qs, facts))
    return out


def variant(name: str) -> tuple[str, dict[str, Any]]:
    """``profile[-window][+sel=S][+block=N][+bytes=M][+share=F][+most=M][+step=prev][+live]``
    (M in MiB): the profile and what differs from its defaults (a retrieval selector, block
    size, device bytes, the share of old blocks the budget grows to and the device bytes it
    grows to at most, a turn attending the blocks the
    step before chose instead of its own; ``live``: the session is neither resumed nor forked
    where the chat's family would, the twin a resumed or forked session is compared with)."""
    base, *mods = name.split("+")
    opts: dict[str, Any] = {}
    for m in mods:
        if m == "live":
            opts["live"] = True
            continue
        k, _, v = m.partition("=")
        if k not in ("sel", "block", "bytes", "share", "most", "step") or (
                k == "step" and v not in ("own", "prev")):
            raise ValueError(f"unknown configuration option {m!r} in {name!r}")
        opts[k] = (v if k in ("sel", "step") else int(v) << 20 if k in ("bytes", "most")
                   else float(v) if k == "share" else int(v))
    return base, opts


class Configs:
    """The caches under test: ``full`` and, per profile, its defaults (retrieval on) and its
    sinks + window only; each trial gets a fresh session, deleted after it."""

    def __init__(self, model: Any, names: list[str], workdir: str | None = None,
                 mounted: bool = False) -> None:
        self.model, self.names = model, names
        self.tmp = Path(tempfile.mkdtemp(prefix="kvfs-memory-", dir=workdir))
        self._routers: dict[str, Any] = {}
        self._n = 0
        # a directory as the mount: what a resume through a fresh router reads back
        self.mount = self.tmp / "cold" if mounted else None
        if self.mount is not None:
            (self.mount / "sessions").mkdir(parents=True)
        self._warm_n = 0

    def router(self, name: str) -> Any:
        from kvfs.torch import KVRouter

        if name not in self._routers:
            base, opts = variant(name)
            profile, _, kind = base.partition("-")
            self._warm_n += 1  # a fresh router gets a fresh warm tier: it reads the mount
            self._routers[name] = KVRouter(
                mount=None if self.mount is None else str(self.mount), device="cpu",
                profile=profile, warm_root=str(self.tmp / f"{self._warm_n}"),
                retrieval=False if kind == "window" else None,
                retrieval_block=opts.get("block"), retrieval_bytes=opts.get("bytes"),
                retrieval_share=opts.get("share"), retrieval_max_bytes=opts.get("most"),
                warm_options={"shards": 16, "cap_bytes": 2 << 30})
        return self._routers[name]

    def selecting(self, name: str) -> Any:
        """A context in which new retrievals of configuration ``name`` use its selector."""
        import contextlib

        import kvfs.torch.retrieval as retrieval

        opts = variant(name)[1]
        sel = opts.get("sel")

        @contextlib.contextmanager
        def ctx() -> Any:
            old, old_step = retrieval.DEFAULT_SELECTOR, retrieval.IN_STEP
            retrieval.DEFAULT_SELECTOR = sel or old
            retrieval.IN_STEP = opts.get("step", "own") == "own"
            try:
                yield
            finally:
                retrieval.DEFAULT_SELECTOR, retrieval.IN_STEP = old, old_step
        return ctx()

    def resume(self, name: str, sid: str) -> Any:
        """Session ``sid`` closed and resumed through a fresh router over the same mount
        (the full cache has nothing to resume: None)."""
        if name == "full":
            return None
        self._routers.pop(name).close()
        with self.selecting(name):
            return self.router(name).resume(sid, self.model)

    def fork(self, name: str, sid: str) -> tuple[Any, str] | None:
        """(the fork's cache, its id); None for the full cache (a fork of it is itself)."""
        if name == "full":
            return None
        new = f"{sid}-fork"
        with self.selecting(name):
            return self.router(name).fork(sid, new, self.model), new

    def cache(self, name: str) -> tuple[Any, Any]:
        """(cache, release) for a fresh session of configuration ``name``."""
        c, sid = self.session(name)
        return c, (lambda: None) if sid is None else (lambda: self.delete(name, sid))

    def session(self, name: str) -> tuple[Any, str | None]:
        """(cache, session id) of a fresh session (``full``: a DynamicCache, no id)."""
        if name == "full":
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config), None
        self._n += 1
        sid = f"{self._n}-m"  # a device id first: the iot profile shards by it
        with self.selecting(name):
            return self.router(name).cache(sid, self.model, fresh=True), sid

    def delete(self, name: str, *sids: str) -> None:
        r = self.router(name)
        for sid in sids:
            r.delete(sid)

    def settings(self, name: str) -> dict[str, Any]:
        if name == "full":
            return {}
        r = self.router(name)
        c, release = self.cache(name)
        ret = c.retrieval
        out = {"max_kv_len": r.max_kv_len, "sink_tokens": r.sink_tokens,
               "retrieval": ret is not None,
               "retrieval_bytes": r.retrieval_bytes if ret else 0,
               "blocks_attended": ret.attend if ret else 0, "block": ret.block if ret else 0,
               "selector": ret.selector.name if ret else None}
        release()
        return out

    def close(self) -> None:
        for r in self._routers.values():
            r.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_trial(model: Any, tok: Any, cache: Any, trial: Trial, new_tokens: int) -> list[str]:
    """Feed ``trial`` round by round into ``cache``; the answer to each question."""
    import torch

    ids: list[int] = []
    answers = []
    with torch.no_grad():
        for r in trial.rounds:
            model(input_ids=torch.tensor([r]), cache=cache, use_cache=True)
            ids += r
            if hasattr(cache, "end_round"):
                cache.end_round()
        for q, prefix, _ in trial.questions:
            model(input_ids=torch.tensor([q]), cache=cache, use_cache=True)
            ids += q
            if hasattr(cache, "end_round"):
                cache.end_round()
            x = torch.tensor([ids + prefix])
            out = model.generate(x, attention_mask=torch.ones_like(x), cache=cache,
                                 max_new_tokens=new_tokens, do_sample=False)
            new = out[0, x.shape[1]:].tolist()
            answers.append(tok.decode(new, skip_special_tokens=True))
            ids = out[0].tolist()[:-1]  # generate does not feed its last token
            if hasattr(cache, "end_round"):
                cache.end_round()
    return answers


def correct(answer: str, want: str) -> bool:
    return want.lower() in answer.strip().split("\n")[0].lower()


def run(model: Any, tok: Any, trials: list[Trial], configs: Configs, new_tokens: int,
        label: str) -> dict[str, Any]:
    """Every trial under every configuration (trial by trial, configurations in turn)."""
    res: dict[str, Any] = {n: {"correct": [], "answers": [], "seconds": 0.0} for n in configs.names}
    for i, trial in enumerate(trials):
        for name in configs.names:
            cache, release = configs.cache(name)
            t0 = time.perf_counter()
            try:
                answers = run_trial(model, tok, cache, trial, new_tokens)
            finally:
                release()
            res[name]["seconds"] += time.perf_counter() - t0
            res[name]["answers"].append(answers)
            res[name]["correct"].append([correct(a, q[2]) for a, q in zip(answers, trial.questions,
                                                                         strict=True)])
        row = "  ".join(f"{n} {sum(map(sum, res[n]['correct']))}" for n in configs.names)
        log.info("%s %d/%d %s (%d tokens): %s", label, i + 1, len(trials), trial.name, trial.tokens, row)
    return res


def summary(res: dict[str, Any], ref: str = "full") -> dict[str, Any]:
    """Per configuration: correct answers, and how many of the reference's correct answers it
    also answers correctly (the goal's measure)."""
    base = [c for trial in res[ref]["correct"] for c in trial]
    out = {}
    for name, r in res.items():
        mine = [c for trial in r["correct"] for c in trial]
        both = sum(a and b for a, b in zip(base, mine, strict=True))
        out[name] = {"correct": sum(mine), "questions": len(mine),
                     "of_reference": both / sum(base) if sum(base) else None,
                     "seconds": round(r["seconds"], 1)}
    return out


def passkey_lengths(quick: bool) -> tuple[list[int], list[float]]:
    """Lengths (tokens) and depths of the pass-key trials: 2 x 20 = 40 (quick: 2 x 3)."""
    if quick:
        return [400, 800], [0.2, 0.5, 0.8]
    return [400, 800], [i / 19 for i in range(20)]


def profile_perplexity(model: Any, ids: Any, configs: Configs, round_every: int) -> dict[str, Any]:
    """Perplexity token by token (bench_quality's loop) of every configuration, as a ratio to
    the full cache; the configurations stepped in turn, so their step times compare."""
    from bench_quality import perplexities

    caches, releases = {}, []
    for name in configs.names:
        c, release = configs.cache(name)
        caches[name] = c
        releases.append(release)
    try:
        got = perplexities(model, ids, caches, round_every)
    finally:
        for release in releases:
            release()
    full = got["full"][0]
    return {name: {"ppl": p, "ratio": p / full} for name, (p, _) in got.items()}


def step_cost(model: Any, configs: Configs, tokens: int, steps: int, round_tokens: int = 64,
              subject: str = "gov") -> dict[str, Any]:
    """Median and mean decode step of a ``tokens``-token session with retrieval
    (``subject``: gov or a variant of it) and without (gov-window), stepped in turn after the
    same prefill (rounds of ``round_tokens``). The mean holds the steps that score the
    blocks (a block leaving the window), which the median does not show."""
    import statistics

    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, tokens + steps), generator=g)
    names = [subject, "gov-window"]
    caches, releases = {}, []
    for name in names:
        caches[name], release = configs.cache(name)
        releases.append(release)
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        with torch.no_grad():
            for name in names:
                for a in range(0, tokens, round_tokens):
                    model(input_ids=ids[:, a:min(tokens, a + round_tokens)], cache=caches[name], use_cache=True)
                    caches[name].end_round()
            for t in range(tokens, tokens + steps):
                for name in (names if t % 2 == 0 else names[::-1]):
                    t0 = time.perf_counter()
                    model(input_ids=ids[:, t:t + 1], cache=caches[name], use_cache=True)
                    times[name].append((time.perf_counter() - t0) * 1e3)
        ret = caches[subject].retrieval
        info = {"blocks_attended": ret.attended_tokens // ret.block if ret else 0}
    finally:
        for release in releases:
            release()
    on, off = statistics.median(times[subject]), statistics.median(times["gov-window"])
    mon, moff = statistics.fmean(times[subject]), statistics.fmean(times["gov-window"])
    return {"config": subject, "tokens": tokens, "steps": steps, "step_ms_retrieval": on, "step_ms_window": off,
            "ratio": on / off, "mean_ms_retrieval": mon, "mean_ms_window": moff, "mean_ratio": mon / moff,
            **info}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few trials of each kind (minutes)")
    p.add_argument("--facts", type=int, default=20, help="fact dialogues (default 20)")
    p.add_argument("--small-talk", type=int, default=30,
                   help="rounds between the facts and the questions (default 30)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--configs", default="full,gov,ecommerce,iot,gov-window",
                   help="full, a profile, <profile>-window, or <profile>+sel=S+block=N+bytes=MiB")
    p.add_argument("--no-passkey", action="store_true")
    p.add_argument("--no-facts", action="store_true")
    p.add_argument("--no-ppl", action="store_true")
    p.add_argument("--no-cost", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    from bench_memory_chats import add_arguments

    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kvfs").setLevel(logging.WARNING)
    import torch

    from kvfs.torch.reference import load_smollm2

    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    names = args.configs.split(",")
    configs = Configs(model, names)
    out: dict[str, Any] = {"command": " ".join(["python tools/bench_memory.py", *(argv or sys.argv[1:])]),
                           "settings": {n: configs.settings(n) for n in names}}
    print("configurations:")
    for n, s in out["settings"].items():
        print(f"  {n}: {s or 'transformers DynamicCache'}")

    def show(title: str, summ: dict[str, Any]) -> None:
        print(f"\n{title}")
        for n, s in summ.items():
            of = "n/a" if s["of_reference"] is None else f"{100 * s['of_reference']:.0f}%"
            print(f"  {n:>16}: {s['correct']:>3} of {s['questions']} correct, {of} of the full "
                  f"cache's correct answers ({s['seconds']:.0f} s)")
    try:
        if args.chats:
            from bench_memory_chats import chats_report

            out["chats"] = chats_report(model, tok, names, args)
        if not args.chats and not args.no_passkey:
            lengths, depths = passkey_lengths(args.quick)
            trials = passkey_trials(tok, lengths, depths)
            res = run(model, tok, trials, configs, args.new_tokens, "pass key")
            out["passkey"] = {"lengths": lengths, "depths": depths, "summary": summary(res),
                              "by_length": {str(n): summary({k: {"correct": [c for t, c in zip(
                                  trials, v["correct"], strict=True) if t.info["length"] == n],
                                  "seconds": 0.0} for k, v in res.items()}) for n in lengths},
                              "answers": {k: v["answers"] for k, v in res.items()}}
            show(f"pass key, {len(trials)} trials ({', '.join(map(str, lengths))} tokens, depth 0-100 %)",
                 out["passkey"]["summary"])
        if not args.chats and not args.no_facts:
            trials = fact_trials(tok, 4 if args.quick else args.facts, args.small_talk)
            res = run(model, tok, trials, configs, args.new_tokens, "facts")
            out["facts"] = {"small_talk": args.small_talk, "tokens": [t.tokens for t in trials],
                            "summary": summary(res), "answers": {k: v["answers"] for k, v in res.items()}}
            toks = sorted(t.tokens for t in trials)
            show(f"facts asked {args.small_talk + 1}-{args.small_talk + 3} rounds later, {len(trials)} "
                 f"dialogues x 3 ({toks[0]}-{toks[-1]} tokens before the questions)", out["facts"]["summary"])
        if not args.chats and not args.no_ppl:
            from bench_quality import DEFAULT_TEXT, load_text

            ids = load_text(tok, DEFAULT_TEXT, 200 if args.quick else 600)
            out["perplexity"] = profile_perplexity(model, ids, configs, 48)
            print(f"\nperplexity, {ids.shape[1]} tokens token by token (ratio to the full cache)")
            for n, r in out["perplexity"].items():
                print(f"  {n:>16}: {r['ppl']:.2f} ({r['ratio']:.2f}x)")
        subjects = [n for n in names if n == "gov" or n.startswith("gov+")]
        if not args.chats and not args.no_cost and subjects and "gov-window" in names:
            costs = [step_cost(model, configs, 512 if args.quick else 2048, 32 if args.quick else 64,
                               subject=n) for n in subjects]
            out["cost"] = costs
            for c in costs:
                print(f"\ndecode step, {c['tokens']}-token session: {c['config']} (retrieval, "
                      f"{c['blocks_attended']} blocks) {c['step_ms_retrieval']:.1f} ms, window only "
                      f"{c['step_ms_window']:.1f} ms ({c['ratio']:.2f}x); mean {c['mean_ms_retrieval']:.1f} "
                      f"against {c['mean_ms_window']:.1f} ms ({c['mean_ratio']:.2f}x)")
    finally:
        configs.close()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
