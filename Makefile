# mlx-relay: `make serve` and `make test` work on a fresh machine (they create .venv and install).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
TEST_WORKERS ?= 2

REPLICAS ?= 2

.PHONY: install serve cluster test lint bench agents clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# uv resolves and installs the whole set in seconds where pip took ~75 s on a fresh 2-core clone
# (compiling the bytecode as pip does: else every process the tests start compiles its imports);
# pip is the fallback (an offline machine with wheels only where pip's configuration points)
$(STAMP): pyproject.toml | $(PY)
	($(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e ".[dev]") \
	  || $(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# On Linux MLX's CPU wheel links the reference BLAS: its float matmuls through the OpenBLAS numpy
# ships instead (tools/cpu_blas/: a preloaded shim, built on first use; nothing where it does not
# apply), one OpenBLAS thread a process (its idle threads spin: with the suite's processes sharing
# two cores, its default of one a core made `make test` slower, not faster). Evaluated when a
# recipe runs, after the install
CPU_BLAS = $(shell $(PY) tools/cpu_blas/build.py $(VENV)/lib 2>/dev/null)
RUN_ENV = $(if $(CPU_BLAS),LD_PRELOAD=$(CPU_BLAS) OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1})

## Serve the embedded tiny model (or MODEL=<hf-dir-or-repo>) on $(HOST):$(PORT).
serve: install
	$(RUN_ENV) $(VENV)/bin/mlx-relay serve $(MODEL) --host $(HOST) --port $(PORT)

## $(REPLICAS) replicas of the embedded model (or MODEL=...) on $(PORT)+1.. behind SMG's cache-aware router on $(PORT).
cluster: install
	$(RUN_ENV) $(VENV)/bin/mlx-relay cluster $(MODEL) --replicas $(REPLICAS) --host $(HOST) --port $(PORT)

## Lint, then run the whole test suite on the tiny models (TEST_WORKERS processes, a file each at a time).
test: install
	$(PY) -m ruff check mlx_relay tests benchmarks tools
	$(RUN_ENV) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(PY) -m ruff check mlx_relay tests benchmarks tools

## First benchmark: raw library loop vs in-process API vs HTTP streaming on the tiny model.
bench: install
	$(RUN_ENV) $(PY) benchmarks/bench_decode.py

AGENTS_CACHE := .cache/agents
AGENTS_STAMP := $(AGENTS_CACHE)/.installed-stamp
AGENTS ?= claude-code,codex,qwen-code,qwen-code-slim,opencode,cline

$(AGENTS_STAMP): benchmarks/agents/package.json
	mkdir -p $(AGENTS_CACHE)
	cp benchmarks/agents/package.json $(AGENTS_CACHE)/
	npm install --prefix $(AGENTS_CACHE) --no-fund --no-audit --loglevel=error
	$(PYTHON) -m venv $(AGENTS_CACHE)/mcp-venv
	$(AGENTS_CACHE)/mcp-venv/bin/pip install -q mcp==2.3.0
	touch $(AGENTS_STAMP)

## Not part of `make test`: the pinned coding agents (npm, under .cache/agents/), one headless turn each
## against `mlx-relay serve` with an MCP tool, recorded (benchmarks/agents/; AGENTS=claude-code,codex,...).
agents: install $(AGENTS_STAMP)
	$(RUN_ENV) $(PY) benchmarks/agents/run_agents.py --agents $(AGENTS) $(AGENTS_FLAGS)
	$(PY) benchmarks/agents/standing.py --write docs/agents.md --write README.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
