"""``kvfs-serve`` as a client of the OpenAI API uses it: sessions named by ``user`` or
``X-Session-Id``, tenants (``cache_salt``) apart, a conversation continued after a restart.

One server started through ``kvfs-serve`` (``python -m kvfs.vllm.serve``, the console
script's module) over a real mount, the tiny model of tests/test_vllm.py, the ``openai``
client; restarted once.
"""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")

from kvfs.mount_runner import HAVE_FUSE, Mount
from kvfs.vllm.server_runner import VLLMServer, have_vllm, model_dir
from kvfs.vllm.store import server_key, session_dir

pytestmark = [
    pytest.mark.mount, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse"),
    pytest.mark.skipif(not have_vllm(), reason="no .venv-vllm: make vllm-env builds it"),
]

BLOCK = 32
USER = ["Tell me about the harbour at dawn.", "What did the fishermen bring back?",
        "And the price of the catch that morning?"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-serve")
    model = model_dir(d / "model")
    mount = Mount(d / "vol.kvvol", d / "mnt", size="256M").start()
    key_file = d / "state" / "vllm.key"
    server = VLLMServer(model, d / "server.log", block_size=BLOCK,
                        kvfs_serve={"mount": mount.mountpoint, "key_file": str(key_file)})
    try:
        server.start()
        yield {"mount": mount, "server": server, "key_file": key_file}
    finally:
        server.stop()
        mount.stop()


def client(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", timeout=120)


def chat(server: VLLMServer, messages: list[dict], **kw) -> tuple[list[int], str, dict]:
    """One greedy turn with the stock client (``user=``, ``extra_headers=``, ...): output
    ids, text, the reply's kv_transfer_params."""
    salt = kw.pop("salt", None)
    body = {"return_token_ids": True, **({"cache_salt": salt} if salt else {})}
    r = client(server).chat.completions.create(model="m", messages=messages, max_tokens=12,
                                               temperature=0, extra_body=body, **kw)
    choice = r.choices[0]
    return (list(choice.model_extra["token_ids"]), choice.message.content or "",
            (r.model_extra or {}).get("kv_transfer_params") or {})


def stored(mount: Mount, name: str, timeout: float = 60.0, tokens: int | None = None) -> dict:
    """meta.json of ``sessions/<name>`` once it is there (and claims ``tokens``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            m = json.loads((mount.sessions / name / "meta.json").read_text())
            if tokens is None or m.get("tokens") == tokens:
                return m
        except (FileNotFoundError, ValueError):
            pass
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.2)


def files(mount: Mount, name: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((mount.sessions / name).iterdir())}


def tenant_dir(world: dict, sid: str, salt: str) -> str:
    """Where the server keeps tenant ``salt``'s session ``sid`` (it takes the server's key)."""
    return session_dir(server_key(str(world["key_file"])), sid, salt)


def test_user_named_conversation_and_tenants_across_a_restart(world) -> None:
    """A chat named only by ``user=`` continues after a restart from kvfs with the tokens of
    the uninterrupted run; another tenant naming the same session sees none of its KV and
    changes none of its files, and keeps a session of its own under that name."""
    server, mount = world["server"], world["mount"]
    messages: list[dict] = []
    for text in USER[:2]:
        messages.append({"role": "user", "content": text})
        _, reply, params = chat(server, messages, user="agent-u")
        assert params["session"] == "agent-u"
        messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": USER[2]})
    ref_out, _, ref_params = chat(server, messages)  # the uninterrupted run, no session
    assert "session" not in ref_params
    mine = stored(mount, "agent-u", tokens=params["kvfs_stored_tokens"])
    assert mine["tokens"] == params["kvfs_stored_tokens"] > 0
    before = files(mount, "agent-u")
    # tenant B, same session name, the same history: offered nothing, stored apart
    _, _, b = chat(server, messages[:3], user="agent-u", salt="tenant-B")
    assert b["session"] == "agent-u" and b["kvfs_loaded_tokens"] == 0
    b_dir = tenant_dir(world, "agent-u", "tenant-B")
    assert stored(mount, b_dir, tokens=b["kvfs_stored_tokens"])["tokens"] == b["kvfs_stored_tokens"]
    assert files(mount, "agent-u") == before

    server.stop()
    server.start()  # a new process: vLLM's prefix cache is empty, kvfs is not
    out, _, params = chat(server, messages, user="agent-u")
    assert params["kvfs_loaded_tokens"] > 0
    assert out == ref_out, "continuing from kvfs gave other tokens than the uninterrupted run"
    # each tenant is offered its own session's KV under the same name, a third one none
    _, _, b2 = chat(server, messages, user="agent-u", salt="tenant-B")
    assert 0 < b2["kvfs_loaded_tokens"] <= b["kvfs_stored_tokens"]
    _, _, c = chat(server, messages, user="agent-u", salt="tenant-C")
    assert c["kvfs_loaded_tokens"] == 0
    assert {p.name for p in mount.sessions.iterdir()} >= {"agent-u", b_dir}
    assert "tenant-B" not in {p.name for p in mount.sessions.iterdir()}


def test_sessions_from_header_completions_and_streams(world) -> None:
    """``X-Session-Id`` comes before ``user``, an explicit ``kv_transfer_params`` before
    both; completions and streamed chats are stored the same way."""
    server, mount = world["server"], world["mount"]
    c = client(server)
    r = c.completions.create(model="m", prompt="The harbour at dawn was", max_tokens=8,
                             temperature=0, user="not-this", extra_headers={"X-Session-Id": "hdr-1"})
    assert (r.model_extra or {})["kv_transfer_params"]["session"] == "hdr-1"
    r = c.completions.create(model="m", prompt="The harbour at noon was", max_tokens=8,
                             temperature=0, user="not-this", extra_headers={"X-Session-Id": "hdr-2"},
                             extra_body={"kv_transfer_params": {"session": "explicit-1"}})
    assert (r.model_extra or {})["kv_transfer_params"]["session"] == "explicit-1"
    stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": USER[0]}],
                                       max_tokens=8, temperature=0, stream=True, user="stream-1")
    text = "".join((ch.choices[0].delta.content or "") for ch in stream if ch.choices)
    assert text
    for name in ("hdr-1", "explicit-1", "stream-1"):
        assert stored(mount, name).get("tokens", 0) > 0, name
    names = {p.name for p in mount.sessions.iterdir()}
    assert "not-this" not in names and "hdr-2" not in names
