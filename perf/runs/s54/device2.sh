#!/usr/bin/env bash
# Session 54's second call (issue 38): the Gluon forward with its launch bound per plan.
# 1. tests/test_hopper.py -m gpu -> tests.log; 2. perf/runs/s54/short_n.py (Gluon at every N vs
# Triton vs cuDNN: GPU ms and host µs per call, N 1k-16k) -> short_n.json; 3. benchmarks.attention
# as the package ships (REROPE_GLUON default, MIN_KEYS) and with REROPE_GLUON=0, causal, fwd and
# fwd+bwd -> default_*.json, off_*.json. All in $OUT/gluon2.tgz.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-570}
R=$OUT/gluon2
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 20)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
timeout "$(left 200)" python3 -m pytest tests/test_hopper.py -m gpu -n 4 -q -p no:cacheprovider \
    -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
timeout "$(left 110)" python3 perf/runs/s54/short_n.py --out "$R/short_n.json" > "$R/short_n.log" 2>&1
echo "short_n rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
GRID=(--impl rerope,sdpa_cudnn --causal true --n 1024,2048,4096,8192,16384,32768 --d 64,128
      --skip-check --mode fwd,fwd+bwd)
for dtype in float16 bfloat16; do
    timeout "$(left 70)" python3 -m benchmarks.attention "${GRID[@]}" --dtype $dtype \
        --out "$R/default_$dtype.json" > "$R/default_$dtype.log" 2>&1
    echo "default $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
    REROPE_GLUON=0 timeout "$(left 70)" python3 -m benchmarks.attention "${GRID[@]}" \
        --dtype $dtype --out "$R/off_$dtype.json" > "$R/off_$dtype.log" 2>&1
    echo "off $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
done
tar czf "$OUT/gluon2.tgz" -C "$OUT" gluon2 && rm -rf "$R"
ls -la "$OUT"
