#!/usr/bin/env bash
# Issue 38, step 2: the ReRoPE Gluon forward (perf/gluon/rerope_fwd.py) on one sm_90 GPU
# (H100/H200, Triton 3.6), from the repository root, in at most ~240 s:
#
#   OUT=$OUT bash perf/gluon/device_rerope.sh
#
# Precompile (every config key, with and without LSE, JIT-compiled into Triton's on-disk cache by
# parallel processes (one per key, up to 24), nothing launched, 60 s cap each, 120 s in all: precompile.log;
# the BAND_TWICE kernels take ~2x the old kernel's compile time), smoke pass (each config once at
# N=1024 H=2 window 300 in its own process, 100 s cap, repeated without a config that hung or
# crashed it: smoke.log, smoke.txt, skipped.txt), then bench_rerope.py: $OUT/gluon_rerope.json
# (rewritten after every row) and gluon_rerope.log; versions.txt (CROSS=1: cross_compile_rerope.txt).
# REPS (default 20). 32 config keys (rerope_fwd.all_configs: 8 old kernel, 4 BAND_TWICE,
# 14 BAND_TWICE with FA3 scheduling (PIPE / PINGPONG, rerope_fwd_twice_pp_kernel, unmeasured),
# 6 SPLIT=3 (band-twice, LEAN); the configs retired after s46, s47 and s53 are not run). QUICK=1:
# rerope_fwd.quick_configs (the default, (128,128,2,4,2,0,1) and its three FA3-scheduled variants
# per D: 20 keys).
# D64=1 (instead of QUICK; ~80-100 s): D64 only, rerope_fwd.d64_configs (the two best D64 configs,
# the band-twice SPLIT=3 one and the two LEAN ones, (192,128,2|3,4,3,0,2); the three-tiles SPLIT=3
# ones are retired) and the plain Gluon kernel at SPLIT=2 and SPLIT=3 beside cuDNN, fp16 and bf16
# (16 keys; caps: 75 s precompile, 50 s a smoke attempt, bench ends by 150 s).
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export PYTHONPATH="$ROOT/kernels:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else 1)' 2>/dev/null; then
    echo "device_rerope.sh: no sm_90 CUDA device here; nothing run" >&2
    exit 2
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1
  $PY -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version()); print("triton", triton.__version__)'
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# CROSS=1: also the AOT cross-compile report of the BAND_TWICE configs (up to 90 s, outside the 240 s;
# the CPU machine's, all configs, is in cross_compile_rerope_3.6.txt)
if [[ "${CROSS:-0}" == 1 ]]; then
    timeout 90 $PY "$HERE/cross_compile_rerope.py" --twice > "$OUT/cross_compile_rerope.txt" 2>&1
    echo "cross_compile_rerope rc=$?"; cut -c1-220 "$OUT/cross_compile_rerope.txt"
fi

Q=(); [[ "${QUICK:-0}" == 1 ]] && Q=(--quick)
# seconds: precompile cap, one smoke attempt's cap, no new smoke attempt after, the bench's end
CAP_PRE=120; CAP_SMOKE=100; LAST_SMOKE=150; END=235
if [[ "${D64:-0}" == 1 ]]; then Q=(--d64); CAP_PRE=75; CAP_SMOKE=50; LAST_SMOKE=90; END=150; fi
# JIT compiles in parallel (a compile is single-threaded; the smoke and the bench then hit the cache)
$PY "$HERE/bench_rerope.py" "${Q[@]}" --list-keys | timeout $CAP_PRE xargs -P 24 -n 1 \
    timeout 60 $PY "$HERE/bench_rerope.py" --precompile > "$OUT/precompile.log" 2>&1
echo "precompile rc=$? after ${SECONDS} s: $(grep -c '^precompiled' "$OUT/precompile.log") keys"
SKIP=()
for attempt in 1 2 3; do
    ((SECONDS > LAST_SMOKE)) && { echo "no time left for another smoke attempt"; break; }
    : > "$OUT/smoke.txt"
    timeout $CAP_SMOKE $PY "$HERE/bench_rerope.py" "${Q[@]}" --smoke "$OUT/smoke.txt" \
        --skip "${SKIP[@]}" 2>&1 | tee -a "$OUT/smoke.log"
    src=$?
    last=$(grep '^start ' "$OUT/smoke.txt" | tail -1 | cut -d' ' -f2)
    if [[ $src == 0 || -z "$last" ]] || grep -q "^\(ok\|bad\) $last\$" "$OUT/smoke.txt"; then
        echo "smoke attempt $attempt rc=$src"; break
    fi
    echo "smoke attempt $attempt rc=$src: $last hung or crashed the process; skipping it" | tee -a "$OUT/smoke.log"
    SKIP+=("$last")
done
# configs that smoked 'bad' (wrong numbers) are skipped too
for k in $(grep '^bad ' "$OUT/smoke.txt" 2>/dev/null | cut -d' ' -f2); do SKIP+=("$k"); done
echo "skipped: ${SKIP[*]:-none}" | tee "$OUT/skipped.txt"

left=$((END - SECONDS)); ((left < 45)) && left=45
timeout $left $PY "$HERE/bench_rerope.py" "${Q[@]}" --out "$OUT/gluon_rerope.json" --reps "${REPS:-20}" \
    --skip "${SKIP[@]}" 2>&1 | tee "$OUT/gluon_rerope.log"
rc=$?
echo "bench_rerope rc=$rc after ${SECONDS} s (124: cut at $left s, the JSON holds the rows done; 1: a correctness row failed)"
exit $rc
