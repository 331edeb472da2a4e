#!/usr/bin/env bash
# Issue 38, step 1: the plain causal Gluon forward (perf/gluon/plain_fwd.py) on one sm_90 GPU
# (H100/H200, Triton 3.6), from the repository root, in well under 5 minutes:
#
#   OUT=$OUT bash perf/gluon/device_plain.sh
#
# Writes $OUT/gluon_plain.json (correctness rows + timing rows, rewritten after every row),
# $OUT/gluon_plain.log (the printed tables), $OUT/cross_compile.txt (shared memory / registers of
# each variant as compiled on the device) and $OUT/versions.txt.
# QUICK=1: default configs only and N=8192 timing only.  REPS (default 20) timed calls per row.
# Without CUDA (or not sm_90) it says so and exits 2 without running anything.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)

if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else 1)' 2>/dev/null; then
    echo "device_plain.sh: no sm_90 CUDA device here (needs an H100/H200 with torch + Triton 3.6); nothing run" >&2
    exit 2
fi

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1
  $PY -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version()); print("triton", triton.__version__)'
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# the same cross-compile report as on the CPU machine, as a cheap first check (40 s cap)
timeout 40 $PY "$HERE/cross_compile.py" > "$OUT/cross_compile.txt" 2>&1
echo "cross_compile rc=$?"; cut -c1-200 "$OUT/cross_compile.txt"

ARGS=(--out "$OUT/gluon_plain.json" --reps "${REPS:-20}")
[[ "${QUICK:-0}" == 1 ]] && ARGS+=(--quick)
timeout 240 $PY "$HERE/bench_plain.py" "${ARGS[@]}" 2>&1 | tee "$OUT/gluon_plain.log"
rc=$?
echo "bench_plain rc=$rc (124: cut at 240 s; the JSON holds the rows done)"
exit $rc
