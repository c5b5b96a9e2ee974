#!/usr/bin/env bash
# Native NCCL engine check on a CUDA machine (called by benchmarks/gpu_check.sh):
#   benchmarks/gpu_native.sh OUTDIR
# 1. builds zkernels._C and zkernels._C_nccl in place with ZKERNELS_CUDA=1 (timed);
# 2. builds and runs the C++ world-size-1 engine check (ctest label "gpu": reduce-scatter and
#    all-gather of a known buffer on the engine's stream after a producer stream, all-reduce
#    max, and a lonely rank that must time out instead of hanging), timed;
# 3. runs the Python tests of the binding and the Comm backend (tests/native), timing printed.
# Every step's output goes to OUTDIR/<step>.log; OUTDIR/summary.txt has one line per step.
# Needs no network: NCCL comes from the nvidia-nccl-cu13 wheel that CUDA torch depends on.
set -euo pipefail

OUT=${1:?usage: benchmarks/gpu_native.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=$(mktemp -d /tmp/zk-native-cuda.XXXXXX)
trap 'rm -rf "$BUILD"' EXIT
: > "$OUT/summary.txt"

step() {  # step NAME CMD...: run, log, time; stop at the first failure
  local name=$1; shift
  local t0=$SECONDS rc=0
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$OUT/$name.log"
    exit "$rc"
  fi
}

NCCL_ROOT=$(python -c "import nvidia.nccl as n; print(list(n.__path__)[0])") || {
  echo "nvidia-nccl-cu13 is not installed (CUDA torch normally brings it)" | tee -a "$OUT/summary.txt"
  exit 1
}
export ZKERNELS_CUDA=1 ZKERNELS_NCCL_ROOT="$NCCL_ROOT"
PYBIND11_DIR=$(python -c "import pybind11; print(pybind11.get_cmake_dir())")

step env bash -c 'nvidia-smi -L; nvcc --version | tail -n 2; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"'
step build_ext python setup.py build_ext --inplace
step cmake_configure cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DZKERNELS_CUDA=ON -DZKERNELS_NCCL_ROOT="$NCCL_ROOT" -DZKERNELS_BUILD_PYTHON=OFF \
  -Dpybind11_DIR="$PYBIND11_DIR"
step cmake_build cmake --build "$BUILD" -j "$(nproc)"
step ctest ctest --test-dir "$BUILD" --output-on-failure -V
step pytest_native env PYTHONPATH="$ROOT" python -m pytest -q -s tests/native -x
grep -hE " ms|raised as expected" "$OUT/ctest.log" "$OUT/pytest_native.log" \
  | tee -a "$OUT/summary.txt" || true
echo "gpu_native: ok" | tee -a "$OUT/summary.txt"
