#!/usr/bin/env bash
# Session 53's plan for the next device call, whichever GPU comes (from the repository root, OUT
# set, within TOTAL seconds, default 570). Everything lands in ONE file, $OUT/next.tgz (only
# eight files come back from a call). In order of need:
# 1. the GPU tests of the host-path change of 71a3875 (kept partials buffer, HF fast path,
#    heads-last output): tests/test_decode.py, test_hf.py, test_hf_overhead.py,
#    test_generation.py, -m gpu (cap 200 s) -> gpu_tests.log
# 2. issue 37's targets: perf/device_hf_speed.sh (HF decode and generate() at 8k and 32k
#    against stock FlashAttention-2, profile, host per layer; the compiled block gets what
#    is left of BUDGET) -> hf.tgz inside
# 3. issue 38: D64=1 perf/gluon/device_rerope.sh (the lean SPLIT=3 kernel, 16 keys) -> d64/;
#    on an H200 also QUICK=1 (the PIPE keys at D64 and D128, the targets' card) -> quick/
# 4. perf/runs/s48/host_parts.py (the attention function's parts, host µs) -> host_parts*
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH=kernels:.
TOTAL=${TOTAL:-570}
R=$OUT/next
mkdir -p "$R"
left() { local l=$((TOTAL - SECONDS - 15)); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo $1; }
( OUT=$R; source perf/runs/s48/versions.sh )
timeout "$(left 200)" python3 -m pytest tests/test_decode.py tests/test_hf.py \
    tests/test_hf_overhead.py tests/test_generation.py -m gpu -n 4 -q -p no:cacheprovider \
    > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
OUT=$R BUDGET=$(left 170) bash perf/device_hf_speed.sh > "$R/hf_speed.log" 2>&1
echo "hf speed rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
D64=1 OUT=$R/d64 timeout "$(left 150)" bash perf/gluon/device_rerope.sh > "$R/d64.log" 2>&1
echo "gluon d64 rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
if grep -q H200 "$R/versions.txt"; then
    QUICK=1 OUT=$R/quick timeout "$(left 170)" bash perf/gluon/device_rerope.sh \
        > "$R/quick.log" 2>&1
    echo "gluon quick rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
fi
timeout "$(left 60)" python3 perf/runs/s48/host_parts.py --out "$R/host_parts_8k.json" \
    > "$R/host_parts.log" 2>&1
echo "host_parts rc=$? at $SECONDS s" | tee -a "$R/timing.txt"
tar czf "$OUT/next.tgz" -C "$OUT" next && rm -rf "$R"
ls -la "$OUT"
