"""Host cost of the forward's key pre-turn through ``rerope.rerope`` (issue 18 follow-up): per
call, back to back, inputs that need a gradient and inputs that do not, pre-turned
(``PRETURN_MIN_KEYS = 0``) and in registers, at N = 128 (host-bound: the difference is the
pre-turn's host time) and N = 2048; plus torch.profiler's CPU table of the pre-turned grad call.

    REROPE_AUTOTUNE=0 python3 perf/probe_preturn_host.py --out F.json
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rerope  # noqa: E402
from rerope import attention  # noqa: E402
from probe_fused import host_time  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows, tables = [], {}
    for n in (128, 2048):
        for grad in (False, True):
            q, k, v = (torch.randn(1, 32, n, 64, device="cuda", dtype=torch.float16,
                                   requires_grad=grad) for _ in range(3))
            for pre in (False, True):
                attention.PRETURN_MIN_KEYS = 0 if pre else 1 << 40
                def fn():
                    return rerope.rerope(q, k, v, 2048)
                us = host_time(fn, 300)
                rows.append(dict(N=n, grad=grad, preturn=pre, us_per_call=round(us, 1)))
                print(rows[-1], flush=True)
                if pre and grad:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(50):
                            fn()
                        torch.cuda.synchronize()
                    tables[f"N{n}"] = prof.key_averages().table(
                        sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
                    print(tables[f"N{n}"], flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "doc": __doc__.split("\n")[0]}, "rows": rows, "tables": tables}, f,
                  indent=1)


if __name__ == "__main__":
    main()
