"""One GPU probe of the fused-rotation op ``rerope.rerope`` (rotation inside the kernels).

    python perf/probe_fused.py check --dtype float16 --d 64 --out check.json   # correctness
    python perf/probe_fused.py time --out time.json                            # timings

``check``: forward and ``dq, dk, dv`` of ``rerope.rerope`` (raw and rotated inputs, causal
and not, chunked prefill ``Nq < Nk``, Leaky + log-n) at N = 8192, W = 2048 against the float32
reference on the GPU, and the same for the five-tensor route (``rerope_inputs`` rounded to the
input dtype, then ``rerope_attention``): the error the fused rotation removes.
``time``: the headline shape (B=1 H=32 N=8192 W=2048, causal, fp16) for the five-tensor op,
``rerope`` from raw and from rotated inputs, plain RoPE + cuDNN, cuDNN alone; forward and
forward + backward (``benchmarks.attention.measure_case``), the short-sequence row N=2048, and the
host time of one call (a tiny shape, many calls, one synchronisation).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rerope  # noqa: E402
from benchmarks import attention as bench, reference  # noqa: E402
from rerope.rope import apply_rope, rerope_inputs  # noqa: E402


def errors(got, want):
    got, want = got.detach().float(), want.detach().float()
    return {"scaled": ((got - want).abs().max() / want.abs().max()).item(),
            "rel_norm": ((got - want).norm() / want.norm()).item(),
            "finite": bool(torch.isfinite(got).all())}


def check_case(dtype, d, rotated, causal, n_q, n_k, window, leaky=None, logn_len=None, hq=4,
               hkv=2):
    torch.manual_seed(0)
    q = torch.randn(1, hq, n_q, d, device="cuda")
    k = torch.randn(1, hkv, n_k, d, device="cuda")
    v = torch.randn(1, hkv, n_k, d, device="cuda")
    if rotated:
        pos = torch.arange(n_k, device="cuda", dtype=torch.float64)
        q, k = apply_rope(q, pos[n_k - n_q:]), apply_rope(k, pos)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    dout = torch.randn(1, hq, n_q, d, device="cuda", dtype=dtype)
    kw = dict(causal=causal, leaky=leaky, logn_len=logn_len, rotated=rotated)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = rerope.rerope(*leaves, window, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = reference.rerope(*ref_leaves, window, **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    row = {"dtype": str(dtype).split(".")[-1], "D": d, "rotated": rotated, "causal": causal,
           "Nq": n_q, "Nk": n_k, "window": window, "leaky": leaky, "logn_len": logn_len,
           "Hq": hq, "Hkv": hkv, "fused": {}, "five_tensor": {}}
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        row["fused"][name] = errors(a, b)
    # the five-tensor route: q1..k2 rounded to the input dtype before the kernel
    if n_q == n_k:
        leaves5 = [t.clone().requires_grad_() for t in (q, k, v)]
        five = rerope_inputs(leaves5[0], leaves5[1], window, leaky=leaky, logn_len=logn_len,
                             rotated=rotated)
        out5 = rerope.rerope_attention(*five, leaves5[2], window, causal=causal)
        grads5 = torch.autograd.grad(out5, leaves5, dout)
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out5, *grads5), (ref, *ref_grads)):
            row["five_tensor"][name] = errors(a, b)
    del ref, ref_grads, ref_leaves
    torch.cuda.empty_cache()
    return row


def run_check(args):
    dtype = getattr(torch, args.dtype)
    rows = []
    cases = [dict(rotated=False, causal=True), dict(rotated=True, causal=True),
             dict(rotated=False, causal=False), dict(rotated=True, causal=False),
             dict(rotated=True, causal=True, n_q=1000),
             dict(rotated=False, causal=True, leaky=16.0, logn_len=4096.0),
             dict(rotated=True, causal=True, leaky=16.0, logn_len=4096.0)]
    for case in cases:
        n_q = case.pop("n_q", args.n)
        start = time.time()
        row = check_case(dtype, args.d, n_q=n_q, n_k=args.n, window=args.window, **case)
        row["seconds"] = round(time.time() - start, 1)
        rows.append(row)
        worst = max(e["scaled"] for e in row["fused"].values())
        worst5 = max((e["scaled"] for e in row["five_tensor"].values()), default=float("nan"))
        print(f"check {args.dtype} D={args.d} rotated={row['rotated']} causal={row['causal']} "
              f"Nq={n_q} leaky={row['leaky']}: fused max scaled err {worst:.2e}, five-tensor "
              f"{worst5:.2e} ({row['seconds']} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)


def host_time(fn, calls=200):
    """Wall time of one call when the GPU work is negligible: enqueue many, sync once."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def run_time(args):
    rows = []
    impls = ["rerope", "rerope_raw", "rerope_rotated", "sdpa_cudnn", "rope_sdpa_cudnn"]
    grid = [(n, d, mode) for d in (64, 128) for n in (8192,) for mode in bench.MODES]
    grid += [(2048, 64, "fwd"), (2048, 64, "fwd+bwd")]
    if os.environ.get("PROBE_GRID") == "short":
        grid = [(2048, 64, "fwd")]
    for n, d, mode in grid:
        for impl in impls:
            shape = bench.Shape(1, 32, n, d, 2048, "float16", True)
            ms, peak, _ = bench.measure_case(impl, mode, shape, reps=20)
            rows.append(dict(impl=impl, mode=mode, N=n, D=d, ms=ms, peak_gb=peak / 1e9))
            print(f"time {impl:16s} {mode:8s} N={n} D={d}: {ms:.3f} ms  {peak / 1e9:.2f} GB",
                  flush=True)
    host = {}
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    five = rerope_inputs(q, k, 64)
    host["rerope_raw_fwd"] = host_time(lambda: rerope.rerope(q, k, v, 64))
    host["rerope_attention_fwd"] = host_time(lambda: rerope.rerope_attention(*five, v, 64))
    host["sdpa_fwd"] = host_time(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    from rerope import attention
    ops = attention._rotations(128, 64, 10000.0, 64, None, None, False, q.device)
    host["launcher_only_fwd"] = host_time(
        lambda: attention.rerope_forward(q, q, k, k, v, 64, True, 0.125, ops))
    host["custom_op_fwd"] = host_time(
        lambda: attention._fused_fwd(q, k, v, 64, True, 0.125, 10000.0, None, None, False))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    host["rerope_raw_fwd_requires_grad"] = host_time(lambda: rerope.rerope(qg, kg, vg, 64))
    for name, us in host.items():
        print(f"host {name}: {us:.1f} us per call", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "rows": rows, "host_us": host},
                  f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("check", "time"))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    (run_check if args.what == "check" else run_time)(args)


if __name__ == "__main__":
    main()
