# The two commands of the README: `make bench` (the main job) and `make test`.
# Each makes .venv with torch pinned (constraints.txt) and installs what it needs.
# `make test` leaves out the tests marked slow (subprocess, multi-rank, soak and
# pure-Python reruns, and the slow cases of wide parametrizations);
# `make test-all` (what CI runs) runs every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
BENCH_ARGS ?=

.PHONY: bench test test-all lint types check install clean docs gpu-check gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The session pool (tensorstash/memory/_alloc.cpp) builds against the torch installed here,
# so the project builds without isolation, after torch and setuptools.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py tensorstash/core/_fast.c tensorstash/memory/_alloc.cpp constraints.txt
	$(PIP) install -c constraints.txt "torch==2.13.0" "setuptools>=68"
	$(PIP) install -c constraints.txt --no-build-isolation -e ".[all]"
	touch $@

install: $(VENV)/.installed

bench: install
	mkdir -p bench-out
	$(BIN)/tensorstash bench --json bench-out/bench.json --plot bench-out/bench.png $(BENCH_ARGS)

test: install
	$(BIN)/python -m pytest -q -m "not slow"

test-all: install
	$(BIN)/python -m pytest -q --durations=25

lint: install
	$(BIN)/ruff check tensorstash tests benchmarks examples
	$(BIN)/ruff format --check tensorstash tests benchmarks examples

types: install
	$(BIN)/mypy

check: lint types test

# The documentation and the API reference (mkdocs.yml), built strictly: a broken link
# or a docstring mkdocstrings cannot read fails. The docs tools install once (the stamp).
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -c constraints.txt --no-build-isolation -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(BIN)/mkdocs build --strict --site-dir build/site

# On a machine with a CUDA device, after `pip install torch`: the CUDA tests, then the bench
# on `large` and an HF Llama, eager and compiled; tables in gpu-out/, within 8 minutes
# (benchmarks/gpu_check.py). It uses the python that has torch, not .venv (the CPU build).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# What gpu-check installs besides torch, as wheels, for a GPU machine that cannot reach
# PyPI: copy gpu-wheels/ into its clone. GPU_PYTHON=3.12 fetches them for another Python.
GPU_PYTHON ?=
gpu-wheels: install
	$(BIN)/python -m pip --disable-pip-version-check download --dest gpu-wheels \
		--only-binary=:all: $(if $(GPU_PYTHON),--python-version $(GPU_PYTHON)) \
		psutil lz4 xxhash pytest pytest-timeout hypothesis tqdm numpy "setuptools>=77" transformers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
