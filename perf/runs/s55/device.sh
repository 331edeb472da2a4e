#!/usr/bin/env bash
# Session 55's first call: the in-kernel query turn (Q_TURN) and the turn pass's new tiling.
# From the repository root, OUT set; all in $OUT/s55.tgz, within TOTAL seconds (default 400).
# 1. tests/test_hopper.py -m gpu (the oracle grids, rerope through Q_TURN among them);
# 2. qturn_bench.py; 3. turn_bench.py; 4. issue 38's grid: rerope (five tensors),
# rerope_rotated and sdpa_cudnn forward, N = $NS (default 8192; the sweep: NS=1024,...,32768),
# D 64/128, fp16/bf16, as shipped (default_*.json) and with REROPE_GLUON=0 (off_*.json).
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-400}
R=$OUT/s55
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 15)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
timeout "$(left 200)" python3 -m pytest tests/test_hopper.py -m gpu \
    -n 4 -q -p no:cacheprovider -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
timeout "$(left 120)" python3 perf/runs/s55/qturn_bench.py "$R" > "$R/qturn_bench.log" 2>&1
echo "qturn rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
timeout "$(left 90)" python3 perf/runs/s55/turn_bench.py "$R" > "$R/turn_bench.log" 2>&1
echo "turn rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
GRID=(--impl rerope,rerope_rotated,sdpa_cudnn --causal true --mode fwd --skip-check
      --n ${NS:-8192} --d 64,128)
for run in default off; do
    for dtype in float16 bfloat16; do
        [ $run = off ] && export REROPE_GLUON=0
        timeout "$(left 60)" python3 -m benchmarks.attention "${GRID[@]}" --dtype $dtype \
            --out "$R/${run}_$dtype.json" > "$R/${run}_$dtype.log" 2>&1
        echo "$run $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
    done
done
unset REROPE_GLUON
tar czf "$OUT/s55.tgz" -C "$OUT" s55 && rm -rf "$R"
