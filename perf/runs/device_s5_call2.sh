#!/bin/bash
# Device call 2 (session 5 of 2026-12-02): the key turn's launch bound in the plans, and no turn
# for a product with no tile (Nk <= w). GPU tests of the pre-turned paths; the pre-turn probe
# (book/data/preturn_h200.json) to choose PRETURN_MIN_KEYS; the N=2048 variants with kernel
# tables; host time per call with cProfile tables. Everything under $OUT as <= 8 files.
set -o pipefail
export PYTHONUNBUFFERED=1 KERNELS_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/warm /tmp/keep
start=$(date +%s)
stamp() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
for d in 64 128; do
    timeout 200 python3 perf/probe_preturn.py --d $d --out /tmp/warm/pre-$d.json \
        > /tmp/warm/pre-$d.log 2>&1 &
done
for i in 0 2; do
    timeout 200 python3 perf/probe_short_n.py warm --index $i > /tmp/warm/probe-$i.log 2>&1 &
done
timeout 230 python3 -m pytest -m gpu -q -n 5 -p no:cacheprovider tests/test_fused.py \
    tests/test_plans.py "tests/test_gpu.py::test_fused_large" -k "not bfloat16" \
    > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; stamp tests
wait; stamp warm
timeout 150 python3 perf/probe_preturn.py --out "$OUT/preturn_h200.json" > /tmp/keep/preturn.log 2>&1
python3 - "$OUT/preturn_h200.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["N"], r["D"], r["rotated"], r["dtype"], r["Hkv"], round(r["in_registers_ms"], 4),
          round(r["preturn_ms"], 4), r["speedup"], r["max_diff_rel"])
PY
stamp preturn
timeout 100 python3 perf/probe_short_n.py time --variants 2 --out /tmp/keep/short_n.json \
    > /tmp/keep/short_n.log 2>&1
python3 - /tmp/keep/short_n.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["impl"], r["window"], r.get("config"), r.get("tma"), r.get("preturn"),
          r.get("bench_ms"), r.get("graph_us"), r.get("stream_us"), r.get("error", ""))
    for k in r.get("kernels", []):
        print("    ", k)
PY
stamp probe
HOST_PROFILE=/tmp/keep/prof timeout 60 python3 perf/host_h200.py --out /tmp/keep/host.json \
    --label s5-call2 > /tmp/keep/host.log 2>&1; cat /tmp/keep/host.log; stamp host
tar -C /tmp/keep -czf "$OUT/keep.tgz" .
