#!/bin/bash
# Device call 3 (session 5 of 2026-12-02): the issue-20 benchmark grid with the shipped code
# (heads-first grids up to 4096 keys, pre-turned forward and backward from 4096 keys, bound turn
# launches): fp16 N = 1k-32k and bf16 N = 8192, D = 64, 128, causal, forward and forward +
# backward, ReRoPE from raw and rotated q, k, the five-tensor op, SDPA cuDNN plain and after a
# torch RoPE; then host time per call with cProfile and torch.profiler tables. Under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm /tmp/keep
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
IMPLS="--impl rerope_raw,rerope_rotated,rerope,sdpa_cudnn,rope_sdpa_cudnn --causal true --mode fwd,fwd+bwd"
for d in 64 128; do
    for n in 1024,2048 4096 8192 16384,32768; do
        timeout 230 python3 -m kernels.bench --skip-check --reps 1 $IMPLS --n $n --d $d \
            --dtype float16 --out /tmp/warm/f16-$d-$n.json > /tmp/warm/f16-$d-$n.log 2>&1 &
    done
    timeout 230 python3 -m kernels.bench --skip-check --reps 1 $IMPLS --n 8192 --d $d \
        --dtype bfloat16 --out /tmp/warm/bf16-$d.json > /tmp/warm/bf16-$d.log 2>&1 &
done
wait; stamp warm; tail -qn1 /tmp/warm/*.log
timeout 300 python3 -m kernels.bench --skip-check --reps 10 $IMPLS --n 1024,2048,4096,8192,16384,32768 \
    --d 64,128 --dtype float16 --out "$OUT/bench_f16.json" > /tmp/keep/bench_f16.log 2>&1
stamp bench_f16
timeout 100 python3 -m kernels.bench --skip-check --reps 10 $IMPLS --n 8192 --d 64,128 \
    --dtype bfloat16 --out "$OUT/bench_bf16.json" > /tmp/keep/bench_bf16.log 2>&1
stamp bench_bf16
grep -E " (2048|8192) " /tmp/keep/bench_f16.log /tmp/keep/bench_bf16.log | cut -c1-110
HOST_PROFILE=/tmp/keep/prof timeout 90 python3 perf/host_h200.py --out /tmp/keep/host.json \
    --label s5-call3 > /tmp/keep/host.log 2>&1; cat /tmp/keep/host.log; stamp host
tar -C /tmp/keep -czf "$OUT/keep.tgz" .
