#!/bin/bash
# Device call 6 (session 5 of 2026-12-02): the N=2048 rows of bench_h200.json again with the
# forward pre-turning keys from 2048 keys on (attention.PRETURN_MIN_KEYS = 2048); and the N=2048
# forward's GPU time (CUDA graph) through perf/probe_short_n.py's default variant.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
GRID="--impl rerope_raw,rerope_rotated,rerope,sdpa_cudnn,rope_sdpa_cudnn --n 2048 --causal true --mode fwd,fwd+bwd"
for dtype in float16 bfloat16; do for d in 64 128; do
    timeout 150 python3 -m kernels.bench --skip-check --reps 1 $GRID --d $d --dtype $dtype \
        --out /tmp/warm/$dtype-$d.json > /tmp/warm/$dtype-$d.log 2>&1 &
done; done
wait; stamp warm
timeout 90 python3 -m kernels.bench --skip-check --reps 10 $GRID --d 64,128 \
    --dtype float16,bfloat16 --out "$OUT/bench_n2048.json" > "$OUT/bench_n2048.log" 2>&1
grep -E " 2048 " "$OUT/bench_n2048.log" | cut -c1-90; stamp bench
python3 - <<'PY'
import sys
sys.path[:0] = ["perf", "."]
import probe_short_n as p
for impl in ("sdpa_cudnn", "rerope_raw", "rerope_rotated"):
    fn = p.forward_of(impl, 2048)
    print(impl, "graph_us", round(p.graph_us(fn, p.inputs(False)), 1),
          "stream_us(grad)", round(p.stream_us(fn, p.inputs(True)), 1), flush=True)
PY
stamp probe
