#!/bin/bash
# Issue 18 (session 8, helper h18): the device calls. Run from the tree's root, with _before/
# staged next to it (main 4c93c9b's kernels/ plus this tree's perf/host_h200.py and
# perf/probe_fused.py); results under $OUT.
#   CALL=1: host time per call with this tree's kernels ("after", cProfile tables) and with
#     4c93c9b's ("before"), the compiled fused-QKV block with kernel tables, the GPU tests of
#     the plans, generation, decode and paged decode.
#   CALL=2: host time again, after and before alternating (machines and minutes differ by tens
#     of µs: one run each says little), the compiled block at N=4096 (both dtypes, kernel
#     tables) and at N=256 (fp16: a host-bound step).
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/device.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$log"
start=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - start )) s" | tee -a "$log"; }
host() {   # host LABEL DIR OUTFILE [profile prefix]
    (cd "$2" && HOST_PROFILE=$4 timeout ${HOST_TIMEOUT:-60} python3 perf/host_h200.py --label "$1" \
        --out "$3" 2>&1 | tail -n 12 | tee -a "$log"); stamp "host-$1"
}
if [ "${CALL:-1}" = 1 ]; then
mkdir -p /tmp/prof
HOST_TIMEOUT=100 host after . "$OUT/host_after.json" /tmp/prof/after
HOST_TIMEOUT=45 host before _before "$OUT/host_before.json"
HOST_TIMEOUT=30 host after-again . "$OUT/host_after_again.json"
for f in /tmp/prof/*.txt; do echo "=== $f"; cat "$f"; done > "$OUT/host_profiles.txt"
timeout 110 python3 perf/compile_block.py --profile --out "$OUT/compile_block_h200.json" 2>&1 \
    | tail -n 4 | cut -c 1-400 | tee -a "$log"; stamp block
timeout ${TEST_TIMEOUT:-110} python3 -m pytest tests/test_plans.py tests/test_generation.py \
    tests/test_decode.py tests/test_paged.py -m gpu -q -p no:cacheprovider -n 4 \
    > "$OUT/gpu_tests.log" 2>&1
tail -n 15 "$OUT/gpu_tests.log" | tee -a "$log"; stamp tests
else
HOST_TIMEOUT=45 host after-1 . "$OUT/host_after_1.json"
HOST_TIMEOUT=30 host before-1 _before "$OUT/host_before_1.json"
HOST_TIMEOUT=20 host after-2 . "$OUT/host_after_2.json"
HOST_TIMEOUT=20 host before-2 _before "$OUT/host_before_2.json"
timeout 115 python3 perf/compile_block.py --profile --out "$OUT/compile_block_h200.json" 2>&1 \
    | tail -n 4 | cut -c 1-300 | tee -a "$log"; stamp block
timeout 50 python3 perf/compile_block.py --n 256 --dtypes float16 \
    --out "$OUT/compile_block_n256_h200.json" 2>&1 | tail -n 2 | cut -c 1-300 | tee -a "$log"
stamp block-256
fi
