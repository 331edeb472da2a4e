#!/usr/bin/env bash
# Session 56's second call, after gluon_turn_queries went on by default. From the repository
# root, OUT set; all in $OUT/s56.tgz, within TOTAL seconds (default 540):
# 1. tests/test_hopper.py -m gpu (the oracle grids through the new default);
# 2. perf/runs/s55/qturn_bench.py again (old path / Q_TURN / kernel alone, 8k);
# 3. the N sweep: rerope (five tensors), rerope_rotated, rerope_raw and sdpa_cudnn forward,
#    NS (default 1024..32768), D 64/128, fp16/bf16, as shipped (default_*.json) and
#    REROPE_GLUON=0 (off_*);
# 4. benchmarks.hf at 8k twice, the impls in both orders (the first call's rerope decode loop
#    at 8k was 1.7x stock's while its generate() and the 32k rows were not: noise or real?),
#    then benchmarks.hf_profile at 8k.
# TESTS=0, QTURN=0 leave out parts 1 and 2, OFF= the REROPE_GLUON=0 runs, ORDERS=one order.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-540}
R=$OUT/s56
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 15)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
[ "${TESTS:-1}" = 1 ] && timeout "$(left 140)" python3 -m pytest tests/test_hopper.py -m gpu \
    -n 4 -q -p no:cacheprovider -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
[ "${QTURN:-1}" = 1 ] && timeout "$(left 60)" python3 perf/runs/s55/qturn_bench.py "$R" \
    > "$R/qturn_bench.log" 2>&1
echo "qturn rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
GRID=(--impl rerope,rerope_rotated,rerope_raw,sdpa_cudnn --causal true --mode fwd --skip-check
      --n ${NS:-1024,2048,4096,8192,16384,32768} --d 64,128)
for run in default ${OFF-off}; do
    for dtype in float16 bfloat16; do
        [ $run = off ] && export REROPE_GLUON=0
        timeout "$(left 90)" python3 -m benchmarks.attention "${GRID[@]}" --dtype $dtype \
            --out "$R/${run}_$dtype.json" > "$R/${run}_$dtype.log" 2>&1
        echo "$run $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
    done
done
unset REROPE_GLUON
HF=(--context 8192 --window 2048 --steps 32 --reps 3 --generate --skip-checks)
for order in ${ORDERS:-rerope,stock_sdpa_flash stock_sdpa_flash,rerope}; do
    timeout "$(left 60)" python3 -m benchmarks.hf "${HF[@]}" --impls $order \
        --out "$R/hf_8k_${order%%,*}_first.json" > "$R/hf_8k_${order%%,*}_first.log" 2>&1
    echo "hf $order rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
done
timeout "$(left 40)" python3 -m benchmarks.hf_profile --context 8192 > "$R/profile_8k.txt" 2>&1
echo "profile 8k rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
tar czf "$OUT/s56.tgz" -C "$OUT" s56 && rm -rf "$R"
