#!/bin/bash
# Issue 18's device calls: GPU tests of the plans, bound launches, compiled ops and static-cache
# generation; host time per call (book/data/host_h200.json); the N=2048 benchmark rows; the
# compiled fused-QKV block; the Hugging Face benchmark. Results under $OUT. Stages (1 = run):
#   TESTS (pytest -m gpu of $TEST_FILES), REDUCE (the reduce-overhead generate test, alone, and
#   again without Inductor's static launcher if it fails), HOST (HOST_PROFILE=prefix also
#   writes cProfile tables), BENCH, BLOCK, HF ($HF_ARGS passed to benchmarks/hf.py).
#   Call A (2026-12-01): all stages with defaults. Call C (session 2): REDUCE and HF with
#   HF_ARGS="--impls stock_static_compiled,rerope_static_compiled --skip-checks".
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/generation.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$log"
start=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - start )) s" | tee -a "$log"; }
if [ "${TESTS:-1}" = 1 ]; then
timeout ${TEST_TIMEOUT:-240} python3 -m pytest ${TEST_FILES:-tests/test_generation.py tests/test_decode.py} \
    -m gpu -q -p no:cacheprovider -n 4 -k "${TEST_K:-not reduce_overhead}" > "$OUT/gpu_tests.log" 2>&1
tail -n 8 "$OUT/gpu_tests.log" | tee -a "$log"; stamp tests
fi
if [ "${REDUCE:-1}" = 1 ]; then
timeout 150 python3 -m pytest tests/test_generation.py -m gpu -q -p no:cacheprovider \
    -k reduce_overhead > "$OUT/reduce.log" 2>&1 || \
TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 timeout 150 python3 -m pytest tests/test_generation.py \
    -m gpu -q -p no:cacheprovider -k reduce_overhead > "$OUT/reduce_nsl.log" 2>&1
tail -n 3 "$OUT"/reduce*.log | tee -a "$log"; stamp reduce-overhead
fi
if [ "${HOST:-1}" = 1 ]; then
HOST_PROFILE=${HOST_PROFILE:+$OUT/$HOST_PROFILE} timeout 120 python3 perf/host_h200.py \
    --out "$OUT/host_h200.json" 2>&1 | tee -a "$log"; stamp host
fi
if [ "${BENCH:-1}" = 1 ]; then
timeout 150 python3 -m benchmarks.attention --n 2048 --d 64 --dtype float16 --causal true --reps 20 \
    --impl rerope_raw,sdpa_cudnn,rope_sdpa_cudnn --out "$OUT/bench_n2048.json" 2>&1 \
    | grep -E "check|N=2048" | tee -a "$log"; stamp bench
fi
if [ "${BLOCK:-1}" = 1 ]; then
timeout 200 python3 perf/compile_block.py --out "$OUT/compile_block_h200.json" 2>&1 | tail -n 4 | tee -a "$log"
stamp block
fi
if [ "${HF:-1}" = 1 ]; then
timeout ${HF_TIMEOUT:-260} python -m benchmarks.hf --steps 32 --reps 3 ${HF_ARGS} \
    --out "$OUT/hf_h200.json" > "$OUT/hf.log" 2>&1
if [ $? -eq 139 ]; then          # a segfault (Inductor's static launcher once): again without it
    echo "hf: segfault; again with TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0" | tee -a "$log"
    TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 timeout ${HF_TIMEOUT:-260} python -m benchmarks.hf \
        --steps 32 --reps 3 ${HF_ARGS} --out "$OUT/hf_h200.json" > "$OUT/hf_nsl.log" 2>&1
fi
grep -hE "^ *[0-9]+ s |ratio|Error" "$OUT"/hf*.log | tail -n 20 | tee -a "$log"; stamp hf
fi
