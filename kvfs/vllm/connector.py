"""``KVFSConnector``: vLLM's KV connector interface over kvfs sessions.

Loaded by vLLM from ``kv_transfer_config``::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFSConnector",
        "kv_connector_module_path": "kvfs.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"mount": "/mnt/kv"}}'

``kv_connector_extra_config``: ``mount`` (the kvfs mountpoint, required), ``save`` (store
finished turns, default true), ``prefix_chunk`` (tokens per prefix entry for
requests without a session, a multiple of the block size; default 8 blocks; 0: such
requests are left to vLLM), ``model_fingerprint`` (for a checkpoint without
safetensors), ``summary_dim`` (default: the mount's profile), ``key_file`` (the server's
secret that names salted sessions and prefix entries, default
``$XDG_STATE_HOME/kvfs/vllm.key``: :func:`kvfs.vllm.store.server_key`). The class only routes vLLM's
calls: the scheduler half is :mod:`kvfs.vllm.scheduler`, the worker half
:mod:`kvfs.vllm.worker`, the files :mod:`kvfs.vllm.store`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfs.vllm.identity import served_model
from kvfs.vllm.scheduler import SchedulerSide, StepPlan
from kvfs.vllm.store import SessionStore, server_key, session_locks
from kvfs.vllm.worker import WorkerSide, cpu_writer

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvfs.vllm")


def _log_beside_vllm() -> None:
    """kvfs's log lines in the server's output (vLLM configures only its own loggers)."""
    root = logging.getLogger("kvfs")
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("(kvfs pid=%(process)d) %(levelname)s %(asctime)s "
                                         "[%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False


class KVFSPlan(StepPlan, KVConnectorMetadata):
    """One step's loads and saves, as vLLM's connector metadata."""


class KVFSConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to a preemption is a later miss, not an error

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_beside_vllm()
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        mount = extra.get("mount")
        if not mount:
            raise ValueError("KVFSConnector needs kv_connector_extra_config.mount (the kvfs mountpoint)")
        mc = vllm_config.model_config
        fp, geo, _ = served_model(mc.model, mc.dtype, extra.get("model_fingerprint"))
        from kvfs.torch.router import mount_info, mount_profile  # noqa: PLC0415

        dim = int(extra.get("summary_dim") or mount_profile(mount_info(mount)).summary_dim)
        store = SessionStore(mount, fp, geo, dim, locks=session_locks(mount),
                             key=server_key(extra.get("key_file")))
        self.block_size = vllm_config.cache_config.block_size
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            chunk = int(extra.get("prefix_chunk", 8 * self.block_size))
            self.sched = SchedulerSide(store, self.block_size, bool(extra.get("save", True)), chunk)
        else:
            self.worker = WorkerSide(store)
        log.info("KVFSConnector (%s) over %s, model %s", role.name.lower(), mount, fp)

    # --- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        plan = self.sched.plan(scheduler_output)
        return KVFSPlan(loads=plan.loads, saves=plan.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.finished(request, block_ids)

    # --- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        ctx = self._vllm_config.compilation_config.static_forward_context
        first = next(iter(kv_caches))
        self.worker.register(kv_caches, self.block_size, cpu_writer(ctx[first]))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_loads(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a turn is stored whole when its request finishes (wait_for_save)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.submit_saves(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.finished_saves() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _plan(self) -> StepPlan:
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        return plan
