"""Where the Gluon forward starts to pay, with its launch bound (session 54, issue 38).

    REROPE_AUTOTUNE=0 PYTHONPATH=kernels:. python perf/runs/s54/short_n.py --out short_n.json

``rerope.rerope_attention`` forward (no grad, B1 H32 W2048 causal) with the Gluon forward at every
N (``gluon_min_keys=0``) and with the Triton forward (``gluon=False``), beside SDPA cuDNN on
``(q1, k1, v)``; per cell the GPU time (median CUDA-event ms of back-to-back calls) and the host
time per call (``back_to_back_us``: calls in a row, one sync; it is the host's time where that
exceeds the GPU's). D 64/128, fp16/bf16, N 1k-16k.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import rerope
from benchmarks.harness import back_to_back_us, environment, event_times_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="short_n.json")
    parser.add_argument("--n", default="1024,2048,4096,8192,16384")
    args = parser.parse_args()
    rows = []
    for d in (64, 128):
        for dtype in (torch.float16, torch.bfloat16):
            for n in map(int, args.n.split(",")):
                gen = torch.Generator(device="cuda").manual_seed(n)
                t = [torch.randn(1, 32, n, d, device="cuda", dtype=dtype, generator=gen)
                     for _ in range(5)]
                steps = {
                    "gluon": (lambda: rerope.rerope_attention(*t, 2048),
                              dict(gluon=True, gluon_min_keys=0)),
                    "triton": (lambda: rerope.rerope_attention(*t, 2048), dict(gluon=False)),
                    "sdpa_cudnn": (lambda: F.scaled_dot_product_attention(
                        t[0], t[2], t[4], is_causal=True), {}),
                }
                for impl, (step, config) in steps.items():
                    with torch.no_grad(), rerope.using_config(**config), \
                            sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        for _ in range(3):
                            step()
                        calls = max(20, min(200, int(2e5 // n)))
                        host = back_to_back_us(step, calls)
                        gpu = statistics.median(event_times_ms(step, 20))
                    rows.append({"impl": impl, "D": d, "dtype": str(dtype)[6:], "N": n,
                                 "gpu_ms": round(gpu, 4), "call_us": round(host, 1)})
                    print(rows[-1], flush=True)
                with open(args.out, "w") as f:
                    json.dump({"meta": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
