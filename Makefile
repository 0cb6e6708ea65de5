# Two entry points for a newcomer: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PKGS   := magi-solver ffa-kernels magi-comm magi-dist
# CuTe DSL compiles the kernels without a GPU, so CI builds every variant for sm_90a.
EXTRAS_ffa-kernels := [cute]
STAMP  := $(VENV)/.installed

# CPU torch lies on disk (torch 2.13.0); where nvidia-smi exists, pip's default (CUDA) build.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
# triton: its interpreter runs the native comm kernels on the CPU in CI; mypy: `make lint`;
# transformers: ffa-kernels' optional integration (attn_implementation="ffa") and its tests
DEV_DEPS   := pytest pytest-xdist hypothesis ruff "mypy==2.4.*" setuptools wheel "matplotlib>=3.7" "triton==3.6.*" \
              "transformers==5.24.*"

.PHONY: venv test lint demo bench-solver clean

venv: $(STAMP)

$(STAMP): Makefile $(foreach p,$(PKGS),packages/$(p)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(DEV_DEPS)
	$(PIP) install -q --no-build-isolation $(foreach p,$(PKGS),-e "packages/$(p)$(EXTRAS_$(p))")
	touch $(STAMP)

# ruff (lint, complexity, format) over everything; mypy over the packages' host-side code
# (its files and settings: [tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile

# The planner on a built-in mask, then context-parallel training on 4 CPU gloo ranks beside the
# single-process run (on a GPU machine use torchrun; see examples/cp_train.py).
demo: $(STAMP)
	$(VENV)/bin/magi-plan --demo
	@echo
	$(PY) examples/cp_train.py --spawn 4 --steps 20

bench-solver: $(STAMP)
	$(PY) tools/bench_solver.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
