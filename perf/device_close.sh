#!/bin/bash
# The device call that checks and measures the pre-turned keys of the fused forward (see
# kernels.attention.preturn_keys) and the Hugging Face drop-in: GPU tests of the fused op and
# the decode kernel, perf/probe_preturn.py, the kernels.rerope benchmark rows (raw, rotated and
# plain RoPE + cuDNN; fp16 N sweep and bf16 N=8192) merged into book/data/bench_h200.json, and
# perf/bench_hf.py into book/data/hf_h200.json. Results go to /tmp/close, archived into
# $OUT/close.tgz after every step (the device tool returns at most 8 files), so a step that runs
# out of time still leaves the earlier ones. Carry .whl.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; R=/tmp/close; mkdir -p "$OUT" "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
log() { echo "$(( $(date +%s) - start )) s: $*" | tee -a "$R/close.log"
        tar czf "$OUT/close.tgz" -C "$R" .; }
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/close.log"
GPU_TEST_REPORT=$R/gpu_tests.json timeout ${TEST_TIMEOUT:-170} python3 -m pytest \
    tests/test_gpu.py tests/test_decode.py -m gpu -q -p no:cacheprovider -n 8 \
    -k "${GPU_TEST_FILTER-fused or rerope_raw or decode}" > "$R/gpu_tests.log" 2>&1
tail -n 4 "$R/gpu_tests.log" | tee -a "$R/close.log"; log "GPU tests done"
timeout ${PROBE_TIMEOUT:-120} python3 perf/probe_preturn.py --out "$R/preturn_h200.json" \
    > "$R/preturn.log" 2>&1; tail -n 3 "$R/preturn.log"; log "probe done"
IMPLS=rerope_raw,rerope_rotated,rope_sdpa_cudnn
timeout ${BENCH_TIMEOUT:-120} python3 -m kernels.bench --reps 10 --impl $IMPLS --causal true \
    --dtype float16 --out /tmp/bench_f16.json > "$R/bench_f16.log" 2>&1
timeout 60 python3 -m kernels.bench --skip-check --reps 10 --impl $IMPLS --causal true \
    --dtype bfloat16 --n 8192 --out /tmp/bench_bf16.json > "$R/bench_bf16.log" 2>&1
python3 perf/merge_bench.py "$R/bench_h200.json" book/data/bench_h200.json \
    /tmp/bench_f16.json /tmp/bench_bf16.json | tee -a "$R/close.log"; log "bench done"
timeout ${HF_TIMEOUT:-110} python3 perf/bench_hf.py --out "$R/hf_h200.json" \
    > "$R/hf.log" 2>&1; tail -n 12 "$R/hf.log"; log "HF benchmark done"
