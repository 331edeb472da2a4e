#!/bin/bash
# One device call for Self-Extend beside ReRoPE: correctness at N=8192 in four parallel processes
# (they also fill Triton's on-disk cache), then the timings in one process, then the merge.
#   bash perf/device_self_extend.sh      (results in $OUT: self_extend_h200.json, self_extend.log)
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=${REROPE_AUTOTUNE:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/logs /tmp/se
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/self_extend.log"
start=$(date +%s)
for dtype in float16 bfloat16; do for d in 64 128; do
    raw=""; [ $dtype = float16 ] && raw="--raw"
    timeout "${CHECK_TIMEOUT:-170}" python3 perf/probe_self_extend.py check --dtype $dtype --d $d \
        $raw --out /tmp/se/check_${dtype}_$d.json > /tmp/logs/check_${dtype}_$d.log 2>&1 &
done; done
wait
cat /tmp/logs/check_*.log | tee -a "$OUT/self_extend.log" | grep -v "^\s*$" | tail -40
echo "checks done in $(( $(date +%s) - start )) s" | tee -a "$OUT/self_extend.log"
timeout "${TIME_TIMEOUT:-90}" python3 perf/probe_self_extend.py time --out /tmp/se/time.json 2>&1 \
    | tee -a "$OUT/self_extend.log"
python3 perf/probe_self_extend.py merge --out "$OUT/self_extend_h200.json" /tmp/se/*.json \
    > /dev/null 2>> "$OUT/self_extend.log"
echo "all done in $(( $(date +%s) - start )) s" | tee -a "$OUT/self_extend.log"
