"""Where the short-sequence forward's time goes (issue 18's N=2048 target), on a GPU.

    python -m benchmarks.short_n warm --index I      # compile variant I (run several at once)
    python -m benchmarks.short_n time --out F.json   # time everything (one process)

(from the repository root, ``rerope`` importable: ``pip install -e .`` or
``PYTHONPATH=kernels:.``). ``book/data/short_n_h200.json`` holds two such runs' rows, ``before``
and ``after`` the heads-first grid (perf/NOTES.md v10).

At B=1 H=32 N=2048 D=64 fp16 causal (the issue's shape; window 2048 as in the benchmark grid,
and 512) it times, for ``rerope.rerope`` from raw and rotated ``q, k`` and for SDPA cuDNN/flash:

* the benchmark's own figure (``benchmarks.attention.measure_case``: inputs that require grad, L2
  flushed, one CUDA-event pair per call): what ``book/data/bench_h200.json`` reports;
* the GPU time alone: a CUDA graph of 20 no-grad forwards, replayed (``graph_us``);
* back-to-back eager calls with one sync at the end (``stream_us``: max of host and GPU time);

and the same for each variant of the forward's launch: its ``(BLOCK_M, BLOCK_N, warps, stages)``,
TMA loads on or off, and keys pre-turned before the kernel or turned in registers.
"""

import argparse
import json
import statistics
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import rerope
from rerope import attention, configs

from . import attention as bench
from .harness import back_to_back_us, environment, event_times_ms, write_results

B, H, N, D = 1, 32, 2048, 64
DEFAULT = (128, 64, 4, 3)
# (config or None for the default, TMA mode, pre-turn keys)
VARIANTS = [(None, "auto", False), (None, "off", False), (None, "auto", True),
            ((128, 64, 8, 3), "auto", False), ((64, 64, 4, 3), "auto", False),
            ((64, 64, 4, 4), "auto", False), ((128, 128, 8, 3), "auto", False),
            ((128, 32, 4, 3), "auto", False), ((64, 32, 4, 3), "auto", False),
            ((64, 64, 4, 3), "auto", True), ((128, 64, 8, 3), "auto", True)]


@contextmanager
def variant(cfg, tma, preturn):
    """Force one forward launch configuration (fresh plans and launchers)."""
    original = configs.launch_configs

    def patched(name, head_dim, capability, elem_bytes=2, split=False, autotune=None):
        found = original(name, head_dim, capability, elem_bytes, split)
        if name == "fwd" and cfg is not None:
            bm, bn, w, s = cfg
            return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
        return found[:1]

    def clear():
        attention._autotuned.cache_clear()
        attention.PLANS.clear()
        attention._LAUNCHERS.clear()

    clear()
    configs.launch_configs = patched
    try:
        with rerope.using_config(tma=tma, preturn_min_keys=0 if preturn else 1 << 40):
            yield
    finally:
        configs.launch_configs = original
        clear()


def inputs(grad, dtype=torch.float16):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)
            for _ in range(3)]


def forward_of(impl, window):
    if impl.startswith("sdpa"):
        backend = SDPBackend.CUDNN_ATTENTION if impl == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run
    rotated = impl == "rerope_rotated"
    return lambda q, k, v: rerope.rerope(q, k, v, window, rotated=rotated)


def graph_us(fn, args, calls=20, replays=10):
    """GPU µs per call: a CUDA graph of ``calls`` no-grad calls, median of ``replays``."""
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(*args)
    times_ms = event_times_ms(graph.replay, replays, sync_each=True)
    return statistics.median(times_ms) * 1e3 / calls


def stream_us(fn, args, calls=200):
    """Wall µs per call of back-to-back calls (one sync at the end)."""
    return back_to_back_us(lambda: fn(*args), calls)


def kernel_table(fn, args, steps=5):
    from torch.profiler import ProfilerActivity, profile
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(*args)
        torch.cuda.synchronize()
    rows = [dict(name=e.key[:70], us=round(getattr(e, "device_time_total", 0) / steps, 2),
                 calls=e.count / steps) for e in prof.key_averages()]
    return [r for r in sorted(rows, key=lambda r: -r["us"]) if r["us"] > 0][:8]


def measure(impl, window, cfg=None, tma="auto", preturn=False, profile=False):
    def body():
        fn = forward_of(impl, window)
        shape = bench.Shape(B, H, N, D, window, "float16", True)
        row = dict(impl=impl, window=window, config=cfg or (DEFAULT if impl.startswith("rerope")
                                                            else None),
                   tma=tma, preturn=preturn)
        row["bench_ms"] = bench.measure_case(impl, "fwd", shape)[0]
        row["graph_us"] = graph_us(fn, inputs(False))
        row["stream_us"] = stream_us(fn, inputs(True))
        row["stream_nograd_us"] = stream_us(fn, inputs(False))
        if profile:
            row["kernels"] = kernel_table(fn, inputs(True))
        return row
    if impl.startswith("sdpa"):
        return body()
    with variant(cfg, tma, preturn):
        return body()


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.short_n",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("warm", "time"))
    parser.add_argument("--index", type=int)
    parser.add_argument("--out")
    parser.add_argument("--variants", default=None,
                        help="comma-separated indices of VARIANTS to time (default: all)")
    args = parser.parse_args()
    chosen = (range(len(VARIANTS)) if args.variants is None
              else [int(i) for i in args.variants.split(",")])
    if args.what == "warm":
        cfg, tma, pre = VARIANTS[args.index]
        for impl in ("rerope_raw", "rerope_rotated"):
            with variant(cfg, tma, pre):
                fn = forward_of(impl, 2048)
                fn(*inputs(True))
                fn(*inputs(False))
        print(f"warm {VARIANTS[args.index]}: ok", flush=True)
        return
    rows = []

    env = environment()
    meta = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
            "shape": f"B={B} H={H} N={N} D={D} fp16 causal", "doc": __doc__.split("\n")[0]}

    def save():
        write_results(args.out, rows, meta)

    for impl in ("sdpa_cudnn", "sdpa_flash"):
        rows.append(measure(impl, 2048, profile=True))
        print(json.dumps(rows[-1]), flush=True)
    for window in (2048, 512):
        for impl in ("rerope_raw", "rerope_rotated"):
            rows.append(measure(impl, window, profile=True))
            print(json.dumps(rows[-1]), flush=True)
            save()
    for cfg, tma, pre in (VARIANTS[i] for i in chosen if i > 0):
        for impl in ("rerope_raw", "rerope_rotated"):
            try:
                rows.append(measure(impl, 2048, cfg, tma, pre, profile=pre))
            except Exception as error:   # a variant that does not compile is reported, not fatal
                rows.append(dict(impl=impl, config=cfg, tma=tma, preturn=pre,
                                 error=f"{type(error).__name__}: {str(error)[:200]}"))
            print(json.dumps(rows[-1]), flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
