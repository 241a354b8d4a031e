#!/usr/bin/env bash
# The package as a user installs it (README, "Install"), into a fresh venv that holds only
# torch==2.11.0, each followed by scripts/install_check.py (the installed package and its libtorch,
# the audit on a user's script, RustBlock parity), run from a directory outside the repo:
#   1. the wheel in dist/ (`make wheel`): `pip install dist/*.whl`, with no Rust toolchain on PATH;
#   2. the repo installed from source, in an isolated build environment (PEP 517) that holds only
#      build-system.requires. Cargo builds in this repo's target/ (CARGO_TARGET_DIR when set), so
#      after `make build-dev` it reuses that release build: same features, same profile, same CXX
#      (the Makefile's ccache). torch-sys's build script then does not run again
#      (tests/test_install_config.py holds what it needs). The installer is uv (`uv pip install`,
#      a build of the repo forced each time): its build environment's torch comes from its cache in
#      a second, where pip unpacks torch and its CUDA wheels into a new one each time (a minute, the
#      check's longest step). COLD=1 builds with pip, as the README's user does, in WORKDIR/target,
#      from nothing: torch-sys finds the build environment's torch (about 20 min on 2 cores).
#      The check after it leaves out the two checks that start Python again (`audit run`, the
#      quick start) when the installed extension is the wheel's to the byte, as cargo's reuse makes
#      it; it runs them all when not (install_check.py --same-as).
# Each step prints one line with its seconds (scripts/step.sh); the whole output goes to
# WORKDIR/install.log. Usage: scripts/test_install.sh [WORKDIR]   (default target/install-check;
# PYTHON makes the venv)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$repo/target/install-check}
log=$work/install.log
venv=$work/venv
step() { "$repo/scripts/step.sh" "$@"; }

wheels=("$repo"/dist/plusequals-*.whl)
if [ ${#wheels[@]} -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
  echo "test-install: expected one wheel in dist/, found: ${wheels[*]} (run make wheel)" >&2
  exit 1
fi

rm -rf "$work" && mkdir -p "$work/run"
: >"$log"
# The user's shell: this venv activated (first on PATH; the Makefile's .venv stays behind it for
# the ccache of CXX=scripts/ccache-g++, which keeps torch-sys's build fingerprint), no PYTHONPATH.
unset PYTHONPATH
python=$(command -v "${PYTHON:-python3}")
export VIRTUAL_ENV=$venv
export PATH=$venv/bin:$PATH
# The same PATH without any folder that holds cargo or rustc.
no_rust=$(tr ':' '\n' <<<"$PATH" | while read -r d; do
  [ -n "$d" ] && [ ! -e "$d/cargo" ] && [ ! -e "$d/rustc" ] && echo "$d"
done | paste -sd:)
check() {
  local start=$SECONDS path=$1
  shift
  (cd "$work/run" && PATH=$path python "$repo/scripts/install_check.py" "$@") | sed 's/^/    /'
  echo "install: scripts/install_check.py${*:+ $*} ... ok ($((SECONDS - start)) s)"
}

# The fresh venv: uv (the Makefile's .venv has it) keeps the torch wheels it downloads in its cache
# (~/.cache/uv), so this takes seconds after the first time on a machine, where pip here keeps no
# cache and downloads torch each time. Without uv: python -m venv and pip.
if command -v uv >/dev/null; then
  step "install: uv venv --seed, uv pip install torch==2.11.0 (fresh venv)" "$log" \
    bash -c "UV_PYTHON_DOWNLOADS=never uv venv --seed --python '$python' '$venv' && uv pip install torch==2.11.0"
else
  step "install: $python -m venv, pip install torch==2.11.0 (fresh venv)" "$log" \
    bash -c "'$python' -m venv '$venv' && pip install torch==2.11.0"
fi

if PATH=$no_rust command -v cargo >/dev/null; then
  echo "test-install: cargo is still on PATH without the Rust folders" >&2
  exit 1
fi
# With the diffusers extra, as the README's install line says: its quick start imports diffusers.
# uv installs the wheel (from its cache: seconds; a wheel installs alike by pip or uv), pip the
# source below, where pip's isolated build is what a user meets.
if command -v uv >/dev/null; then wheel_pip=(uv pip install); else wheel_pip=(pip install); fi
step "install: ${wheel_pip[*]} dist/$(basename "${wheels[0]}")[diffusers] (no cargo on PATH)" "$log" \
  env PATH="$no_rust" "${wheel_pip[@]}" "${wheels[0]}[diffusers]"
check "$no_rust"

step "install: pip uninstall plusequals" "$log" pip uninstall -y plusequals
target=${CARGO_TARGET_DIR:-$repo/target}
[ "${COLD:-0}" = 1 ] && target=$work/target
# BUILD_LOCK (the Makefile's): this build and make's own release builds take turns in the shared target.
locked=()
[ -n "${BUILD_LOCK:-}" ] && [ "$target" != "$work/target" ] && locked=(flock "$BUILD_LOCK")
if [ "${COLD:-0}" != 1 ] && command -v uv >/dev/null; then
  source_pip=(uv pip install --reinstall-package plusequals)
else
  source_pip=(pip install)
fi
step "install: ${source_pip[*]} <repo>[diffusers] (from source, isolated build, cargo in $target)" "$log" \
  env CARGO_TARGET_DIR="$target" "${locked[@]}" "${source_pip[@]}" "$repo[diffusers]"
check "$PATH" --same-as "${wheels[0]}"
