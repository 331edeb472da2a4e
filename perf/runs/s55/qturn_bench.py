"""`rerope` from rotated q, k through the Gluon forward at B1 H32 N8192 W2048 (D 64/128, fp16 and
bf16), three ways in one process: the turn of both q and k by a pass and the five-tensor kernel
(session 54's path), the keys by a pass and the queries in the kernel (Q_TURN, session 55's),
and the kernel alone on turned tensors; against cuDNN plain attention. Checks the new path's
output and LSE against the old one's. Writes qturn_bench.json to the folder given."""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from rerope import attention, hopper
from rerope.rotary import turn_operands

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"]
B, H, N, W = 1, 32, 8192, 2048
rows = []
torch.manual_seed(0)
for d in (64, 128):
    ops = attention._rotations(N, d, 10000.0, W, None, None, True, "cuda")
    q_turns, k_turns = attention._turn_specs(ops, 0, True)
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        scale = 1 / math.sqrt(d)
        five = hopper.Forward(q, k, W, scale)
        turned = hopper.Forward(q, k, W, scale,
                                q_turn=hopper.query_turn(q_turns[0], q_turns[1], q_turns[3]))

        def old():
            return five(*turn_operands(q, *q_turns), *turn_operands(k, *k_turns), v)

        def new():
            return turned(q, q, *turn_operands(k, *k_turns), v)

        q1, q2 = turn_operands(q, *q_turns)
        k1, k2 = turn_operands(k, *k_turns)

        def kernel_only():
            return five(q1, q2, k1, k2, v)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        (o_old, l_old), (o_new, l_new) = old(), new()
        row = dict(d=d, dtype=str(dtype).replace("torch.", ""),
                   max_out_diff=float((o_old.float() - o_new.float()).abs().max()),
                   max_lse_diff=float((l_old - l_new).abs().max()),
                   out_equal=bool(torch.equal(o_old, o_new)))
        for name, fn in (("cudnn", cudnn), ("old", old), ("new", new),
                         ("kernel_only", kernel_only), ("cudnn_again", cudnn)):
            row[name + "_ms"] = do_bench(fn, warmup=25, rep=200)
        for name in ("old", "new", "kernel_only"):
            row[name + "_ratio"] = row["cudnn_ms"] / row[name + "_ms"]
        rows.append(row)
        print(row, flush=True)
with open(os.path.join(out_dir, "qturn_bench.json"), "w") as fh:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, shape=dict(B=B, H=H, N=N, window=W), rows=rows),
              fh, indent=1)
