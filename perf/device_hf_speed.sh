#!/usr/bin/env bash
# Issue 37 on one GPU (H100 or H200), in at most 8 minutes, from the repository root:
#
#   OUT=$OUT bash perf/device_hf_speed.sh
#
# Everything goes into ONE file, $OUT/hf.tgz (folder hf/), plus $OUT/profile_decode.txt:
#   hf_8k.json / hf_32k.json (+ .log)  python -m benchmarks.hf, impls stock_sdpa_flash, rerope and
#        stock_sdpa (cuDNN, for the prefill target), context 8192 and 32768: prefill rows and decode rows per token, the plain decode loop
#        ("ms") and plain generate() with the dynamic cache ("generate_ms", --generate); the
#        32k run also runs the correctness checks (window = tokens equals RoPE; generate with
#        the cache equals recomputation; left padding)
#   compile.json (+ .log)  python -m benchmarks.compile_block: the fused-QKV block (B=2, 8 heads
#        of 64, fp16, window 256) at N 1024 and 4096, fwd and fwd+bwd, eager / compiled /
#        reduce-overhead, with each variant's top GPU kernels ("kernels")
#   profile_decode.txt  python -m benchmarks.hf_profile --context 32768: torch.profiler tables
#        (CPU and GPU) and cProfile of HF decode steps, stock_sdpa_flash then rerope, with the
#        attention and mask functions' CPU time per step
#   hf_host.json, hf_host_stock.json  python -m benchmarks.hf_host --device cuda (--impl
#        stock_sdpa_flash for the second): the attention function's host
#        time per layer in a 16-layer step on a growing cache (first layer vs the others)
#   gpu.txt, versions.txt, timing.txt (seconds per part)
# Each part has a time cap (the whole stays under BUDGET seconds, default 465; the compiled block
# runs last and gets what is left); a part cut short leaves its partial JSON (the benchmarks
# write after every row) and says so in timing.txt (rc=124).
# TINY=1: the same parts at toy sizes on the CPU (Triton's interpreter), to test this script.
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=${REROPE_AUTOTUNE:-0}
export PYTHONPATH="kernels:.${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
W="$OUT/hf"
mkdir -p "$W"
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-465}))

cap() {   # cap SECONDS: the smaller of SECONDS and what is left of the budget (at least 5)
    local left=$((DEADLINE - $(date +%s)))
    ((left < 5)) && left=5
    ((left < $1)) && echo "$left" || echo "$1"
}

part() {   # part NAME CAP COMMAND...: run with a time limit, log to $W/NAME.log, note the time
    local name=$1 limit t0 rc
    limit=$(cap "$2")
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" > "$W/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc, $(($(date +%s) - t0)) s (cap $limit s)" | tee -a "$W/timing.txt"
}

if [ "${TINY:-0}" = 1 ]; then
    HF_ARGS=(--tiny --context 40 --window 16 --steps 2 --reps 1 --check-tokens 24)
    HF_ARGS_32=("${HF_ARGS[@]}")
    CB_ARGS=(--tiny)
    PROF_ARGS=(--tiny --context 40 --window 16 --steps 1)
    HOST_ARGS=(--device cpu --steps 4 --context 64)
else
    HF_ARGS=(--context 8192)
    HF_ARGS_32=(--context 32768)
    CB_ARGS=()
    PROF_ARGS=(--context 32768 --steps 2)
    HOST_ARGS=(--device cuda --context 32768)
fi

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null \
    || echo "no GPU"; } > "$W/gpu.txt"
$PY - > "$W/versions.txt" 2>&1 <<'EOF'
import platform, torch, triton, transformers
print("python", platform.python_version(), "torch", torch.__version__, "triton",
      triton.__version__, "transformers", transformers.__version__)
EOF
git log -1 --format='commit %H %s' >> "$W/versions.txt" 2>/dev/null || true

# 1. the issue's HF targets: decode per token (loop and generate()) and prefill, rerope vs FA2
#    (and stock cuDNN last, for the prefill target; its decode rebuilds a cuDNN plan per length)
IMPLS=stock_sdpa_flash,rerope,stock_sdpa
part hf_8k 120 $PY -m benchmarks.hf "${HF_ARGS[@]}" --impls $IMPLS \
    --generate --skip-checks --out "$W/hf_8k.json"
part hf_32k 130 $PY -m benchmarks.hf "${HF_ARGS_32[@]}" --impls $IMPLS \
    --generate --out "$W/hf_32k.json"
# 2. where a decode step's time goes
part profile_decode 60 $PY -m benchmarks.hf_profile "${PROF_ARGS[@]}"
mv "$W/profile_decode.log" "$W/profile_decode.txt"
cp "$W/profile_decode.txt" "$OUT/profile_decode.txt"
# 3. the attention function's host time per layer, ReRoPE's then stock FlashAttention-2's
#    (the 8k decode gap of session 47 is host time: which part of a layer is it?)
part hf_host 25 $PY -m benchmarks.hf_host "${HOST_ARGS[@]}" --out "$W/hf_host.json"
part hf_host_stock 25 $PY -m benchmarks.hf_host "${HOST_ARGS[@]}" --impl stock_sdpa_flash \
    --out "$W/hf_host_stock.json"
# 4. the compiled block, last: whatever is left of the budget (its JSON is written per row,
#    N=1024 first)
part compile 400 $PY -m benchmarks.compile_block "${CB_ARGS[@]}" --out "$W/compile.json"

echo "total: $(($(date +%s) - START)) s" | tee -a "$W/timing.txt"
tar czf "$OUT/hf.tgz" -C "$OUT" hf && rm -rf "$W"
ls -la "$OUT"
