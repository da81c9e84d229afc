"""Profiles: shipped values, override order, conversions, and every bad input."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvfs.engine.types import StoreConfig
from kvfs.ops import profiles, units
from kvfs.ops.profiles import Profile, ProfileError, load, parse_overrides
from kvfs.ops.units import parse_size

GiB, TiB = 1 << 30, 1 << 40
ROOT = Path(__file__).resolve().parents[1]

TABLE = {  # the profile table of docs/operations.md
    "gov": dict(max_kv_len=24, warm_shards=65536, warm_migrate_at=0.85, lru_group=10,
                ring_size=int(1.2 * TiB), checkpoint_interval_s=600.0, shard_key="session",
                keep_summary_rounds=0),
    "ecommerce": dict(max_kv_len=12, warm_shards=131072, warm_migrate_at=0.75, lru_group=5,
                      ring_size=800 * GiB, checkpoint_interval_s=300.0, shard_key="session",
                      keep_summary_rounds=1),
    "iot": dict(max_kv_len=6, warm_shards=262144, warm_migrate_at=0.90, lru_group=20,
                ring_size=500 * GiB, checkpoint_interval_s=1800.0, shard_key="device",
                keep_summary_rounds=0, alert_warm_pct=0.95),  # above its 0.90 migration point
}
COMMON = dict(warm_cap_bytes=16 * GiB, retention_s=7 * 86400.0, cleanup_threshold=0.70,
              hot_sessions=100, summary_dim=128, device_watermark=0.90,
              alert_device_pct=0.92, alert_device_for_s=30.0, alert_warm_pct=0.88,
              alert_warm_for_s=120.0, alert_cold_write_ms=5.0, alert_cold_write_for_s=60.0)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_profile_values(name: str) -> None:
    p = load(name)
    assert p.name == name
    for key, want in {**COMMON, **TABLE[name]}.items():
        assert getattr(p, key) == pytest.approx(want), key
    assert isinstance(p.max_kv_len, int) and isinstance(p.ring_size, int)


def test_default_is_gov_and_frozen() -> None:
    p = load()
    assert p.name == "gov"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_kv_len = 3  # type: ignore[misc]


def test_store_config_and_warm_kwargs() -> None:
    p = load("ecommerce", {"hot_sessions": 7, "retention_s": "1d"})
    sc = p.store_config()
    assert isinstance(sc, StoreConfig)
    assert (sc.hot_sessions, sc.checkpoint_interval_s, sc.cleanup_threshold, sc.retention_s) == (
        7, 300.0, 0.70, 86400.0)
    assert p.store_config(evict_when_full=True).evict_when_full is True
    w = p.warm_kwargs()
    assert w == {"root": f"/dev/shm/kvfs-warm-{os.geteuid()}", "cap_bytes": 16 * GiB, "migrate_at": 0.75,
                 "group": 5, "shards": 131072, "shard_key": "session", "summary_dim": 128,
                 "writebehind": True, "writebehind_s": 2.0, "writebehind_bytes": 64 << 20}


@pytest.mark.parametrize("text,want", [
    ("512M", 512 << 20), ("1.2T", int(1.2 * TiB)), ("64KiB", 64 << 10), ("4096", 4096),
    ("1g", GiB), ("16 GB", 16 * GiB), (".5K", 512), (123, 123),
])
def test_parse_size(text: str, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["12Q", "-1", "", "M", "1.2.3G", "ten"])
def test_parse_size_bad(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text,want", [("30", 30.0), ("30s", 30.0), ("10m", 600.0),
                                       ("2h", 7200.0), ("7d", 604800.0), ("250ms", 0.25)])
def test_parse_duration(text: str, want: float) -> None:
    assert units.parse_duration(text) == want


def test_overrides_dict_typed_and_strings() -> None:
    p = load("gov", {"max_kv_len": 48, "ring_size": "64M", "warm_migrate_at": "80%",
                     "warm_cap_bytes": 32 << 20, "checkpoint_interval_s": "2m",
                     "shard_key": "device", "alert_cold_write_ms": "7.5"})
    assert (p.max_kv_len, p.ring_size, p.warm_migrate_at, p.warm_cap_bytes) == (
        48, 64 << 20, 0.80, 32 << 20)
    assert (p.checkpoint_interval_s, p.shard_key, p.alert_cold_write_ms) == (120.0, "device", 7.5)
    assert p.lru_group == 10  # untouched values stay the profile's


def test_parse_overrides_cli_strings() -> None:
    o = parse_overrides(["max_kv_len=48", "ring_size=1.2T", "warm_migrate_at=0.8",
                         "retention_s=3d", "shard_key=device", "max_kv_len=50",
                         "warm_root=/dev/shm/x=y"])
    assert o == {"max_kv_len": 50, "ring_size": int(1.2 * TiB), "warm_migrate_at": 0.8,
                 "retention_s": 3 * 86400.0, "shard_key": "device", "warm_root": "/dev/shm/x=y"}
    assert load("iot", o).max_kv_len == 50
    assert parse_overrides([]) == {}


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_override_order(tmp_path, suffix: str) -> None:
    cfg = tmp_path / f"kvfs{suffix}"
    if suffix == ".json":
        cfg.write_text(json.dumps({"max_kv_len": 30, "lru_group": 3, "ring_size": "256M"}))
    else:
        cfg.write_text('max_kv_len = 30\nlru_group = 3\nring_size = "256M"\n')
    p = load("gov", {"max_kv_len": "40"}, str(cfg))
    assert p.max_kv_len == 40  # overrides beat the config file
    assert p.lru_group == 3  # the config file beats the profile
    assert p.ring_size == 256 << 20
    assert p.warm_shards == 65536  # the profile where nobody overrides
    assert load("gov", config_file=cfg).max_kv_len == 30


def test_replace_and_direct_construction_validate() -> None:
    p = load("gov").replace(max_kv_len="12", ring_size="8M")
    assert (p.max_kv_len, p.ring_size) == (12, 8 << 20)
    gov = profiles.profile_data("gov")
    assert Profile(**{**gov, "checkpoint_interval_s": 5}).checkpoint_interval_s == 5.0
    with pytest.raises(ProfileError, match="max_kv_len"):
        Profile(**{**gov, "max_kv_len": 0})
    with pytest.raises(TypeError, match="max_kv_len"):  # no value is written in the code
        Profile(name="t", **{k: v for k, v in gov.items() if k != "max_kv_len"})
    with pytest.raises(ProfileError, match="lru_group"):
        load("gov").replace(lru_group=0)


def _one_line(e: pytest.ExceptionInfo, key: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg
    assert key in msg
    return msg


BAD = [
    ("max_kv_len", 0), ("max_kv_len", -1), ("max_kv_len", "2.5"), ("max_kv_len", True),
    ("max_kv_len", "many"), ("max_kv_len", 2.5), ("max_kv_len", None),
    ("warm_shards", 1000), ("warm_shards", 0), ("warm_shards", 1 << 33),
    ("warm_migrate_at", 0), ("warm_migrate_at", 1.5), ("warm_migrate_at", "150%"),
    ("warm_migrate_at", "abc"), ("cleanup_threshold", -0.1), ("device_watermark", 2),
    ("alert_device_pct", 0.0), ("alert_warm_pct", "92"),
    ("lru_group", 0), ("hot_sessions", 0), ("summary_dim", 0), ("keep_summary_rounds", -1),
    ("shard_key", "user"), ("shard_key", 3),
    ("ring_size", "12Q"), ("ring_size", "1K"), ("ring_size", -5), ("warm_cap_bytes", "0"),
    ("checkpoint_interval_s", "-5"), ("checkpoint_interval_s", "soon"), ("retention_s", 0),
    ("alert_device_for_s", "-1s"), ("alert_cold_write_ms", 0), ("alert_interval_s", "inf"),
    ("warm_root", 5), ("description", ["a"]),
]


@pytest.mark.parametrize("key,value", BAD)
def test_bad_value_dict(key: str, value: object) -> None:
    with pytest.raises(ProfileError) as e:
        load("gov", {key: value})
    msg = _one_line(e, key)
    assert "allowed" in msg and e.value.key == key


@pytest.mark.parametrize("key,value", [b for b in BAD if isinstance(b[1], str | int)
                                       and not isinstance(b[1], bool)])
def test_bad_value_cli(key: str, value: object) -> None:
    with pytest.raises(ProfileError) as e:
        parse_overrides([f"{key}={value}"])
    _one_line(e, key)


def test_bad_value_in_config_file(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("warm_shards = 1000\n")
    with pytest.raises(ProfileError) as e:
        load("gov", config_file=cfg)
    msg = _one_line(e, "warm_shards")
    assert "power of two" in msg and str(cfg) in msg


def test_ranges_named_in_message() -> None:
    with pytest.raises(ProfileError, match=r"warm_migrate_at.*\(0, 1\]"):
        load("gov", {"warm_migrate_at": 1.5})
    with pytest.raises(ProfileError, match=r"shard_key.*session, device"):
        parse_overrides(["shard_key=user"])


def test_unknown_profile() -> None:
    with pytest.raises(ProfileError) as e:
        load("bank")
    msg = _one_line(e, "bank")
    assert "gov, ecommerce, iot" in msg


@pytest.mark.parametrize("how", ["dict", "cli", "json", "toml"])
def test_unknown_key(tmp_path, how: str) -> None:
    with pytest.raises(ProfileError) as e:
        if how == "dict":
            load("gov", {"max_kv_length": 3})
        elif how == "cli":
            parse_overrides(["max_kv_length=3"])
        else:
            cfg = tmp_path / f"c.{how}"
            cfg.write_text('{"max_kv_length": 3}' if how == "json" else "max_kv_length = 3\n")
            load("gov", config_file=cfg)
    msg = _one_line(e, "max_kv_length")
    assert "max_kv_len" in msg  # the allowed keys are listed


@pytest.mark.parametrize("item", ["max_kv_len", "=3", ""])
def test_cli_without_equals(item: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_overrides([item])
    _one_line(e, "key=value")


def test_name_is_not_a_key() -> None:
    with pytest.raises(ProfileError) as e:
        parse_overrides(["name=iot"])
    assert "--profile" in _one_line(e, "name")


@pytest.mark.parametrize("name,text", [
    ("c.json", "{not json"), ("c.toml", "max_kv_len = = 3\n[broken"), ("c.json", "[1, 2]"),
    ("c.conf", "max_kv_len=3"), ("c.toml", "[kvfs]\nmax_kv_len = 3\n"),
])
def test_config_file_that_does_not_parse(tmp_path, name: str, text: str) -> None:
    cfg = tmp_path / name
    cfg.write_text(text)
    with pytest.raises(ProfileError) as e:
        load("gov", config_file=str(cfg))
    msg = str(e.value)
    assert "\n" not in msg and ("kvfs" in msg or str(cfg) in msg)


def test_config_file_missing(tmp_path) -> None:
    with pytest.raises(ProfileError) as e:
        load("gov", config_file=tmp_path / "nope.toml")
    assert "nope.toml" in _one_line(e, "cannot read")


def test_profile_error_is_value_error_and_describe() -> None:
    assert issubclass(ProfileError, ValueError)
    assert "power of two" in profiles.describe("warm_shards")
    for name in profiles.PROFILE_NAMES:  # package data present and complete for the table
        assert set(TABLE[name]) <= set(profiles.profile_data(name))


def test_values_live_only_in_the_data_files() -> None:
    """Every key has exactly one source: a profile file sets the profile table's keys (and
    may override a shared one), defaults.json the rest; no field carries a value in code."""
    shared = profiles.defaults()
    assert set(shared) <= set(profiles.KEYS)
    for f in dataclasses.fields(Profile):
        if f.name not in ("name", "description"):
            assert f.default is dataclasses.MISSING, f.name
    for name in profiles.PROFILE_NAMES:
        own = json.loads((ROOT / "kvfs" / "ops" / "profiles" / f"{name}.json").read_text())
        assert set(TABLE[name]) <= set(own) | {"alert_warm_pct"}
        assert set(own) | set(shared) == set(profiles.KEYS)
        repeated = {k for k in own if k in shared and own[k] == shared[k]}
        assert not repeated, f"{name}.json repeats defaults.json: {repeated}"


def test_broken_install_is_one_line(monkeypatch) -> None:
    real = profiles._data_file
    monkeypatch.setattr(profiles, "_data_file",
                        lambda stem: {} if stem == "defaults" else real(stem))
    with pytest.raises(ProfileError) as e:
        load("gov")
    assert "warm_cap_bytes" in _one_line(e, "broken install")


def test_what_the_router_and_warm_tier_read() -> None:
    """kvfs.torch.router reads these from ``load(name)``; WarmTier takes warm_kwargs()."""
    import inspect

    from kvfs.warm import WarmTier

    params = inspect.signature(WarmTier).parameters
    for name in profiles.PROFILE_NAMES:
        p = load(name)
        want = {**COMMON, **TABLE[name]}
        for attr in ("max_kv_len", "device_watermark", "summary_dim", "warm_cap_bytes",
                     "warm_migrate_at", "lru_group", "warm_shards", "shard_key"):
            assert getattr(p, attr) == pytest.approx(want[attr]), (name, attr)
        assert p.warm_root.startswith("/")
        kw = p.warm_kwargs()
        assert set(kw) <= set(params), set(kw) - set(params)
        assert kw["shards"] == p.warm_shards and kw["group"] == p.lru_group


@pytest.mark.parametrize("n,down,up", [(0, "0", "0"), (1000, "1000", "1000"),
                                       (1 << 20, "1M", "1M"), ((1 << 20) + 1, "1M", "2M"),
                                       (1610612736, "1G", "2G"), (15 << 30, "15G", "15G"),
                                       (int(1.2 * (1 << 40)), "1T", "2T")])
def test_size_arg(n: int, down: str, up: str) -> None:
    assert (units.size_arg(n), units.size_arg(n, up=True)) == (down, up)
    assert parse_size(units.size_arg(n)) <= n <= parse_size(units.size_arg(n, up=True))
    with pytest.raises(ValueError):
        units.size_arg(-1)


def test_format_size() -> None:
    assert units.format_size(512) == "512 B"
    assert units.format_size(int(1.2 * (1 << 40))) == "1.2 TiB"
    assert units.format_size(16 << 30) == "16.0 GiB"
