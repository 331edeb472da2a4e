#!/bin/bash
# Issue 19, session 7 (helper h19), device call 1: TMA loads of K and V, the merge as a
# programmatic dependent launch (PDL), registers and stages, side by side.
#   GPU tests of tests/test_decode.py and tests/test_paged.py (3 xdist workers, during the
#   compile warm-up), then perf/tune_decode.py --s7 (every variant and SDPA on the grid's
#   bf16 shapes, two rounds, outputs compared with the pointer path bit for bit).
# Run from the root of a copy of the branch: cd .h19 && bash perf/runs/device_h19s7_call1.sh
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader \
    | tee "$OUT/gpu_h19s7_call1.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu_h19s7_call1.txt"
start=$(date +%s)
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -n 3 \
    tests/test_decode.py tests/test_paged.py > "$OUT/gpu_tests_h19s7_call1.log" 2>&1 &
tests=$!
WAIT_PID=$tests timeout 330 python3 perf/tune_decode.py --s7 > "$OUT/decode_h19s7_call1.log" 2>&1
echo "tune exit $? after $(( $(date +%s) - start )) s"
wait $tests; echo "tests exit $? after $(( $(date +%s) - start )) s"
tail -n 12 "$OUT/gpu_tests_h19s7_call1.log"
grep -E "^warm|geomean|done|Error|error" "$OUT/decode_h19s7_call1.log" | cut -c1-600 | tail -n 30
grep -E "^summary" "$OUT/decode_h19s7_call1.log" | cut -c1-700
