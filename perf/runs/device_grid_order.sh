#!/bin/bash
# One device call (session of 2026-12-02): the heads-first grid of the forward and both backward
# kernels, checked and timed. .dev_old holds kernels/ as it was before (carried), for an A/B in
# the same run. Writes under $OUT: gpu_tests.log, bench.json (into book/data/bench_h200.json),
# ab.json (old/new alternating, N=8192 fwd+bwd).
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"

GRID="--impl rerope_raw,rerope_rotated,rerope,sdpa_cudnn,rope_sdpa_cudnn --n 2048,8192 --causal true"
AB="--impl rerope_raw,rerope_rotated --n 8192 --d 64,128 --dtype float16 --causal true --mode fwd+bwd"
# warm Triton's cache: new kernels (4 processes), old kernels (1), while the GPU tests run
for dtype in float16 bfloat16; do for d in 64 128; do
    timeout 150 python3 -m kernels.bench --skip-check --reps 1 $GRID --d $d --dtype $dtype \
        --out /tmp/warm/$dtype-$d.json > /tmp/warm/$dtype-$d.log 2>&1 &
done; done
(cd .dev_old && timeout 150 python3 -m kernels.bench --skip-check --reps 1 $AB \
    --out /tmp/warm/old.json > /tmp/warm/old.log 2>&1) &
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused.py \
    tests/test_gpu.py -k "fused or small_grid or deterministic or raw_inputs" \
    > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; stamp tests
wait; tail -qn1 /tmp/warm/*.log; stamp warm

timeout 120 python3 -m kernels.bench --skip-check --reps 10 $GRID --d 64,128 \
    --dtype float16,bfloat16 --mode fwd,fwd+bwd --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep -E "N=(2048|8192)" "$OUT/bench.log" | cut -c1-90; stamp bench
for round in 1 2; do
    (cd .dev_old && timeout 40 python3 -m kernels.bench --skip-check --reps 10 $AB \
        --out "$OUT/ab_old_$round.json" 2>&1 | grep "N=8192" | cut -c1-80)
    timeout 40 python3 -m kernels.bench --skip-check --reps 10 $AB \
        --out "$OUT/ab_new_$round.json" 2>&1 | grep "N=8192" | cut -c1-80
done
stamp ab
