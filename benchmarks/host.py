"""Python (host) time per call of the public ops with a cached plan, against SDPA's, at a short
length where the GPU work is negligible: many calls back to back, one synchronisation
(:func:`benchmarks.harness.back_to_back_us`). Run on a GPU from the repository root, with
``rerope`` importable (``pip install -e .``, or ``PYTHONPATH=kernels:.`` in a checkout)::

    REROPE_AUTOTUNE=0 python -m benchmarks.host --out book/data/host_h200.json

Shapes (fp16, causal, D=64): ``rerope_fwd`` / ``rerope_fwd_bwd`` B=1 H=32 N=128 from raw q, k;
``rerope_decode`` one query, Hq=32 Hkv=8, a cache of N keys (bf16 as in the Hugging Face
benchmark), against ``F.scaled_dot_product_attention`` on the same tensors (the SDPA backend
torch picks). ``*_fwd``: no gradient (``torch.no_grad``); ``*_fwd_grad``: the forward of inputs
that require grad (the autograd node recorded, no backward); ``op_rerope_fwd`` /
``op_rerope_fwd_bwd``: the custom ops a compiled graph calls (``torch.ops.rerope.rerope_fwd``
and ``rerope_bwd``, no autograd). JSON: ``{"meta": {...}, "rows": [{"impl", "N",
"python_us"}]}``.

``--label`` names the run in ``meta`` (e.g. ``before`` for the same script on an older
``rerope``: the checks below use only what every version has).
"""

import argparse
import os

import torch
import torch.nn.functional as F

import rerope
from rerope import attention, decode

from .harness import back_to_back_us as host_time
from .harness import environment, write_results


CHECKS = {}


def _all_bound():
    """Whether every launcher the op plans and the old per-argument cache keep is bound."""
    launchers = list(attention._LAUNCHERS.values())
    for plan in attention.PLANS.values():
        launchers += attention.plan_launchers(plan)
    return bool(launchers) and all(l.bound for l in launchers)
PROFILE = os.environ.get("HOST_PROFILE")      # a path prefix: write cProfile tables there


def rows_for(n, calls):
    dev, f16, bf16 = "cuda", torch.float16, torch.bfloat16
    q, k, v = (torch.randn(1, 32, n, 64, device=dev, dtype=f16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def fwd_bwd(fn):
        def run():
            fn().backward(dout)
        return run

    def ours():
        return rerope.rerope(q, k, v, 32)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def op_fwd():
        return torch.ops.rerope.rerope_fwd(q, k, v, 32, True, 0.125, 10000.0, None, None, False)

    def op_fwd_bwd():
        out, lse = op_fwd()
        return torch.ops.rerope.rerope_bwd(dout, q, k, v, out, lse, 32, True, 0.125, 10000.0,
                                           None, None, False)

    qd = torch.randn(1, 32, 1, 64, device=dev, dtype=bf16)
    kd, vd = (torch.randn(1, 8, n, 64, device=dev, dtype=bf16) for _ in range(2))
    timings = {}
    with torch.no_grad():      # a bound launch gives the first (Triton-launched) call's result
        first, first_decode = ours(), rerope.rerope_decode(qd, kd, vd, 32)
        again, again_decode = ours(), rerope.rerope_decode(qd, kd, vd, 32)
        first_op, again_op = op_fwd_bwd(), op_fwd_bwd()
        CHECKS[n] = dict(fwd_equal=bool(torch.equal(first, again)),
                         decode_equal=bool(torch.equal(first_decode, again_decode)),
                         op_equal=all(torch.equal(a, b) for a, b in zip(first_op, again_op)),
                         fwd_bound=_all_bound(),
                         decode_bound=all(p.bound for p in decode.PLANS.values()))
    with torch.no_grad():
        timings["rerope_fwd"] = host_time(ours, calls)
        timings["sdpa_fwd"] = host_time(sdpa, calls)
        timings["rerope_decode"] = host_time(lambda: rerope.rerope_decode(qd, kd, vd, 32), calls)
        timings["sdpa_decode"] = host_time(
            lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), calls)
    with torch.no_grad():
        timings["op_rerope_fwd"] = host_time(op_fwd, calls)
        timings["op_rerope_fwd_bwd"] = host_time(op_fwd_bwd, calls)
    timings["rerope_fwd_grad"] = host_time(ours, calls)
    timings["sdpa_fwd_grad"] = host_time(sdpa, calls)
    timings["rerope_fwd_bwd"] = host_time(fwd_bwd(ours), calls)
    timings["sdpa_fwd_bwd"] = host_time(fwd_bwd(sdpa), calls)
    if PROFILE:                      # where the host time of a call goes (cProfile, cumulative)
        import cProfile
        import io
        import pstats
        for name, fn, grad in (("rerope_fwd_bwd", fwd_bwd(ours), True),
                               ("rerope_fwd", ours, False),
                               ("rerope_decode", lambda: rerope.rerope_decode(qd, kd, vd, 32),
                                False)):
            profiler = cProfile.Profile()
            with torch.set_grad_enabled(grad):
                profiler.runcall(lambda: [fn() for _ in range(100)])
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            with open(f"{PROFILE}_{name}.txt", "w") as f:
                f.write(text.getvalue())
        # torch's profiler sees what cProfile does not: the autograd engine's C++ work, the
        # allocations and launches, each op's host time (ours and SDPA's side by side)
        from torch.profiler import ProfilerActivity, profile
        for name, fn in (("rerope_fwd_bwd", fwd_bwd(ours)), ("sdpa_fwd_bwd", fwd_bwd(sdpa))):
            fn(), torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
            with open(f"{PROFILE}_torch_{name}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                  max_name_column_width=70))
    return [dict(impl=impl, N=n, python_us=round(us, 1)) for impl, us in timings.items()]


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[128])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", default="book/data/host_h200.json")
    parser.add_argument("--label", default="", help="a name for the run, kept in meta")
    args = parser.parse_args()
    rows = [row for n in args.n for row in rows_for(n, args.calls)]
    for row in rows:
        print(row, flush=True)
    env = environment(day=True)
    meta = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
            "date": env["date"], "autotune": rerope.config().autotune,
            "shapes": "fwd, fwd_bwd: B=1 H=32 D=64 fp16 causal, raw q, k, window 32; decode: "
                      "B=1 Hq=32 Hkv=8 D=64 bf16, one query, window 32",
            "unit": f"microseconds of host time per call ({args.calls} calls, one sync)",
            "bound_launch_checks": CHECKS, "label": args.label}
    print(CHECKS, flush=True)
    write_results(args.out, rows, meta)


if __name__ == "__main__":
    main()
