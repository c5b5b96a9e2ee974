#!/usr/bin/env bash
# CI: compile and link (not run: CI has no GPU) the CUDA/NCCL part of the native core, so a
# change that breaks the engine's build fails CI. Called by .ci/run inside its venv:
#   bash .ci/build_native_cuda.sh
# Needs nvcc (CUDA toolkit; FindCUDAToolkit locates it through nvcc); NCCL comes from pip.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

command -v nvcc >/dev/null || { echo "build_native_cuda: nvcc not found (CUDA toolkit)"; exit 1; }
python -m pip install -q nvidia-nccl-cu13 pybind11 cmake ninja
NCCL_ROOT=$(python -c "import nvidia.nccl as n; print(list(n.__path__)[0])")
PYBIND11_DIR=$(python -c "import pybind11; print(pybind11.get_cmake_dir())")
BUILD=$(mktemp -d /tmp/zk-ci-cuda.XXXXXX)
trap 'rm -rf "$BUILD"' EXIT

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZKERNELS_CUDA=ON \
  -DZKERNELS_NCCL_ROOT="$NCCL_ROOT" -DZKERNELS_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$(command -v python)" -Dpybind11_DIR="$PYBIND11_DIR"
# Every target: the engine library, the _C_nccl module and the check executable (a full
# link, so an unresolved CUDA/NCCL symbol fails here rather than at import on a GPU).
cmake --build "$BUILD" -j "$(nproc)"
# Put the engine's module into the package of this (CI) clone, so the test run that follows
# imports it: its loader finds libnccl.so.2 through the RUNPATH, and its no-GPU tests
# (unique id, argument checks, the named CUDA error) run instead of skipping.
cp "$BUILD"/_C_nccl*.so zkernels/
echo "build_native_cuda: CUDA/NCCL targets compiled and linked in $((SECONDS - start))s"
