#!/bin/bash
# One device call for the fused-rotation op: correctness at N=8192 in four parallel processes
# (they also fill Triton's on-disk cache), then the timings in one process.
#   bash perf/device_fused.sh        (results in $OUT: check_*.json, time.json, fused.log)
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=${REROPE_AUTOTUNE:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/fused.log"
start=$(date +%s)
for dtype in float16 bfloat16; do for d in 64 128; do
    timeout "${CHECK_TIMEOUT:-240}" python3 perf/probe_fused.py check --dtype $dtype --d $d \
        --out "$OUT/check_${dtype}_$d.json" > /tmp/logs/check_${dtype}_$d.log 2>&1 &
done; done
wait
cat /tmp/logs/check_*.log | tee -a "$OUT/fused.log" | grep -v "^\s*$" | tail -40
echo "checks done in $(( $(date +%s) - start )) s" | tee -a "$OUT/fused.log"
timeout "${TIME_TIMEOUT:-200}" python3 perf/probe_fused.py time --out "$OUT/time.json" 2>&1 \
    | tee -a "$OUT/fused.log"
echo "all done in $(( $(date +%s) - start )) s" | tee -a "$OUT/fused.log"
