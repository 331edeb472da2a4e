#!/bin/bash
# Device call 1 of 2026-12-04 (issues 18 and 20): the runs a cut-off session of 2026-12-02 had
# prepared for two calls, in one:
# * GPU tests of the plans (kept turns bound) and of the fused op;
# * perf/probe_bwd_host.py: the fwd+bwd host time taken apart (the autograd engine's floor, SDPA,
#   our direct calls) and the N=2048 forward + fwd+bwd pre-turn A/B (PRETURN_MIN_KEYS 4096 vs
#   2048, D 64/128, fp16/bf16, two rounds) with the kept turn (kernels.rotary.kept_turn);
# * the warp-specialised forward loop (perf/sweep_bwd128.py's copy, variant fwd) against main,
#   alternating twice, N=2048 and 8192, D=64 and 128, fp16, raw / rotated / five-tensor, with
#   SDPA cuDNN and torch RoPE + cuDNN in main's runs; correctness checked in the warm-up;
# * perf/host_h200.py's rows.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r" /tmp/warm
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
WS=$(python3 -c "import sys; sys.path.insert(0, 'perf'); import sweep_bwd128 as s; print(s.warp_specialized_copy('fwd'))")
echo "ws copy: $WS"; grep -c "warp_specialize" "$WS/kernels/forward.py"
FWD="--impl rerope_raw,rerope_rotated,rerope --mode fwd --n 2048,8192 --d 64,128 --dtype float16 --causal true"
BASE="--impl sdpa_cudnn,rope_sdpa_cudnn --mode fwd --n 2048,8192 --d 64,128 --dtype float16 --causal true"
timeout 240 python3 -m kernels.bench --reps 1 $FWD --out /tmp/warm/main.json > /tmp/warm/main.log 2>&1 &
(cd "$WS" && timeout 240 python3 -m kernels.bench --reps 1 $FWD --out /tmp/warm/ws.json > /tmp/warm/ws.log 2>&1) &
timeout 240 python3 -m kernels.bench --skip-check --reps 1 $BASE --out /tmp/warm/base.json > /tmp/warm/base.log 2>&1 &
for dtype in float16 bfloat16; do
    timeout 240 python3 -m kernels.bench --skip-check --reps 1 --impl rerope_raw,sdpa_cudnn --mode fwd,fwd+bwd \
        --n 2048 --d 64,128 --dtype $dtype --causal true --out /tmp/warm/n2048_$dtype.json > /tmp/warm/n2048_$dtype.log 2>&1 &
done
timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_plans.py tests/test_fused.py \
    > "$OUT/r/gpu_tests.log" 2>&1 &
wait; stamp warm; tail -n 3 "$OUT/r/gpu_tests.log"; grep -h "check " /tmp/warm/main.log /tmp/warm/ws.log; tail -n 2 /tmp/warm/*.log | cut -c1-200
cp /tmp/warm/main.log "$OUT/r/warm_main.log"; cp /tmp/warm/ws.log "$OUT/r/warm_ws.log"
timeout 200 python3 perf/probe_bwd_host.py --n2048 --n2048-grid --out "$OUT/r/probe_bwd_host.json" > "$OUT/r/probe_bwd_host.log" 2>&1
grep -E "^round|^\{" "$OUT/r/probe_bwd_host.log" | cut -c1-330; stamp probe
for i in 1 2; do
    timeout 100 python3 -m kernels.bench --skip-check --reps 10 $FWD --out "$OUT/r/fwd_main_$i.json" > "$OUT/r/fwd_main_$i.log" 2>&1
    (cd "$WS" && timeout 100 python3 -m kernels.bench --skip-check --reps 10 $FWD --out "$OUT/r/fwd_ws_$i.json" > "$OUT/r/fwd_ws_$i.log" 2>&1)
    timeout 100 python3 -m kernels.bench --skip-check --reps 10 $BASE --out "$OUT/r/fwd_base_$i.json" > "$OUT/r/fwd_base_$i.log" 2>&1
    echo "-- round $i main / ws / base"; grep -h -E " (2048|8192) " "$OUT/r/fwd_main_$i.log" "$OUT/r/fwd_ws_$i.log" "$OUT/r/fwd_base_$i.log" | cut -c1-75
done; stamp ws
timeout 60 python3 perf/host_h200.py --label s7-call1 --out "$OUT/r/host_h200.json" > "$OUT/r/host_h200.log" 2>&1; tail -n 12 "$OUT/r/host_h200.log"
stamp host
tar czf "$OUT/results.tgz" -C "$OUT" r
