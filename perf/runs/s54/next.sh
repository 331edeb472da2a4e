#!/usr/bin/env bash
# Session 54's plan for the next device call, whichever GPU comes (an H200 gives the targets'
# rows). From the repository root, OUT set, within TOTAL seconds (default 570); everything in
# ONE file, $OUT/next.tgz (only eight files come back from a call). In order of need:
# 1. tests/test_hopper.py -m gpu (the Gluon forward: oracle grids, bound launch) -> tests.log
# 2. issue 38's grid: benchmarks.attention fwd, causal, rerope (five tensors), rerope_rotated
#    and sdpa_cudnn, N 1k-32k, D 64/128, fp16/bf16, as shipped (default_*.json) and with
#    REROPE_GLUON=0 (off_*.json): the cells of book/data/bench_h200.json's target
# 3. issue 37: perf/device_hf_speed.sh (HF decode and generate() at 8k and 32k against stock
#    FlashAttention-2, profile, host per layer with stock's mask timed too, the compiled block
#    with what is left) -> hf.tgz inside
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-570}
R=$OUT/next
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 20)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
timeout "$(left 160)" python3 -m pytest tests/test_hopper.py -m gpu -n 4 -q -p no:cacheprovider \
    -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
GRID=(--impl rerope,rerope_rotated,sdpa_cudnn --causal true --mode fwd --skip-check
      --n 1024,2048,4096,8192,16384,32768 --d 64,128)
for dtype in float16 bfloat16; do
    timeout "$(left 60)" python3 -m benchmarks.attention "${GRID[@]}" --dtype $dtype \
        --out "$R/default_$dtype.json" > "$R/default_$dtype.log" 2>&1
    echo "default $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
    REROPE_GLUON=0 timeout "$(left 60)" python3 -m benchmarks.attention "${GRID[@]}" \
        --dtype $dtype --out "$R/off_$dtype.json" > "$R/off_$dtype.log" 2>&1
    echo "off $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
done
OUT=$R BUDGET=$(left 300) bash perf/device_hf_speed.sh > "$R/hf_speed.log" 2>&1
echo "hf speed rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
tar czf "$OUT/next.tgz" -C "$OUT" next && rm -rf "$R"
ls -la "$OUT"
