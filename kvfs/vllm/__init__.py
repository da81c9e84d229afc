"""kvfs under vLLM: a KV connector that keeps vLLM's conversations in kvfs sessions.

``vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFSConnector",
"kv_connector_module_path": "kvfs.vllm.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {"mount": "/mnt/kv"}}'``; a request names its session with
``kv_transfer_params={"session": "<id>"}``. Modules: ``connector`` (vLLM's interface),
``scheduler`` (what kvfs holds for a prompt, what to load and save), ``worker`` (loads layer
by layer, saves on a thread), ``paged`` (vLLM's block layout <-> token-major bytes),
``store`` (the session files on the mount), ``identity`` (the model fingerprint of the
served checkpoint), ``testing`` (``vllm serve`` for tests and benchmarks).

Importing ``kvfs.vllm`` imports neither vLLM nor torch; ``kvfs.vllm.connector`` needs vLLM.
"""
