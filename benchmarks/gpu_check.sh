#!/usr/bin/env bash
# GPU check of the Triton kernels, in one go, on a CUDA machine:
#   1. versions (GPU, driver, torch, CUDA, triton)
#   2. tests/ops on CUDA with compiled Triton (TRITON_INTERPRET unset)  -> OUTDIR/tests_ops.log
#   3. the kernel benchmark at GPU sizes (64M and 256M elements)        -> OUTDIR/kernels.json
#   4. each kernel's GB/s as a fraction of the device copy bandwidth measured in that same run
#   5. the native extension's GPU check, benchmarks/gpu_native.sh OUTDIR, when that file exists
#      (it builds zkernels._C_nccl in place, which step 6 then uses)
#   6. the demo's model trained on CUDA at world size 1, every stage in TRAIN_STAGES x both
#      comm backends (torch.distributed, the native NCCL engine), against torch.optim.AdamW
#      on the same data, one line per check (benchmarks/train_check.py) -> OUTDIR/train.json
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
# The whole run fits one GPU session (under 10 minutes on an H100/H200).
#
# Usage: benchmarks/gpu_check.sh OUTDIR   (from anywhere; runs from the repository root)
# Env:   GPU_CHECK_SIZES="67108864 268435456" to change the benchmark sizes.
#        GPU_CHECK_STAGES="1 2 3" to change the trained stages.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Compiled kernels, automatic backend choice: nothing forced from the caller's shell.
unset TRITON_INTERPRET ZKERNELS_BACKEND
SIZES=${GPU_CHECK_SIZES:-"67108864 268435456"}
TRAIN_STAGES=${GPU_CHECK_STAGES:-"1 2 3"}
TRAIN_BACKENDS="torch nccl"
failed=()

echo "== 1. versions"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv
fi
python - <<'PY'
import sys
import torch
import triton
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"triton {triton.__version__}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
props = torch.cuda.get_device_properties(0)
print(f"device 0: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
      f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs")
PY

echo
echo "== 2. tests/ops on CUDA (compiled Triton)"
if ! python -m pytest -q tests/ops -p no:cacheprovider 2>&1 | tee "$OUTDIR/tests_ops.log"; then
    failed+=("tests/ops")
fi

echo
echo "== 3. kernel benchmark at sizes: $SIZES"
# shellcheck disable=SC2086  # SIZES is a list of numbers
if ! python -m zkernels.bench --sections kernels --device cuda --sizes $SIZES --repeat 10 \
        --warmup 3 --json "$OUTDIR/kernels.json" 2>&1 | tee "$OUTDIR/kernels.log"; then
    failed+=("benchmark")
fi

echo
echo "== 4. GB/s as a fraction of the device copy (dst.copy_(src), read + write bytes)"
if [[ -f "$OUTDIR/kernels.json" ]]; then
    python - "$OUTDIR/kernels.json" <<'PY' || failed+=("bandwidth summary")
import json
import sys
rows = json.load(open(sys.argv[1]))
copies = {r["numel"]: r["gbps"] for r in rows if r.get("op") == "copy_"}
for numel, rate in sorted(copies.items()):
    print(f"copy bandwidth at {numel} fp32 elements: {rate:.0f} GB/s")
print(f"{'op':>14} {'numel':>10} {'backend':>8} {'GB/s':>8} {'of copy':>8} {'vs torch':>9}")
for r in rows:
    if r.get("section") == "kernels" and r.get("op") != "copy_" and "gbps" in r:
        print(f"{r['op']:>14} {r['numel']:>10} {r['backend']:>8} {r['gbps']:>8.0f} "
              f"{r['gbps'] / copies[r['numel']]:>8.2f} {r['speedup']:>8.2f}x")
PY
else
    echo "no $OUTDIR/kernels.json (benchmark failed)"
fi

echo
echo "== 5. native extension GPU check (benchmarks/gpu_native.sh)"
if [[ -f benchmarks/gpu_native.sh ]]; then
    if ! bash benchmarks/gpu_native.sh "$OUTDIR" 2>&1 | tee "$OUTDIR/gpu_native.log"; then
        failed+=("gpu_native.sh")
    fi
else
    echo "benchmarks/gpu_native.sh not present in this checkout: nothing to run"
fi

echo
echo "== 6. train the demo's model at world size 1: stages $TRAIN_STAGES x comm $TRAIN_BACKENDS"
if ! python benchmarks/train_check.py --device cuda --stages "$TRAIN_STAGES" \
        --backends "$TRAIN_BACKENDS" --json "$OUTDIR/train.json" 2>&1 \
        | tee "$OUTDIR/train.log"; then
    failed+=("train check")
fi

echo
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "gpu_check: FAILED: ${failed[*]} (logs in $OUTDIR)"
    exit 1
fi
echo "gpu_check: all steps passed (logs and JSON in $OUTDIR)"
