"""Where a Hugging Face decode step's time goes, ReRoPE against stock SDPA FlashAttention-2: the
1B-shaped Llama of :mod:`benchmarks.hf` after a prefill of ``--context`` tokens, a few greedy
steps (``warm_decoder``'s loop) under ``torch.profiler`` (CPU and CUDA), then under Python's
``cProfile``. Run on a GPU from the repository root::

    REROPE_AUTOTUNE=0 python -m benchmarks.hf_profile --context 32768 > profile_decode.txt
    python -m benchmarks.hf_profile --tiny --context 40 --steps 1    # CPU, tests this script

Per implementation it prints: the per-step wall time; ``torch.profiler``'s tables (top ops by
self CPU time and by GPU time, per step); labelled ranges ``attention_fn`` (the registered
attention function, every layer) and ``mask_fn`` (the mask function, once per forward), whose
CPU totals say how much of a step is spent in them; and cProfile's top Python functions by own
time and cumulative time.
"""

import argparse
import cProfile
import functools
import io
import pstats
import time

import torch

from . import hf as bench


def _labelled(fn, label):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def label_registry(name):
    """Wrap the attention and mask functions registered under ``name`` in profiler ranges
    (``attention_fn``, ``mask_fn``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS[name]
    if not getattr(attention, "_labelled", False):
        wrapped = _labelled(attention, "attention_fn")
        wrapped._labelled = True
        AttentionInterface.register(name, wrapped)
    if name in ALL_MASK_ATTENTION_FUNCTIONS:
        mask = ALL_MASK_ATTENTION_FUNCTIONS[name]
        if not getattr(mask, "_labelled", False):
            wrapped = _labelled(mask, "mask_fn")
            wrapped._labelled = True
            AttentionMaskInterface.register(name, wrapped)


def profile_impl(model, ids, impl, steps, window):
    import rerope.hf

    if impl == "rerope":
        rerope.hf.enable_rerope(model, window=window)
    elif rerope.hf.is_rerope_enabled(model):
        rerope.hf.disable_rerope(model)
    try:
        label_registry(model.config._attn_implementation)
    except Exception as error:       # an older transformers: profile without the ranges
        print(f"(no attention_fn / mask_fn ranges: {type(error).__name__}: {error})")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if bench.DEVICE == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    print(f"===== {impl}: {steps} decode step(s) after a prefill of {ids.shape[1]} tokens "
          f"(attention implementation {model.config._attn_implementation!r})", flush=True)
    with torch.no_grad(), bench.sdpa_backends(impl):
        step, token = bench.warm_decoder(model, ids)
        times = []
        for _ in range(5):
            bench.sync()
            start = time.perf_counter()
            token = step(token)
            bench.sync()
            times.append((time.perf_counter() - start) * 1e3)
        print(f"wall ms per step (5 steps, synchronised): {[round(t, 2) for t in times]}")
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                token = step(token)
            bench.sync()
        table = prof.key_averages()
        print(f"--- torch.profiler, top ops by self CPU time ({steps} step(s))")
        print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        if bench.DEVICE == "cuda":
            print(f"--- torch.profiler, top ops by GPU time ({steps} step(s))")
            print(table.table(sort_by="cuda_time_total", row_limit=15,
                              max_name_column_width=70))
        for event in table:
            if event.key in ("attention_fn", "mask_fn"):
                print(f"range {event.key}: {event.count / steps:.0f} calls per step, "
                      f"CPU total {event.cpu_time_total / steps:.0f} us per step "
                      f"({event.cpu_time_total / max(1, event.count):.1f} us per call)")
        profiler = cProfile.Profile()
        bench.sync()
        profiler.enable()
        for _ in range(steps):
            token = step(token)
        bench.sync()
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    print(f"--- cProfile ({steps} step(s); the profiler inflates every call alike)")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    print(text.getvalue(), flush=True)
    del step
    if bench.DEVICE == "cuda":
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_profile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--impls", default="stock_sdpa_flash,rerope")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU")
    args = parser.parse_args()
    if args.tiny:
        bench.use_tiny_model()
    import transformers

    dtype = torch.bfloat16 if bench.DEVICE == "cuda" else torch.float32
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {torch.cuda.get_device_name() if bench.DEVICE == 'cuda' else 'cpu'}")
    model = bench.build_model(dtype)
    ids = torch.randint(0, bench.VOCAB, (1, args.context), device=bench.DEVICE,
                        generator=torch.Generator(bench.DEVICE).manual_seed(2))
    for impl in args.impls.split(","):
        profile_impl(model, ids, impl, args.steps, args.window)


if __name__ == "__main__":
    main()
