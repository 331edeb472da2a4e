#!/bin/bash
# Device call 4 (session 5 of 2026-12-02): the merged code checked on the GPU (the turn and delta
# kernels' grids with batch · heads first, 2 x 32769 heads, h19's merge as default two launches
# and the opt-in fused merge forced in its tests), and the pre-turned rows of bench_h200.json
# re-timed with the new turn grid (N = 8192, 16384, fp16, raw and rotated, fwd+bwd).
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
IMPLS="--impl rerope_raw,rerope_rotated,rope_sdpa_cudnn --causal true --mode fwd,fwd+bwd --dtype float16"
for d in 64 128; do
    timeout 200 python3 -m kernels.bench --skip-check --reps 1 $IMPLS --n 8192,16384 --d $d \
        --out /tmp/warm/$d.json > /tmp/warm/$d.log 2>&1 &
done
timeout 260 python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/test_decode.py \
    tests/test_paged.py tests/test_fused.py tests/test_plans.py \
    "tests/test_gpu.py::test_more_heads_than_the_grid_second_axis" \
    "tests/test_gpu.py::test_fused_large" -k "not bfloat16" > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"; stamp tests
wait; stamp warm
timeout 120 python3 -m kernels.bench --skip-check --reps 10 $IMPLS --n 8192,16384 --d 64,128 \
    --out "$OUT/bench_turn_grid.json" > "$OUT/bench_turn_grid.log" 2>&1
grep -E "8192|16384" "$OUT/bench_turn_grid.log" | cut -c1-100; stamp bench
