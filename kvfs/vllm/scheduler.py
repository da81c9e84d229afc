"""The scheduler half of the connector: which prompt tokens kvfs holds, what to load and save.

Runs in vLLM's scheduler (engine core) process. For a request that names a session it reads
the ids of that session of the request's tenant (its ``cache_salt``:
:meth:`SessionStore.session_dir`) on the mount (:meth:`SessionStore.lookup`) and offers the longest prefix
of the prompt that agrees with them, cut to whole blocks and leaving the prompt's last token
to compute (vLLM needs one token to run). A request without a session is matched run by run
against prefix entries (``chunk`` tokens each, named by a keyed chained hash of the ids:
:func:`~kvfs.vllm.store.prefix_keys`). Blocks vLLM already holds in its own prefix cache are
not loaded again. When the request finishes, its computed tokens (prompt and output, less
the last sampled token, which was never fed through the model) are handed to the worker to
append to the session (or to store as the prefix entries not there yet), and vLLM keeps the
blocks until the worker says they are stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvfs.vllm.store import SESSION_RE, SessionStore, agreed

log = logging.getLogger("kvfs.vllm")


#: where loaded tokens come from: (stored name, its first token, the request's first token, count)
Part = tuple[str, int, int, int]


@dataclass
class LoadJob:
    req_id: str
    block_ids: list[int]
    parts: list[Part]
    expect: list[int] | None = None  # a session's ids of the loaded tokens, checked at load

    @property
    def start(self) -> int:
        return self.parts[0][2]

    @property
    def end(self) -> int:
        return self.parts[-1][2] + self.parts[-1][3]


@dataclass
class SaveJob:
    req_id: str
    sid: str | None  # the session's stored name (its tenant's), or None: prefix entries
    block_ids: list[int]
    ids: list[int]  # every token of the request whose KV is in the blocks
    entries: list[str] = field(default_factory=list)  # prefix entry names, one per chunk


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


def parts_of(source: str | list[str], chunk: int, start: int, end: int) -> list[Part]:
    """Tokens ``[start, end)`` of a request: from one session (same positions), or from
    the prefix entries ``source[j]`` holding tokens ``[j * chunk, (j + 1) * chunk)``."""
    if isinstance(source, str):
        return [(source, start, start, end - start)]
    out = []
    for j in range(start // chunk, -(-end // chunk)):
        a, b = max(start, j * chunk), min(end, (j + 1) * chunk)
        out.append((source[j], a - j * chunk, a, b - a))
    return out


class SchedulerSide:
    def __init__(self, store: SessionStore, block_size: int, save: bool = True,
                 chunk: int = 256) -> None:
        if chunk and chunk % block_size:
            raise ValueError(f"prefix_chunk {chunk} must be a multiple of the block size {block_size}")
        self.store, self.block_size, self.save, self.chunk = store, block_size, save, chunk
        # req_id -> (session or prefix entry names, tokens offered)
        self._offered: dict[str, tuple[str | list[str], int, list[int]]] = {}  # ..., prompt
        self._pending: dict[str, tuple[str | list[str], int, list[int]]] = {}  # ... to load
        self._loaded: dict[str, int] = {}  # req_id -> tokens loaded (reported back at the end)
        self._saves: list[SaveJob] = []

    def _dir(self, request: Any, sid: str) -> str:
        """The stored name of the request's session: its tenant's (``cache_salt``)."""
        return self.store.session_dir(sid, getattr(request, "cache_salt", None))

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        sid = session_of(request)
        prompt = list(request.prompt_token_ids or [])
        source: str | list[str]
        if sid is not None:
            source = self._dir(request, sid)
            stored = self.store.lookup(source, sizes=False)
            usable = min(agreed(stored, prompt), len(prompt) - 1)
        elif self.chunk:
            source = self._entries(request, prompt[:len(prompt) - 1])
            have = num_computed // self.chunk  # runs vLLM holds need not be in kvfs
            usable = self.chunk * (have + self.store.present(source[have:]))
        else:
            return 0, False
        usable -= usable % self.block_size
        n = max(0, usable - num_computed)
        self._offered[request.request_id] = (source, n, prompt)
        if n:
            log.debug("request %s: %d tokens from kvfs (%s)", request.request_id, n,
                      sid if sid is not None else "prefix entries")
        return n, False

    def _entries(self, request: Any, ids: list[int]) -> list[str]:
        return self.store.prefix_entries(getattr(request, "cache_salt", None), ids, self.chunk)

    def after_alloc(self, request: Any, num_external: int) -> None:
        if num_external > 0:
            offered = self._offered.get(request.request_id)
            if offered is not None:
                self._pending[request.request_id] = (offered[0], num_external, offered[2])

    def plan(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        starts = [(new.req_id, new.block_ids, new.num_computed_tokens)
                  for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # preempted and resumed: all blocks anew
            if rid in self._pending and rid in cached.resumed_req_ids and cached.new_block_ids[i]:
                starts.append((rid, cached.new_block_ids[i], cached.num_computed_tokens[i]))
        for rid, block_ids, end in starts:
            job = self._pending.pop(rid, None)
            if job is None:
                continue
            source, n, prompt = job
            expect = prompt[end - n:end] if isinstance(source, str) else None
            plan.loads.append(LoadJob(rid, list(block_ids[0]),
                                      parts_of(source, self.chunk, end - n, end), expect))
            self._loaded[rid] = n
        if self._pending:  # allocated for but not scheduled in this step: vLLM re-asks
            log.warning("load plans of %d requests not scheduled: %s", len(self._pending),
                        sorted(self._pending))
            self._pending.clear()
        plan.saves, self._saves = self._saves, []
        return plan

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._offered.pop(rid, None)
        loaded = self._loaded.pop(rid, 0)
        sid = session_of(request)
        computed = int(request.num_computed_tokens)
        if sid is None and not self.chunk:
            return False, None
        info = {"session": sid, "kvfs_loaded_tokens": loaded, "kvfs_stored_tokens": computed}
        if sid is None:  # prefix entries: full runs only
            info = {"kvfs_loaded_tokens": loaded}
            computed -= computed % self.chunk
        if not self.save or computed <= 0 or not block_ids:
            return False, info
        ids = list(request.all_token_ids[:computed])
        entries = self._entries(request, ids) if sid is None else []
        stored = self._dir(request, sid) if sid is not None else None
        self._saves.append(SaveJob(rid, stored, list(block_ids), ids, entries))
        return True, info
