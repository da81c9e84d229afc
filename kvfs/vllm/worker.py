"""The worker half of the connector: session bytes into vLLM's blocks, and back out.

Loads run layer by layer on a thread started before the forward pass: layer ``n``'s bytes
are read from the mount and scattered into its blocks while the model computes the layers
before it; the attention layer ``n`` waits only for its own layer
(:meth:`WorkerSide.wait_layer`). A read that fails marks the request's blocks as failed, so
vLLM recomputes them instead of attending wrong KV.

Saves run on one thread in submission order (turns of one session stay in order): the
finished request's new tokens are gathered from its blocks, which vLLM keeps until
:meth:`WorkerSide.finished_saves` reports them, and appended to the session. A failed
save is logged and the session keeps what it had (a later turn stores the tokens again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvfs.session.files import read_ids
from kvfs.torch.fingerprint import KVUnsupported
from kvfs.vllm.paged import BlockLayout, CacheWriter, probe_layout
from kvfs.vllm.scheduler import LoadJob, SaveJob, StepPlan
from kvfs.vllm.store import SessionStore, agreed
from kvfs.warm import WarmError

log = logging.getLogger("kvfs.vllm")

READ_AHEAD = 4  # layers read ahead of the one being scattered into vLLM's blocks
_LAYER_NO = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_order(names: list[str]) -> list[str]:
    """vLLM's attention layer names in model order (the number in ``model.layers.N.``)."""
    def key(n: str) -> tuple[int, str]:
        m = _LAYER_NO.search(n)
        return (int(m.group(1)) if m else -1, n)
    return sorted(names, key=key)


class WorkerSide:
    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.geo = store.geo
        self.caches: list[torch.Tensor] = []
        self.index: dict[str, int] = {}
        self.layout: BlockLayout | None = None
        self._events: list[threading.Event] = []
        self._loader: threading.Thread | None = None
        self._load_failed: set[int] = set()
        self._saves: queue.Queue[SaveJob | None] = queue.Queue()
        self._done: set[str] = set()
        self._lock = threading.Lock()
        self._saver = threading.Thread(target=self._save_loop, name="kvfs-vllm-save", daemon=True)
        self._saver.start()
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="kvfs-vllm-read")
        self.loaded_tokens = 0
        self.saved_tokens = 0
        self.saves = 0
        self.save_s = 0.0  # seconds the saver spent storing turns

    # --- set-up -------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], block_size: int,
                 writer: CacheWriter) -> None:
        names = layer_order(list(kv_caches))
        if len(names) != self.geo.num_layers:
            raise KVUnsupported(f"kvfs.vllm: vLLM has {len(names)} attention layers, the "
                                f"model's config {self.geo.num_layers}")
        self.caches = [kv_caches[n] for n in names]
        self.index = {n: i for i, n in enumerate(names)}
        c = self.caches[0]
        want = (self.geo.num_kv_heads, block_size, 2 * self.geo.head_dim)
        if c.dim() != 4 or tuple(c.shape[1:]) != want or c.dtype != self.geo.dtype:
            raise KVUnsupported(f"kvfs.vllm: KV cache of shape {tuple(c.shape)} {c.dtype}, "
                                f"expected [blocks, {want[0]}, {want[1]}, {want[2]}] "
                                f"{self.geo.dtype} (vLLM's CPU backend, KV in the model dtype)")
        self.layout = probe_layout(writer, block_size, self.geo.num_kv_heads,
                                   self.geo.head_dim, self.geo.dtype)
        self._events = [threading.Event() for _ in names]
        for e in self._events:
            e.set()
        log.info("kvfs.vllm: %d layers, blocks of %d tokens, layout probed", len(names), block_size)

    # --- loads --------------------------------------------------------------------------
    def start_loads(self, plan: StepPlan) -> None:
        if not plan.loads:
            return
        self.wait_loads()
        for e in self._events:
            e.clear()
        self._loader = threading.Thread(target=self._load, args=(list(plan.loads),),
                                        name="kvfs-vllm-load", daemon=True)
        self._loader.start()

    def _load(self, jobs: list[LoadJob]) -> None:
        """Layer by layer, every job. A session's ids are checked before the first layer
        and again before the last layer is released: a session rewritten meanwhile (an
        edited history stored by another request or process writes its ids before it cuts
        the layers) fails the load, and vLLM recomputes, never attends the wrong KV.

        The reads of the next ``READ_AHEAD`` layers run on the reader threads while this
        one is scattered: the reads wait on the disk (or, on a mount with ``--shared``, on
        the cluster for a session another node stored), each in its own file."""
        assert self.layout is not None
        live = [j for j in jobs if self._ids_agree(j)]
        for job in jobs:
            if job not in live:
                self._failed(job, "its stored ids changed")
        last = len(self.caches) - 1
        ahead: dict[int, dict[int, Future[np.ndarray]]] = {}

        def read_ahead(layer: int) -> None:
            if layer <= last:
                ahead[layer] = {id(j): self._readers.submit(self._read_layer, j, layer) for j in live}
        try:
            for layer in range(min(READ_AHEAD, last + 1)):
                read_ahead(layer)
            for layer, (cache, ev) in enumerate(zip(self.caches, self._events, strict=True)):
                reads = ahead.pop(layer)
                read_ahead(layer + READ_AHEAD)
                for job in list(live):
                    try:
                        raw = reads[id(job)].result()
                        tm = torch.from_numpy(raw).view(self.geo.dtype).view(
                            job.end - job.start, 2, self.geo.num_kv_heads, self.geo.head_dim)
                        self.layout.scatter(cache, job.block_ids, job.start, tm)
                        if layer == last and not self._ids_agree(job):
                            raise RuntimeError("its stored ids changed during the load")
                    except Exception as e:  # noqa: BLE001 - the blocks are recomputed instead
                        self._failed(job, f"layer {layer}: {e}")
                        live.remove(job)
                ev.set()
            self.loaded_tokens += sum(j.end - j.start for j in live)
        finally:
            for reads in ahead.values():  # reads no layer will take (an error above): not waited for
                for f in reads.values():
                    f.cancel()
            for ev in self._events:
                ev.set()

    def _read_layer(self, job: LoadJob, layer: int) -> np.ndarray:
        parts = [self.store.read(name, layer, a, a + n) for name, a, _, n in job.parts]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _ids_agree(self, job: LoadJob) -> bool:
        if job.expect is None:  # prefix entries: named by their ids, never rewritten
            return True
        try:
            ids = read_ids(self.store.cold, job.parts[0][0])
        except Exception:  # noqa: BLE001 - unreadable: not what was planned
            return False
        return ids[job.start:job.end].tolist() == job.expect

    def _failed(self, job: LoadJob, why: str) -> None:
        assert self.layout is not None
        log.error("request %s: loading %r failed (%s); its tokens are recomputed",
                  job.req_id, job.parts[0][0], why)
        n = self.layout.block_size
        self._load_failed.update(job.block_ids[job.start // n:-(-job.end // n)])

    def wait_layer(self, name: str) -> None:
        i = self.index.get(name)
        if i is not None and self._loader is not None:
            self._events[i].wait()

    def wait_loads(self) -> None:
        if self._loader is not None:
            self._loader.join()
            self._loader = None

    def load_errors(self) -> set[int]:
        out, self._load_failed = self._load_failed, set()
        return out

    # --- saves --------------------------------------------------------------------------
    def submit_saves(self, plan: StepPlan) -> None:
        self.wait_loads()  # this step's loads are in the blocks before anything reads them
        for job in plan.saves:
            self._saves.put(job)

    def finished_saves(self) -> set[str]:
        with self._lock:
            out, self._done = self._done, set()
        return out

    def _save_loop(self) -> None:
        # below the forward pass: a turn stored later costs nothing, a slower step does
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while (job := self._saves.get()) is not None:
            t0 = time.perf_counter()
            try:
                self._save(job)
                self.saves += 1
            except Exception:  # noqa: BLE001 - the session keeps what it had
                log.exception("request %s: storing its KV in session %r failed", job.req_id, job.sid)
            finally:
                self.save_s += time.perf_counter() - t0
                with self._lock:
                    self._done.add(job.req_id)

    def _save(self, job: SaveJob) -> None:
        ids = np.asarray(job.ids, dtype=np.int64)
        if job.sid is None:
            chunk = ids.size // max(1, len(job.entries))
            for j, name in enumerate(job.entries):
                if self.store.lookup(name) is not None:  # entries never change once written
                    continue
                try:
                    self._store(name, job.block_ids, ids[j * chunk:(j + 1) * chunk], 0, j * chunk)
                except WarmError as e:
                    # not ours (refused) or unwritable: later runs could never be matched
                    # past it, so they are not stored either
                    log.warning("prefix entry %r not stored (%s); the prefix is stored up to "
                                "token %d", name, e, j * chunk)
                    break
            return
        with self.store.owned(job.sid) as mine:
            if mine:
                start = agreed(self.store.lookup(job.sid), ids)
                if start < ids.size:
                    self._store(job.sid, job.block_ids, ids, start, 0)

    def _store(self, name: str, block_ids: list[int], ids: np.ndarray, start: int,
               offset: int) -> None:
        """Append tokens ``[start, len(ids))`` of ``name``, which are the request's tokens
        from ``offset + start`` on."""
        assert self.layout is not None
        a, b = offset + start, offset + ids.size
        kv = []
        for cache in self.caches:
            tm = self.layout.gather(cache, block_ids, a, b)
            kv.append(tm.contiguous().view(torch.uint8).numpy().reshape(-1))
        keys = tm[:, 0].float().numpy()  # the last layer's keys: the round's summary
        total = self.store.append_turn(name, ids, kv, start, keys)
        self.saved_tokens += b - a
        log.debug("%r: tokens [%d, %d) stored (%d in all)", name, start, ids.size, total)

    def close(self, timeout: float = 60.0) -> None:
        self.wait_loads()
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._saves.put(None)
        self._saver.join(timeout)
        log.info("kvfs.vllm: %d tokens loaded; %d turns stored (%d tokens) in %.1f s",
                 self.loaded_tokens, self.saves, self.saved_tokens, self.save_s)


def cpu_writer(layer: object) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The CPU backend's own cache write for ``layer`` (its instruction-set layout)."""
    from vllm import _custom_ops as ops  # noqa: PLC0415

    isa = getattr(layer, "isa", None)
    if isa is None:
        raise KVUnsupported("kvfs.vllm: the attention layer has no CPU kernel set (kvfs.vllm "
                            "supports vLLM's CPU attention backend)")

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        nb, h, n, _ = cache.shape
        kc, vc = cache.view(nb, h, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    return write
