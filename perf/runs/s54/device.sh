#!/usr/bin/env bash
# Session 54 (issue 38): the Gluon forward wired into the package (rerope.hopper), on whichever
# GPU comes. From the repository root, OUT set, within TOTAL seconds (default 570). Everything
# lands in ONE file, $OUT/gluon.tgz (only eight files come back from a call):
# 1. tests/test_hopper.py -m gpu (the float64 oracle grid through rerope_attention with the
#    Gluon forward, what it leaves to Triton, the benchmark's shape against Triton) -> tests.log
# 2. benchmarks.attention, causal, rerope (five tensors) and sdpa_cudnn, N 1k-32k, D 64/128,
#    fp16/bf16, B1 H32 W2048: fwd and fwd+bwd with the Gluon forward (REROPE_GLUON=1, the
#    default) -> on_*.json; fwd with the Triton forward (REROPE_GLUON=0) -> off_*.json
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-570}
R=$OUT/gluon
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 20)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
timeout "$(left 220)" python3 -m pytest tests/test_hopper.py -m gpu -n 4 -q -p no:cacheprovider \
    -rs > "$R/tests.log" 2>&1
echo "tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
GRID=(--impl rerope,sdpa_cudnn --causal true --n 1024,2048,4096,8192,16384,32768 --d 64,128
      --skip-check)
for dtype in float16 bfloat16; do
    REROPE_GLUON=1 timeout "$(left 120)" python3 -m benchmarks.attention "${GRID[@]}" \
        --dtype $dtype --mode fwd,fwd+bwd --out "$R/on_$dtype.json" > "$R/on_$dtype.log" 2>&1
    echo "gluon on $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
    REROPE_GLUON=0 timeout "$(left 80)" python3 -m benchmarks.attention "${GRID[@]}" \
        --dtype $dtype --mode fwd --out "$R/off_$dtype.json" > "$R/off_$dtype.log" 2>&1
    echo "gluon off $dtype rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
done
tar czf "$OUT/gluon.tgz" -C "$OUT" gluon && rm -rf "$R"
ls -la "$OUT"
