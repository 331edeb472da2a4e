"""``torch.compile(fullgraph=True)`` of a fused-QKV attention block (``tests/test_generation.py``'s
``Block``: one ``Linear`` for q, k, v, viewed and permuted, ``kernels.rerope``, an output
projection), forward + backward, against eager: the largest differences of the output and every
gradient, and the time of a training step of each (CUDA events, median); with ``--profile``,
the GPU time per step of each one's ten costliest kernels (``torch.profiler``), to see where
the two differ. Run on a GPU::

    KERNELS_AUTOTUNE=0 python3 perf/compile_block.py --out perf/runs/compile_block_h200.json
"""

import argparse
import copy
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT, os.path.join(ROOT, "perf")]
# (tests/ first: its conftest.py, not the root's, is what test_generation imports; so it is
# imported before bench_hf, which puts the root first on sys.path)

from test_generation import Block  # noqa: E402
from bench_hf import event_ms  # noqa: E402,I100


def step_results(block, x):
    block.zero_grad()
    x = x.detach().requires_grad_()
    out = block(x)
    out.float().square().mean().backward()
    return {"out": out.detach(), "dx": x.grad,
            **{name: p.grad.clone() for name, p in block.named_parameters()}}


def kernel_table(fn, steps=3, top=10):
    """The ``top`` kernels by GPU time over ``steps`` calls of ``fn``: name, µs per step, calls
    per step."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None)
        if us is None:
            us = event.cuda_time_total
        if us > 0:
            rows.append(dict(name=event.key[:90], us_per_step=round(us / steps, 1),
                             calls_per_step=event.count / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--out", default="perf/runs/compile_block_h200.json")
    parser.add_argument("--profile", action="store_true", help="add the kernel tables")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    args = parser.parse_args()
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        torch.manual_seed(0)
        block = Block(args.dim, args.heads, window=1024).to("cuda", dtype)
        x = torch.randn(1, args.n, args.dim, device="cuda", dtype=dtype)
        compiled = copy.deepcopy(block)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        eager_r, compiled_r = step_results(block, x), step_results(compiled, x)
        diffs = {k: (compiled_r[k].float() - eager_r[k].float()).abs().max().item()
                 for k in eager_r}
        scale = {k: eager_r[k].float().abs().max().item() for k in eager_r}
        row = dict(dtype=str(dtype).replace("torch.", ""), N=args.n, dim=args.dim,
                   heads=args.heads, max_abs_diff=diffs, max_abs=scale,
                   eager_ms=event_ms(lambda: step_results(block, x)),
                   compiled_ms=event_ms(lambda: step_results(compiled, x)))
        if args.profile:
            row["kernels_eager"] = kernel_table(lambda: step_results(block, x))
            row["kernels_compiled"] = kernel_table(lambda: step_results(compiled, x))
        rows.append(row)
        print(json.dumps(row), flush=True)
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "what": __doc__.split("\n")[0],
            "shape": f"B=1 N={args.n} dim={args.dim} heads={args.heads} window=1024 leaky=8"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
