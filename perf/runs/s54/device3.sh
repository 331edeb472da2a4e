#!/usr/bin/env bash
# Session 54's third call (issue 38): rerope.rerope (raw and rotated q, k) through the Gluon
# forward after the operands' turn. 1. tests/test_hopper.py -m gpu -> tests.log; 2.
# benchmarks.attention, causal, fwd, N 4k/8k/16k, D 64/128, fp16/bf16: rerope_rotated,
# rerope_raw, rerope (five tensors), sdpa_cudnn, rope_sdpa_cudnn as shipped -> default_*.json,
# and with REROPE_GLUON=0 -> off_*.json. All in $OUT/gluon3.tgz.
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-440}
R=$OUT/gluon3
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 15)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
timeout "$(left 190)" python3 -m pytest tests/test_hopper.py -m gpu -n 4 -q -p no:cacheprovider \
    -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
GRID=(--impl rerope_rotated,rerope_raw,rerope,sdpa_cudnn,rope_sdpa_cudnn --causal true
      --n 4096,8192,16384 --d 64,128 --skip-check --mode fwd)
for dtype in float16 bfloat16; do
    timeout "$(left 60)" python3 -m benchmarks.attention "${GRID[@]}" --dtype $dtype \
        --out "$R/default_$dtype.json" > "$R/default_$dtype.log" 2>&1
    echo "default $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
    REROPE_GLUON=0 timeout "$(left 60)" python3 -m benchmarks.attention "${GRID[@]}" \
        --dtype $dtype --out "$R/off_$dtype.json" > "$R/off_$dtype.log" 2>&1
    echo "off $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
done
tar czf "$OUT/gluon3.tgz" -C "$OUT" gluon3 && rm -rf "$R"
ls -la "$OUT"
