# Two entry points, each does its own set-up on a fresh machine:
#   make demo   -- mount a volume and run agents over it
#   make test   -- the test suite
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench bench-quick setup clean

$(STAMP): setup.cfg tools/setup_env.sh
	bash tools/setup_env.sh

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

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
