#!/bin/bash
# Issue 19, session 5 (helper h19): one device call for the fused merge.
#   GPU tests of tests/test_decode.py and tests/test_paged.py (during the compile warm-up),
#   then perf/tune_decode.py --s5 (old vs new vs SDPA on the grid, the TMA read probe).
# Run from the root of a copy of the branch, with the code before (commit e8b0be5) in
# base/kernels_base (git archive e8b0be5 kernels, renamed, its torch.library namespace
# "kernels::" renamed "kernels_base::" so both packages load in one process).
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu_h19s5.txt"
export PYTHONPATH=$PWD/base:$PWD
start=$(date +%s)
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/test_decode.py tests/test_paged.py > "$OUT/gpu_tests_h19s5.log" 2>&1 &
tests=$!
WAIT_PID=$tests timeout "${BENCH_TIMEOUT:-330}" python3 perf/tune_decode.py --s5 \
    > "$OUT/decode_h19s5.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"
wait $tests; echo "tests exit $?"
tail -n 15 "$OUT/gpu_tests_h19s5.log"
grep -E "^warm|checks|read_kv|done|Error|error" "$OUT/decode_h19s5.log" | cut -c1-400 | tail -n 60
