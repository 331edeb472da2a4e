#!/usr/bin/env bash
# Session 48, device call C (one H200, from the repository root, OUT set, ≤ 595 s): what the
# scarce device time allows of issues 34 and 38 in one call.
# 1. In parallel (CPU): the Gluon kernels' JIT compiles (QUICK keys, 8 processes) and the
#    attention benchmark's warm-up (rerope only, 4 processes: fp16/bf16 x causal/not).
# 2. Issue 34: python -m benchmarks.attention, impls rerope and sdpa_cudnn (the yardstick of
#    the same run), the whole N x D x dtype x causal x mode grid -> bench_rerope_cudnn.json
# 3. Issue 38: QUICK=1 perf/gluon/device_rerope.sh -> gluon/ (not with SKIP_GLUON=1)
# 4. Issue 34: python -m benchmarks.decode, impls rerope_decode and sdpa_flash, what time is
#    left (--budget-s) -> decode_h200.json
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
source perf/runs/s48/versions.sh
mkdir -p "$OUT/gluon" /tmp/warm
[ "${SKIP_GLUON:-0}" = 1 ] || ( python3 perf/gluon/bench_rerope.py --quick --list-keys \
    | timeout 150 xargs -P 8 -n 1 timeout 90 python3 perf/gluon/bench_rerope.py --precompile \
    > "$OUT/gluon/precompile_early.log" 2>&1 ) &
for dtype in float16 bfloat16; do for causal in true false; do
    timeout 150 python3 -m benchmarks.attention --skip-check --reps 1 --impl rerope \
        --dtype $dtype --causal $causal --out /tmp/warm/$dtype-$causal.json \
        > "$OUT/warm-$dtype-$causal.log" 2>&1 &
done; done
wait
echo "warm-up done at $SECONDS s: $(grep -c '^precompiled' "$OUT/gluon/precompile_early.log") Gluon keys"
timeout 150 python3 -m benchmarks.attention --skip-check --reps 10 --impl rerope,sdpa_cudnn \
    --out "$OUT/bench_rerope_cudnn.json" > "$OUT/attention.log" 2>&1
echo "attention rc=$? at $SECONDS s"
if [ "${SKIP_GLUON:-0}" != 1 ]; then
    QUICK=1 OUT=$OUT/gluon timeout 170 bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
    echo "gluon rc=$? at $SECONDS s"
fi
left=$((${TOTAL:-590} - SECONDS))
timeout $left python3 -m benchmarks.decode --impl rerope_decode sdpa_flash \
    --budget-s $((left - 40)) --out "$OUT/decode_h200.json" > "$OUT/decode.log" 2>&1
echo "decode rc=$? at $SECONDS s"
