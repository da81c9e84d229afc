"""Where a chat's fact sits when gov answers it: the blocks holding the wanted value's tokens
(family c: the corrected value's, and the stale value's where it was first said) and how
many layers choose each for the first answer step.

``python tools/memory_misses.py --split test a-500-21:0 b-500-2:2`` (family-length-trial, then
the question): each chat of tools/memory_chats.py is fed round by round to a fresh gov session
(ChatML, or ``--format plain``) up to that question, and the choice the question's step made for the answer is
read from the session's retrieval.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

log = logging.getLogger("bench.memory")


def value_span(tok: Any, ids: list[int], want: str) -> tuple[int, int]:
    """The shortest run of ``ids`` whose text holds ``want`` (its digits and letters)."""
    core = want.lstrip("$")
    best: tuple[int, int] | None = None
    for i in range(len(ids)):
        for j in range(i + 1, min(len(ids), i + 12) + 1):
            if core in tok.decode(ids[i:j]):
                if best is None or j - i < best[1] - best[0]:
                    best = (i, j)
                break
    if best is None:
        raise ValueError(f"{want!r} is not in the fact's round")
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="test", choices=("dev", "test"))
    p.add_argument("--format", default="chatml", choices=("chatml", "plain"))
    p.add_argument("--config", default="gov", help="a configuration of bench_memory (gov, gov+sel=...)")
    p.add_argument("chats", nargs="+", help="family-length-trial:question, e.g. a-500-21:0")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("kvfs").setLevel(logging.WARNING)
    import memory_chats as mc
    import torch
    from bench_memory import Configs

    from kvfs.torch.reference import load_smollm2

    model, tok = load_smollm2()
    configs = Configs(model, [args.config], mounted=True)
    try:
        for spec in args.chats:
            name, _, q = spec.partition(":")
            fam, length, trial = name.split("-")
            qk = int(q or 0)
            chat = next(iter(mc.chats(tok, args.split, [fam], [int(length)], 1, int(trial))))
            r = mc.render(tok, chat, args.format)
            # the wanted value where it was said (family c: in the correction), and the
            # stale value where it was first said
            wanted = [("value", chat.questions[qk].want[0], chat.fact_rounds[qk])]
            if chat.family == "c" and qk == 0:
                wanted = [("new value", chat.questions[0].want[0], chat.info["correction_round"]),
                          ("stale value", chat.questions[0].stale[0], chat.fact_rounds[0])]
            cache, sid = configs.session(args.config)
            with torch.no_grad():
                for x in r.rounds:
                    model(input_ids=torch.tensor([x]), cache=cache, use_cache=True)
                    cache.end_round()
                for k in range(qk + 1):  # the questions before it were asked, unanswered
                    ids = (r.after_answer if k else []) + r.questions[k][0]
                    model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
                    if k < qk:
                        cache.end_round()
            ret = cache.retrieval
            lay = ret.layout
            for what, want, fr in wanted:
                start = sum(map(len, r.rounds[:fr]))
                a, e = value_span(tok, r.rounds[fr], want)
                blocks = sorted({(t - lay.origin) // lay.block for t in range(start + a, start + e)})
                near = range(max(blocks[0] - 1, 0), min(blocks[-1] + 2, ret.count[0]))  # one either side
                chose = {b: sum(b in ch for ch in ret.chosen) for b in near}
                log.info("%s question %d: %s %r in tokens [%d, %d), blocks %s; layers choosing it "
                         "and the blocks around it (of %d): %s; %d blocks left the window, %d "
                         "attended", chat.name, qk, what, want, start + a, start + e, blocks,
                         len(ret.chosen), chose, ret.count[0], len(ret.chosen[0]))
            configs.delete(args.config, sid)
    finally:
        configs.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
