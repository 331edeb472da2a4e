"""GPU probe: the fused backward on pre-turned operands against turning tiles in registers, and
against plain RoPE + SDPA cuDNN (issue 20).

    REROPE_AUTOTUNE=0 python -m benchmarks.preturn_bwd --out book/data/preturn_bwd_h200.json

(on a CUDA GPU, from the repository root, ``rerope`` importable: ``pip install -e .`` or
``PYTHONPATH=kernels:.``)

Three parts, one process (plus compile warm-up workers):

1. Warm-up: every Triton kernel variant the run needs is compiled first by parallel worker
   processes (one per dtype, D, convention and backward path, at N = 1024 and 4096 — the same
   specialisations as every N of the run, below and above the forward's key pre-turn
   threshold), which fill Triton's on-disk cache.
2. Check at full size (B = 1, H = 32, N = 8192, W = 2048, causal), fp16 and bf16, D = 64 and
   128, raw and rotated: ``rerope.attention.rerope_backward`` with ``preturn=False`` (in
   registers) and ``True`` (pre-turned) on the same forward; the largest difference between the
   two, relative to the largest gradient, and each one's error against a float32 reference
   (``rerope.reference.rerope``, first two heads).
3. Timing, forward + backward, with the benchmark's own ``benchmarks.attention.measure_case`` (median
   of CUDA-event timings, L2 flushed, inputs requiring grad, ``torch.autograd.grad``):
   ``rerope_raw`` / ``rerope_rotated`` with each backward path (forced through
   ``Config.preturn_bwd_min_keys``), and ``rope_sdpa_cudnn``; N = 8192 for fp16 and bf16,
   D = 64 and 128, and the sweep N = 1k … 32k for fp16 (``--lengths``: fewer; the file's rows of
   the others are kept). Rows ``part: "core"`` at N = 8192: plain SDPA cuDNN, the five-tensor
   core op and the forwards alone (:func:`core_rows`).

Rows: ``{"part": "check" | "time", "impl", "path", "dtype", "D", "N", ...}`` with ``ms`` (and
``vs_rope_cudnn``: the cuDNN + RoPE time over ours, > 1 when ours is faster) for timings, and the
differences for checks; ``meta`` has the device, versions and thresholds. The file is rewritten
after every row, so a run cut short keeps what it measured. Its key ``breakdown`` (where the
backward's time goes, with its own runs' metadata: ``python -m benchmarks.sweep_bwd128 --merge``) is
kept.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

import rerope
from rerope import attention, reference

from . import attention as bench
from .harness import environment, read_results, write_results

WINDOW = 2048
HEADS = 32
PATHS = {"in_registers": 1 << 62, "preturned": 0}     # preturn_bwd_min_keys forcing each
SWEEP = (1024, 2048, 4096, 8192, 16384, 32768)


def _inputs(n, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, HEADS, n, d, device="cuda", dtype=dtype, generator=gen)
            for _ in range(4)]


def forced(path):
    """The configuration that forces one backward path (memory is plenty)."""
    return rerope.using_config(preturn_bwd_min_keys=PATHS[path], preturn_bwd_max_bytes=1 << 62)


def warm(job):
    """Compile the kernels of one (dtype, D, convention, path) at N = 1024 and 4096 (4096 only
    for bf16, or where every length measured is >= 4096)."""
    dtype, d, rotated, path, short = job
    for n in (1024, 4096) if dtype == "float16" and short else (4096,):
        q, k, v, dout = (t.requires_grad_() for t in _inputs(n, d, getattr(torch, dtype), 0))
        with forced(path):
            out = rerope.rerope(q, k, v, WINDOW, rotated=rotated)
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()


def warm_all(short=True):
    jobs = [(dtype, d, rotated, path, short) for dtype in ("float16", "bfloat16")
            for d in (64, 128) for rotated in (False, True) for path in PATHS]
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.preturn_bwd", "--warm",
                               json.dumps(job)]) for job in jobs]
    codes = [p.wait() for p in procs]
    print(f"warm-up: {len(jobs)} workers, {time.time() - start:.0f} s, exit codes {codes}",
          flush=True)


def check(dtype, d, rotated):
    """Both backward paths on one forward at N = 8192; their difference, and their errors
    against a float32 reference on the first two heads."""
    n = 8192
    q, k, v, dout = _inputs(n, d, dtype, 1)
    scale = d ** -0.5
    ops = attention._rotations(n, d, 10000.0, WINDOW, None, None, rotated, q.device)
    out, lse = attention.rerope_forward(q, q, k, k, v, WINDOW, True, scale, ops)
    grads = {path: attention.rerope_backward(dout, q, q, k, k, v, out, lse, WINDOW, True, scale,
                                             ops, preturn=path == "preturned")
             for path in PATHS}
    leaves = [t[:, :2].float().requires_grad_() for t in (q, k, v)]
    ref_out = reference.rerope(*leaves, WINDOW, causal=True, rotated=rotated)
    ref = torch.autograd.grad(ref_out, leaves, dout[:, :2].float())
    row = {"part": "check", "dtype": str(dtype).replace("torch.", ""), "D": d, "N": n,
           "H": HEADS, "rotated": rotated,
           "extra_bytes": attention._preturned_shapes(q, k, ops)[1]}
    for i, name in enumerate(("dq", "dk", "dv")):
        old, new = grads["in_registers"][i].float(), grads["preturned"][i].float()
        row[f"{name}_diff_rel"] = ((new - old).abs().max() / old.abs().max()).item()
        row[f"{name}_bitwise_equal"] = bool(torch.equal(grads["in_registers"][i],
                                                        grads["preturned"][i]))
        want = ref[i]
        for path, got in (("in_registers", old), ("preturned", new)):
            row[f"{name}_err_{path}"] = ((got[:, :2] - want).abs().max()
                                         / want.abs().max()).item()
    del ref_out, ref, leaves
    torch.cuda.empty_cache()
    return row


def timing(impl, path, dtype, d, n):
    shape = bench.Shape(B=1, H=HEADS, N=n, D=d, window=WINDOW, dtype=dtype, causal=True)
    with forced(path) if path is not None else contextlib.nullcontext():
        ms, peak, _ = bench.measure_case(impl, "fwd+bwd", shape)
    torch.cuda.empty_cache()
    return {"part": "time", "impl": impl, "path": path, "mode": "fwd+bwd", "dtype": dtype,
            "D": d, "N": n, "B": 1, "H": HEADS, "window": WINDOW, "ms": ms,
            "peak_gb": peak / 1e9}


CORE = (("sdpa_cudnn", "fwd"), ("sdpa_cudnn", "fwd+bwd"), ("rerope", "fwd"), ("rerope", "fwd+bwd"),
        ("rope_sdpa_cudnn", "fwd"), ("rerope_raw", "fwd"), ("rerope_rotated", "fwd"))


def core_rows(dtype, d, n):
    """Rows ``part: "core"``: plain SDPA cuDNN and the five-tensor op ``rerope_attention``
    (``rerope``: the standing core-op target, forward and forward + backward), and the forwards
    of torch RoPE + cuDNN and of ``rerope.rerope`` (raw, rotated; the policy's key pre-turn), each
    with ``vs_cudnn`` (plain cuDNN's time over this one, same mode)."""
    shape = bench.Shape(B=1, H=HEADS, N=n, D=d, window=WINDOW, dtype=dtype, causal=True)
    rows, cudnn = [], {}
    for impl, mode in CORE:
        ms = bench.measure_case(impl, mode, shape)[0]
        torch.cuda.empty_cache()
        if impl == "sdpa_cudnn":
            cudnn[mode] = ms
        rows.append({"part": "core", "impl": impl, "mode": mode, "dtype": dtype, "D": d, "N": n,
                     "B": 1, "H": HEADS, "window": WINDOW, "ms": ms,
                     "vs_cudnn": round(cudnn[mode] / ms, 3)})
    return rows


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.preturn_bwd",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="book/data/preturn_bwd_h200.json")
    parser.add_argument("--warm", help=argparse.SUPPRESS)
    parser.add_argument("--no-warm", action="store_true", help="skip the parallel warm-up")
    parser.add_argument("--lengths", default=",".join(map(str, SWEEP)),
                        help="fp16 lengths N to time (8192 is always timed, fp16 and bf16); "
                        "the file's rows of other lengths are kept, and meta says so")
    parser.add_argument("--note", default="", help="meta['changes']: what changed since the "
                        "file's previous run")
    args = parser.parse_args()
    if args.warm:
        warm(json.loads(args.warm))
        return
    config = rerope.config()
    env = environment()
    meta = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
            "date": env["date"], "autotune": config.autotune,
            "PRETURN_MIN_KEYS": config.preturn_min_keys,
            "PRETURN_BWD_MIN_KEYS": config.preturn_bwd_min_keys,
            "preturn_memory_limit": attention.preturn_memory_limit(torch.device("cuda")),
            "paths": "forced per row (PRETURN_BWD_MIN_KEYS 0 or 2**62), not the policy",
            "timing": "benchmarks.attention.measure_case (median CUDA events, L2 flushed)"}
    lengths = sorted({int(x) for x in args.lengths.split(",") if x} | {8192})
    if args.note:
        meta["changes"] = args.note
    rows = []
    kept = {}                             # written by python -m benchmarks.sweep_bwd128 --merge
    old_rows = []
    if os.path.exists(args.out):
        previous = read_results(args.out)
        kept = {k: v for k, v in previous.items() if k == "breakdown"}
        old_rows = [r for r in previous["rows"] if r["part"] == "time" and r["N"] not in lengths]
        if old_rows:
            meta["kept_rows"] = (f"{len(old_rows)} timing rows of N = "
                                 f"{sorted({r['N'] for r in old_rows})} from the run of "
                                 f"{previous['meta']['date']} (not re-measured)")

    def save(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(args.out, rows + old_rows, meta, **kept)

    if not args.no_warm:
        warm_all(short=min(lengths) < 4096)
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for rotated in (False, True):
                save(check(dtype, d, rotated))
    cells = [(dtype, d, 8192) for dtype in ("float16", "bfloat16") for d in (64, 128)]
    for dtype, d, n in cells:
        for row in core_rows(dtype, d, n):
            save(row)
    cells += [("float16", d, n) for d in (64, 128) for n in lengths if n != 8192]
    for dtype, d, n in cells:
        base = timing("rope_sdpa_cudnn", None, dtype, d, n)
        save(base)
        for impl in ("rerope_raw", "rerope_rotated"):
            for path in PATHS:
                row = timing(impl, path, dtype, d, n)
                row["vs_rope_cudnn"] = round(base["ms"] / row["ms"], 3)
                save(row)


if __name__ == "__main__":
    main()
