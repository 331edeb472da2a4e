"""``torch.compile(fullgraph=True)`` of a fused-QKV attention block (``tests/test_generation.py``'s
``Block``: one ``Linear`` for q, k, v, viewed and permuted, ``rerope.rerope``, an output
projection), forward + backward, against eager: the largest differences of the output and every
gradient, and the time of a training step of each (CUDA events, median); with ``--profile``,
the GPU time per step of each one's ten costliest kernels (``torch.profiler``), to see where
the two differ. Each step is timed twice: alone (a sync after each, so the host's latency before
the first kernel counts: ``*_ms``) and back to back as a training loop runs them (20 steps, one
sync: ``*_pipelined_ms``). ``--reduce-overhead`` adds the block compiled with
``mode="reduce-overhead"`` (the training step replayed as CUDA graphs). ``--stock`` runs the same
block with plain RoPE in torch and SDPA instead of ``rerope.rerope`` (rows ``impl: "stock"``):
what compiling costs or saves a model without ReRoPE on the same host. Run on a GPU::

    REROPE_AUTOTUNE=0 python3 perf/compile_block.py --out perf/runs/compile_block_h200.json
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


class StockBlock(Block):
    """:class:`Block` with plain RoPE (torch, rotate-half convention, base 10000) and SDPA's
    causal attention in place of ``rerope.rerope``: the stock model's block."""

    def forward(self, x):
        b, n, dim = x.shape
        d = dim // self.heads
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=x.device).float() / d)
        angles = torch.arange(n, device=x.device).float()[:, None] * inv_freq
        cos, sin = (f(torch.cat((angles, angles), -1)).to(x.dtype) for f in (torch.cos, torch.sin))

        def rope(t):
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat((-t2, t1), -1) * sin
        out = torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, dim))


def step_results(block, x):
    block.zero_grad()
    x = x.detach().requires_grad_()
    out = block(x)
    out.float().square().mean().backward()
    return {"out": out.detach(), "dx": x.grad,
            **{name: p.grad.clone() for name, p in block.named_parameters()}}


def pipelined_ms(fn, steps=20, reps=5):
    """Median GPU ms per step of ``steps`` back-to-back calls of ``fn()`` (one sync per rep)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return sorted(times)[len(times) // 2]


def reduce_overhead(block, x, eager_r):
    """The block compiled with ``mode="reduce-overhead"``: its differences to eager and step
    times (``torch.compiler.cudagraph_mark_step_begin()`` before each step, as the graphs'
    outputs are overwritten by the next replay)."""
    graphed = copy.deepcopy(block)
    graphed.forward = torch.compile(graphed.forward, fullgraph=True, mode="reduce-overhead")

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        return step_results(graphed, x)
    for _ in range(3):                     # warm-up runs, then the recorded graph
        step()
    got = {k: t.clone() for k, t in step().items()}
    return {"reduce_overhead_max_abs_diff": {
                k: (got[k].float() - eager_r[k].float()).abs().max().item() for k in eager_r},
            "reduce_overhead_ms": event_ms(step), "reduce_overhead_pipelined_ms": pipelined_ms(step)}


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
    parser.add_argument("--host-profile", action="store_true",
                        help="print the eager step's costliest host calls (torch.profiler)")
    parser.add_argument("--stock", action="store_true",
                        help="also the block with torch RoPE + SDPA (rows impl='stock')")
    parser.add_argument("--reduce-overhead", action="store_true",
                        help='also mode="reduce-overhead" (CUDA graphs of the training step)')
    args = parser.parse_args()
    rows = []
    kinds = [("rerope", Block)] + ([("stock", StockBlock)] if args.stock else [])
    for dtype, (impl, kind) in ((getattr(torch, name), k) for name in args.dtypes.split(",")
                                for k in kinds):
        torch.manual_seed(0)
        block = kind(args.dim, args.heads, window=1024).to("cuda", dtype)
        x = torch.randn(1, args.n, args.dim, device="cuda", dtype=dtype)
        compiled = copy.deepcopy(block)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        eager_r, compiled_r = step_results(block, x), step_results(compiled, x)
        diffs = {k: (compiled_r[k].float() - eager_r[k].float()).abs().max().item()
                 for k in eager_r}
        scale = {k: eager_r[k].float().abs().max().item() for k in eager_r}
        row = dict(impl=impl, dtype=str(dtype).replace("torch.", ""), N=args.n, dim=args.dim,
                   heads=args.heads, max_abs_diff=diffs, max_abs=scale,
                   eager_ms=event_ms(lambda: step_results(block, x)),
                   compiled_ms=event_ms(lambda: step_results(compiled, x)))
        if args.profile:
            row["kernels_eager"] = kernel_table(lambda: step_results(block, x))
            row["kernels_compiled"] = kernel_table(lambda: step_results(compiled, x))
        row["eager_pipelined_ms"] = pipelined_ms(lambda: step_results(block, x))
        row["compiled_pipelined_ms"] = pipelined_ms(lambda: step_results(compiled, x))
        if args.host_profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step_results(block, x)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                            max_name_column_width=60), flush=True)
        if args.reduce_overhead:
            try:
                row.update(reduce_overhead(block, x, eager_r))
            except Exception as error:   # reported in the row: the recipe may not apply
                row["reduce_overhead_error"] = f"{type(error).__name__}: {str(error)[:300]}"
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
