#!/usr/bin/env bash
# Session 48, device call B (one H200, from the repository root, OUT set, ≤ 595 s):
# issue 34's attention grid (benchmarks/device_run.sh attention: parallel warm-up, the whole
# grid, merged into a copy of bench_h200.json) while the Gluon kernels of issue 38 JIT-compile
# on the other CPUs (8 processes); then QUICK=1 perf/gluon/device_rerope.sh (its precompile
# now hits Triton's cache) -> $OUT/gluon/.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
source perf/runs/s48/versions.sh
mkdir -p "$OUT/gluon"
( python3 perf/gluon/bench_rerope.py --quick --list-keys \
    | timeout 200 xargs -P 8 -n 1 timeout 90 python3 perf/gluon/bench_rerope.py --precompile \
    > "$OUT/gluon/precompile_early.log" 2>&1 ) &
OUT=$OUT WARM_TIMEOUT=150 timeout 400 bash benchmarks/device_run.sh attention
echo "attention rc=$? at $SECONDS s"
wait
echo "gluon precompile: $(grep -c '^precompiled' "$OUT/gluon/precompile_early.log") keys at $SECONDS s"
QUICK=1 OUT=$OUT/gluon timeout $((592 - SECONDS)) bash perf/gluon/device_rerope.sh > "$OUT/gluon/run.log" 2>&1
echo "gluon rc=$? at $SECONDS s"
