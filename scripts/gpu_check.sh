#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU, Python 3.12 and torch 2.11.0 already
# installed, but no Rust toolchain and no network (the project's H200 machine).
#
# How the extension travels: it is built HERE (Rust toolchain, network) as an abi3 wheel
# (pyo3 feature abi3-py311: one .so for CPython >= 3.11, so the 3.11 build imports under 3.12).
# The .so links libtorch by soname; `import plusequals` imports torch first, so the GPU
# machine's own torch 2.11.0 (+cu130) libraries are the ones used. That machine already has
# rich, hypothesis, psutil, pytest, numpy and matplotlib; diffusers (for the UNet step) and the
# newer huggingface-hub it needs travel as wheels beside the extension (about 8 MB in all).
#
#   scripts/gpu_check.sh build    # here: wheel + dependency wheels into .gpu/ (git-ignored)
#   scripts/gpu_check.sh run OUT  # there: install from .gpu/ offline, run the CUDA tests,
#                                 # the demo and the GPU report; logs and report under OUT
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu

case "${1:-}" in
build)
  make venv
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  VIRTUAL_ENV=$PWD/.venv PATH=$PWD/.venv/bin:$PATH LIBTORCH_USE_PYTORCH=1 \
    .venv/bin/maturin build --release --auditwheel skip --out "$WHEELS"  # libtorch comes from the torch there
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" \
    diffusers==0.42.1 huggingface-hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore \
    importlib_metadata==10.2.0 lazy-importer
  ls -la "$WHEELS"
  ;;
run)
  OUT=${2:-gpu-out}
  mkdir -p "$OUT"
  SITE=/tmp/plusequals-site
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
  python3 -c "import torch, plusequals; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
  # the CUDA tests (parity in fp16, gradients, memory returning to baseline)
  python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$OUT/pytest-cuda.log"
  # the Python bugs and the runtime mirrors (rustc is not there: compile-fail cases are skipped)
  python3 -m plusequals demo --skip-compile-fail > "$OUT/demo.log" 2>&1 || echo "demo failed" | tee -a "$OUT/demo.log"
  # the report's terminal summary in report.log (its tail is the verdicts), and as JSON
  COLUMNS=100 python3 -m plusequals report --device cuda --out "$OUT/report-h200" > "$OUT/report.log" 2>&1 \
    || echo "report failed" | tee -a "$OUT/report.log"
  tail -60 "$OUT/report.log"
  python3 -m plusequals summary "$OUT/report-h200" --json > "$OUT/summary.json" || true
  ;;
*)
  sed -n 2,16p "$0"
  exit 2
  ;;
esac
