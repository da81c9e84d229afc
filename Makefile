# Two entry points, each does its own set-up on a fresh machine:
#   make demo   -- mount a volume and run agents over it
#   make test   -- the test suite
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-unit test-slow demo lint bench bench-quick setup clean

$(STAMP): setup.cfg tools/setup_env.sh
	bash tools/setup_env.sh

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# the fast lane: no mounts, nothing slow (at most 90 s on two cores)
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not mount and not slow" tests

# what the fast lane leaves out: mounts through /dev/fuse, models, long loops
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "mount or slow" tests

demo: $(STAMP)
	$(PY) tools/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) tools/bench.py

bench-quick: $(STAMP)
	$(PY) tools/bench.py --quick --out bench-out

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
