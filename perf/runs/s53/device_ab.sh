#!/usr/bin/env bash
# Session 53 (issue 34, "no speed lost"): the attention grid of ReRoPE with this tree's package
# and with the package of 98758ef (issue 34's baseline; carried as .dev/b98/pkg/rerope, renamed
# from kernels/), side by side on one machine, whichever GPU comes. From the repository root,
# OUT set. 1. Both packages' kernels compile in parallel (reps 1, 8 processes). 2. Per dtype and
# causal: this tree (rerope, sdpa_cudnn) then the baseline (rerope), alternating, so drift in
# the machine touches both -> $OUT/new_*.json, $OUT/old_*.json (compare_grid.py OLD NEW).
# As run in session 53 it lacked KERNELS_AUTOTUNE=0, so the old package autotuned (README).
# Only eight files come back from a call: pack $OUT (tar) before it ends.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 KERNELS_AUTOTUNE=0   # 98758ef reads KERNELS_*
OLD=.dev/b98/pkg
mkdir -p "$OUT/warm"
source perf/runs/s48/versions.sh
for pkg in new old; do
    path=kernels; [ $pkg = old ] && path=$OLD
    for dtype in float16 bfloat16; do for causal in true false; do
        PYTHONPATH=$path:. timeout ${WARM_TIMEOUT:-170} python3 -m benchmarks.attention \
            --skip-check --reps 1 --impl rerope --dtype $dtype --causal $causal \
            --out /tmp/warm-$pkg-$dtype-$causal.json > "$OUT/warm/$pkg-$dtype-$causal.log" 2>&1 &
    done; done
done
wait
echo "warm-up done at $SECONDS s"
for dtype in float16 bfloat16; do for causal in true false; do
    PYTHONPATH=kernels:. python3 -m benchmarks.attention --impl rerope,sdpa_cudnn --dtype $dtype \
        --causal $causal --out "$OUT/new_$dtype-$causal.json" > "$OUT/new_$dtype-$causal.log" 2>&1
    echo "new $dtype causal=$causal rc=$? at $SECONDS s"
    PYTHONPATH=$OLD:. python3 -m benchmarks.attention --impl rerope,sdpa_cudnn --dtype $dtype \
        --causal $causal --out "$OUT/old_$dtype-$causal.json" > "$OUT/old_$dtype-$causal.log" 2>&1
    echo "old $dtype causal=$causal rc=$? at $SECONDS s"
done; done
( cd "$OUT" && tar czf ab.tgz ./*.json ./*.log versions.txt warm && rm -rf ./*.json ./*.log warm )
