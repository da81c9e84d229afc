"""The mount is the record of every session an agent holds: flush is durable on the mount,
a reboot (RAM tier wiped) loses nothing flushed, deletion on the mount wins, volumes never
mix, one process owns a session at a time, and a lost mount is an error, not a log line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.mount_runner import Mount
from kvfs.ops.profiles import user_path
from kvfs.torch import KVRouter, geometry
from kvfs.torch.reference import generate_turns, prompt, tiny_llama
from kvfs.warm import WarmError

WINDOW, NEW = 8, 5
WARM_OPTS = {"shards": 16, "writebehind_s": 0.2}


def router(m: Mount, warm: Path, **kw) -> KVRouter:
    kw.setdefault("warm_options", WARM_OPTS)
    return KVRouter(mount=str(m.root), warm_root=str(warm), max_kv_len=WINDOW, **kw)


def conversation(turns: list, outs: list) -> torch.Tensor:
    return torch.cat([x for t, o in zip(turns, outs, strict=True) for x in (t, o)], 1)


def test_flush_puts_every_token_on_the_mount(make_mount, tmp_path: Path) -> None:
    m = make_mount(size="64M")
    model = tiny_llama(seed=0)
    r = router(m, tmp_path / "warm")
    c = r.cache("agent-1", model)
    generate_turns(model, c, [prompt(1, 9), prompt(2, 7)], NEW)
    r.flush()
    d = m.sessions / "agent-1"
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("layer_")) == [
        f"layer_{i}" for i in range(c.num_layers)]
    meta = json.loads((d / "meta.json").read_bytes())
    assert meta["tokens"] == c.seen == 9 + NEW + 7 + NEW - 1  # the last token is not fed back
    for i in range(c.num_layers):
        on_mount = (d / f"layer_{i}").read_bytes()
        assert len(on_mount) == c.seen * c.geo.token_bytes
        assert on_mount == bytes(r.warm.read("agent-1", i, 0, len(on_mount)))
    r.close()


CHILD = r"""
import json, sys, time
import torch
from kvfs.torch import KVRouter
from kvfs.torch.reference import generate_turns, tiny_llama
a = json.loads(sys.argv[1])
r = KVRouter(mount=a["mount"], warm_root=a["warm"], max_kv_len=a["window"],
             warm_options={"shards": 16}, **a["retrieval"])
for s in a["sessions"]:
    m = tiny_llama(seed=s["seed"], dtype=getattr(torch, s["dtype"]))
    generate_turns(m, r.cache(s["sid"], m), [torch.tensor([t]) for t in s["turns"]], a["new"])
r.flush()
print("FLUSHED", flush=True)
time.sleep(600)
"""


def test_flush_kill_wipe_remount_resume_is_exact(make_mount, tmp_path: Path) -> None:
    m = make_mount(size="64M")
    warm = tmp_path / "warm"
    specs = [("r-fp32", 3, "float32"), ("r-bf16", 4, "bfloat16")]
    before = [prompt(30 + i, 6) for i in range(3)]
    after = [prompt(40 + i, 5) for i in range(2)]
    # retrieval on, choosing 2 of the old blocks of 4 tokens: the resumed sessions attend the
    # blocks the key_centroids stream and meta.json kept, as a router that never stopped does
    ret = {"retrieval": True, "retrieval_block": 4,
           "retrieval_bytes": (2 + 2) * 4 * geometry(tiny_llama()).session_token_bytes}
    args = {"mount": str(m.root), "warm": str(warm), "window": WINDOW, "new": NEW, "retrieval": ret,
            "sessions": [{"sid": s, "seed": seed, "dtype": dt, "turns": [t[0].tolist() for t in before]}
                         for s, seed, dt in specs]}
    p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "FLUSHED", p.stderr.read()[-3000:] if p.poll() is not None else line
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    shutil.rmtree(warm)  # a reboot: the RAM tier is gone
    m.remount()
    r = router(m, warm, **ret)
    (tmp_path / "plain" / "sessions").mkdir(parents=True)
    never_stopped = KVRouter(mount=str(tmp_path / "plain"), warm_root=str(tmp_path / "warm-ref"),
                             max_kv_len=WINDOW, warm_options={"shards": 16}, **ret)
    for sid, seed, dt in specs:
        model = tiny_llama(seed=seed, dtype=getattr(torch, dt))
        ref = generate_turns(model, never_stopped.cache(sid, model), before + after, NEW)
        c = r.resume(sid, model)
        assert c.seen == sum(t.shape[1] for t in before) + NEW * len(before) - 1
        ids = conversation(before, ref[:len(before)])  # generate slices off what c has seen
        for t, want in zip(after, ref[len(before):], strict=True):
            ids = torch.cat([ids, t], 1)
            full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=c,
                                  max_new_tokens=NEW, do_sample=False)
            assert torch.equal(full[:, ids.shape[1]:], want), sid
            ids = full
            c.end_round()
    never_stopped.close()
    r.close()


def test_rm_r_on_the_mount_wins_over_the_ram_tier(make_mount, tmp_path: Path) -> None:
    m = make_mount(size="64M")
    model = tiny_llama(seed=0)
    r = router(m, tmp_path / "warm")
    generate_turns(model, r.cache("gone", model), [prompt(5, 9)], NEW)
    r.flush()
    r.close()
    assert (tmp_path / "warm").exists()  # the RAM tier still holds the session
    shutil.rmtree(m.sessions / "gone")
    r = router(m, tmp_path / "warm")
    assert r.cache("gone", model).seen == 0
    r.close()


def test_router_delete_removes_every_tier(make_mount, tmp_path: Path) -> None:
    m = make_mount(size="64M")
    model = tiny_llama(seed=0)
    r = router(m, tmp_path / "warm")
    generate_turns(model, r.cache("del", model), [prompt(6, 9)], NEW)
    r.save("del")
    assert (m.sessions / "del" / "meta.json").exists()
    r.delete("del")
    assert not (m.sessions / "del").exists()
    assert r.warm.where("del") is None and "del" not in r.sessions()
    assert r.cache("del", model).seen == 0
    r.close()


def test_two_volumes_on_one_host_never_mix(make_mount, tmp_path: Path) -> None:
    a, b = make_mount("a", size="64M"), make_mount("b", size="64M")
    model = tiny_llama(seed=0)
    ra = router(a, tmp_path / "warm")  # one RAM-tier root for the host
    generate_turns(model, ra.cache("same-name", model), [prompt(7, 9)], NEW)
    ra.flush()
    rb = router(b, tmp_path / "warm")
    assert ra.volume_id != rb.volume_id
    assert rb.cache("same-name", model).seen == 0  # volume b never had it
    rb.close()
    ra.close()
    assert not (b.sessions / "same-name" / "layer_0").exists() or \
        (b.sessions / "same-name" / "layer_0").stat().st_size == 0


HOLDER = r"""
import sys, time
from kvfs.torch import KVRouter
from kvfs.torch.reference import generate_turns, prompt, tiny_llama
r = KVRouter(mount=sys.argv[1], warm_root=sys.argv[2], max_kv_len=8, warm_options={"shards": 16})
m = tiny_llama(seed=0)
generate_turns(m, r.cache("held", m), [prompt(1, 6)], 3)
print("HOLDING", flush=True)
time.sleep(600)
"""


def test_two_agent_processes_share_a_volume_but_not_a_session(make_mount, tmp_path: Path) -> None:
    m = make_mount(size="64M")
    warm = tmp_path / "warm"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(m.root), str(warm)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "HOLDING", p.stderr.read()[-3000:]
        model = tiny_llama(seed=0)
        r = router(m, warm)
        generate_turns(model, r.cache("mine", model), [prompt(2, 6)], 3)  # side by side
        r.flush()
        with pytest.raises(WarmError, match=str(p.pid)):
            r.cache("held", model)
        p.send_signal(signal.SIGKILL)  # the owner dies: its lock goes with it
        p.wait(timeout=30)
        deadline = time.monotonic() + 10
        while True:
            try:
                c = r.cache("held", model)
                break
            except WarmError:
                assert time.monotonic() < deadline, "the dead owner's session was never freed"
                time.sleep(0.1)
        assert c.seen in (0, 9)  # what reached the mount before the kill, never an error
        r.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_flush_raises_when_the_mount_is_gone(make_mount, tmp_path: Path) -> None:
    m = make_mount(size="64M")
    model = tiny_llama(seed=0)
    r = router(m, tmp_path / "warm")
    generate_turns(model, r.cache("lost", model), [prompt(8, 9)], NEW)
    r.flush()
    assert m.stop() == 0
    generate_turns(model, r.cache("lost", model), [prompt(9, 9)], NEW)
    with pytest.raises((WarmError, OSError)):
        r.flush()
    with pytest.raises((WarmError, OSError)):
        r.close()
    os.makedirs(m.root, exist_ok=True)


def test_kvfs_stat_shows_the_agents_hot_and_ram_tiers(make_mount) -> None:
    m = make_mount(size="64M")
    model = tiny_llama(seed=0)
    r = KVRouter(mount=str(m.root), max_kv_len=WINDOW)  # the mount's profile: its warm root
    try:
        generate_turns(model, r.cache("seen", model), [prompt(3, 9)], NEW)
        r.flush()
        deadline = time.monotonic() + 10
        while True:
            out = subprocess.run([sys.executable, "-m", "kvfs.cli.stat", str(m.root), "--json"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            tiers = json.loads(out.stdout)["summary"]["tiers"]
            hot, warm = tiers["hot"], tiers["warm"]  # a report older than the round: wait
            if hot["reported"] and warm["reported"] and hot["bytes"] > 0 and warm["bytes"] > 0:
                break
            assert time.monotonic() < deadline, tiers
            time.sleep(0.3)
        assert tiers["hot"]["bytes"] > 0 and tiers["hot"]["sessions"] == 1
        assert tiers["warm"]["bytes"] > 0 and tiers["warm"]["cap"] > 0
        from kvfs.ops.metrics import parse

        scraped = parse((m.root / ".kvfs" / "metrics").read_bytes())  # the mount's own page
        assert scraped["kv_hot_bytes"] == tiers["hot"]["bytes"] and scraped["kv_warm_bytes"] > 0
        assert scraped["kv_hot_sessions"] == 1
    finally:
        r.close()
        shutil.rmtree(Path(user_path(r.profile.warm_root)) / r.volume_id, ignore_errors=True)
