#!/bin/bash
# Device call 2 of 2026-12-04 (issues 18 and 20), the shipped code (PRETURN_MIN_KEYS 2048, kept
# turns): GPU tests of the prefill side during the warm-up; bench_h200.json's N=2048 rows and
# issue 20's N=8192 grid in one timed run (raw / rotated q, k, the five-tensor op, torch RoPE +
# cuDNN, cuDNN; fwd and fwd+bwd; D 64 and 128; fp16 and bf16); FA4's exponential trick
# (perf/probe_exp2.py, odd columns through a polynomial) against main at D=64, two rounds.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r" /tmp/warm
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
IMPLS="--impl rerope_raw,rerope_rotated,rerope,rope_sdpa_cudnn,sdpa_cudnn --causal true --mode fwd,fwd+bwd"
EXP="--impl rerope_raw,rerope --mode fwd --n 2048,8192 --d 64 --dtype float16 --causal true"
HALF=$(python3 perf/probe_exp2.py --copy half); echo "exp2 copy: $HALF"
for dtype in float16 bfloat16; do for d in 64 128; do
    timeout 200 python3 -m kernels.bench --skip-check --reps 1 $IMPLS --n 2048,8192 --d $d --dtype $dtype \
        --out /tmp/warm/$dtype-$d.json > /tmp/warm/$dtype-$d.log 2>&1 &
done; done
(cd "$HALF" && timeout 200 python3 -m kernels.bench --reps 1 $EXP --out /tmp/warm/half.json > /tmp/warm/half.log 2>&1) &
timeout 280 python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/test_attention.py tests/test_fused.py \
    tests/test_plans.py tests/test_gpu.py tests/test_generation.py tests/test_self_extend.py \
    > "$OUT/r/gpu_tests.log" 2>&1 &
wait; stamp warm; tail -n 3 "$OUT/r/gpu_tests.log"; grep -h "check " /tmp/warm/half.log; tail -n 2 /tmp/warm/*.log | cut -c1-160
cp /tmp/warm/half.log "$OUT/r/warm_half.log"
timeout 200 python3 -m kernels.bench --skip-check --reps 10 $IMPLS --n 2048,8192 --d 64,128 \
    --dtype float16,bfloat16 --out "$OUT/r/bench_grid.json" > "$OUT/r/bench_grid.log" 2>&1
grep -E " (2048|8192) " "$OUT/r/bench_grid.log" | cut -c1-80; stamp bench
for i in 1 2; do
    timeout 60 python3 -m kernels.bench --skip-check --reps 10 $EXP --out "$OUT/r/exp_main_$i.json" > "$OUT/r/exp_main_$i.log" 2>&1
    (cd "$HALF" && timeout 60 python3 -m kernels.bench --skip-check --reps 10 $EXP --out "$OUT/r/exp_half_$i.json" > "$OUT/r/exp_half_$i.log" 2>&1)
    echo "-- round $i main / half"; grep -h -E " (2048|8192) " "$OUT/r/exp_main_$i.log" "$OUT/r/exp_half_$i.log" | cut -c1-75
done; stamp exp2
tar czf "$OUT/results.tgz" -C "$OUT" r
