#!/usr/bin/env bash
# Session 48's last device call (whatever sm_90 GPU comes; from the repository root, OUT set,
# within TOTAL seconds, default 180): issue 38's QUICK=1 perf/gluon/device_rerope.sh, then
# issue 37's perf/runs/s48/host_parts.py (one model round) with what time is left.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-180}
source perf/runs/s48/versions.sh
mkdir -p "$OUT/gluon"
QUICK=1 OUT=$OUT/gluon timeout $((TOTAL - 40)) bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
echo "gluon rc=$? at $SECONDS s"
left=$((TOTAL - SECONDS))
if ((left > 30)); then
    timeout $left python3 perf/runs/s48/host_parts.py --rounds 1 --calls 300 \
        --out "$OUT/host_parts_8k.json" > "$OUT/host_parts.log" 2>&1
    echo "host_parts rc=$? at $SECONDS s"
fi
