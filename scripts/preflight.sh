#!/usr/bin/env bash
# What `make` needs before it installs anything; each missing piece is one line saying what is
# missing and how to get it, and the exit code is 1. Usage: scripts/preflight.sh [VENV]
# (PYTHON picks the interpreter that makes the venv; default python3.)
set -u
venv=${1:-.venv}
py=${PYTHON:-python3}
missing=0
say() { echo "make: $*" >&2; missing=1; }

if ! command -v "$py" >/dev/null 2>&1; then
  say "no $py on PATH: install Python >= 3.11 (Debian: apt-get install python3), or set PYTHON=/path/to/python3.11"
else
  version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
  case "$version" in
    3.1[1-9] | 3.[2-9][0-9]) ;;
    *) say "$py is Python ${version:-?}, plusequals needs >= 3.11 (diffusers 0.42 does): install python3.11 or set PYTHON=/path/to/python3.11" ;;
  esac
  if [ ! -x "$venv/bin/python" ] && ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    say "$py cannot make a virtual environment (no venv/ensurepip): apt-get install python3-venv"
  fi
fi
command -v cargo >/dev/null 2>&1 ||
  say "no Rust toolchain (cargo) on PATH: install it with rustup (https://rustup.rs), then open a new shell"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 ||
  say "no C++ compiler (c++/g++) on PATH, needed for torch-sys and cpp/: apt-get install g++ (Debian/Ubuntu)"
if [ -x "$venv/bin/python" ]; then
  torch=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
  if [ -n "$torch" ] && [ "$torch" != "2.11.0" ]; then
    say "$venv has torch $torch, but tch 0.24 is built for torch 2.11.0: run 'make clean' (removes $venv and target/) or '$venv/bin/pip install torch==2.11.0'"
  fi
fi
exit $missing
