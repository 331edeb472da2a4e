#!/bin/bash
# Issue 19, session 7 (helper h19), device call 2: the benchmark grid with the final code
# (TMA loads of K and V where a split reads >= decode.TMA_MIN_KEYS keys), and the GPU tests of
# tests/test_decode.py and tests/test_paged.py (3 xdist workers, during the grid's compile
# warm-up; the timing waits for them: WAIT_PID).
# Run from the root of a copy of the branch (kernels perf tests tools conftest.py
# pyproject.toml _toc.yml): cd .h19 && bash perf/runs/device_h19s7_call2.sh
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader \
    | tee "$OUT/gpu_h19s7_call2.txt"
start=$(date +%s)
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -n 3 --durations=8 \
    tests/test_decode.py tests/test_paged.py > "$OUT/gpu_tests_h19s7_call2.log" 2>&1 &
tests=$!
WAIT_PID=$tests timeout 420 python3 -m kernels.bench_decode --time-budget 0.06 --budget-s 300 \
    --out "$OUT/decode_h200.json" > "$OUT/decode_bench_h19s7_call2.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"
wait $tests; echo "tests exit $? after $(( $(date +%s) - start )) s"
tail -n 14 "$OUT/gpu_tests_h19s7_call2.log"
grep -E "precompiled|bench_decode on|wrote|budget|Error|error" "$OUT/decode_bench_h19s7_call2.log" | tail -n 12
