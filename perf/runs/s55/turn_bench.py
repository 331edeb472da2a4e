"""The operand turn of `rerope` from rotated q, k (rotary._turn_operands_kernel) at B1 H32 (and
8 key heads) N8192 W2048, fp16: GB/s of each tiling (rows per program, heads per program,
warps), each checked bit for bit against one head per program (the tiling before session 55).
Writes turn_bench.json to the folder given (default $OUT)."""
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

from rerope import attention
from rerope.rotary import _turn_operands_kernel

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"]
rows = []
torch.manual_seed(0)
for d in (64, 128):
    ops = attention._rotations(8192, d, 10000.0, 2048, None, None, True, "cuda")
    tab_in, off_in, tab_out, off_out = ops.tables
    f = ops.flags
    for what, heads, shift in (("q", 32, f["SHIFT_OUT"]), ("k", 32, False), ("k", 8, False)):
        x = torch.randn(1, heads, 8192, d, device="cuda", dtype=torch.float16)
        tail = ((tab_out, off_out, tab_in, off_in), x.stride(), heads, 8192, 0, 0.0)
        want = None
        for block, group, warps in ((64, 1, 4), (64, 2, 4), (64, 4, 4), (64, 8, 4), (32, 4, 4),
                                    (32, 8, 4), (128, 4, 4), (128, 4, 8), (64, 4, 8), (16, 8, 2)):
            if heads % group:
                continue
            y = torch.empty_like(x)
            grid = (heads // group, triton.cdiv(8192, block))
            run = lambda: _turn_operands_kernel[grid](
                x, y, x, *tail, HEAD_DIM=d, BLOCK=block, HEADS=group, LOGN=False,
                FIRST=(f["TURN_OUT"], shift), SECOND=None, num_warps=warps)
            run()
            if want is None:
                want = y.clone()
            same = bool(torch.equal(y, want))
            ms = do_bench(run, warmup=25, rep=200)
            gbs = 2 * x.numel() * 2 / ms / 1e6
            rows.append(dict(d=d, tensor=what, heads=heads, block=block, heads_per_program=group,
                             warps=warps, ms=ms, gb_s=gbs, equal_to_one_head=same))
            print(rows[-1], flush=True)
with open(os.path.join(out_dir, "turn_bench.json"), "w") as fh:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, rows=rows), fh, indent=1)
