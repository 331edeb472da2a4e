#!/bin/bash
# One device call for the book: execute notebooks on the GPU, then (optionally) GPU tests.
#   bash perf/device_book.sh book/03_online_softmax.ipynb ...   (carry .whl: Jupyter wheels)
# Environment: NB_TIMEOUT (s, default 330), GPU_TEST_FILTER (pytest -k; no tests if unset),
# TEST_TIMEOUT (s, default 200). Results (notebooks, logs, test report) go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
timeout "${NB_TIMEOUT:-330}" python3 tools/execute_notebooks.py "$@" 2>&1 \
    | grep -v "without encryption" | tee "$OUT/notebooks.log"
cp "$@" "$OUT"/
if [ -n "$GPU_TEST_FILTER" ]; then
    GPU_TEST_REPORT=$OUT/gpu_tests.json timeout "${TEST_TIMEOUT:-200}" python3 -m pytest \
        tests/test_gpu.py -m gpu -q -p no:cacheprovider -k "$GPU_TEST_FILTER" 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15
fi
