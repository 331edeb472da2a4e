#!/bin/bash
# One device call: compile every case of perf/sweep_fused.py in parallel, then time them all in
# one process, then the host-path timings of perf/probe_fused.py (short grid).
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/logs
n=$(python3 -c "import sys; sys.path.insert(0,'perf'); import sweep_fused; print(len(sweep_fused.CASES))")
start=$(date +%s)
seq 0 $((n - 1)) | xargs -P 14 -I{} sh -c \
    "timeout ${WARM_TIMEOUT:-150} python3 perf/sweep_fused.py warm --index {} > /tmp/logs/warm_{}.log 2>&1"
cat /tmp/logs/warm_*.log | grep "^warm" | tee "$OUT/sweep.log"
echo "warm-up done in $(( $(date +%s) - start )) s" | tee -a "$OUT/sweep.log"
timeout ${SWEEP_TIMEOUT:-150} python3 perf/sweep_fused.py time --out "$OUT/sweep.json" 2>&1 | tee -a "$OUT/sweep.log"
PROBE_GRID=short timeout 90 python3 perf/probe_fused.py time --out "$OUT/host.json" 2>&1 | tee -a "$OUT/sweep.log"
echo "all done in $(( $(date +%s) - start )) s" | tee -a "$OUT/sweep.log"
