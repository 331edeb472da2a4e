#!/usr/bin/env bash
# Session 48, on whichever sm_90 GPU comes (from the repository root, OUT set, within TOTAL
# seconds, default 590):
# 1. issue 37: perf/runs/s48/host_parts.py (this tree), then its parts with the package before
#    the session's change (.dev/before/kernels, carried) -> host_parts_8k*.json
# 2. issue 38: QUICK=1 perf/gluon/device_rerope.sh -> gluon/ (unless SKIP_GLUON=1)
# 3. the GPU tests of decode, LSE and serving (perf/runs/s48/gpu_tests.txt), if time is left;
#    with ALL_GPU_TESTS=1 every GPU test instead (pytest tests -m gpu -n 8, about 240 s on an H200)
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-590}
mkdir -p "$OUT/gluon"
source perf/runs/s48/versions.sh
timeout 110 python3 perf/runs/s48/host_parts.py --out "$OUT/host_parts_8k.json" > "$OUT/host_parts.log" 2>&1
echo "host_parts rc=$? at $SECONDS s"
PYTHONPATH=.dev/before/kernels:. timeout 35 python3 perf/runs/s48/host_parts.py --rounds 0 \
    --out "$OUT/host_parts_8k_before.json" > "$OUT/host_parts_before.log" 2>&1
echo "host_parts before rc=$? at $SECONDS s"
if [ "${SKIP_GLUON:-0}" != 1 ]; then
    cap=$((TOTAL - SECONDS - 5)); ((cap > 250)) && cap=250
    QUICK=1 OUT=$OUT/gluon timeout $cap bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
    echo "gluon rc=$? at $SECONDS s"
fi
tests=$(cat perf/runs/s48/gpu_tests.txt)
[ "${ALL_GPU_TESTS:-0}" = 1 ] && tests="tests -m gpu -n 8"
left=$((TOTAL - SECONDS))
if ((left > 60)); then
    timeout $left python3 -m pytest $tests -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$? at $SECONDS s"; tail -2 "$OUT/gpu_tests.log"
fi
