#!/usr/bin/env bash
# Issue 38, step 1: the plain causal Gluon forward (perf/gluon/plain_fwd.py) on one sm_90 GPU
# (H100/H200, Triton 3.6), from the repository root, in well under 5 minutes:
#
#   OUT=$OUT bash perf/gluon/device_plain.sh
#
# First a smoke pass (each config once at N=512, own process, 90 s cap, repeated without a config
# that hung or crashed it: $OUT/smoke.log, smoke.txt, skipped.txt); then
# writes $OUT/gluon_plain.json (correctness rows + timing rows, rewritten after every row),
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

Q=(); [[ "${QUICK:-0}" == 1 ]] && Q=(--quick)

# Smoke pass, in its own process: each config once at N=512. A config that hangs (mbarrier
# deadlock) or crashes the process (illegal address poisons the CUDA context) is the last one
# started and not finished in smoke.txt: it is added to SKIP and the pass repeats (at most 3 times).
SKIP=()
for attempt in 1 2 3; do
    ((SECONDS > 150)) && { echo "no time left for another smoke attempt"; break; }
    : > "$OUT/smoke.txt"
    timeout 90 $PY "$HERE/bench_plain.py" "${Q[@]}" --smoke "$OUT/smoke.txt" --skip "${SKIP[@]}" 2>&1 | tee -a "$OUT/smoke.log"
    src=$?
    last=$(grep '^start ' "$OUT/smoke.txt" | tail -1 | cut -d' ' -f2)
    if [[ $src == 0 || -z "$last" ]] || grep -q "^\(ok\|bad\) $last\$" "$OUT/smoke.txt"; then
        echo "smoke attempt $attempt rc=$src"; break
    fi
    echo "smoke attempt $attempt rc=$src: $last hung or crashed the process; skipping it" | tee -a "$OUT/smoke.log"
    SKIP+=("$last")
done
echo "skipped: ${SKIP[*]:-none}" | tee "$OUT/skipped.txt"

left=$((290 - SECONDS)); ((left < 90)) && left=90   # the whole stays under ~5 minutes
timeout $left $PY "$HERE/bench_plain.py" "${Q[@]}" --out "$OUT/gluon_plain.json" --reps "${REPS:-20}" \
    --skip "${SKIP[@]}" 2>&1 | tee "$OUT/gluon_plain.log"
rc=$?
echo "bench_plain rc=$rc after ${SECONDS} s in all (124: cut at $left s; the JSON holds the rows done; 1: a correctness row failed)"
exit $rc
