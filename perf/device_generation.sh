#!/bin/bash
# Issue 18's device call A: GPU tests of the plans, bound launches, compiled ops and static-cache
# generation; host time per call (book/data/host_h200.json); the N=2048 benchmark rows; the
# compiled fused-QKV block; the Hugging Face benchmark (dynamic cache). Results under $OUT.
#   bash perf/device_generation.sh        (HF=0 skips the Hugging Face benchmark)
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/generation.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$log"
start=$(date +%s)
timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_generation.py tests/test_decode.py \
    tests/test_hf.py -m gpu -q -p no:cacheprovider -n 4 ${TEST_K:+-k "$TEST_K"} \
    > "$OUT/gpu_tests.log" 2>&1
tail -n 15 "$OUT/gpu_tests.log" | tee -a "$log"
echo "tests done in $(( $(date +%s) - start )) s" | tee -a "$log"
timeout 120 python3 perf/host_h200.py --out "$OUT/host_h200.json" 2>&1 | tee -a "$log"
timeout 150 python3 -m kernels.bench --n 2048 --d 64 --dtype float16 --causal true --reps 20 \
    --impl rerope_raw,sdpa_cudnn,rope_sdpa_cudnn --out "$OUT/bench_n2048.json" 2>&1 \
    | grep -E "check|N=2048" | tee -a "$log"
timeout 150 python3 perf/compile_block.py --out "$OUT/compile_block_h200.json" 2>&1 | tail -n 4 | tee -a "$log"
echo "host/bench/block done in $(( $(date +%s) - start )) s" | tee -a "$log"
if [ "${HF:-1}" = 1 ]; then
timeout ${HF_TIMEOUT:-260} python3 perf/bench_hf.py --steps 32 --reps 3 ${HF_ARGS} \
    --out "$OUT/hf_h200.json" > "$OUT/hf.log" 2>&1
tail -n 30 "$OUT/hf.log" | tee -a "$log"
fi
echo "all done in $(( $(date +%s) - start )) s" | tee -a "$log"
