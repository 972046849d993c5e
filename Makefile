# One command sets up and tests kvpool on a fresh machine: `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed
# The CPU build of torch, from this machine's local file; an open range would pull CUDA.
TORCH ?= torch==2.13.0
# The top-level operator/ folder would shadow the standard library's `operator` module
# whenever Python puts the working directory on sys.path (`python -m ...` here). Python
# 3.11's safe-path mode leaves it off, for every Python these targets start.
export PYTHONSAFEPATH := 1

.PHONY: install test lint format pytest bench run clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: install lint pytest

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

pytest: install
	$(VENV)/bin/pytest

bench: install
	$(PY) bench/hashing.py
	$(PY) bench/engine.py
	$(PY) bench/kv_transfer.py
	$(PY) bench/sim_fleet.py

# Today: one worker server with the tiny model, the OpenAI API on http://127.0.0.1:8000 and
# KV events on tcp://127.0.0.1:5557 (replay on 5558); Ctrl-C drains and stops it. It becomes
# the local stack (workers behind the router) when the router lands.
TINY_MODEL := .cache/tiny-model
run: install
	@test -f $(TINY_MODEL)/config.json || $(VENV)/bin/kvpool worker make-tiny-model $(TINY_MODEL)
	$(VENV)/bin/kvpool worker serve --model $(TINY_MODEL) --port 8000 --num-blocks 4096 \
		--kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis *.egg-info
