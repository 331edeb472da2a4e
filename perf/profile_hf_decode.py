"""Profile a few decode steps of the 1B-like Llama of benchmarks/hf.py at 32k context, stock
SDPA and ReRoPE: where a generated token's time goes (torch.profiler, top ops by CUDA and by
CPU time). Run on a GPU: ``python perf/profile_hf_decode.py > profile.txt``; with ``--python``,
Python's own profiler instead (cProfile, top functions by total and by own time), for stock SDPA
with cuDNN excluded (FlashAttention-2) and ReRoPE."""

import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_hf  # noqa: E402
import rerope.hf  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main(context=32768, steps=3, python=False):
    model = bench_hf.build_model(torch.bfloat16)
    ids = torch.randint(0, bench_hf.VOCAB, (1, context), device="cuda")
    for impl in ("stock_sdpa_flash", "rerope") if python else ("stock_sdpa", "rerope"):
        if impl == "rerope":
            rerope.hf.enable_rerope(model, window=2048)
        if python:
            python_profile(model, ids, impl, steps)
            continue
        with torch.no_grad():
            step, token = bench_hf.warm_decoder(model, ids)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    token = step(token)
                torch.cuda.synchronize()
        print(f"===== {impl}: {steps} decode steps at {context} context")
        table = prof.key_averages()
        print(table.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        del step
        torch.cuda.empty_cache()


def python_profile(model, ids, impl, steps):
    with torch.no_grad(), bench_hf.sdpa_backends(impl):
        step, token = bench_hf.warm_decoder(model, ids)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            token = step(token)
            torch.cuda.synchronize()
        profiler.disable()
    print(f"===== {impl}: {steps} decode steps, Python profile")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(steps=10 if "--python" in sys.argv else 3, python="--python" in sys.argv)
