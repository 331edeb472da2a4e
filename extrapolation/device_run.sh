#!/bin/bash
# The GPU run behind chapter 10, in one call: train, evaluate, execute the chapter.
#   bash extrapolation/device_run.sh         (carry .whl: the Jupyter wheels, see tools/execute_notebooks.py)
# Environment: STEPS (optimizer steps, default 2000: the stored run) or TRAIN_SECONDS, SEED (default 0). Everything comes back under $OUT:
# the four files train.py writes, the evaluation JSON, the executed notebook and run.log.
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Triton compiles the evaluation's kernel variants on the CPU while the GPU trains.
python3 -m extrapolation.evaluate --warmup > /tmp/warmup.log 2>&1 &
warm=$!
if [ -n "$TRAIN_SECONDS" ]; then budget="--seconds $TRAIN_SECONDS"; else budget="--steps ${STEPS:-2000}"; fi
python3 -m extrapolation.train --seed "${SEED:-0}" $budget || exit 1
cp book/data/extrapolation_model.safetensors book/data/extrapolation_heldout.safetensors \
   book/data/extrapolation_split.json book/data/extrapolation_training.json "$OUT"/
wait $warm; cat /tmp/warmup.log
python3 -m extrapolation.evaluate || exit 1
cp book/data/extrapolation_h200.json "$OUT"/
timeout 150 python3 tools/execute_notebooks.py book/10_extrapolation.ipynb 2>&1 \
    | grep -v "without encryption"
cp book/10_extrapolation.ipynb "$OUT"/
