"""A fused-QKV attention block eager, under ``torch.compile`` and under ``torch.compile(mode=
"reduce-overhead")`` (CUDA graphs): forward, and forward + backward. Run on a GPU from the
repository root, with ``rerope`` importable (``PYTHONPATH=kernels:.`` in a checkout)::

    REROPE_AUTOTUNE=0 python -m benchmarks.compile_block --out book/data/compile_h200.json
    python -m benchmarks.compile_block --tiny --out /tmp/compile_block.json   # CPU, this script

The block (issue 37, as ``tests/test_generation.py``'s ``Block``): ``Linear(512, 1536)`` → view
and permute (q, k, v strided views of one buffer) → ``rerope.rerope(window=256)`` →
``Linear(512, 512)``; B=2, 8 heads of 64, fp16, N = 1024 and 4096 (``--n``). Modes: ``fwd``
(under ``torch.no_grad()``) and ``fwd+bwd`` (a training step: gradients set to ``None``,
forward, ``out.float().square().mean().backward()``). Compiled: ``torch.compile(block,
fullgraph=True)`` (Inductor, default mode) and the same with ``mode="reduce-overhead"``
(``torch.compiler.cudagraph_mark_step_begin()`` before each step). Each is checked against
eager first (``max_abs_diff`` of the output). The yardstick, ``stock_*``: the same three
variants of the same block with RoPE in torch and causal SDPA instead of ``rerope`` (what
compiling does to a block without our ops; ``stock_*_vs_eager`` against ``stock_eager_ms``);
the floor, ``floor_*``: the block with no attention at all (``q * 2`` in its place), what
compiling does to the rest of the block (its guards, wrappers and two GEMMs).

Times (ms, median, :func:`benchmarks.harness.event_times_ms`): ``*_ms`` one step at a time, a
synchronisation after each, so the host's latency before the first kernel counts (what a
single call costs); ``*_pipelined_ms`` 20 steps back to back, one synchronisation (what a
training loop sees: the host's time per step wherever it exceeds the GPU's); on a GPU
``*_host_us`` the host's own time per step (median µs until the call returns, the GPU idle at
its start: what compiling adds or removes on the host). With
``--profile`` (default on a GPU) the JSON's ``kernels`` holds, per N and mode, each variant's
ten costliest GPU kernels per step (``torch.profiler``): what compiling adds or removes around
the ``rerope`` ops; and under ``"<variant> host"`` its 25 costliest Python functions per step
(cProfile, own time). JSON: ``{"meta": {...}, "rows": [{"N", "mode", "eager_ms", "compiled_ms",
"reduce_overhead_ms", "*_pipelined_ms", "max_abs_diff", ...}], "kernels": {...}}``.
"""

import argparse
import copy
import os
import statistics
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import rerope  # noqa: E402
from rerope.rope import rope_frequencies, rotate_half  # noqa: E402

from .harness import environment, event_times_ms, wall_ms, write_results  # noqa: E402


class Block(torch.nn.Module):
    """An attention block as most models write it: ``Linear(dim, 3 dim)`` → view/permute (q, k,
    v strided views of one buffer) → ``rerope.rerope(window, **options)`` → ``Linear(dim,
    dim)``. The tests' compile and overhead checks use it at small sizes. ``attention``:
    ``True`` (ReRoPE), ``"rope_sdpa"`` (the stock block: RoPE in torch from cos/sin tables
    built once, then causal ``F.scaled_dot_product_attention``; the yardstick for what
    compiling does to any such block) or ``False`` (``q * 2`` where the attention was)."""

    def __init__(self, dim=512, heads=8, window=256, attention=True, **options):
        super().__init__()
        self.heads, self.window, self.options, self.attention = heads, window, options, attention
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.rope_cache = {}

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "rope_sdpa":
            cos, sin = self._rope_tables(n, dim // self.heads, x)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.attention:
            out = rerope.rerope(q, k, v, self.window, **self.options)
        else:
            out = q * 2
        return self.proj(out.transpose(1, 2).reshape(b, n, dim))

    def _rope_tables(self, n, head_dim, like):
        """``(cos, sin)`` ``(n, head_dim)`` in ``like``'s dtype, built once per length (as models
        keep them in a buffer)."""
        key = (n, head_dim, like.dtype, like.device)
        if key not in self.rope_cache:
            angles = (torch.arange(n, dtype=torch.float64, device=like.device)[:, None]
                      * rope_frequencies(head_dim, device=like.device)[None, :])
            angles = torch.cat((angles, angles), dim=-1)
            self.rope_cache[key] = (angles.cos().to(like.dtype), angles.sin().to(like.dtype))
        return self.rope_cache[key]


# The blocks a variant's name prefix runs (Block's ``attention``): ReRoPE, the stock block,
# and the floor (no attention: what compiling does to the rest of the block).
KINDS = {"": True, "stock_": "rope_sdpa", "floor_": False}


def _split(name):
    """``(prefix, base)`` of a variant's name: ``"stock_compiled"`` → ``("stock_",
    "compiled")``."""
    prefix = next((p for p in KINDS if p and name.startswith(p)), "")
    return prefix, name[len(prefix):]


def step_fn(block, x, mode, graphs=False):
    """One step of ``block`` on ``x``: ``mode`` ``fwd`` (no_grad) or ``fwd+bwd``; ``graphs``:
    a CUDA-graph step is begun first (reduce-overhead)."""
    xg = x.detach().requires_grad_()

    def fwd():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return block(x)

    params = list(block.parameters())

    def fwd_bwd():
        # gradients set to None first, as a training loop's zero_grad(set_to_none=True): an
        # accumulated .grad would be a CUDA-graph output of the last step, which the next
        # replay overwrites ("accessing tensor output of CUDAGraphs that has been overwritten")
        xg.grad = None
        for p in params:
            p.grad = None
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = block(xg)
        out.float().square().mean().backward()
        return out

    return fwd if mode == "fwd" else fwd_bwd


def host_us(step, reps):
    """Median µs until ``step()`` returns, the GPU idle at each start (a synchronisation
    before each call, none inside): the host's own time per step, what the GPU waits for
    where the step is host-bound."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def timed_ms(step, device, reps):
    """``(one step at a time, back to back)``: median ms."""
    for _ in range(3):
        step()
    if device != "cuda":
        return wall_ms(step, reps, device), wall_ms(step, reps, device)
    single = statistics.median(event_times_ms(step, reps, sync_each=True))

    def window():                                  # 20 steps back to back, one event pair
        for _ in range(20):
            step()

    return single, statistics.median(event_times_ms(window, 5, sync_each=True)) / 20


def host_profile(step, steps=20, top=25):
    """The ``top`` Python functions of ``step()`` by their own time (cProfile): name, calls and
    µs per step (own and cumulative). cProfile slows every call alike: for where, not how
    much."""
    import cProfile
    import pstats

    step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [dict(function=f"{file.split('site-packages/')[-1]}:{line}({name})"[-120:],
                 calls_per_step=round(calls / steps, 2), own_us=round(own / steps * 1e6, 1),
                 cumulative_us=round(cumulative / steps * 1e6, 1))
            for (file, line, name), (_, calls, own, cumulative, _) in stats.items()]
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def kernel_table(step, steps=3, top=10):
    """The ``top`` GPU kernels of ``step()`` by time: name, µs per step, calls per step."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None)
        if us is None:
            us = event.cuda_time_total
        if us > 0:
            rows.append(dict(name=event.key[:100], us_per_step=round(us / steps, 1),
                             calls_per_step=event.count / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def measure(n, mode, device, dtype, batch, dim, heads, window, reps, profile, variants):
    """One row (and its kernel tables) for ``n`` and ``mode``."""
    import torch._dynamo

    torch.manual_seed(0)
    blocks = {kind: Block(dim, heads, window, attention=kind).to(device=device, dtype=dtype)
              for kind in KINDS.values()}
    x = torch.randn(batch, n, dim, device=device, dtype=dtype)
    row = dict(N=n, mode=mode, B=batch, heads=heads, head_dim=dim // heads, window=window,
               dtype=str(dtype).replace("torch.", ""))
    kernels = {}
    wants = {kind: step_fn(block, x, mode)().detach().float() for kind, block in blocks.items()}
    for name in variants:
        torch._dynamo.reset()
        prefix, base = _split(name)
        block, want = blocks[KINDS[prefix]], wants[KINDS[prefix]]
        model = block
        if base != "eager":
            model = copy.deepcopy(block)
            options = ({"mode": "reduce-overhead"} if name.endswith("reduce_overhead")
                       else {})
            model.forward = torch.compile(model.forward, fullgraph=True, **options)
        step = step_fn(model, x, mode, graphs=name.endswith("reduce_overhead"))
        try:
            start = time.time()
            got = step().detach().float().clone()
            if base != "eager":
                row[f"{name}_compile_s"] = round(time.time() - start, 1)
                row[f"{name}_max_abs_diff"] = round((got - want).abs().max().item(), 5)
            single, piped = timed_ms(step, device, reps)
            row[f"{name}_ms"], row[f"{name}_pipelined_ms"] = round(single, 4), round(piped, 4)
            if device == "cuda":
                row[f"{name}_host_us"] = round(host_us(step, reps), 1)
            if profile:
                kernels[name] = kernel_table(step)
                kernels[f"{name} host"] = host_profile(step)
        except Exception as error:          # recorded; the other variants go on
            row[f"{name}_ms"] = None
            row.setdefault("errors", []).append(f"{name}: {traceback.format_exc()[-1500:]}")
            print(row["errors"][-1], flush=True)
            del error
        del model, step
    torch._dynamo.reset()
    for name in variants:
        eager = _split(name)[0] + "eager"
        if name != eager and row.get(f"{name}_ms") and row.get(f"{eager}_ms"):
            row[f"{name}_vs_eager"] = round(row[f"{name}_ms"] / row[f"{eager}_ms"], 3)
    return row, kernels


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_block",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="book/data/compile_h200.json")
    parser.add_argument("--n", default="1024,4096", help="sequence lengths, comma-separated")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel tables")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU (Triton's interpreter): a 2-head block at N=32, eager and "
                             "compiled only (tests this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny or device == "cpu":
        shape = dict(batch=1, dim=128, heads=2, window=16, dtype=torch.float32)
        lengths, reps, profile = [32], 2, False
        variants = ("eager", "compiled", "stock_eager", "stock_compiled", "floor_eager",
                    "floor_compiled")
    else:
        shape = dict(batch=2, dim=512, heads=8, window=256, dtype=torch.float16)
        lengths = [int(n) for n in args.n.split(",")]
        variants = tuple(prefix + base for prefix in KINDS
                         for base in ("eager", "compiled", "reduce_overhead"))
        reps = args.reps
        profile = not args.no_profile
    meta = {**environment(device), "rerope_autotune": rerope.config().autotune,
            "block": f"Linear({shape['dim']}, {3 * shape['dim']}) -> view/permute -> "
                     f"rerope(window={shape['window']}) -> Linear({shape['dim']}, "
                     f"{shape['dim']}), B={shape['batch']}, {shape['heads']} heads of "
                     f"{shape['dim'] // shape['heads']}, {str(shape['dtype'])[6:]}",
            "timing": "*_ms: median of single steps, synchronised after each; "
                      "*_pipelined_ms: 20 steps back to back, median of 5"}
    rows, kernels = [], {}
    t0 = time.time()
    for n in lengths:
        for mode in args.modes.split(","):
            row, tables = measure(n, mode, device, shape["dtype"], shape["batch"], shape["dim"],
                                  shape["heads"], shape["window"], reps, profile, variants)
            rows.append(row)
            if tables:
                kernels[f"N={n} {mode}"] = tables
            print(f"{time.time() - t0:5.0f} s  {row}", flush=True)
            write_results(args.out, rows, meta, kernels=kernels)
    meta["seconds"] = round(time.time() - t0)
    write_results(args.out, rows, meta, kernels=kernels)


if __name__ == "__main__":
    main()
