"""The scheduler half of the connector: which prompt tokens kvfs holds, what to load and save.

Runs in vLLM's scheduler (engine core) process. For a request that names a session it reads
the session's ids on the mount (:meth:`SessionStore.lookup`) and offers the longest prefix
of the prompt that agrees with them, cut to whole blocks and leaving the prompt's last token
to compute (vLLM needs one token to run). Blocks vLLM already holds in its own prefix cache
are not loaded again. When the request finishes, its computed tokens (prompt and output,
less the last sampled token, which was never fed through the model) are handed to the
worker to append, and vLLM keeps the blocks until the worker says they are stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvfs.vllm.store import SESSION_RE, SessionStore, agreed

log = logging.getLogger("kvfs.vllm")


@dataclass
class LoadJob:
    req_id: str
    sid: str
    block_ids: list[int]
    start: int  # first token to load (the tokens before it vLLM already has)
    end: int


@dataclass
class SaveJob:
    req_id: str
    sid: str
    block_ids: list[int]
    ids: list[int]  # every token of the request whose KV is in the blocks


@dataclass
class StepPlan:
    """What the worker does in one engine step (vLLM's KVConnectorMetadata)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def session_of(request: Any) -> str | None:
    """The session a request names: ``kv_transfer_params={"session": ...}`` (the OpenAI
    server passes ``kv_transfer_params`` through), else ``vllm_xargs={"kvfs_session": ...}``.
    A name the mount could not take is logged and ignored."""
    sid = (getattr(request, "kv_transfer_params", None) or {}).get("session")
    if sid is None:
        sp = getattr(request, "sampling_params", None)
        sid = ((getattr(sp, "extra_args", None) or {}).get("kvfs_session")) if sp else None
    if sid is None:
        return None
    if not isinstance(sid, str) or not SESSION_RE.fullmatch(sid):
        log.warning("request %s: session name %r is not usable on the mount (letters, digits, "
                    "_.@:+=- up to 200 characters); served without kvfs",
                    getattr(request, "request_id", "?"), sid)
        return None
    return sid


class SchedulerSide:
    def __init__(self, store: SessionStore, block_size: int, save: bool = True) -> None:
        self.store, self.block_size, self.save = store, block_size, save
        self._offered: dict[str, tuple[str, int]] = {}  # req_id -> (session, tokens offered)
        self._pending: dict[str, tuple[str, int]] = {}  # req_id -> (session, tokens to load)
        self._loaded: dict[str, int] = {}  # req_id -> tokens loaded (reported back at the end)
        self._saves: list[SaveJob] = []

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        sid = session_of(request)
        if sid is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        stored = self.store.lookup(sid)
        usable = min(agreed(stored, prompt), len(prompt) - 1)
        usable -= usable % self.block_size
        n = max(0, usable - num_computed)
        self._offered[request.request_id] = (sid, n)
        if stored is not None:
            log.debug("request %s: session %r holds %d tokens, %d agree, %d to load",
                      request.request_id, sid, stored.tokens, usable, n)
        return n, False

    def after_alloc(self, request: Any, num_external: int) -> None:
        if num_external > 0:
            sid, _ = self._offered.get(request.request_id, (session_of(request), 0))
            if sid is not None:
                self._pending[request.request_id] = (sid, num_external)

    def plan(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        for new in scheduler_output.scheduled_new_reqs:
            job = self._pending.pop(new.req_id, None)
            if job is None:
                continue
            sid, n = job
            end = new.num_computed_tokens
            plan.loads.append(LoadJob(new.req_id, sid, list(new.block_ids[0]), end - n, end))
            self._loaded[new.req_id] = n
        if self._pending:  # not scheduled after all (preempted before running): recomputed
            log.debug("dropping %d load plans not scheduled", len(self._pending))
            self._pending.clear()
        plan.saves, self._saves = self._saves, []
        return plan

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._offered.pop(rid, None)
        loaded = self._loaded.pop(rid, 0)
        sid = session_of(request)
        if sid is None:
            return False, None
        computed = int(request.num_computed_tokens)
        info = {"session": sid, "kvfs_loaded_tokens": loaded, "kvfs_stored_tokens": computed}
        if not self.save or computed <= 0 or not block_ids:
            return False, info
        ids = list(request.all_token_ids[:computed])
        self._saves.append(SaveJob(rid, sid, list(block_ids), ids))
        return True, info
