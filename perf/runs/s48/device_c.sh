#!/usr/bin/env bash
# Session 48, device call for an H200 (from the repository root, OUT set, within TOTAL seconds,
# default 590; the attention and Gluon steps capped at ATT_CAP, default 320 s, and GLUON_CAP,
# 170 s): issue 34's "no speed lost" grids and, unless SKIP_GLUON=1, issue 38's Gluon run.
# 1. The Gluon kernels' JIT compiles (QUICK keys, 8 processes) start in the background.
# 2. benchmarks/device_run.sh attention with ATTENTION_IMPLS=rerope,sdpa_cudnn: its warm-up,
#    with the GPU tests of perf/runs/s48/gpu_tests.txt during the warm-up ($OUT/gpu_tests.log),
#    then the whole N x D x dtype x causal x mode grid of ReRoPE and its same-run yardstick
#    ($OUT/bench_full.json; compare with compare_grid.py).
# 3. QUICK=1 perf/gluon/device_rerope.sh (its compiles now hit Triton's cache) -> gluon/
# 4. benchmarks/device_run.sh decode, rerope_decode and sdpa_flash, with the time left.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
mkdir -p "$OUT/gluon"
source perf/runs/s48/versions.sh
[ "${SKIP_GLUON:-0}" = 1 ] || ( python3 perf/gluon/bench_rerope.py --quick --list-keys \
    | timeout 150 xargs -P 8 -n 1 timeout 90 python3 perf/gluon/bench_rerope.py --precompile \
    > "$OUT/gluon/precompile_early.log" 2>&1 ) &
GPU_TESTS=perf/runs/s48/gpu_tests.txt ATTENTION_IMPLS=rerope,sdpa_cudnn WARM_TIMEOUT=150 timeout ${ATT_CAP:-320} bash benchmarks/device_run.sh attention
echo "attention rc=$? at $SECONDS s"
wait
if [ "${SKIP_GLUON:-0}" != 1 ]; then
    QUICK=1 OUT=$OUT/gluon timeout ${GLUON_CAP:-170} bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
    echo "gluon rc=$? at $SECONDS s"
fi
left=$((${TOTAL:-590} - SECONDS))
DECODE_ARGS="--impl rerope_decode sdpa_flash --budget-s $((left - 40))" \
    timeout $left bash benchmarks/device_run.sh decode
echo "decode rc=$? at $SECONDS s"
