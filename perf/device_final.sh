#!/bin/bash
# A session's closing device call (carry .whl): GPU tests of the fused op and the decode kernel
# ($GPU_TEST_FILTER), optionally (PRETURN_PROBE=1) perf/probe_preturn.py into
# book/data/preturn_h200.json, the benchmark rows of $IMPLS (fp16 N sweep, bf16 at N=8192) merged
# into book/data/bench_h200.json, optionally (HF_BENCH=1) the Hugging Face benchmark, then the
# notebooks named in $NOTEBOOKS executed on the GPU in three parallel groups. Everything comes
# back as one archive, $OUT/final.tgz, plus final.log (the device tool returns at most 8 files:
# everything else goes into the archive). GPU_TESTS=0 skips step 1, BENCH=0 step 2.
# Session 5's two calls (issues 11 and 13). The first (its log: perf/runs/device_close.log; it
# ran as a script of its own, since folded in here, without the parallel warm-up):
#   GPU_TEST_FILTER="fused or rerope_raw or decode" TEST_WORKERS=8 PRETURN_PROBE=1 \
#   IMPLS=rerope_raw,rerope_rotated,rope_sdpa_cudnn HF_BENCH=1 bash perf/device_final.sh
# The last (the five-tensor GPU tests, the Hugging Face benchmark, the chapters whose outputs
# changed):
#   GPU_TEST_FILTER="not fused and not rerope_raw and not 128k and not graph_replay" \
#   TEST_WORKERS=8 BENCH=0 HF_BENCH=1 HF_TIMEOUT=150 NB_TIMEOUT=300 NOTEBOOKS="book/04_three_regions.ipynb \
#     book/06_speed.ipynb book/07_fused_rotation.ipynb book/08_decoding.ipynb \
#     book/09_huggingface.ipynb" bash perf/device_final.sh
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm /tmp/logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/final.log"
start=$(date +%s)
IMPLS=${IMPLS:-rerope,rerope_raw,rerope_rotated,sdpa_cudnn,rope_sdpa_cudnn,rope_inputs}
# 1. GPU tests and cache warm-up, in parallel
if [ "${GPU_TESTS:-1}" = 1 ]; then
GPU_TEST_REPORT=/tmp/logs/gpu_tests.json timeout ${TEST_TIMEOUT:-200} python3 -m pytest \
    tests/test_gpu.py tests/test_decode.py -m gpu -q -p no:cacheprovider \
    -n ${TEST_WORKERS:-4} -k "${GPU_TEST_FILTER-fused_large or decode}" \
    > /tmp/logs/gpu_tests.log 2>&1 &
fi
[ "${BENCH:-1}" = 1 ] && for dtype in float16 bfloat16; do
    timeout ${WARM_TIMEOUT:-150} python3 -m benchmarks.attention --skip-check --reps 1 \
        --impl rerope,rerope_raw,rerope_rotated --dtype $dtype --causal true \
        --out /tmp/warm/$dtype.json > /tmp/warm/$dtype.log 2>&1 &
done
wait
[ -f /tmp/logs/gpu_tests.log ] && tail -n 25 /tmp/logs/gpu_tests.log | tee -a "$OUT/final.log"
echo "tests + warm-up done in $(( $(date +%s) - start )) s" | tee -a "$OUT/final.log"
# 1b. optional (PRETURN_PROBE=1): keys turned in registers against turned once (chapter 7)
if [ -n "$PRETURN_PROBE" ]; then
    timeout ${PROBE_TIMEOUT:-120} python3 perf/probe_preturn.py \
        --out book/data/preturn_h200.json > /tmp/logs/preturn.log 2>&1
    tail -n 3 /tmp/logs/preturn.log | tee -a "$OUT/final.log"
fi
# 2. the benchmark rows
if [ "${BENCH:-1}" = 1 ]; then
timeout ${BENCH_TIMEOUT:-150} python3 -m benchmarks.attention --reps 10 --impl $IMPLS --causal true \
    --dtype float16 --out /tmp/bench_f16.json > /tmp/logs/bench_f16.log 2>&1
timeout 60 python3 -m benchmarks.attention --skip-check --reps 10 --impl $IMPLS --causal true \
    --dtype bfloat16 --n 8192 --out /tmp/bench_bf16.json > /tmp/logs/bench_bf16.log 2>&1
grep -E "check|N=8192|N=2048" /tmp/logs/bench_f16.log | tee -a "$OUT/final.log"
python3 perf/merge_bench.py book/data/bench_h200.json book/data/bench_h200.json \
    /tmp/bench_f16.json /tmp/bench_bf16.json | tee -a "$OUT/final.log"
echo "bench done in $(( $(date +%s) - start )) s" | tee -a "$OUT/final.log"
fi
# 2b. optional (HF_BENCH=1): the Hugging Face model benchmark of issue 11 into book/data/
if [ -n "$HF_BENCH" ]; then
    python3 -m pip show transformers | head -2 | tee -a "$OUT/final.log"
    timeout ${HF_TIMEOUT:-280} python -m benchmarks.hf --out book/data/hf_h200.json 2>&1 | tee /tmp/logs/hf.log \
        | tail -n 30 | tee -a "$OUT/final.log"
fi
# 3. the notebooks, three groups in parallel
set -- $NOTEBOOKS
groups=("" "" "")
i=0; for nb in "$@"; do groups[$((i % 3))]="${groups[$((i % 3))]} $nb"; i=$((i + 1)); done
for g in 0 1 2; do
    [ -n "${groups[$g]}" ] && timeout ${NB_TIMEOUT:-240} python3 tools/execute_notebooks.py \
        ${groups[$g]} > /tmp/logs/nb_$g.log 2>&1 &
done
wait
cat /tmp/logs/nb_*.log | grep -v "without encryption" | tail -n 40 | tee -a "$OUT/final.log"
echo "all done in $(( $(date +%s) - start )) s" | tee -a "$OUT/final.log"
tar czf "$OUT/final.tgz" book/*.ipynb book/data/bench_h200.json book/data/hf_h200.json \
    book/data/preturn_h200.json /tmp/bench_f16.json /tmp/bench_bf16.json /tmp/logs 2>/dev/null
