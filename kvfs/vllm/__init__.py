"""kvfs under vLLM: a KV connector that keeps vLLM's conversations in kvfs sessions.

``kvfs-serve MODEL --mount /mnt/kv [vLLM options...]`` (:mod:`kvfs.vllm.serve`) starts vLLM's
OpenAI server with the connector; a request names its session with ``kv_transfer_params=
{"session": "<id>"}``, an ``X-Session-Id`` header or the OpenAI ``user`` field
(:mod:`kvfs.vllm.sessions`), and its ``cache_salt`` is its tenant. Modules: ``connector`` (vLLM's interface),
``scheduler`` (what kvfs holds for a prompt, what to load and save), ``worker`` (loads layer
by layer, saves on a thread), ``paged`` (vLLM's block layout <-> token-major bytes),
``store`` (the session files on the mount), ``identity`` (the model fingerprint of the
served checkpoint), ``server_runner`` (``vllm serve`` for tests and benchmarks).

Importing ``kvfs.vllm`` imports neither vLLM nor torch; ``kvfs.vllm.connector`` needs vLLM.
"""
