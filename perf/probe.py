"""GPU probe: correctness at full size and first timings of every kernel (one device call).

    python perf/probe.py [--d 64 128] [--causal 1 0] [--dtype float16]

Prints a table; writes JSON to $OUT/probe.json when OUT is set. Not part of the package: it is
the measuring script of perf/NOTES.md.
"""
import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rerope  # noqa: E402
from rerope import attention, reference  # noqa: E402


def bench(fn, reps=30):
    return triton.testing.do_bench(fn, warmup=25, rep=reps * 5, return_mode="median")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--dtype", nargs="+", default=["float16"])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--window", type=int, default=2048)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          flush=True)
    rows = []
    for dname in args.dtype:
        dtype = getattr(torch, dname)
        for d in args.d:
            for causal in map(bool, args.causal):
                t0 = time.time()
                B, H, N, W = 1, args.h, args.n, args.window
                gen = torch.Generator(device="cuda").manual_seed(d + causal)
                q1, q2, k1, k2, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype,
                                                 generator=gen).requires_grad_() for _ in range(5))
                do = torch.randn(B, H, N, d, device="cuda", dtype=dtype, generator=gen)
                ins = (q1, q2, k1, k2, v)
                out = rerope.rerope_attention(*ins, W, causal=causal)
                out.backward(do)
                grads = [t.grad.clone() for t in ins]
                compile_s = time.time() - t0
                # reference on 4 heads (heads are independent), fp32
                hs = slice(0, 4)
                ref_in = [t.detach()[:, hs].float().requires_grad_() for t in ins]
                ref = reference.rerope_attention(*ref_in, W, causal=causal)
                ref.backward(do[:, hs].float())
                errs = {"out": rel_err(out[:, hs], ref)}
                for name, g, r in zip(("dq1", "dq2", "dk1", "dk2", "dv"), grads, ref_in):
                    errs[name] = rel_err(g[:, hs], r.grad)
                del ref, ref_in
                sm = d ** -0.5
                fwd = bench(lambda: attention.rerope_forward(*[t.detach() for t in ins], W, causal, sm))
                o, lse = attention.rerope_forward(*[t.detach() for t in ins], W, causal, sm)
                bwd = bench(lambda: attention.rerope_backward(do, *[t.detach() for t in ins], o, lse,
                                                              W, causal, sm))
                qd, kd, vd = q1.detach(), k1.detach(), v.detach()
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    sd_fwd = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qd, kd, vd, is_causal=causal))
                    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (qd, kd, vd))
                    def sd_step():
                        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                        o.backward(do)
                    sd_fb = bench(sd_step)
                flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
                best = {k: str(attention._autotuned(k, d, torch.cuda.get_device_capability(),
                                                    q1.element_size()).best_config)
                        for k in ("fwd", "dkdv", "dq")}
                row = dict(dtype=dname, D=d, causal=causal, N=N, H=H, W=W, errs=errs,
                           fwd_ms=fwd, bwd_ms=bwd, fwdbwd_ms=fwd + bwd,
                           fwd_tflops=flops / fwd / 1e9, fwdbwd_tflops=3.5 * flops / (fwd + bwd) / 1e9,
                           cudnn_fwd_ms=sd_fwd, cudnn_fwdbwd_ms=sd_fb,
                           first_call_s=compile_s, best=best)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n dtype    D causal | fwd ms (TF/s)  cuDNN | fwd+bwd ms (TF/s)  cuDNN | max rel err")
    for r in rows:
        print(f"{r['dtype']:8s} {r['D']:3d} {int(r['causal']):5d}  | {r['fwd_ms']:.3f} ({r['fwd_tflops']:.0f})"
              f"  {r['cudnn_fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} ({r['fwdbwd_tflops']:.0f})"
              f"  {r['cudnn_fwdbwd_ms']:.3f} | {max(r['errs'].values()):.1e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
