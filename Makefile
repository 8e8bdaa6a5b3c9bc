# Two commands for a fresh clone:
#   make run    create .venv, install, run the whole pipeline on the shipped sample data
#   make test   create/use .venv, run the default test suite
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV)/bin)
# Local-only defaults: no telemetry, no network lookups for models.
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test test-all bench lock clean-outputs serve stop

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, so no other package drags in a different (e.g. multi-GB CUDA) build
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c requirements.lock -e ".[test,dwave,qaoa,dask]"
	touch $@

install: $(VENV)/.installed

# The peers (TRL, lm-evaluation-harness) the tests and benchmarks compare against: not in `make run`'s install.
$(VENV)/.installed-peers: $(VENV)/.installed
	$(PY) -m pip install --quiet -c requirements.lock -e ".[peers]"
	touch $@

run: install
	PATH="$(BIN):$$PATH" $(VENV)/bin/qllm run $(ARGS)

test: install $(VENV)/.installed-peers
	PATH="$(BIN):$$PATH" $(PY) -m pytest $(ARGS)

test-all: install $(VENV)/.installed-peers
	PATH="$(BIN):$$PATH" $(PY) -m pytest -m "slow or not slow" $(ARGS)

# Local Prefect server + process worker (pool "qllm") + MLflow UI on 127.0.0.1; `make stop` ends them.
serve: install
	PATH="$(BIN):$$PATH" $(PY) -m flows.serve start

stop:
	$(PY) -m flows.serve stop

bench: install $(VENV)/.installed-peers
	PATH="$(BIN):$$PATH" $(PY) -m benchmarks.train_throughput

# Re-pin every transitive dependency from the current .venv (commit the result).
lock: install $(VENV)/.installed-peers
	$(PY) -m pip freeze --exclude-editable | grep -v '^torch==' > requirements.lock

clean-outputs:
	rm -rf data/sample data/ingested data/prepared data/tokenizer data/tokenized data/models \
	  data/evaluate data/register data/metrics .qllm
