# The README's two commands: `make demo` and `make test`. Both install what they need first.
PY ?= python3
PIP := $(PY) -m pip

.PHONY: install demo test lint bench-producer

# torch==2.13.0 first: it is the CPU build this machine has on disk; any other spec pulls a CUDA build.
.install-stamp: pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch .install-stamp

install: .install-stamp

demo: install
	regen demo

test: install
	$(PY) -m pytest -q

lint: install
	ruff check . && ruff format --check .
