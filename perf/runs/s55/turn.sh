#!/usr/bin/env bash
# Session 55: the operand turn's new tiling (heads per program). From the repository root, OUT
# set; everything in $OUT/turn.tgz. 1. turn_bench.py (GB/s per tiling, bit-for-bit checks);
# 2. tests/test_hopper.py -m gpu -k fused and tests/test_rotary.py on the GPU; 3. issue 38's
# cells at 8k: rerope (five tensors), rerope_rotated, sdpa_cudnn, fp16 and bf16, D 64/128.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
R=$OUT/turn
mkdir -p "$R"
( OUT=$R; source perf/runs/s48/versions.sh )
timeout 120 python3 perf/runs/s55/turn_bench.py "$R" > "$R/turn_bench.log" 2>&1
echo "turn bench rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
timeout 200 python3 -m pytest tests/test_hopper.py tests/test_backward.py tests/test_gpu.py -m gpu -k "fused_oracle or fused_small or preturn" -n 4 -q \
    -p no:cacheprovider -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
for dtype in float16 bfloat16; do
    timeout 100 python3 -m benchmarks.attention --impl rerope,rerope_rotated,sdpa_cudnn \
        --causal true --mode fwd --skip-check --n 8192 --d 64,128 --dtype $dtype \
        --out "$R/rot_$dtype.json" > "$R/rot_$dtype.log" 2>&1
    echo "grid $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
done
tar czf "$OUT/turn.tgz" -C "$OUT" turn && rm -rf "$R"
