"""Deployment profiles: the article's production settings, as validated, frozen values.

Owns the profile data files (``kvfs/ops/profiles/<name>.json`` over the shared
``profiles/defaults.json``: the only place profile values are written), the override order
(defaults < profile file < config file < ``-o key=value`` overrides) and the validation of every
value. Every bad input raises :class:`ProfileError` whose message is one line naming the
key and what is allowed, so ``kvfs-mount`` can print it and exit without mounting anything.

Sizes and durations are read and written by ``kvfs.ops.units``. Never imports pyfuse3 or
torch, and of the engine only ``kvfs.engine.types`` (for ``StoreConfig``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvfs.engine.types import StoreConfig

from .units import format_size, parse_duration, parse_size

#: profiles shipped as package data
PROFILE_NAMES = ("gov", "ecommerce", "iot")

class ProfileError(ValueError):
    """A bad profile name, key, value or config file. ``str(e)`` is one line."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(" ".join(str(message).split()))
        self.key = key


# --- field kinds: how a value is converted and which values are allowed -------------------

def _spec(kind: str, help: str, **limits: Any) -> Any:
    """A tunable without a value here: values come from ``profiles/*.json`` (see :func:`load`)."""
    return field(metadata={"kind": kind, "help": help, **limits})


@dataclass(frozen=True, kw_only=True)
class Profile:
    """All tunables of one deployment. Build with :func:`load`; every field is validated.

    No value is written here: each profile's file sets the keys of the profile table and
    ``profiles/defaults.json`` the rest, so the data files are the only copy of them.
    """

    name: str = field(default="custom", metadata={"kind": "name", "help": "profile name"})
    description: str = field(default="", metadata={"kind": "str",
                                                   "help": "one line about the workload"})
    # hot tier
    max_kv_len: int = _spec("int", "tokens per layer kept on the device (hot window)", min=1)
    device_watermark: float = _spec("fraction", "device memory ratio that moves rounds out")
    sink_tokens: int = _spec(
        "int", "first tokens of a session kept on the device (attention sinks)", min=0, max=1024)
    auto_recall: bool = _spec("bool", "at each new round, attend the older rounds whose summaries "
                              "match it best")
    recall_rounds: int = _spec("int", "rounds brought back by automatic recall", min=0, max=64)
    rope_rerotate: str = _spec("choice", "RoPE models: move the sinks' keys closer to the query "
                               "(reach: only as far as keeps them within rope_reach of it; "
                               "window: next to the window)", choices=("off", "reach", "window"))
    rope_reach: int = _spec("int", "reach: the farthest the sinks may be from the query, tokens "
                            "(capped at the model's max_position_embeddings)", min=1)
    retrieval: bool = _spec("bool", "attend, beside the sinks and the window, the old blocks whose "
                            "key centroids the current queries would attend most; off: sinks and "
                            "window only")
    retrieval_block: int = _spec("int", "tokens per retrieval block", min=1, max=4096)
    retrieval_bytes: int = _spec("size", "device bytes of the old blocks one session attends per "
                                 "step, over all layers (the blocks per layer follow from the "
                                 "model's KV bytes per token)", min=0)
    retrieval_share: float = _spec("fraction", "share of a session's old blocks attended when that "
                                   "is more than retrieval_bytes holds (a budget that grows with "
                                   "the session), up to retrieval_max_bytes")
    retrieval_max_bytes: int = _spec("size", "device bytes the grown share may reach, one session "
                                     "over all layers", min=0)
    keep_summary_rounds: int = _spec(
        "int", "previous rounds kept findable by their summary (ecommerce: 1)", min=0, max=1024)
    # warm tier
    warm_shards: int = _spec("pow2", "warm .kvmap shard count", min=1, max=1 << 32)
    shard_key: str = _spec("choice", "what picks a shard", choices=("session", "device"))
    warm_migrate_at: float = _spec("fraction", "warm usage ratio that migrates a group to cold")
    lru_group: int = _spec("int", "sessions migrated together (LRU group)", min=1, max=1 << 20)
    warm_cap_bytes: int = _spec("size", "warm tier capacity", min=1 << 20)
    warm_root: str = _spec("path", "RAM-backed directory of the warm tier")
    summary_dim: int = _spec("int", "floats in one round's summary vector", min=1, max=1 << 16)
    writebehind: bool = _spec("bool", "append what the RAM tier receives to the mount behind it "
                              "(off: sessions reach the mount only when migrated or synced)")
    writebehind_s: float = _spec("seconds", "longest lag of the mount behind the RAM tier",
                                 min=0.01)
    writebehind_bytes: int = _spec("size", "bytes not yet on the mount that start a write early",
                                   min=1 << 16)
    # cold tier
    ring_size: int = _spec("size", "volume (ring) size when one is created", min=1 << 20)
    checkpoint_interval_s: float = _spec("seconds", "index checkpoint period", min=0.001)
    hot_sessions: int = _spec("int", "sessions in the in-memory hot index", min=1)
    cleanup_threshold: float = _spec("fraction", "ring usage that starts retention cleanup")
    retention_s: float = _spec("seconds", "idle time after which cleanup may drop a session",
                               min=1.0)
    compress_on_copy: bool = _spec("bool", "append KV raw and compress it when reclaim copies it "
                                   "forward (false: compress at append)")
    evict_when_full: bool = _spec("bool", "full volume: drop sessions at the ring tail whole "
                                  "instead of answering ENOSPC")
    # shared tier (docs/scale-out.md)
    shared: str = _spec("str", "Redis Cluster of the shared tier, redis://host:port[,host:port...] "
                        "(empty: none)")
    shared_optional: bool = _spec("bool", "cluster unreachable at mount: run local-only with a "
                                  "warning instead of refusing")
    shared_retention_s: float = _spec("seconds", "how long the cluster keeps a session after its "
                                      "last write", min=1.0)
    shared_max_bytes: int = _spec("size", "bound on the cluster's session bytes, least recently "
                                  "written dropped first (0: none)", min=0)
    shared_queue_bytes: int = _spec("size", "bound on bytes waiting to be replicated; past it, "
                                    "fsync is EIO while the cluster is away", min=1 << 20)
    shared_lease_s: float = _spec("seconds", "session lease: a dead node's sessions are taken "
                                  "over this long after its last renewal", min=0.1)
    shared_fsync_wait_s: float = _spec("seconds", "how long fsync waits for an unreachable "
                                       "cluster before acknowledging locally", min=0.0)
    shared_node_id: str = _spec("str", "this mount's name in the cluster's leases (empty: the "
                                "host name and a hash of the volume's path; cloned hosts must "
                                "not share one)")
    shared_secret_file: str = _spec("file", "the cluster's secret (32+ random bytes, mode 0600, "
                                    "the same on every node): every value is sealed with it")
    shared_encrypt: bool = _spec("bool", "also encrypt every value (ChaCha20-Poly1305) so that a "
                                 "Redis operator reads no conversation")
    shared_password_file: str = _spec("file", "the Redis user's password (the environment's "
                                      "KVFS_SHARED_PASSWORD wins; a password in the URL is the "
                                      "last resort: ps shows it until the mount hides it)")
    shared_tls_ca: str = _spec("file", "rediss://: the CA that signed the servers' certificates")
    shared_tls_cert: str = _spec("file", "rediss://: this node's client certificate")
    shared_tls_key: str = _spec("file", "rediss://: this node's client key")
    # quotas of one uid on a volume other users write (kvfs.engine.quota; root has none).
    # "auto": none on a private mount; with --allow-other a quarter of the volume each
    quota_sessions: int = _spec("auto_int", "sessions one uid may own (0: no limit)", min=0)
    quota_bytes: int = _spec("auto_size", "bytes of file data one uid's sessions may hold "
                             "(0: no limit)", min=0)
    quota_index_share: float = _spec("auto_share", "share of the volume's index one uid's "
                                     "sessions may fill (0 or 1: no limit)")
    # the native channel (kvfs.fuse.channel; its other limits are fixed, docs/reliability.md)
    channel_idle_s: float = _spec("seconds", "the mount closes a native-channel connection "
                                  "with no request for this long", min=0.1)
    # alert rules
    alert_device_pct: float = _spec("fraction", "device_memory_high threshold")
    alert_device_for_s: float = _spec("seconds", "device_memory_high duration", min=0.0)
    alert_warm_pct: float = _spec("fraction", "warm_usage_high threshold")
    alert_warm_for_s: float = _spec("seconds", "warm_usage_high duration", min=0.0)
    alert_cold_write_ms: float = _spec("ms", "cold_write_slow threshold (ms)", min=0.001)
    alert_cold_write_for_s: float = _spec("seconds", "cold_write_slow duration", min=0.0)
    alert_interval_s: float = _spec("seconds", "how often alert rules are evaluated", min=0.01)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # converts (e.g. int -> float seconds) and checks
            object.__setattr__(self, f.name, _convert(f, getattr(self, f.name), "profile"))

    # --- views for the components ----------------------------------------------------
    def store_config(self, **extra: Any) -> StoreConfig:
        """The engine's ``StoreConfig`` for this profile (``extra`` sets the other fields:
        ``shared=True`` for a mount other users write, which resolves "auto" quotas)."""
        kw: dict[str, Any] = dict(hot_sessions=self.hot_sessions,
                                  checkpoint_interval_s=self.checkpoint_interval_s,
                                  cleanup_threshold=self.cleanup_threshold,
                                  retention_s=self.retention_s,
                                  evict_when_full=self.evict_when_full,
                                  compress_on_copy=self.compress_on_copy,
                                  quota_sessions=self.quota_sessions,
                                  quota_bytes=self.quota_bytes,
                                  quota_index_share=self.quota_index_share)
        return StoreConfig(**{**kw, **extra})

    def warm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``kvfs.warm.WarmTier`` (see docs/contracts/warm-api.md);
        ``{uid}`` in ``warm_root`` is this process's effective uid."""
        return {"root": user_path(self.warm_root), "cap_bytes": self.warm_cap_bytes,
                "migrate_at": self.warm_migrate_at, "group": self.lru_group,
                "shards": self.warm_shards, "shard_key": self.shard_key,
                "summary_dim": self.summary_dim, "writebehind": self.writebehind,
                "writebehind_s": self.writebehind_s, "writebehind_bytes": self.writebehind_bytes}

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Profile:
        """A copy with ``changes`` converted and validated like overrides."""
        return dataclasses.replace(self, **_coerce_all(changes, "replace"))


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Profile)}
#: keys a profile file, config file or override may set
KEYS = tuple(k for k in FIELDS if k != "name")


def user_path(path: str, uid: int | None = None) -> str:
    """``path`` with ``{uid}`` replaced by ``uid`` (default: this process's effective uid):
    per-user defaults such as ``/dev/shm/kvfs-warm-{uid}``."""
    return path.replace("{uid}", str(os.geteuid() if uid is None else uid))


AUTO = -1  # an "auto" quota (kvfs.engine.quota.AUTO): decided by how the volume is mounted


def _allowed(f: dataclasses.Field) -> str:
    md = f.metadata
    kind = md["kind"]
    lo, hi = md.get("min"), md.get("max")
    if kind.startswith("auto_"):
        base = {"auto_int": "an integer from 0", "auto_size": "a size, e.g. 0, 512M, 16G",
                "auto_share": "a fraction from 0 to 1, e.g. 0.25 or 25%"}[kind]
        return f"auto or {base}"
    if kind == "fraction":
        return "a fraction in (0, 1], e.g. 0.85 or 85%"
    if kind == "choice":
        return "one of " + ", ".join(md["choices"])
    if kind == "pow2":
        return f"a power of two from {lo} to {hi}"
    if kind == "size":
        return f"a size of at least {format_size(lo or 0)}, e.g. 512M, 16G, 1.2T"
    if kind == "seconds":
        return f"a duration of at least {lo:g} s, e.g. 30, 30s, 10m, 7d"
    if kind == "ms":
        return f"milliseconds, at least {lo:g}"
    if kind == "path":
        return "an absolute path ({uid} stands for the user's uid)"
    if kind == "file":
        return "an absolute path, or empty for none"
    if kind == "int":
        return f"an integer from {lo}" + (f" to {hi}" if hi is not None else " up")
    if kind == "bool":
        return "true or false"
    return "a string"


def _fail(f: dataclasses.Field, value: Any, origin: str) -> ProfileError:
    return ProfileError(f"{f.name}: bad value {value!r} (from {origin}); "
                        f"allowed: {_allowed(f)}", key=f.name)


def _check(f: dataclasses.Field, v: Any, origin: str, shown: Any) -> None:
    """Raise ProfileError (showing ``shown``) unless converted ``v`` is allowed for ``f``."""
    md = f.metadata
    kind = md["kind"]
    lo, hi = md.get("min"), md.get("max")
    if kind.startswith("auto_"):
        ok = v == AUTO or (isinstance(v, float) and 0.0 <= v <= 1.0 if kind == "auto_share"
                           else isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    elif kind == "bool":
        ok = isinstance(v, bool)
    elif kind in ("name", "str"):
        ok = isinstance(v, str)
    elif kind == "path":
        ok = isinstance(v, str) and v.startswith("/")
    elif kind == "file":
        ok = isinstance(v, str) and (not v or v.startswith("/"))
    elif kind == "choice":
        ok = v in md["choices"]
    elif kind == "fraction":
        ok = isinstance(v, float) and 0.0 < v <= 1.0
    elif kind in ("seconds", "ms"):
        ok = isinstance(v, float) and math.isfinite(v) and (lo is None or v >= lo)
    else:  # int, pow2, size
        ok = isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)
        ok = ok and (hi is None or v <= hi)
        ok = ok and (kind != "pow2" or v & (v - 1) == 0)
    if not ok:
        raise _fail(f, shown, origin)


def _convert(f: dataclasses.Field, raw: Any, origin: str) -> Any:
    """Convert ``raw`` (a string from the command line or a JSON/TOML value) for ``f``."""
    kind = f.metadata["kind"]
    if kind == "bool":
        words = {"true": True, "yes": True, "on": True, "1": True,
                 "false": False, "no": False, "off": False, "0": False}
        flag = raw if isinstance(raw, bool) else words.get(str(raw).strip().lower())
        if flag is None:
            raise _fail(f, raw, origin)
        return flag
    if isinstance(raw, bool) or raw is None or isinstance(raw, list | dict):
        raise _fail(f, raw, origin)
    try:
        if kind.startswith("auto_") and (raw == AUTO or isinstance(raw, str)
                                         and raw.strip().lower() == "auto"):
            v: int | float | str = AUTO  # as typed, or already converted (Profile re-checks its values)
        elif kind == "auto_share":
            v = (float(raw.strip()[:-1]) / 100.0 if isinstance(raw, str) and raw.strip().endswith("%")
                 else float(raw))
        elif kind == "auto_size":
            v = parse_size(int(raw) if isinstance(raw, float) and raw.is_integer() else raw)
        elif kind == "auto_int":
            v = int(raw.replace("_", "")) if isinstance(raw, str) else int(raw)
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
        elif kind in ("name", "str", "choice", "path", "file"):
            if not isinstance(raw, str):
                raise ValueError
            v = raw.strip()
        elif kind == "size":
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise ValueError
                raw = int(raw)
            v = parse_size(raw)
        elif kind in ("int", "pow2"):
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise ValueError
                raw = int(raw)
            v = int(raw.replace("_", "")) if isinstance(raw, str) else int(raw)
        elif kind == "fraction":
            if isinstance(raw, str) and raw.strip().endswith("%"):
                v = float(raw.strip()[:-1]) / 100.0
            else:
                v = float(raw)
        elif kind == "seconds":
            v = parse_duration(raw)
        else:  # ms
            v = float(raw.strip().removesuffix("ms")) if isinstance(raw, str) else float(raw)
    except (ValueError, TypeError, OverflowError):
        raise _fail(f, raw, origin) from None
    _check(f, v, origin, raw)
    return v


def _field(key: Any, origin: str) -> dataclasses.Field:
    if key == "name":
        raise ProfileError(f"name: cannot be set (from {origin}); choose the profile with "
                           f"--profile / profile= ({', '.join(PROFILE_NAMES)})", key="name")
    f = FIELDS.get(key) if isinstance(key, str) else None
    if f is None:
        raise ProfileError(f"{key}: unknown profile key (from {origin}); "
                           f"allowed keys: {', '.join(KEYS)}", key=str(key))
    return f


def _coerce_all(values: dict[str, Any], origin: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise ProfileError(f"{origin}: expected a table of key = value, got "
                           f"{type(values).__name__}")
    return {k: _convert(_field(k, origin), v, origin) for k, v in values.items()}


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["max_kv_len=48", "ring_size=512M"]`` -> ``{"max_kv_len": 48, "ring_size": 536870912}``.

    Converts each value by its field's type; ProfileError on a missing ``=``, an unknown
    key or a bad value. A later item for the same key wins.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ProfileError(f"{item!r}: expected key=value (from -o); "
                               f"allowed keys: {', '.join(KEYS)}", key=key or None)
        out[key] = _convert(_field(key, f"-o {key}"), value, f"-o {key}")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """Read a config file (``.toml`` via tomllib, anything else as JSON); values converted."""
    p = Path(path)
    origin = f"config file {p}"
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ProfileError(f"{origin}: cannot read: {e.strerror or e}") from None
    try:
        if p.suffix.lower() == ".toml":
            data = tomllib.loads(text.decode("utf-8"))
        else:
            data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProfileError(f"{origin}: does not parse: {e}") from None
    return _coerce_all(data, origin)


def _data_file(stem: str) -> dict[str, Any]:
    res = resources.files("kvfs.ops").joinpath("profiles", f"{stem}.json")
    try:
        data = json.loads(res.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # a broken install, not user input
        raise ProfileError(f"profile: data file {stem}.json is unreadable: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"profile: data file {stem}.json is not a JSON object")
    return data


def defaults() -> dict[str, Any]:
    """The raw shared values (``profiles/defaults.json``) that a profile file may override."""
    return _data_file("defaults")


def profile_data(name: str) -> dict[str, Any]:
    """The raw key/values of a shipped profile: the shared defaults, then its own file
    (ProfileError for an unknown name or an incomplete install)."""
    if name not in PROFILE_NAMES:
        raise ProfileError(f"profile: unknown profile {name!r}; allowed: "
                           f"{', '.join(PROFILE_NAMES)}", key="profile")
    data = {**defaults(), **_data_file(name)}
    missing = [k for k in KEYS if k not in data and FIELDS[k].default is dataclasses.MISSING]
    if missing:
        raise ProfileError(f"profile: {name}.json and defaults.json leave {', '.join(missing)} "
                           "unset (a broken install)")
    return data


def load(name: str = "gov", overrides: dict[str, Any] | None = None,
         config_file: str | Path | None = None) -> Profile:
    """The profile ``name`` with the config file's values, then ``overrides``, applied.

    ``overrides`` values may be typed (``{"ring_size": 1 << 30}``) or strings as typed on
    a command line (``{"ring_size": "1G"}``); both are converted and validated.
    """
    values = _coerce_all(profile_data(name), f"profile {name}")
    if config_file is not None:
        values.update(read_config(config_file))
    if overrides:
        values.update(_coerce_all(dict(overrides), "overrides"))
    return Profile(name=name, **values)


#: keys only agent processes use (the hot and RAM tiers): a mount refuses them as overrides
AGENT_KEYS = frozenset({
    "max_kv_len", "device_watermark", "sink_tokens", "auto_recall", "recall_rounds", "rope_rerotate", "rope_reach",
    "retrieval", "retrieval_block", "retrieval_bytes", "retrieval_share", "retrieval_max_bytes",
    "keep_summary_rounds", "warm_shards", "shard_key", "warm_migrate_at", "lru_group",
    "warm_cap_bytes", "warm_root", "summary_dim", "writebehind", "writebehind_s",
    "writebehind_bytes",
})


def check_mount_keys(overrides: dict[str, Any], config_file: str | Path | None) -> None:
    """Refuse agent-only keys given to a mount: there they would change nothing."""
    given = set(overrides) | (set(read_config(config_file)) if config_file else set())
    wrong = sorted(given & AGENT_KEYS)
    if wrong:
        raise ProfileError(
            f"{', '.join(wrong)}: agent setting{'s' if len(wrong) > 1 else ''}, not the mount's; "
            "pass it to KVRouter(...) in the agent, or put it in the profile both load (agents "
            "take the profile the mount was started with from /.kvfs/stats)", wrong[0])


def describe(key: str) -> str:
    """Help text of a key with what it allows (for ``--help`` and the docs)."""
    f = _field(key, "describe")
    return f"{f.metadata['help']}; {_allowed(f)}"
