"""Self-Extend (``group=G``) beside ReRoPE in the same ops, on a GPU (book/data/self_extend_h200.json).

    python -m benchmarks.self_extend check --dtype float16 --d 64 --out check.json
    python -m benchmarks.self_extend time --out time.json
    python -m benchmarks.self_extend merge --out self_extend_h200.json check_*.json time.json

(from the repository root, ``rerope`` importable: ``pip install -e .`` or
``PYTHONPATH=kernels:.``).

``check``: ``rerope.rerope`` forward and ``dq, dk, dv`` at B=1 H=32 N=8192 W=2048, Self-Extend
G=8 and ReRoPE, rotated inputs (and raw ones with ``--raw``), against a float32 reference
(``rerope.reference.rerope``, TF32 off) on the first two heads; a chunked-prefill GQA case
(Nq=1024 of Nk=8192, Hq=32, Hkv=8) forward only; ``rerope.rerope_decode`` on a 32k rotated
cache (Hq=32, Hkv=8) against the reference on that row. Errors: ``max|err| / max|ref|`` and
the relative Frobenius norm.
``time``: the same shapes, fp16: forward and forward + backward at N=8192 (``benchmarks.attention.
time_cuda``, L2 flushed), decode against a 32k cache (CUDA-graph replay, ``benchmarks.decode.
graph_us``); ReRoPE, Self-Extend and Leaky ReRoPE with κ = G (Self-Extend without the floor)
interleaved three times, medians kept, ratios SE / ReRoPE and SE / Leaky. ``merge`` keeps the
checks of an earlier merged file given among its inputs (``meta.checks_date``).
``--small``: tiny shapes, to run the script's logic under the CPU interpreter.
"""

import argparse
import json
import os
import statistics
import time

import torch

import rerope
from rerope import reference
from rerope.rope import apply_rope

from .harness import environment, write_results

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def shapes(small):
    if small:
        return dict(n=64, heads=2, kv_heads=1, window=16, group=4, chunk=16, cache=96)
    return dict(n=8192, heads=32, kv_heads=8, window=2048, group=8, chunk=1024, cache=32768)


def errors(got, want):
    got, want = got.detach().float(), want.detach().float()
    return {"scaled": ((got - want).abs().max() / want.abs().max()).item(),
            "rel_norm": ((got - want).norm() / want.norm()).item(),
            "finite": bool(torch.isfinite(got).all())}


def inputs(dtype, d, hq, hkv, n_q, n_k, rotated, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(1, hq, n_q, d, device=DEVICE, generator=gen)
    k = torch.randn(1, hkv, n_k, d, device=DEVICE, generator=gen)
    v = torch.randn(1, hkv, n_k, d, device=DEVICE, generator=gen)
    if rotated:
        pos = torch.arange(n_k, device=DEVICE, dtype=torch.float64)
        q, k = apply_rope(q, pos[n_k - n_q:]), apply_rope(k, pos)
    return [t.to(dtype) for t in (q, k, v)]


def _reference(leaves, window, **kw):
    if DEVICE == "cpu":
        return reference.rerope(*leaves, window, **kw)
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False           # a true float32 reference
    try:
        return reference.rerope(*leaves, window, **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def check_prefill(dtype, d, s, rotated, group, backward=True, n_q=None, hq=None, hkv=None):
    n_k = s["n"]
    n_q = n_q or n_k
    hq, hkv = hq or s["heads"], hkv or s["heads"]
    q, k, v = inputs(dtype, d, hq, hkv, n_q, n_k, rotated)
    kw = dict(rotated=rotated, group=group)
    row = {"case": "prefill", "dtype": str(dtype).split(".")[-1], "D": d, "rotated": rotated,
           "group": group, "Nq": n_q, "Nk": n_k, "Hq": hq, "Hkv": hkv, "window": s["window"],
           "reference_heads": 2 * hq // hkv if hq != hkv else 2, "errors": {}}
    slice_q, slice_kv = row["reference_heads"], row["reference_heads"] * hkv // hq
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    dout = torch.randn(q.shape, device=DEVICE, dtype=dtype)
    out = rerope.rerope(*leaves, s["window"], **kw)
    got = {"out": out}
    if backward:
        got.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout)))
    ref_leaves = [t[:, :h].detach().float().requires_grad_(backward)
                  for t, h in zip((q, k, v), (slice_q, slice_kv, slice_kv))]
    ref = _reference(ref_leaves, s["window"], **kw)
    want = {"out": ref}
    if backward:
        want.update(zip(("dq", "dk", "dv"),
                        torch.autograd.grad(ref, ref_leaves, dout[:, :slice_q].float())))
    for name in got:
        heads = slice_q if name in ("out", "dq") else slice_kv
        row["errors"][name] = errors(got[name][:, :heads], want[name])
    return row


def check_decode(dtype, d, s, group):
    n_k = s["cache"]
    q, k, v = inputs(dtype, d, s["heads"], s["kv_heads"], 1, n_k, True)
    with torch.no_grad():
        out = rerope.rerope_decode(q, k, v, s["window"], group=group)
    ref = _reference([t.float() for t in (q, k, v)], s["window"], rotated=True, group=group)
    return {"case": "decode", "dtype": str(dtype).split(".")[-1], "D": d, "rotated": True,
            "group": group, "Nq": 1, "Nk": n_k, "Hq": s["heads"], "Hkv": s["kv_heads"],
            "window": s["window"], "errors": {"out": errors(out, ref)}}


def run_check(args):
    dtype, s = getattr(torch, args.dtype), shapes(args.small)
    rows = []
    cases = [("prefill", dict(rotated=True, group=s["group"])),
             ("prefill", dict(rotated=True, group=None))]
    if args.raw:
        cases += [("prefill", dict(rotated=False, group=s["group"]))]
    cases += [("prefill", dict(rotated=True, group=s["group"], backward=False, n_q=s["chunk"],
                               hq=s["heads"], hkv=s["kv_heads"])),
              ("decode", dict(group=s["group"])), ("decode", dict(group=None))]
    for kind, case in cases:
        start = time.time()
        row = (check_prefill(dtype, args.d, s, **case) if kind == "prefill"
               else check_decode(dtype, args.d, s, **case))
        row["seconds"] = round(time.time() - start, 1)
        rows.append(row)
        worst = max(e["scaled"] for e in row["errors"].values())
        print(f"check {args.dtype} D={args.d} {kind} rotated={row['rotated']} "
              f"group={row['group']} Nq={row['Nq']}: max scaled err {worst:.2e} "
              f"({row['seconds']} s)", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        write_results(args.out, rows, environment(DEVICE))


def _time(step):
    if DEVICE == "cpu":
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    from . import attention as bench
    return bench.time_cuda(step, reps=20)


def _graph_us(step):
    if DEVICE == "cpu":
        return _time(step) * 1e3
    from . import decode as bench_decode
    return bench_decode.graph_us(step)


def run_time(args):
    s = shapes(args.small)
    dtype = torch.float16
    rows = []

    def pair(label, make, measure, **extra):
        """ReRoPE, Self-Extend (group G) and Leaky ReRoPE (κ = G: the same positions without
        the floor) interleaved three times; medians, Self-Extend / ReRoPE (``ratio``) and
        Self-Extend / Leaky (``ratio_to_leaky``)."""
        g = s["group"]
        steps = {"rerope": make(None, None), "self_extend": make(g, None),
                 "leaky": make(None, float(g))}
        for step in steps.values():          # compile and warm up all first
            step()
        times = {name: [] for name in steps}
        for _ in range(3):
            for name, step in steps.items():
                times[name].append(measure(step))
        med = {name: statistics.median(t) for name, t in times.items()}
        row = dict(label=label, **extra, window=s["window"], group=g, **med,
                   ratio=med["self_extend"] / med["rerope"],
                   ratio_to_leaky=med["self_extend"] / med["leaky"], runs=times)
        rows.append(row)
        print(f"time {label} {extra}: ReRoPE {med['rerope']:.4g}, Self-Extend "
              f"{med['self_extend']:.4g}, Leaky {med['leaky']:.4g}, ratios {row['ratio']:.3f} "
              f"(to ReRoPE), {row['ratio_to_leaky']:.3f} (to Leaky)", flush=True)

    for d in (64, 128):
        for rotated in (True, False):
            q, k, v = inputs(dtype, d, s["heads"], s["heads"], s["n"], s["n"], rotated)
            common = dict(D=d, N=s["n"], B=1, H=s["heads"], dtype="float16", rotated=rotated,
                          unit="ms")

            def fwd(g, leaky, q=q, k=k, v=v, rotated=rotated):
                def step():
                    with torch.no_grad():
                        rerope.rerope(q, k, v, s["window"], rotated=rotated, group=g,
                                      leaky=leaky)
                return step
            pair("fwd", fwd, _time, **common)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            dout = torch.randn_like(q)

            def fwd_bwd(g, leaky, leaves=leaves, dout=dout, rotated=rotated):
                def step():
                    out = rerope.rerope(*leaves, s["window"], rotated=rotated, group=g,
                                        leaky=leaky)
                    torch.autograd.grad(out, leaves, dout)
                return step
            pair("fwd+bwd", fwd_bwd, _time, **common)
            del q, k, v, leaves, dout
    for d in (128,):
        q, k, v = inputs(dtype, d, s["heads"], s["kv_heads"], 1, s["cache"], True)

        def decode(g, leaky, q=q, k=k, v=v):
            def step():
                rerope.rerope_decode(q, k, v, s["window"], group=g, leaky=leaky)
            return step
        pair("decode", decode, _graph_us, D=d, Nk=s["cache"], Nq=1, B=1, Hq=s["heads"],
             Hkv=s["kv_heads"], dtype="float16", rotated=True, unit="us")
    write_results(args.out, rows, environment(DEVICE))


def run_merge(args):
    env = environment(DEVICE)
    data = {"meta": {
        "what": "Self-Extend (rerope.rerope / rerope_decode with group=G) beside ReRoPE in the "
                "same ops: GPU correctness against a float32 reference and speed; written by "
                "python -m benchmarks.self_extend",
        "device": env["gpu"], "torch": env["torch"], "triton": env["triton"], "date": env["date"],
        "autotune": os.environ.get("REROPE_AUTOTUNE", "1"),
        "error_metrics": "scaled = max|got - ref| / max|ref|; rel_norm = ||got - ref|| / ||ref||"},
        "checks": [], "timings": []}
    for path in args.inputs:
        with open(path) as f:
            part = json.load(f)
        if "checks" in part:           # an earlier merged file: keep its checks, say when
            data["checks"] += part["checks"]
            data["meta"]["checks_date"] = part["meta"]["date"]
            continue
        rows = part["rows"]
        data["timings" if "label" in (rows[0] if rows else {}) else "checks"] += rows
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(json.dumps(data["timings"], indent=None)[:3000])


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.self_extend",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("check", "time", "merge"))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--raw", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("inputs", nargs="*")
    args = parser.parse_intermixed_args()
    {"check": run_check, "time": run_time, "merge": run_merge}[args.what](args)


if __name__ == "__main__":
    main()
