#!/bin/bash
# One device call (session 5 of 2026-12-02): check the heads-first grid in its final form
# (constexpr HEADS_FIRST, threshold kernels.attention.HEADS_FIRST_MAX_KEYS) on the GPU, time the
# N=2048 forward's launch variants under it (perf/probe_short_n.py), the short-N benchmark rows,
# the host time per call with cProfile tables, and the compiled fused-QKV block at N=16384 with
# the stock block beside it. Writes under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

GRID="--impl rerope_raw,rerope_rotated,rerope,sdpa_cudnn,rope_sdpa_cudnn --n 1024,2048,4096 --causal true"
for dtype in float16 bfloat16; do for d in 64 128; do
    timeout 170 python3 -m kernels.bench --skip-check --reps 1 $GRID --d $d --dtype $dtype \
        --out /tmp/warm/$dtype-$d.json > /tmp/warm/$dtype-$d.log 2>&1 &
done; done
for i in $(seq 0 11); do
    timeout 170 python3 perf/probe_short_n.py warm --index $i > /tmp/warm/probe-$i.log 2>&1 &
done
timeout 240 python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider tests/test_fused.py \
    tests/test_plans.py "tests/test_gpu.py::test_fused_small_grid" "tests/test_gpu.py::test_fused_large" \
    > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; stamp tests
wait; tail -qn1 /tmp/warm/*.log | sort | uniq -c | head; stamp warm

timeout 90 python3 -m kernels.bench --skip-check --reps 10 $GRID --d 64,128 \
    --dtype float16,bfloat16 --mode fwd,fwd+bwd --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep -E "N=|fwd" "$OUT/bench.log" | grep " 2048 " | cut -c1-90; stamp bench
timeout 150 python3 perf/probe_short_n.py time --out "$OUT/short_n.json" > "$OUT/short_n.log" 2>&1
python3 - "$OUT/short_n.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["impl"], r["window"], r.get("config"), r.get("tma"), r.get("preturn"),
          r.get("bench_ms"), r.get("graph_us"), r.get("stream_us"), r.get("error", ""))
PY
stamp probe
HOST_PROFILE=$OUT/prof timeout 60 python3 perf/host_h200.py --out "$OUT/host.json" --label s5 \
    > "$OUT/host.log" 2>&1; tail -12 "$OUT/host.log"; stamp host
timeout 200 python3 perf/compile_block.py --n 16384 --dtypes float16 --stock --reduce-overhead \
    --out "$OUT/compile_block_n16384.json" > "$OUT/compile_block.log" 2>&1
grep -o '"impl": "[a-z]*"\|"[a-z_]*_ms": [0-9.]*' "$OUT/compile_block.log"; stamp compile
