#!/bin/bash
# Device call 3 of 2026-12-04: every GPU test (pytest -m gpu, 141 tests) on main after the merge
# of h19 (TMA decode loads) and the forward pre-turn from 2048 keys.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
start=$(date +%s)
timeout 480 python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider tests > "$OUT/gpu_tests_s7_call3.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests_s7_call3.log" | tail -15
