#!/usr/bin/env bash
# Session 48, device call A (one H200, from the repository root, OUT set, ≤ 595 s):
# 1. issue 37: perf/runs/s48/host_parts.py on this tree, then its parts on the package before
#    the session's change (.dev/before/kernels, carried) -> host_parts_8k*.json
# 2. the GPU tests of decode, LSE and serving (perf/runs/s48/gpu_tests.txt) -> gpu_tests.log
# 3. issue 34: benchmarks/device_run.sh decode host (what time is left)
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
source perf/runs/s48/versions.sh
timeout 130 python3 perf/runs/s48/host_parts.py --out "$OUT/host_parts_8k.json" > "$OUT/host_parts.log" 2>&1
echo "host_parts rc=$? at $SECONDS s"
PYTHONPATH=.dev/before/kernels:. timeout 40 python3 perf/runs/s48/host_parts.py --rounds 0 \
    --out "$OUT/host_parts_8k_before.json" > "$OUT/host_parts_before.log" 2>&1
echo "host_parts before rc=$? at $SECONDS s"
timeout 150 python3 -m pytest $(cat perf/runs/s48/gpu_tests.txt) -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? at $SECONDS s"; tail -2 "$OUT/gpu_tests.log"
OUT=$OUT timeout $((592 - SECONDS)) bash benchmarks/device_run.sh decode host
echo "grids done at $SECONDS s"
