#!/usr/bin/env bash
# Session 50, one short call on whichever sm_90 GPU comes (from the repository root, OUT set,
# about 250 s): issue 38's FA3-scheduled Gluon variants, QUICK=1 perf/gluon/device_rerope.sh
# (-> $OUT/gluon/), with the 18 decode/LSE/serving GPU tests of perf/runs/s48/gpu_tests.txt
# beside its CPU-bound precompile (-> $OUT/gpu_tests.log, timed out at 120 s).
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
mkdir -p "$OUT/gluon"
source perf/runs/s48/versions.sh
( timeout 120 python3 -m pytest $(cat perf/runs/s48/gpu_tests.txt) -q -p no:cacheprovider \
    > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$? at $SECONDS s" >> "$OUT/gpu_tests.log" ) &
QUICK=1 OUT=$OUT/gluon timeout ${GLUON_CAP:-245} bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
echo "gluon rc=$? at $SECONDS s"
wait
tail -3 "$OUT/gpu_tests.log"
sed -n "/cuDNN\/impl/,\$p" "$OUT/gluon/gluon_rerope.log" | tail -40
