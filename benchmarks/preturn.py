"""GPU probe: the fused forward with each product's keys turned in registers (per key tile, per
query block) against turned once before the kernel (``rerope.rotary.turn_keys``).

    REROPE_AUTOTUNE=0 python -m benchmarks.preturn --out book/data/preturn_h200.json

(on a CUDA GPU, from the repository root, ``rerope`` importable: ``pip install -e .`` or
``PYTHONPATH=kernels:.``)

Times ``rerope.attention.rerope_forward`` (causal, W = 2048) both ways with
``triton.testing.do_bench`` (L2 cleared between runs; the pre-turned time includes the key
turn's launch; both through a plan's launchers, every launch bound as in ``rerope.rerope``),
for raw and rotated inputs, fp16, B = 1, H = 32 (no GQA: the most keys to turn per query
head), D = 64 and 128, N = 1k … 32k; and the shape of the Hugging Face
benchmark (bf16, Hq = 32, Hkv = 8, D = 64, rotated). Also the largest difference between the
two outputs, relative to the largest output. The threshold of ``attention.preturn_keys`` in force
is recorded in ``meta`` (the auto rule is not used here: both ways are forced).
"""

import argparse
import json

import torch

import rerope  # (before triton: the interpreter is chosen at import)
from rerope import attention

import triton  # noqa: I100
import triton.testing

from .harness import environment, write_results

WINDOW = 2048


def case(n, d, rotated, dtype=torch.float16, hq=32, hkv=32):
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(1, hkv, n, d, device="cuda", dtype=dtype, generator=gen)
            for _ in range(2))
    ops = attention._rotations(n, d, 10000.0, WINDOW, None, None, rotated, q.device)
    row = {"N": n, "D": d, "rotated": rotated, "dtype": str(dtype).replace("torch.", ""),
           "Hq": hq, "Hkv": hkv, "window": WINDOW}
    outs = {}
    for preturn in (False, True):
        state = attention.PlanState()    # a plan's own: its launches bound, as every call

        def run():
            return attention.rerope_forward(q, q, k, k, v, WINDOW, True, d ** -0.5, ops, preturn,
                                            state)
        outs[preturn] = run()[0]
        row["preturn_ms" if preturn else "in_registers_ms"] = triton.testing.do_bench(
            run, warmup=10, rep=60)
    row["speedup"] = round(row["in_registers_ms"] / row["preturn_ms"], 3)
    row["max_diff_rel"] = ((outs[True].float() - outs[False].float()).abs().max()
                           / outs[False].float().abs().max()).item()
    return row


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.preturn",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="book/data/preturn_h200.json")
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128],
                        help="head dims (a subset: to compile in parallel processes first)")
    args = parser.parse_args()
    rows = []
    shapes = [(n, d, rotated) for d in args.d for rotated in (False, True)
              for n in (1024, 2048, 4096, 8192, 16384, 32768)]
    for n, d, rotated in shapes:
        rows.append(case(n, d, rotated))
        print(json.dumps(rows[-1]), flush=True)
    for n in (8192, 32768) if 64 in args.d else ():  # the Hugging Face benchmark's shape
        rows.append(case(n, 64, True, torch.bfloat16, 32, 8))
        print(json.dumps(rows[-1]), flush=True)
    env = environment(day=True)
    meta = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
            "date": env["date"], "autotune": rerope.config().autotune,
            "PRETURN_MIN_KEYS": rerope.config().preturn_min_keys}
    write_results(args.out, rows, meta)


if __name__ == "__main__":
    main()
