"""GPU probe for v4: TMA tensor-descriptor loads and the fused score scale, against v3.

    REROPE_AUTOTUNE=0 python perf/probe_tma.py [--d 64 128] [--sweep]

Times, at B=1 H=32 N=8192 W=2048 fp16 causal: v3 (``perf/variants/kernels_v3``, the previous
version: pointer loads, scale applied in its own pass), v4 with pointer loads (``REROPE_TMA=0``)
and v4 with TMA; the same v4 at ``window = N`` (plain causal attention through the same kernels:
what the band costs); and SDPA's cuDNN backend. Checks v4 (both load paths) against a float32
reference on 4 heads first. ``--sweep`` then autotunes the TMA kernels over a wider candidate
list and records every configuration's time (``--sweep-only``: just that). Writes
``$OUT/probe_tma.json``.

v3 is not in the repository's tree any more; recreate it before a comparing run with
``git archive 1d35c38 kernels | tar -x -C perf/variants && mv perf/variants/kernels
perf/variants/kernels_v3`` (``perf/variants/`` is git-ignored: name it in the device call's carry).
"""
import argparse
import json
import os
import sys
import time

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "perf", "variants"))
import rerope  # noqa: E402
from rerope import attention, configs, reference  # noqa: E402
from probe import bench, rel_err  # noqa: E402  (perf/probe.py, beside this script)

SWEEP = {   # extra candidates tried with TMA (BLOCK_M, BLOCK_N, warps, stages)
    "fwd": {64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                 (128, 64, 8, 3), (64, 64, 4, 4)],
            128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3),
                  (128, 64, 8, 4)]},
    "dkdv": {64: [(64, 64, 4, 2), (64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 3),
                  (64, 64, 4, 3)],
             128: [(64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3),
                   (128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 2)]},
    "dq": {64: [(64, 32, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                (128, 64, 8, 2)],
           128: [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                 (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 4, 2), (64, 128, 8, 2)]},
}


def inputs(d, n, h, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ins = [torch.randn(1, h, n, d, device="cuda", dtype=torch.float16, generator=gen)
           for _ in range(5)]
    do = torch.randn(1, h, n, d, device="cuda", dtype=torch.float16, generator=gen)
    return ins, do


def check(d, ins, do, window):
    """v4 forward and gradients vs float32 reference on 4 heads, with the current load path."""
    hs = slice(0, 4)
    small = [t[:, hs].contiguous().requires_grad_() for t in ins]
    out = rerope.rerope_attention(*small, window)
    out.backward(do[:, hs])
    ref_in = [t.detach().float().requires_grad_() for t in small]
    ref = reference.rerope_attention(*ref_in, window)
    ref.backward(do[:, hs].float())
    errs = {"out": rel_err(out, ref)}
    for name, t, r in zip(("dq1", "dq2", "dk1", "dk2", "dv"), small, ref_in):
        errs[name] = rel_err(t.grad, r.grad)
    return errs


def time_package(pkg, ins, do, window, sm):
    fwd = bench(lambda: pkg.attention.rerope_forward(*ins, window, True, sm))
    o, lse = pkg.attention.rerope_forward(*ins, window, True, sm)
    bwd = bench(lambda: pkg.attention.rerope_backward(do, *ins, o, lse, window, True, sm))
    return fwd, bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true")
    args = ap.parse_args()
    N, H, W = 8192, 32, 2048
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, B=1, H=H, N=N, W=W, dtype="float16", causal=True)
    print(meta, flush=True)
    rows = []
    for d in ([] if args.sweep_only else args.d):
        import kernels_v3
        t0 = time.time()
        ins, do = inputs(d, N, H, d)
        sm = d ** -0.5
        flops = 4 * H * N * N * d * 0.5
        row = {"D": d}
        for mode in ("0", "auto"):
            configs.TMA = mode
            row[f"errs_tma{mode}"] = check(d, ins, do, W)
        configs.TMA = "0"
        row["v4_ptr"] = time_package(kernels, ins, do, W, sm)
        configs.TMA = "auto"
        row["v4_tma"] = time_package(kernels, ins, do, W, sm)
        row["v4_tma_plain"] = time_package(kernels, ins, do, N, sm)
        row["v3"] = time_package(kernels_v3, ins, do, W, sm)
        row["v3_plain"] = time_package(kernels_v3, ins, do, N, sm)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qs, ks, vs = (t.clone().requires_grad_() for t in (ins[0], ins[2], ins[4]))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa = torch.nn.functional.scaled_dot_product_attention
            c_fwd = bench(lambda: sdpa(qs, ks, vs, is_causal=True))
            c_fb = bench(lambda: sdpa(qs, ks, vs, is_causal=True).backward(do))
        row["cudnn"] = (c_fwd, c_fb - c_fwd)
        for k in ("v3", "v3_plain", "v4_ptr", "v4_tma", "v4_tma_plain", "cudnn"):
            f, b = row[k]
            print(f"D={d} {k:13s} fwd {f:.3f} ms ({flops / f / 1e9:.0f} TF/s)  bwd {b:.3f}  "
                  f"fwd+bwd {f + b:.3f} ms ({3.5 * flops / (f + b) / 1e9:.0f} TF/s)  "
                  f"fwd/cuDNN {row['cudnn'][0] / f:.2f}x  fwd+bwd/cuDNN "
                  f"{sum(row['cudnn']) / (f + b):.2f}x", flush=True)
        print("errors", row["errs_tma0"], row["errs_tmaauto"], flush=True)
        row["setup_s"] = time.time() - t0
        rows.append(row)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "probe_tma.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)

    if args.sweep or args.sweep_only:
        configs.AUTOTUNE, configs.TMA = True, "auto"
        for d in args.d:
            ins, do = inputs(d, N, H, d)
            sm = d ** -0.5
            for kernel, per_d in SWEEP.items():
                configs._CANDIDATES[kernel][d] = per_d[d]
            attention._autotuned.cache_clear()
            t0 = time.time()
            o, lse = attention.rerope_forward(*ins, W, True, sm)
            attention.rerope_backward(do, *ins, o, lse, W, True, sm)
            tuned = {}
            for kernel in ("fwd", "dkdv", "dq"):
                at = attention._autotuned(kernel, d, torch.cuda.get_device_capability(), 2)
                timings = getattr(at, "configs_timings", None) or {}
                tuned[kernel] = {"best": str(at.best_config),
                                 "timings": {str(c): t for c, t in timings.items()}}
                print(f"D={d} {kernel}: best {at.best_config}", flush=True)
                for c, t in sorted(timings.items(), key=lambda x: x[1]):
                    print(f"    {t} {c}", flush=True)
            fwd, bwd = time_package(kernels, ins, do, W, sm)
            flops = 4 * H * N * N * d * 0.5
            print(f"D={d} tuned TMA fwd {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TF/s) bwd {bwd:.3f} "
                  f"fwd+bwd {fwd + bwd:.3f} ({3.5 * flops / (fwd + bwd) / 1e9:.0f} TF/s) "
                  f"[tuning {time.time() - t0:.0f} s]", flush=True)
            rows.append({"D": d, "sweep": tuned, "tuned": (fwd, bwd)})
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], "probe_tma.json"), "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
