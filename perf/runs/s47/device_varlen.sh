#!/usr/bin/env bash
# Session 47, first device call: every GPU test (issue 34's typed plans, issue 36's paged TMA
# tiles), then benchmarks.varlen (prefill and chunk scenarios) with pages of 64 keys (a page per
# 64-key tile: one descriptor copy per tile), 128 (two tiles a page) and 16 (a tile spans four
# pages: pointer loads, as before this change).
#   OUT=$OUT bash perf/runs/s47/device_varlen.sh
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0 PYTHONPATH="kernels:.${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$OUT/versions.txt"
t0=$(date +%s)
timeout "${TEST_CAP:-300}" python3 -m pytest tests -m gpu -q -rA -p no:cacheprovider \
    -n "${WORKERS:-8}" --dist load > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
for page in 64 128 16; do
    t0=$(date +%s)
    timeout 120 python3 -m benchmarks.varlen --page-size "$page" --out "$OUT/varlen_p$page.json" \
        > "$OUT/varlen_p$page.log" 2>&1
    echo "varlen page $page rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
done
tail -n 3 "$OUT/gpu_tests.txt"; grep -h "FAILED\|ERROR" "$OUT/gpu_tests.txt" | head -20
grep -h "over\|paged" "$OUT"/varlen_p*.log | tail -n 30
