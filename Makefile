# plusequals: `make report` (set up + the benchmark report), `make test` (set up + every test).
# Everything installs into .venv; cargo's target dir is ./target (CARGO_TARGET_DIR overrides).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# torch-sys's build script runs `python` from VIRTUAL_ENV to find the pip torch and its libtorch.
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
REPORT_ARGS ?=

.PHONY: help venv build-dev test test-python test-rust lint report demo clean

help:
	@echo "make report   set up, build, run python -m plusequals report (REPORT_ARGS=...)"
	@echo "make test     set up, build, run clippy, cargo test and pytest (parity, bugs, compile-fail, aliases)"
	@echo "make demo     set up, build, run python -m plusequals demo"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: torch-sys's build script imports it to find libtorch (same pin as pyproject.toml)
	$(PY) -m pip install -q "maturin>=1.7,<2" "torch==2.11.0"
	touch $@

venv: $(VENV)/.installed

# maturin develop: compiles the extension (release) and installs plusequals editable into .venv,
# with its dependencies and the test and diffusers extras from pyproject.toml
build-dev: venv
	set -o pipefail; $(VENV)/bin/maturin develop --release --quiet --extras test,diffusers 2>&1 | sed '/^Requirement already satisfied/d'

test-python: build-dev
	$(PY) -m pytest -q

test-rust: venv
	cargo test --tests

test: lint test-rust test-python

report: build-dev
	$(PY) -m plusequals report $(REPORT_ARGS)

demo: build-dev
	$(PY) -m plusequals demo

# clippy.toml forbids tch's write-through-& methods in this crate (scripts/gen_clippy_toml.py)
lint: venv
	cargo fmt --check
	cargo clippy --quiet --all-targets -- -D warnings

clean:
	rm -rf target $(VENV)
