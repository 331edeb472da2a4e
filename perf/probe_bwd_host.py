"""Where the host time of a forward + backward through ``rerope.rerope`` goes (issue 18: the
fwd+bwd target), against SDPA and against the autograd engine's own floor, in one process.

Per call, back to back, one synchronisation at the end (``probe_fused.host_time``); B=1 H=32
N=128 D=64 fp16 causal, raw ``q, k``, window 32 (the shape of ``perf/host_h200.py``: the GPU
work is negligible, so each figure is host time):

* ``{rerope,sdpa,floor}_backward``: ``fn().backward(dout)`` into leaves that accumulate
  ``.grad`` (as ``host_h200.py``'s ``*_fwd_bwd``); ``*_grad``: ``torch.autograd.grad(fn(),
  (q, k, v), dout)`` (no accumulation); ``*_fwd``: the forward alone of inputs that need a
  gradient. ``floor``: a ``torch.autograd.Function`` whose forward and backward only allocate
  their outputs (``empty_like``): what any Python autograd node costs the engine.
* ``rerope_direct_fwd_bwd`` / ``rerope_direct_bwd``: the plan's kept forward and backward
  called without autograd (``attention.rerope_forward`` / ``rerope_backward`` with the plan's
  launchers): our own Python and launches.
* pieces: ``empty`` (one ``torch.empty`` of ``q``'s shape), ``launch`` (one bound launch, the
  δ kernel's kept call), ``scratch`` (the TMA scratch allocator's call).

With ``--n2048``, also the N=2048 forward from raw ``q, k`` with the keys turned in registers
and pre-turned (``attention.PRETURN_MIN_KEYS`` 4096 and 1024, alternating, three rounds; D=64
fp16): ``benchmarks.attention.measure_case``'s figure beside SDPA cuDNN's, and back to back with and
without a gradient; ``--n2048-grid``: D 64 and 128, fp16 and bf16, forward and forward +
backward, ``PRETURN_MIN_KEYS`` 4096 and 2048, two rounds (back to back at D=64 fp16 only).

    REROPE_AUTOTUNE=0 python3 perf/probe_bwd_host.py --n2048 --out F.json
    REROPE_AUTOTUNE=0 python3 perf/probe_bwd_host.py --skip-host --n2048 --n2048-grid --out F.json
"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rerope  # noqa: E402
from rerope import attention, bench  # noqa: E402
from probe_fused import host_time  # noqa: E402

WINDOW = 32
DEFAULT_MIN_KEYS = attention.PRETURN_MIN_KEYS


class _Floor(torch.autograd.Function):
    """The cheapest Python autograd node with three inputs: allocations only."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def host_rows(calls):
    q, k, v = (torch.randn(1, 32, 128, 64, device="cuda", dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    forwards = {"rerope": lambda: rerope.rerope(q, k, v, WINDOW),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "floor": lambda: _Floor.apply(q, k, v)}
    timings = {}
    for name, fn in forwards.items():
        timings[f"{name}_fwd"] = host_time(fn, calls)
        timings[f"{name}_backward"] = host_time(lambda: fn().backward(dout), calls)
        timings[f"{name}_grad"] = host_time(
            lambda: torch.autograd.grad(fn(), (q, k, v), dout), calls)
    plan = next(p for p in attention._OP_PLANS._plans.values() if getattr(p, "grad", False))
    window, causal, scale = plan.settings[:3]

    def forward():
        return attention.rerope_forward(q, q, k, k, v, window, causal, scale, plan.operands,
                                        launchers=plan.launchers)

    def backward(out, lse):
        return attention.rerope_backward(dout, q, q, k, k, v, out, lse, window, causal, scale,
                                         plan.operands, launchers=plan.launchers)

    with torch.no_grad():
        out, lse = forward()
        timings["rerope_direct_fwd_bwd"] = host_time(lambda: backward(*forward()), calls)
        timings["rerope_direct_bwd"] = host_time(lambda: backward(out, lse), calls)
        timings["empty"] = host_time(
            lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device), calls)
        sub = plan.launchers[("backward", *rerope.launch.signature(dout))]
        delta_launcher = next(l for key, l in sub.items() if key[0][0] == "delta")
        delta = torch.empty_like(lse)
        tail = (*attention._strides(out, dout), 32, 128)
        delta_launch = delta_launcher.fixed(*tail)
        timings["launch"] = host_time(lambda: delta_launch(out, dout, delta), calls)
        timings["scratch"] = host_time(lambda: attention._torch_scratch(4096, 128, 0), calls)
    return [dict(impl=impl, N=128, python_us=round(us, 1)) for impl, us in timings.items()]


def n2048_rows(rounds=3, min_keys=(4096, 1024), dims=(64,), dtypes=("float16",), modes=("fwd",),
               host_only=False):
    """The N=2048 forward (and ``modes``) from raw ``q, k`` at each ``attention.
    PRETURN_MIN_KEYS`` of ``min_keys`` in turn, ``rounds`` times, beside SDPA cuDNN's; back to
    back (host time) for the first of ``dims`` and ``dtypes`` only."""
    rows = []
    for r in range(rounds):
        for d in dims:
            for dtype in dtypes:
                shape = bench.Shape(1, 32, 2048, d, 2048, dtype, True)
                first = (d, dtype) == (dims[0], dtypes[0])
                q, k, v = (torch.randn(1, 32, 2048, d, device="cuda", dtype=getattr(torch, dtype))
                           for _ in range(3))
                for keys in min_keys:
                    attention.PRETURN_MIN_KEYS = keys
                    row = dict(round=r, D=d, dtype=dtype, preturn_min_keys=keys)
                    for mode in modes:
                        row[f"bench_ms_{mode}"] = bench.measure_case("rerope_raw", mode, shape,
                                                                     reps=20)[0]
                    for grad in (False, True) if first else ():
                        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
                        row[f"back_to_back_us_grad_{grad}"] = host_time(
                            lambda: rerope.rerope(*leaves, 2048), 200)
                    rows.append(row)
                    print(row, flush=True)
                row = dict(round=r, D=d, dtype=dtype, impl="sdpa_cudnn")
                for mode in modes:
                    row[f"bench_ms_{mode}"] = bench.measure_case("sdpa_cudnn", mode, shape,
                                                                 reps=20)[0]
                if first:
                    row["back_to_back_us"] = host_time(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 200)
                rows.append(row)
                print(rows[-1], flush=True)
    attention.PRETURN_MIN_KEYS = DEFAULT_MIN_KEYS
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--n2048", action="store_true")
    parser.add_argument("--n2048-grid", action="store_true",
                        help="with --n2048: D 64 and 128, fp16 and bf16, fwd and fwd+bwd, "
                             "PRETURN_MIN_KEYS 4096 and 2048, two rounds")
    parser.add_argument("--skip-host", action="store_true", help="only the N=2048 part")
    args = parser.parse_args()
    result = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "doc": __doc__.split("\n")[0]}}
    rounds = []
    for r in range(0 if args.skip_host else 3):     # three rounds: the host's noise is large
        rows = host_rows(args.calls)
        rounds.append(rows)
        print(f"round {r}:", " ".join(f"{row['impl']}={row['python_us']}" for row in rows),
              flush=True)
    result["rows"] = [dict(row, round=r) for r, rows in enumerate(rounds) for row in rows]
    if args.n2048 and args.n2048_grid:
        result["n2048"] = n2048_rows(2, (4096, 2048), (64, 128), ("float16", "bfloat16"),
                                     ("fwd", "fwd+bwd"))
    elif args.n2048:
        result["n2048"] = n2048_rows()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
