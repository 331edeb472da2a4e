#!/bin/bash
# One device call: the full benchmark grid into book/data/bench_h200.json, then chapter 6 executed
# on the GPU; GPU tests named in $GPU_TESTS (a file of pytest node ids) run during the warm-up.
#   bash perf/device_bench.sh            (carry .whl: Jupyter wheels for chapter 6)
# Compiling is the slow part, so four processes first warm Triton's and Inductor's on-disk caches
# in parallel (one per dtype x causal, one timed run per case), then one process times the grid.
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1

start=$(date +%s)
for dtype in float16 bfloat16; do for causal in true false; do
    timeout "${WARM_TIMEOUT:-170}" python3 -m benchmarks.attention --skip-check --reps 1 \
        --impl rerope,flex_two_pass --dtype $dtype --causal $causal \
        --out /tmp/warm/$dtype-$causal.json > /tmp/warm/$dtype-$causal.log 2>&1 &
done; done
if [ -n "$GPU_TESTS" ]; then
    GPU_TEST_REPORT=$OUT/gpu_tests.json timeout "${WARM_TIMEOUT:-170}" python3 -m pytest \
        $(cat "$GPU_TESTS") -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -5 "$OUT/gpu_tests.log"
fi
wait
echo "warm-up done in $(( $(date +%s) - start )) s"; tail -n 2 /tmp/warm/*.log

timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.attention --skip-check --reps 10 \
    --out "$OUT/bench_full.json" > "$OUT/bench_full.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"; tail -n 45 "$OUT/bench_full.log"
python3 perf/merge_bench.py book/data/bench_h200.json book/data/bench_h200.json "$OUT/bench_full.json"
timeout "${NB_TIMEOUT:-120}" python3 tools/execute_notebooks.py book/06_speed.ipynb 2>&1 \
    | grep -v "without encryption"
cp book/06_speed.ipynb book/data/bench_h200.json "$OUT"/
