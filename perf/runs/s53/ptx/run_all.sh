#!/usr/bin/env bash
# Capture + compile (sm_90, Triton 3.6, CPU only) the launches of one rerope_attention fwd+bwd,
# new package (REROPE_AUTOTUNE=0: first config) and old package (as in device_ab.sh: only
# REROPE_AUTOTUNE=0 set, which the old package does not read -> it autotunes; every candidate
# compiled, tag "candidate"), N = 16384 and 32768, D=128, non-causal (and causal at 32768).
cd "$(dirname "$0")/../../../.."
OUT=perf/runs/s53/ptx/out
PY=/work/venv36/bin/python
for N in 32768 16384; do for dt in bfloat16 float16; do for causal in false true; do
  [ $causal = true ] && [ $N = 16384 ] && continue
  tag=N${N}_${dt}_c${causal}
  REROPE_AUTOTUNE=0 PYTHONPATH=kernels $PY perf/runs/s53/ptx/capture.py new $N $dt $causal $OUT/new_$tag > $OUT/new_$tag.log 2>&1
  REROPE_AUTOTUNE=0 ALL_CANDIDATES=1 PYTHONPATH=.dev/b98/pkg $PY perf/runs/s53/ptx/capture.py old $N $dt $causal $OUT/old_$tag > $OUT/old_$tag.log 2>&1
  echo "$tag done rc=$?"
done; done; done
