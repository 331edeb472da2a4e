#!/bin/bash
# One device call: GPU tests at full size, then the benchmark grid that fits the session's
# device-time budget. Writes everything under $OUT (logs, JSON). Run from the repository root:
#   bash perf/device_run.sh
# KERNELS_AUTOTUNE=0: one launch configuration per kernel (the H200 winners, kernels/configs.py),
# so each (dtype, D, causal) compiles once instead of once per candidate.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

echo "== GPU tests"
GPU_TEST_REPORT=$OUT/gpu_tests.json timeout 160 python3 -m pytest tests/test_gpu.py -m gpu -q -s \
    -p no:cacheprovider ${GPU_TEST_FILTER:+-k "$GPU_TEST_FILTER"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40

echo "== benchmark: causal fp16, N 1k..32k, D 64/128"
timeout 170 python3 -m kernels.bench --skip-check --dtype float16 --causal true \
    --impl rerope,sdpa_cudnn,flex_two_pass,naive --reps 10 \
    --out "$OUT/bench_causal.json" 2>&1 | tee "$OUT/bench_causal.log" | grep -v "^\[" | tail -20

echo "== benchmark: N=8192 bf16 + non-causal, and N=131072 H=8 D=128"
timeout 70 python3 -m kernels.bench --skip-check --n 8192 --dtype bfloat16,float16 --causal false,true \
    --impl rerope,sdpa_cudnn,sdpa_flash,flex_two_pass,rope_inputs --reps 10 --out "$OUT/bench_8k.json" 2>&1 \
    | tee "$OUT/bench_8k.log" | grep -v "^\[" | tail -30
timeout 30 python3 -m kernels.bench --skip-check --n 131072 --heads 8 --d 128 --dtype float16 --causal true \
    --impl rerope,naive --mode fwd+bwd --reps 3 --out "$OUT/bench_128k.json" 2>&1 | tail -5
# keep the compiled kernels for a following call (carry them back in as .triton_cache.tgz)
tar czf "$OUT/triton_cache.tgz" -C ~/.triton cache 2>/dev/null; ls -la "$OUT"
