"""kvfs under vLLM: ``vllm serve`` (CPU) with the kvfs connector over a real mount.

The server runs from ``.venv-vllm`` (``make vllm-env``); this process holds the conversation
through the ``openai`` client and, for the hand-over tests, runs ``KVRouter`` with the same
model loaded by transformers. The model is a tiny random Llama with SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
import os
import time

import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from kvfs.mount_runner import HAVE_FUSE, Mount
from kvfs.session.files import read_ids
from kvfs.session.tokens import common_prefix
from kvfs.vllm.server_runner import VLLMServer, connector_config, have_vllm, model_dir
from kvfs.warm.coldfiles import ColdStore

pytestmark = [
    pytest.mark.mount, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse"),
    pytest.mark.skipif(not have_vllm(), reason="no .venv-vllm: make vllm-env builds it"),
]

BLOCK = 32
USER = ["Tell me about the harbour at dawn.", "What did the fishermen bring back?",
        "And the price of the catch that morning?", "Summarise all of it in one line."]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One mount, one model directory, one connector server (restarted by the tests)."""
    d = tmp_path_factory.mktemp("vllm")
    model = model_dir(d / "model")
    mount = Mount(d / "vol.kvvol", d / "mnt", size="256M").start()
    server = VLLMServer(model, d / "server.log", block_size=BLOCK, dev_mode=True,
                        kv_config=connector_config(mount.mountpoint, key_file=str(d / "key")))
    try:
        yield {"dir": d, "model": model, "mount": mount, "server": server, "state": {}}
    finally:
        server.stop()
        mount.stop()


def chat(server: VLLMServer, messages: list[dict], session: str | None = None,
         salt: str | None = None, max_tokens: int = 12) -> tuple[list[int], str, list[int], dict]:
    """One greedy turn: (output token ids, text, prompt token ids, kv_transfer_params)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=120)
    body: dict = {"return_token_ids": True}
    if session is not None:
        body["kv_transfer_params"] = {"session": session}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                       temperature=0, extra_body=body)
    extra = r.model_extra or {}
    choice = r.choices[0]
    return (list(choice.model_extra["token_ids"]), choice.message.content or "",
            list(extra["prompt_token_ids"]), extra.get("kv_transfer_params") or {})


def meta(mount: Mount, sid: str) -> dict:
    """The session's meta.json; {} while it is being replaced (truncate, then one write)."""
    for _ in range(50):
        try:
            return json.loads((mount.sessions / sid / "meta.json").read_text())
        except ValueError:
            time.sleep(0.05)
        except FileNotFoundError:
            return {}
    return {}


def stored_soon(mount: Mount, sid: str, tokens: int, timeout: float = 60.0) -> dict:
    """meta.json once it claims ``tokens`` (a turn is stored just after its reply)."""
    deadline = time.monotonic() + timeout
    while True:
        m = meta(mount, sid)
        if m.get("tokens") == tokens or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def complete(server: VLLMServer, prompt: list[int], **body) -> tuple[list[int], dict]:
    client = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=120)
    r = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True, **body})
    return (list(r.choices[0].model_extra["token_ids"]),
            (r.model_extra or {}).get("kv_transfer_params") or {})


def test_conversation_continues_after_restart(world) -> None:
    """A chat held through the server, the server restarted, the chat continued: the prefix
    comes from kvfs (counted in the reply) and the tokens are the uninterrupted run's. A
    long prompt without a session is reused the same way through prefix entries."""
    server, mount = world["server"], world["mount"]
    server.start()
    messages: list[dict] = []
    for text in USER[:3]:
        messages.append({"role": "user", "content": text})
        out, reply, prompt, params = chat(server, messages, session="chat-1")
        assert params["session"] == "chat-1"
        messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": USER[3]})
    # the uninterrupted run: the same server, vLLM's own prefix cache, no kvfs session
    ref_out, _, ref_prompt, ref_params = chat(server, messages)
    assert "session" not in ref_params
    # a request without a session: its full 256-token runs become prefix entries
    doc = list(range(2000, 2600))
    complete(server, doc)
    doc_ref, _ = complete(server, doc + [7, 8, 9])
    server.stop()
    stored = meta(mount, "chat-1")
    assert stored["tokens"] > 0 and len(stored["rounds"]) == 3
    assert sorted(p.name for p in (mount.sessions / "chat-1").iterdir()) == [
        "layer_0", "layer_1", "meta.json", "summaries.f32", "tokens"]
    assert len([p for p in mount.sessions.iterdir() if p.name.startswith("prefix-")]) >= 2

    server.start()  # a new process: vLLM's prefix cache is empty, kvfs is not
    out, _, prompt, params = chat(server, messages, session="chat-1")
    assert prompt == ref_prompt
    assert out == ref_out, "continuing from kvfs gave other tokens than the uninterrupted run"
    agree = min(common_prefix(read_ids(ColdStore(str(mount.root)), "chat-1"), prompt),
                stored["tokens"], len(prompt) - 1)
    assert params["kvfs_loaded_tokens"] == agree - agree % BLOCK > 0  # the prefill skipped
    after = stored_soon(mount, "chat-1", params["kvfs_stored_tokens"])
    assert after["tokens"] == params["kvfs_stored_tokens"] > stored["tokens"]
    # the re-rendered prompt may differ from the stored ids (a reply re-tokenized): the turn
    # replaced the history from there, and its round ends the session
    assert after["rounds"][-1] == [after["rounds"][-2][1], after["tokens"]]
    doc_out, doc_params = complete(server, doc + [7, 8, 9])
    assert doc_params["kvfs_loaded_tokens"] == 512 and doc_out == doc_ref
    world["state"]["chat-1"] = True


def test_vllm_session_resumes_in_kvrouter(world) -> None:
    """The session vLLM stored, resumed by KVRouter: the bytes are the KV transformers
    computes for those ids, and generation continues from them."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvfs.torch import KVRouter

    mount = world["mount"]
    if "chat-1" not in world["state"]:
        pytest.skip("needs the session of test_conversation_continues_after_restart")
    model = AutoModelForCausalLM.from_pretrained(world["model"], dtype=torch.float32).eval()
    n = meta(mount, "chat-1")["tokens"]
    ids = torch.from_numpy(read_ids(ColdStore(str(mount.root)), "chat-1")[:n].astype("int64"))[None]
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=ref, use_cache=True)
    with KVRouter(mount=str(mount.root), max_kv_len=None, warm_root=str(world["dir"] / "warm")) as router:
        cache = router.resume("chat-1", model)
        assert cache.seen == n
        for i in range(model.config.num_hidden_layers):
            k, v = cache.layers[i].keys, cache.layers[i].values
            torch.testing.assert_close(k[..., :n, :], ref.layers[i].keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v[..., :n, :], ref.layers[i].values, atol=1e-4, rtol=1e-4)
        more = torch.tensor([[17, 4242, 999, 31]])
        full = torch.cat([ids, more], dim=1)
        got = model.generate(full, attention_mask=torch.ones_like(full), cache=cache,
                             max_new_tokens=8, do_sample=False)
        want = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=8,
                              do_sample=False)
        assert torch.equal(got, want)
        router.delete("chat-1")


def test_kvrouter_session_continues_in_vllm(world) -> None:
    """A session started by KVRouter (ids recorded) is continued behind vLLM: the stored
    blocks are loaded, and the output is the one vLLM computes from scratch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfs.torch import KVRouter

    mount, server = world["mount"], world["server"]
    model = AutoModelForCausalLM.from_pretrained(world["model"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(world["model"])
    messages = [{"role": "user", "content": USER[0] + " " + USER[1]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with KVRouter(mount=str(mount.root), max_kv_len=None, warm_root=str(world["dir"] / "warm")) as router:
        cache = router.cache("agent-2", model, fresh=True)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                              max_new_tokens=40, do_sample=False)
        cache.end_round()
        router.record_tokens("agent-2", full[0])
        router.flush()
    stored = meta(mount, "agent-2")["tokens"]
    assert stored == full.shape[1] - 1  # generate's last token is not fed through the model
    if server.proc is None:
        server.start()
    prompt = full[0].tolist() + tok.encode(" And then?", add_special_tokens=False)
    # no block of the earlier chats in vLLM's prefix cache serves it (a KVRouter session is
    # the default tenant's: a cache_salt would make it another tenant's request)
    server.reset_prefix_cache()
    out, params = complete(server, prompt, kv_transfer_params={"session": "agent-2"})
    assert params["kvfs_loaded_tokens"] == stored - stored % BLOCK > 0
    fresh, _ = complete(server, prompt, cache_salt="recompute")  # vLLM's own prefill of all
    assert out == fresh
    assert stored_soon(mount, "agent-2", params["kvfs_stored_tokens"])["tokens"] == \
        params["kvfs_stored_tokens"] > stored
    # a layer cut behind meta.json's back: the load fails, vLLM recomputes, same tokens;
    # the turn then stores the session again from where its files agree
    after = meta(mount, "agent-2")["tokens"]
    token_bytes = 2 * 2 * 32 * 4
    os.truncate(mount.sessions / "agent-2" / "layer_1", 10 * token_bytes)
    server.reset_prefix_cache()
    again, params = complete(server, prompt, kv_transfer_params={"session": "agent-2"})
    assert params["kvfs_loaded_tokens"] > 0 and again == out
    # the old meta.json already claimed as many tokens: wait for the layers to agree too
    deadline = time.monotonic() + 60
    while True:
        repaired = meta(mount, "agent-2")
        sizes = [(mount.sessions / "agent-2" / f"layer_{i}").stat().st_size for i in (0, 1)]
        done = repaired["tokens"] == params["kvfs_stored_tokens"]
        if (done and sizes == [repaired["tokens"] * token_bytes] * 2) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert repaired["tokens"] == params["kvfs_stored_tokens"] <= after
    assert sizes == [repaired["tokens"] * token_bytes] * 2
