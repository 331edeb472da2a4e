#!/usr/bin/env bash
# Session 48, on whichever sm_90 GPU comes (from the repository root, OUT set, within TOTAL
# seconds, default 590):
# 1. issue 37: perf/runs/s48/host_parts.py (this tree), then its parts with the package before
#    the session's change (.dev/before/kernels, carried) -> host_parts_8k*.json
# 2. issue 38: QUICK=1 perf/gluon/device_rerope.sh -> gluon/
# 3. the GPU tests of decode, LSE and serving (perf/runs/s48/gpu_tests.txt), if time is left
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-590}
mkdir -p "$OUT/gluon"
source perf/runs/s48/versions.sh
timeout 110 python3 perf/runs/s48/host_parts.py --out "$OUT/host_parts_8k.json" > "$OUT/host_parts.log" 2>&1
echo "host_parts rc=$? at $SECONDS s"
PYTHONPATH=.dev/before/kernels:. timeout 35 python3 perf/runs/s48/host_parts.py --rounds 0 \
    --out "$OUT/host_parts_8k_before.json" > "$OUT/host_parts_before.log" 2>&1
echo "host_parts before rc=$? at $SECONDS s"
cap=$((TOTAL - SECONDS - 5)); ((cap > 250)) && cap=250
QUICK=1 OUT=$OUT/gluon timeout $cap bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
echo "gluon rc=$? at $SECONDS s"
left=$((TOTAL - SECONDS))
if ((left > 60)); then
    timeout $left python3 -m pytest $(cat perf/runs/s48/gpu_tests.txt) -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$? at $SECONDS s"; tail -2 "$OUT/gpu_tests.log"
fi
