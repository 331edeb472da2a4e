"""Launch-configuration sweep for the fused-rotation kernels (``rerope.rerope``) on a GPU.

    python perf/sweep_fused.py warm --index I        # compile case I (run many in parallel)
    python perf/sweep_fused.py time --out sweep.json # time every case (one process)

Each case forces one ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` on one kernel of the fused
form (the others keep their first candidate) at B=1 H=32 N=8192 W=2048 fp16 causal, raw
inputs, and times the forward (``fwd`` cases) or forward + backward (``dkdv``, ``dq``).
"""

import argparse
import json
import os
import sys
from contextlib import contextmanager

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rerope  # noqa: E402
from rerope import attention, bench, configs  # noqa: E402

SWEEP = {
    ("fwd", 64): [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3),
                  (128, 64, 4, 2), (128, 128, 8, 2)],
    ("fwd", 128): [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3),
                   (128, 32, 4, 3)],
    ("dkdv", 64): [(64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 3),
                   (32, 128, 4, 3), (64, 64, 4, 2)],
    ("dkdv", 128): [(64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 3), (32, 128, 8, 3),
                    (64, 128, 8, 2), (32, 64, 4, 2)],
    ("dq", 64): [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3)],
    ("dq", 128): [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3)],
}
CASES = [(kernel, d, cfg) for (kernel, d), cfgs in SWEEP.items() for cfg in cfgs]


@contextmanager
def forced(kernel, cfg):
    original = configs.launch_configs

    def patched(name, head_dim, capability, elem_bytes=2, split=False):
        found = original(name, head_dim, capability, elem_bytes, split)
        if name == kernel and split:
            bm, bn, w, s = cfg
            return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
        return found[:1]

    attention._autotuned.cache_clear()
    configs.launch_configs = patched
    try:
        yield
    finally:
        configs.launch_configs = original
        attention._autotuned.cache_clear()


def measure(kernel, d, cfg, impl="rerope_raw"):
    shape = bench.Shape(1, 32, 8192, d, 2048, "float16", True)
    mode = "fwd" if kernel == "fwd" else "fwd+bwd"
    with forced(kernel, cfg):
        ms, peak, _ = bench.measure_case(impl, mode, shape, reps=15)
    return mode, ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("warm", "time"))
    parser.add_argument("--index", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.what == "warm":
        kernel, d, cfg = CASES[args.index]
        try:
            measure(kernel, d, cfg)
            print(f"warm {kernel} D={d} {cfg}: ok")
        except Exception as error:   # reported; the timing pass skips it too
            print(f"warm {kernel} D={d} {cfg}: {type(error).__name__}: {str(error)[:300]}")
        return
    rows = []
    for kernel, d, cfg in CASES:
        try:
            mode, ms = measure(kernel, d, cfg)
        except Exception as error:
            mode, ms = None, None
            print(f"{kernel} D={d} {cfg}: {type(error).__name__}: {str(error)[:200]}")
        rows.append(dict(kernel=kernel, D=d, config=cfg, mode=mode, ms=ms))
        print(f"sweep {kernel:5s} D={d:<4} {str(cfg):18s} {mode} {ms}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
