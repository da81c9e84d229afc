"""The session router: session id -> TieredCache, one warm tier, one spill thread, the budget.

Owns: the mapping of live sessions (in least-recently-used order), the device budget and
its watermark, the shared :class:`~kvfs.torch.spill.Spiller`, the :class:`kvfs.warm.WarmTier`
it builds over the mount (``cold_root``), resume, forks, and the hot-tier metrics. The
budget's checks and its synchronous "move the oldest round of the least recently used
sessions out" policy are its part :class:`~kvfs.torch.router_budget.HotBudget`
(``router.hot_budget``); the caches call them through the router (:class:`~kvfs.torch.
seams.CacheRouter`), which keeps its sessions in least-recently-used order first.

Never calls ``torch.cuda.empty_cache()``; never writes files itself (the warm tier does).
One thread drives a router and its caches (the forward passes); the spill thread is the
only other thread, and it touches nothing but the warm tier.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from kvfs.ops import metrics, profiles
from kvfs.ops.heap import DEFAULT_INTERVAL_S, HeapTrimmer
from kvfs.torch.cache import (
    TieredCache,
)
from kvfs.torch.fingerprint import KVCorrupt, KVMismatch, KVUnsupported, fingerprint, geometry
from kvfs.torch.meta import acknowledge
from kvfs.torch.meta import stored as stored_meta
from kvfs.torch.parts import Shown
from kvfs.torch.rope import RopeShift
from kvfs.torch.router_budget import HotBudget
from kvfs.torch.seams import BudgetedCache, WarmStore
from kvfs.torch.spill import Spiller, SpillError
from kvfs.warm import mount_info

log = logging.getLogger("kvfs.torch.router")

_UNSET: Any = object()


def load_profile(name: str | Any) -> Any:
    """A :class:`kvfs.ops.profiles.Profile` by name (a Profile object is returned as is)."""
    return profiles.load(name) if isinstance(name, str) else name


def mount_profile(info: dict[str, Any] | None) -> Any:
    """The profile the mount was started with (gov when it publishes none)."""
    values = (info or {}).get("profile")
    if not isinstance(values, dict):
        return profiles.load("gov")
    return profiles.Profile(**values)


def hot_settings(prof: Any) -> dict[str, Any]:
    """The hot-tier values of a profile."""
    return {"sink_tokens": prof.sink_tokens, "auto_recall": prof.auto_recall,
            "recall_rounds": prof.recall_rounds, "rope_rerotate": prof.rope_rerotate,
            "rope_reach": prof.rope_reach, "retrieval": prof.retrieval,
            "retrieval_block": prof.retrieval_block, "retrieval_bytes": prof.retrieval_bytes,
            "retrieval_share": prof.retrieval_share, "retrieval_max_bytes": prof.retrieval_max_bytes}


class KVRouter:
    """Session id -> :class:`TieredCache` over one warm tier (and, below it, the mount).

    ``KVRouter(mount="/mnt/kv", device="cpu", max_kv_len=24, device_budget_bytes=None,
    profile="gov")``. Values not given come from the profile (:mod:`kvfs.ops.profiles`:
    ``max_kv_len``, ``device_watermark``, ``summary_dim``, ``sink_tokens``, ``auto_recall``,
    ``recall_rounds``, ``rope_rerotate``, ``rope_reach``, ``retrieval``, ``retrieval_block``,
    ``retrieval_bytes``, ``retrieval_share``, ``retrieval_max_bytes``, the warm tier's keys);
    explicit arguments win. ``warm=`` injects a
    ready warm tier (tests, benchmarks); otherwise one ``WarmTier(cold_root=mount,
    root=warm_root or profile.warm_root, ...)`` is built and owned. ``retrieval=False`` is
    the one switch back to sinks + window only (retrieval needs the model's attention to
    report its queries: :mod:`kvfs.torch.attention`, installed by :meth:`cache`).
    ``heap_trim_s``: a :meth:`release` gives the C heap's free pages back to the kernel at
    most this often (:mod:`kvfs.ops.heap`; 0: never).
    """

    def __init__(self, mount: str | None = None, device: str | torch.device = "cpu",
                 max_kv_len: int | None = _UNSET, device_budget_bytes: int | None = None,
                 profile: str | Any = None, warm_root: str | None = None, *,
                 watermark: float | None = None, warm: WarmStore | None = None,
                 warm_options: dict[str, Any] | None = None, summary_dim: int | None = None,
                 sink_tokens: int | None = None, auto_recall: bool | None = None,
                 recall_rounds: int | None = None, rope_rerotate: bool | str | None = None,
                 rope_reach: int | None = None, retrieval: bool | None = None,
                 retrieval_block: int | None = None, retrieval_bytes: int | None = None,
                 retrieval_share: float | None = None, retrieval_max_bytes: int | None = None,
                 max_pending_bytes: int = 64 << 20, heap_trim_s: float = DEFAULT_INTERVAL_S) -> None:
        info = mount_info(mount)
        # the mount's profile unless told otherwise: one set of settings for all tiers
        self.profile = mount_profile(info) if profile is None else load_profile(profile)
        vol = ((info or {}).get("store") or {}).get("volume") or {}
        self.volume_id: str | None = vol.get("uuid")
        # a kvfs mount serves layer files without the page cache (direct I/O, its default):
        # a read-ahead hint would only make it read 128 KiB per file into unread pages
        self._prefetch = not ((info or {}).get("fs") or {}).get("direct_io", False)
        hot = hot_settings(self.profile)
        self.sink_tokens = hot["sink_tokens"] if sink_tokens is None else int(sink_tokens)
        self.auto_recall = hot["auto_recall"] if auto_recall is None else bool(auto_recall)
        self.recall_rounds = hot["recall_rounds"] if recall_rounds is None else int(recall_rounds)
        self.rope_rerotate = hot["rope_rerotate"] if rope_rerotate is None else rope_rerotate
        self.rope_reach = hot["rope_reach"] if rope_reach is None else int(rope_reach)
        self.retrieval = hot["retrieval"] if retrieval is None else bool(retrieval)
        self.retrieval_block = hot["retrieval_block"] if retrieval_block is None else int(retrieval_block)
        self.retrieval_bytes = hot["retrieval_bytes"] if retrieval_bytes is None else int(retrieval_bytes)
        self.retrieval_share = float(hot["retrieval_share"] if retrieval_share is None else retrieval_share)
        self.retrieval_max_bytes = int(hot["retrieval_max_bytes"] if retrieval_max_bytes is None
                                       else retrieval_max_bytes)
        # from the profile: "where the model allows"; asked for explicitly: refused otherwise
        self._rope_required = rope_rerotate is not None
        self._rope_ok: dict[str, bool] = {}  # model fingerprint -> its rotation is reproducible
        self.mount = mount
        self.device = torch.device(device)
        self.max_kv_len = self.profile.max_kv_len if max_kv_len is _UNSET else max_kv_len
        line = float(watermark if watermark is not None else self.profile.device_watermark)
        self.summary_dim = int(summary_dim or self.profile.summary_dim)
        self._cuda = self.device.type == "cuda"
        if self._cuda and device_budget_bytes is None:
            device_budget_bytes = torch.cuda.get_device_properties(self.device).total_memory
        self._sessions: OrderedDict[str, TieredCache] = OrderedDict()  # LRU first
        self.hot_budget = HotBudget(self._sessions, device_budget_bytes, line, self.device)
        self._own_warm = warm is None
        if warm is None:
            from kvfs.warm import WarmTier  # noqa: PLC0415 - heavy peer, only when needed

            kw = dict(self.profile.warm_kwargs())
            kw["summary_dim"] = self.summary_dim
            if warm_root is not None:
                kw["root"] = warm_root
            kw.update(warm_options or {})
            warm = WarmTier(cold_root=mount, volume_id=self.volume_id, **kw)
        self.warm: WarmStore = warm
        if self._own_warm:  # kvfs-stat shows this process's hot tier beside its RAM tier
            warm.stats_extra = self._published
        # one spiller for every session: one session's failed spill stays that session's
        self.spiller = Spiller(warm, max_pending_bytes=max_pending_bytes, isolate=True)
        self._closed = False
        self._acked: dict[str, int] = {}
        self._warned_retrieval = False  # tokens recorded as acknowledged, per session
        # a released session's tensors go back to malloc, which keeps the pages: hand them
        # to the kernel now and then, or RSS stays at the busiest hour's (kvfs.ops.heap)
        self.heap = HeapTrimmer(heap_trim_s)
        log.info("router: device=%s max_kv_len=%s sinks=%d auto_recall=%s(k=%d) retrieval=%s "
                 "(blocks of %d, %d B) budget=%s watermark=%.2f profile=%s", self.device,
                 self.max_kv_len, self.sink_tokens, self.auto_recall, self.recall_rounds,
                 self.retrieval, self.retrieval_block, self.retrieval_bytes, self.budget,
                 self.watermark, getattr(self.profile, "name", profile))

    # --- sessions ---------------------------------------------------------------------------
    def cache(self, session_id: str, model: Any, *, fresh: bool = False) -> TieredCache:
        """The session's cache: the live one, else resumed from storage, else a new one.

        ``fresh=True`` deletes anything stored under ``session_id`` and starts empty.
        """
        self._check_open()
        c = self._sessions.get(session_id)
        if c is not None and not fresh:
            if c.fingerprint != fingerprint(model):
                raise KVMismatch(f"session {session_id!r} is live for model {c.fingerprint}, "
                                 f"not for this model ({fingerprint(model)})")
            self._sessions.move_to_end(session_id)
            return c
        if c is not None:
            self.release(session_id, flush=False)
        if fresh:
            self.spiller.wait()  # nothing of the old session may land after the delete
            self.spiller.forget(session_id)
            if self.warm.where(session_id) is not None:
                self.warm.delete(session_id)
        elif stored_meta(self.warm, session_id) is not None:
            return self.resume(session_id, model)
        elif self.warm.where(session_id) is not None and self.warm.size(session_id, 0) > 0:
            raise KVCorrupt(f"session {session_id!r} has stored layer bytes but no meta.json; "
                            "pass fresh=True to start it over")
        c = self._new_cache(session_id, model)
        self._register(c)
        return c

    def resume(self, session_id: str, model: Any, device: str | torch.device | None = None) -> TieredCache:
        """Rebuild a stored session (after a restart) so generation continues exactly.

        Raises :class:`~kvfs.torch.KVMismatch` for another model, :class:`~kvfs.torch.KVCorrupt`
        for truncated layer files, ``KeyError`` when nothing is stored. A live session is
        returned as is.
        """
        self._check_open()
        live = self._sessions.get(session_id)
        if live is not None:
            self._sessions.move_to_end(session_id)
            return live
        c = self._new_cache(session_id, model)
        dev = device if device is not None else _model_device(model, self.device)
        self.spiller.wait()
        if self.spiller.forget(session_id) is not None:
            log.warning("session %r: resumed from the mount after its spill failed", session_id)
        meta = stored_meta(self.warm, session_id)  # KVCorrupt for any bad field; a first use
        # here checks a RAM copy against the mount: a stale one is dropped (and marked lost)
        self.warm.clear_lost(session_id)  # continues from the mount's copy, not lost
        if meta is None and self.warm.where(session_id) is not None:
            raise KVCorrupt(f"session {session_id!r} is stored but its meta.json is missing or "
                            "does not parse; nothing was loaded")
        if isinstance(meta, dict) and isinstance(meta.get("tokens"), int):  # room first
            total = meta["tokens"]
            n = total - c.window_from(total) + min(total, self.sink_tokens)
            if c.retrieval is not None:
                ret = c.retrieval
                n += ret.attend_for(ret.layout.blocks_before(c.window_from(total))) * ret.block
            self.reserve(c, n * c.geo.session_token_bytes)
            tb = c.geo.token_bytes
            if self._prefetch:
                self.warm.prefetch(session_id, range(c.num_layers), (total - n) * tb, total * tb)
        c.load(dev)
        self._register(c)
        self.after_step(c)
        return c

    def _new_cache(self, session_id: str, model: Any) -> TieredCache:
        return TieredCache(model, session_id=session_id, warm=self.warm, max_kv_len=self.max_kv_len,
                           sink_tokens=self.sink_tokens, auto_recall=self.auto_recall,
                           recall_rounds=self.recall_rounds, spiller=self.spiller, router=self,
                           summary_dim=self.summary_dim, dtype=geometry(model).dtype,
                           rope_rerotate=self._rerotates(model), rope_reach=self.rope_reach,
                           retrieval=self.retrieval, retrieval_block=self.retrieval_block,
                           retrieval_bytes=self.session_retrieval_bytes,
                           retrieval_share=self.retrieval_share,
                           retrieval_max_bytes=self._session_bytes(self.retrieval_max_bytes))

    def _session_bytes(self, n: int) -> int:
        """``n`` device bytes of one session's blocks, at most half the device budget."""
        return n if self.budget is None else min(n, self.budget // 2)

    @property
    def session_retrieval_bytes(self) -> int:
        """A session's retrieval budget: the profile's, at most half the device budget (one
        session's blocks never leave the others nothing; a fixed value, so a resumed session
        attends what the live one did under the same settings)."""
        if self.budget is None or self.retrieval_bytes <= self.budget // 2:
            return self.retrieval_bytes
        if not self._warned_retrieval:
            self._warned_retrieval = True
            log.warning("retrieval_bytes=%d is more than half the device budget (%d B): each "
                        "session's retrieval gets %d B", self.retrieval_bytes, self.budget,
                        self.budget // 2)
        return self.budget // 2

    def _rerotates(self, model: Any) -> bool | str:
        """How this model's caches re-rotate their sinks: the profile's ``rope_rerotate``
        applies where the model's rotation can be reproduced (one warning per model)."""
        if self.rope_rerotate in (False, "off") or self._rope_required:
            return self.rope_rerotate
        fp = fingerprint(model)
        if fp not in self._rope_ok:  # checked once per model
            try:
                RopeShift.of(model)
                self._rope_ok[fp] = True
            except KVUnsupported as e:
                self._rope_ok[fp] = False
                log.warning("%s; this model's sessions keep the sinks at their own positions", e)
        return self.rope_rerotate if self._rope_ok[fp] else False

    def _register(self, c: TieredCache) -> None:
        self._sessions[c.session_id] = c
        self.hot_budget.register(c)
        metrics.hot_sessions.set(self.hot_session_count())

    def release(self, session_id: str, flush: bool = True) -> None:
        """Drop a session from the device (after flushing it below, unless ``flush=False``).

        The released cache object must not be used again; ``cache()``/``resume()`` rebuild it.
        """
        c = self._sessions.pop(session_id, None)
        if not flush:  # a session whose RAM copy was lost is let go too (WarmLost)
            self.spiller.forget(session_id)
            self.warm.clear_lost(session_id)
        if c is None:
            return
        if flush:
            c.flush()
            self.spiller.wait(sid=session_id)
            self.warm.release(session_id)  # synced to the mount; another process may take it
        self.hot_budget.forget(session_id)
        for lay in c.tiered:
            lay.release()
        if c.retrieval is not None:
            c.retrieval.release()
        c.router = None
        metrics.hot_bytes.set(self.hot_total)
        metrics.hot_sessions.set(self.hot_session_count())
        self.heap.maybe_trim()

    def fork(self, src_id: str, new_id: str, model: Any = None) -> TieredCache | None:
        """Copy session ``src_id`` to ``new_id`` so two continuations can be explored.

        The stored session is copied by the warm tier (``WarmStore.fork``: on the mount,
        in the session's commit order; a live source is flushed first); a live source's device window, sinks, rounds and recall are
        cloned, so both sessions continue exactly as the source would. Returns the new live
        cache; for a source that is only stored, returns ``resume(new_id, model)`` when
        ``model`` is given, else None (resume it later). Refuses (ValueError) an existing
        ``new_id``; KeyError when ``src_id`` is nowhere.
        """
        self._check_open()
        if new_id == src_id or new_id in self._sessions or self.warm.where(new_id) is not None:
            raise ValueError(f"fork: session {new_id!r} already exists")
        src = self._sessions.get(src_id)
        if src is not None:
            src.flush()
        else:
            self.spiller.wait()
        try:
            self.warm.fork(src_id, new_id)
        except KeyError:
            raise KeyError(f"fork: session {src_id!r} has no meta.json in any tier") from None
        except FileExistsError:
            raise ValueError(f"fork: session {new_id!r} already exists") from None
        if src is None:
            return self.resume(new_id, model) if model is not None else None
        ret = src.retrieval
        c = TieredCache(src.config, session_id=new_id, warm=self.warm, max_kv_len=src.max_kv_len,
                        sink_tokens=src.sink_tokens, auto_recall=src.auto_recall,
                        recall_rounds=src.recall_rounds, spiller=self.spiller, router=self,
                        summary_dim=src.summary_dim, dtype=src.geo.dtype, retrieval=ret is not None,
                        retrieval_block=ret.block if ret else src.retrieval_block,
                        retrieval_bytes=(ret.attend + ret.keep) * ret.block * src.geo.session_token_bytes
                        if ret else None, retrieval_share=ret.share if ret else 0.0,
                        retrieval_max_bytes=(ret.most + ret.keep) * ret.block * src.geo.session_token_bytes
                        if ret else None)
        c.fingerprint = src.fingerprint
        self.reserve(c, src.hot_bytes)
        src.copy_state_to(c)
        self._register(c)
        self.after_step(c)
        return c

    def sessions(self) -> list[str]:
        """Live session ids, least recently used first."""
        return list(self._sessions)

    def hot_session_count(self) -> int:
        return self.hot_budget.hot_sessions()

    # --- the device budget (:class:`HotBudget`), as the caches and callers see it -----------------
    @property
    def budget(self) -> int | None:
        """Device bytes the sessions may use (``limit`` = ``watermark * budget``)."""
        return self.hot_budget.budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        self.hot_budget.budget = value

    @property
    def watermark(self) -> float:
        return self.hot_budget.watermark

    @watermark.setter
    def watermark(self, value: float) -> None:
        self.hot_budget.watermark = value

    limit = Shown[float | None]("hot_budget", "limit")  # watermark * budget
    hot_total = Shown[int]("hot_budget", "hot_total")
    peak_hot_bytes = Shown[int]("hot_budget", "peak_hot_bytes")
    watermark_moves = Shown[int]("hot_budget", "watermark_moves")
    move_ms_total = Shown[float]("hot_budget", "move_ms_total")

    def account(self, c: BudgetedCache) -> None:
        """Record ``c``'s device bytes now (called by the cache after it changed them)."""
        self.hot_budget.account(c)

    def before_step(self, c: BudgetedCache, q: int) -> None:
        """``c`` is about to step: it becomes the most recently used; room for its growth."""
        self._sessions.move_to_end(c.session_id)
        self.hot_budget.before_step(c, q)

    def reserve(self, c: BudgetedCache, extra: int) -> None:
        """Make room for ``extra`` bytes ``c`` is about to read back (refill, recall)."""
        self.hot_budget.reserve(c, extra)

    def has_room(self, c: BudgetedCache, extra: int) -> bool:
        """Whether ``c`` can grow by ``extra`` bytes within the budget (others moved out)."""
        return self.hot_budget.has_room(c, extra)

    def after_step(self, c: BudgetedCache) -> None:
        """Account ``c``'s step and enforce the budget (called by the cache's last layer)."""
        self.hot_budget.after_step(c)

    def device_usage_ratio(self) -> float:
        """Device memory reserved (CUDA) or hot bytes (CPU) over the budget; 0 without one."""
        return self.hot_budget.usage_ratio()

    # --- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """kv_hot_hit_rate, hot bytes/peak/budget, moves, spill queue, warm usage, per session."""
        steps = sum(c.steps for c in self._sessions.values())
        hits = sum(c.hits for c in self._sessions.values())
        metrics.update_hot_hit_rate()
        metrics.hot_sessions.set(self.hot_session_count())
        out: dict[str, Any] = {
            "kv_hot_hit_rate": hits / steps if steps else 1.0,
            "hot_bytes": self.hot_total, "peak_hot_bytes": self.peak_hot_bytes,
            "budget_bytes": self.budget, "limit_bytes": self.limit, "watermark": self.watermark,
            "sessions": len(self._sessions), "hot_sessions": self.hot_session_count(),
            "watermark_moves": self.watermark_moves, "move_ms_total": round(self.move_ms_total, 3),
            "spill": self.spiller.stats(), "heap": self.heap.stats(),
            "per_session": {sid: c.stats() for sid, c in self._sessions.items()},
        }
        if self._cuda:
            out["cuda_memory_reserved"] = torch.cuda.memory_reserved(self.device)
            out["cuda_memory_allocated"] = torch.cuda.memory_allocated(self.device)
        try:
            out["warm"] = self.warm.usage()
        except Exception as e:  # noqa: BLE001 - reporting must not fail the caller
            out["warm"] = {"error": str(e)}
        return out

    def _published(self) -> dict[str, Any]:
        """The hot-tier figures an agent process publishes in its RAM-tier ``stats.json``
        (read from the spill thread: plain numbers only, no tensors touched)."""
        return {"hot": {"bytes": self.hot_total, "budget": self.budget,
                        "sessions": len(self._sessions), "device": str(self.device),
                        "watermark_moves": self.watermark_moves}}

    # --- durability -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Return once every token of every session (hot windows included) is on the mount
        and fsync'd. Raises (``WarmError``) when the mount cannot take them (unmounted,
        full): never only a log line. Without a mount, the RAM tier holds them, msynced."""
        self._check_open()
        failed: dict[str, BaseException | None] = {}  # None: its RAM copy was lost
        for sid, c in self._sessions.items():
            try:
                c.flush(wait=False)
            except SpillError as e:  # that session's error: its own calls raise it
                failed[sid] = e
        self.spiller.wait()
        self.warm.flush()
        if self.mount is not None:
            self.warm.sync()  # a lost session is logged there and left out
        failed.update(self.spiller.failed())
        failed.update((sid, None) for sid in self.warm.lost() if sid not in failed)
        failed.update((s, e) for s, e in self.warm.unsynced().items() if s not in failed)
        for sid, err in failed.items():
            log.warning("flush: session %r is not flushed (%s); its own calls say so, the "
                        "other sessions are flushed", sid, err or "its RAM copy was lost")
        if self.mount is not None:
            ok = [sid for sid in self._sessions if sid not in failed]
            acknowledge(self.warm, ok, self._acked)  # durable: say so

    def save(self, session_id: str) -> None:
        """:meth:`flush` for one session."""
        self._check_open()
        c = self._sessions.get(session_id)
        if c is not None:
            c.flush(wait=False)
        self.spiller.wait(sid=session_id)
        self.warm.flush(session_id)
        if self.mount is not None:
            self.warm.sync(session_id)
            if c is not None:
                acknowledge(self.warm, [session_id], self._acked)

    def record_tokens(self, session_id: str, ids: Any) -> None:
        """Store the token ids of the session's tokens, from its first (``sessions/<id>/
        tokens``, :mod:`kvfs.session.tokens`): another engine (kvfs.vllm) reuses the session's
        KV only for a prompt that starts with these ids. ``ids``: the whole conversation so
        far (e.g. what ``generate`` returned); ids past the stored tokens are kept, unused.
        Needs a mount (the ids are written there directly, fsync'd)."""
        self._check_open()
        cold = self.warm.cold
        if cold is None:
            raise RuntimeError("record_tokens needs a router over a mount")
        from kvfs.session.files import record_ids  # noqa: PLC0415 - only sessions shared with vLLM

        record_ids(cold, session_id, torch.as_tensor(ids).reshape(-1).tolist())

    def delete(self, session_id: str) -> None:
        """Remove a session from every tier: the device, the RAM tier and the mount."""
        self._check_open()
        self.release(session_id, flush=False)
        self.spiller.wait()  # nothing of the session may land after the delete
        self.spiller.forget(session_id)
        self.warm.delete(session_id)
        self._acked.pop(session_id, None)

    def close(self, to_cold: bool = False) -> None:
        """Flush, stop the spill thread, close the warm tier if this router built it.

        ``to_cold=True`` also migrates every warm session to the cold tier first (a node
        shutting down: the mount then holds complete sessions on its own).
        """
        if self._closed:
            return
        try:
            self.flush()
            if to_cold and self.warm.cold is not None:
                moved = self.warm.migrate(max(1, len(self.warm.sessions())))
                log.info("close: %d sessions migrated to the cold tier", len(moved))
        finally:
            self._closed = True
            self.spiller.close()
            for c in self._sessions.values():
                c.router = None
            if self._own_warm:
                self.warm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVRouter is closed")

    def __enter__(self) -> KVRouter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _model_device(model: Any, default: torch.device) -> torch.device:
    if hasattr(model, "parameters"):
        p = next(iter(model.parameters()), None)
        if p is not None:
            return p.device
    return default
