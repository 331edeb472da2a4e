"""How fast is a ReRoPE decode step? ``kernels.rerope_decode`` against what a user could run.

Run it on a CUDA GPU from the repository root::

    python -m kernels.bench_decode                         # the grid below (~1-2 min on an H200)
    python -m kernels.bench_decode --quick                 # B=1, 4k and 128k only
    python -m kernels.bench_decode --sweep                 # also num_splits and launch configs

One decode step: ``Nq = 1`` new query per row against a full cache of ``context`` keys,
``B ∈ {1, 8}``, ``Hq = 32``, ``Hkv = 8``, ``D = 128``, bf16, windows 2048 and 512, the cache
holding RoPE-rotated keys (as a Llama model keeps it). The implementations (``impl``):

- ``rerope_decode``: ours, split-KV with the rotation done in the kernel.
- ``rerotate_torch``: what the author's Hugging Face patch does, in torch: rebuild the unrotated
  keys ``k2 = R(-j) k_rot`` for the whole cache, then two matmuls (``q_rot · k_rot`` inside the
  window, ``R(w) q · k2`` outside), a select, a softmax and ``· v``.
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``: PyTorch's fused *plain* attention decode
  on the same cache (``enable_gqa``): not ReRoPE, the speed of light ReRoPE can approach.
  ``flash_attn_kvcache``: ``flash_attn.flash_attn_with_kvcache`` if importable.
- ``hbm_bound``: the time to read the valid K and V once at the copy bandwidth measured in the
  same run (``meta.copy_tb_s``: a large device-to-device copy, read + write bytes over time).

Per step we report ``us``: the median GPU time of one step replayed from a CUDA graph, the L2
cache flushed before each replay (in a model the other layers' caches evict it), timed with CUDA
events; and ``us_eager``: the wall-clock time per step of back-to-back eager calls (host included:
what a Python decode loop sees). ``hbm_fraction = hbm_bound / us``. JSON like
:mod:`kernels.bench`::

    {"meta": {"gpu", "torch", "triton", "cuda", "date", "copy_tb_s", ...},
     "rows": [{"impl", "B", "Hq", "Hkv", "D", "dtype", "window", "context", "Nq",
               "us", "us_eager", "hbm_fraction", ("num_splits"), ("skipped")}],
     "sweep": [...]}      # with --sweep: num_splits and launch configuration variants

:func:`load_results`, :func:`select_rows` and :func:`plot_latency` read the file back; they need
no GPU.
"""

import argparse
import datetime
import gc
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

IMPLS = ("rerope_decode", "rerotate_torch", "sdpa_flash", "sdpa_cudnn", "flash_attn_kvcache")
# sdpa_efficient (memory-efficient attention) has no GQA decode path in torch 2.11 ("No available
# kernel"): not in the default list.
ALL_IMPLS = IMPLS + ("sdpa_efficient",)
BATCHES = (1, 8)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
WINDOWS = (2048, 512)
HQ, HKV, D, DTYPE = 32, 8, 128, "bfloat16"
BASE = 10000.0

L2_FLUSH_BYTES = 256 * 1024 * 1024   # more than any L2 (H200: 50 MB)
TIME_BUDGET_S = 0.25                 # per case and timing mode
MIN_REPS, MAX_REPS = 5, 200
COPY_BYTES = 2 * 1024 ** 3


# --- timing ------------------------------------------------------------------------------------


def copy_bandwidth(nbytes=COPY_BYTES, reps=10):
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def read_bandwidth(nbytes=COPY_BYTES, reps=10):
    """Bytes/s a max-reduction over a large tensor reads (``meta.read_tb_s``; torch's reduction
    kernel, 3.5 TB/s on the H200: below the copy, so not a ceiling; the bound uses the copy)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    src.amax()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        src.amax()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src
    return nbytes / statistics.median(times)


def _reps(estimate_s):
    return int(min(MAX_REPS, max(MIN_REPS, TIME_BUDGET_S / max(estimate_s, 1e-6))))


def graph_us(step):
    """Median µs of one CUDA-graph replay of ``step``, L2 flushed (untimed) before each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):           # warm-up on a side stream, as capture wants
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    count = _reps(start.elapsed_time(end) * 1e-3)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    for run_start, run_end in zip(starts, ends):
        flush.zero_()
        run_start.record()
        graph.replay()
        run_end.record()
    torch.cuda.synchronize()
    del graph, flush
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def eager_us(step):
    """Wall-clock µs per step of back-to-back eager calls (host and GPU), after a warm-up."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    count = _reps(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(count):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count * 1e6


# --- the implementations ------------------------------------------------------------------------


def rope_cos_sin(n, d, base, device, dtype):
    """Hugging Face style ``(n, d)`` cos/sin caches (halves repeated), in the model dtype."""
    from .rope import rope_frequencies

    angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * \
        rope_frequencies(d, base, device=device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_step(q, k_cache, v_cache, window, cos, sin, sm_scale=None):
    """ReRoPE decode as the author's patch does it, in torch (rotated cache, all rows full).

    Rebuilds the unrotated keys ``k2 = R(-j) k_rot`` of the whole cache, then ``q_rot · k_rot``
    (inside) and ``R(w) q · k2`` (outside) as two batched matmuls, a select, softmax, ``· v``.
    ``q`` ``(B, Hq, Nq, D)`` rotated at the last positions; ``cos, sin`` from
    :func:`rope_cos_sin` (at least ``Nk + window`` rows).
    """
    batch, hq, n_queries, d = q.shape
    hkv, n_keys = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if sm_scale is None else sm_scale
    k2 = k_cache * cos[:n_keys] - _rotate_half(k_cache) * sin[:n_keys]       # R(-j) k_rot
    pos = torch.arange(n_keys - n_queries, n_keys, device=q.device)
    q_raw = q * cos[pos] - _rotate_half(q) * sin[pos]                      # R(-i) q_rot
    q2 = q_raw * cos[window] + _rotate_half(q_raw) * sin[window]           # R(w) q
    qg = q.reshape(batch, hkv, group * n_queries, d)
    q2g = q2.reshape(batch, hkv, group * n_queries, d)
    s1 = qg @ k_cache.transpose(-1, -2)
    s2 = q2g @ k2.transpose(-1, -2)
    keys = torch.arange(n_keys, device=q.device)
    distance = (pos[:, None] - keys[None, :]).repeat(group, 1)             # (group·Nq, Nk)
    scores = torch.where(distance < window, s1, s2).float() * scale
    scores = scores.masked_fill(distance < 0, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
    return (probs @ v_cache).reshape(batch, hq, n_queries, d)


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def build_step(impl, q, k_cache, v_cache, window, cos_sin):
    """A no-argument callable doing one decode step with ``impl``, or raise if unsupported."""
    import kernels

    if impl == "rerope_decode":
        return lambda: kernels.rerope_decode(q, k_cache, v_cache, window)
    if impl == "rerotate_torch":
        cos, sin = cos_sin
        return lambda: rerotate_step(q, k_cache, v_cache, window, cos, sin)
    if impl.startswith("sdpa_"):
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(impl)

        def sdpa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        return sdpa
    if impl == "flash_attn_kvcache":
        from flash_attn import flash_attn_with_kvcache   # (B, N, H, D) layout

        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k_cache, v_cache))
        return lambda: flash_attn_with_kvcache(qt, kt, vt, causal=True)
    raise ValueError(f"unknown impl {impl!r}")


def available_impls(impls):
    import importlib.util

    return [impl for impl in impls
            if impl != "flash_attn_kvcache" or importlib.util.find_spec("flash_attn")]


# --- rows ----------------------------------------------------------------------------------------


def kv_bytes(batch, context, hkv=HKV, d=D, elem=2):
    """Bytes of the valid K and V a step must read."""
    return 2 * batch * hkv * context * d * elem


def make_row(impl, batch, window, context, us=None, us_eager=None, bound_us=None, **extra):
    row = dict(impl=impl, B=batch, Hq=HQ, Hkv=HKV, D=D, dtype=DTYPE, window=window,
               context=context, Nq=1, us=us, us_eager=us_eager,
               hbm_fraction=None if us is None or bound_us is None else bound_us / us)
    row.update(extra)
    return row


def _describe_error(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def measure(impl, step, batch, window, context, bound_us, **extra):
    try:
        us_eager = eager_us(step)
        us = graph_us(step)
        return make_row(impl, batch, window, context, us, us_eager, bound_us, **extra)
    except torch.OutOfMemoryError:
        skipped = "out of memory"
    except Exception as error:   # report and go on: the row says what failed
        traceback.print_exc()
        skipped = f"error: {_describe_error(error)}"
    gc.collect()
    torch.cuda.empty_cache()
    return make_row(impl, batch, window, context, skipped=skipped, **extra)


def check_accuracy(q, k_cache, v_cache, window):
    """rerope_decode against a float32 reference on the benchmark's inputs (first 16k keys)."""
    import kernels
    from kernels import reference

    n = min(k_cache.shape[2], 16384)
    k, v = k_cache[:1, :, :n], v_cache[:1, :, :n]
    got = kernels.rerope_decode(q[:1], k, v, window).float()
    want = reference.rerope(q[:1].float(), k.float(), v.float(), window, rotated=True)
    err = (got - want).abs().max().item()
    return {"context": n, "window": window, "max_abs_err": err,
            "max_abs_ref": want.abs().max().item()}


def run(args):
    import kernels
    from kernels import decode

    started = time.perf_counter()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "config": dict(decode.GPU_CONFIG), "programs_per_sm": decode.PROGRAMS_PER_SM,
            "args": vars(args)}
    rows, sweep = [], []
    bandwidth = copy_bandwidth()
    meta["copy_tb_s"] = bandwidth / 1e12
    meta["read_tb_s"] = read_bandwidth() / 1e12
    print(f"bench_decode on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, read {meta['read_tb_s']:.2f} TB/s",
          flush=True)
    if args.tune:
        meta["tuning"] = tune(bandwidth)
        meta["config"] = dict(decode.GPU_CONFIG)
        meta["programs_per_sm"] = decode.PROGRAMS_PER_SM
        write_results(args.out, rows, meta, sweep)
    impls = available_impls(args.impl)
    dtype = getattr(torch, DTYPE)
    for batch in args.batch:
        for context in args.context:
            torch.manual_seed(0)
            k_cache = torch.randn(batch, HKV, context, D, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=dtype)
            bound_us = kv_bytes(batch, context) / bandwidth * 1e6
            cos_sin = rope_cos_sin(context + max(args.window) + 1, D, BASE, "cuda", dtype)
            if batch == args.batch[0] and context == max(args.context):
                meta["checks"] = [check_accuracy(q, k_cache, v_cache, w) for w in args.window]
                print("check:", meta["checks"], flush=True)
            for window in args.window:
                rows.append(make_row("hbm_bound", batch, window, context, bound_us, None,
                                     bound_us))
                splits = decode.default_num_splits(batch, HKV, HQ // HKV, 1, context, meta["sms"])
                for impl in impls:
                    extra = {"num_splits": splits} if impl == "rerope_decode" else {}
                    if impl == "rerotate_torch" and window != args.window[0]:
                        continue     # its time does not depend on the window
                    try:
                        step = build_step(impl, q, k_cache, v_cache, window, cos_sin)
                        row = measure(impl, step, batch, window, context, bound_us, **extra)
                    except Exception as error:
                        row = make_row(impl, batch, window, context,
                                       skipped=f"error: {_describe_error(error)}")
                    rows.append(row)
                    us = "-" if row["us"] is None else f"{row['us']:9.1f} us"
                    eager = "" if row["us_eager"] is None else f" eager {row['us_eager']:8.1f} us"
                    frac = "" if row["hbm_fraction"] is None else f" {row['hbm_fraction']:.2f} HBM"
                    print(f"B={batch} ctx={context:<6} w={window:<4} {impl:<18} {us}{eager}{frac}"
                          f" {row.get('skipped', '')}", flush=True)
                    write_results(args.out, rows, meta, sweep)
            if args.sweep and context in (4096, 131072):
                sweep += sweep_splits(q, k_cache, v_cache, args.window[0], batch, context,
                                      bound_us)
                if batch == 1 and context == 131072:     # the raw-key cache, for comparison
                    step = lambda: kernels.rerope_decode(q, k_cache, v_cache, args.window[0],
                                                         rotated=False)
                    sweep.append(measure("rerope_decode", step, batch, args.window[0], context,
                                         bound_us, rotated=False))
                write_results(args.out, rows, meta, sweep)
            del k_cache, v_cache, q, cos_sin
            gc.collect()
            torch.cuda.empty_cache()
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_results(args.out, rows, meta, sweep)
    print(f"wrote {len(rows)} rows to {args.out} in {meta['elapsed_s']} s", flush=True)
    return rows


SPLITS_SWEEP = (1, 2, 4, 8, 12, 16, 24, 33, 48, 66, 96, 128)


def sweep_splits(q, k_cache, v_cache, window, batch, context, bound_us):
    import kernels

    out = []
    for splits in SPLITS_SWEEP:
        step = (lambda s: lambda: kernels.rerope_decode(q, k_cache, v_cache, window,
                                                        num_splits=s))(splits)
        row = measure("rerope_decode", step, batch, window, context, bound_us, num_splits=splits)
        out.append(row)
        print(f"  sweep splits={splits:<4} {row['us']} us", flush=True)
    return out


# (BLOCK_N, ANGLES, num_warps, num_stages) tried by --tune, each at 1 and 2 programs per SM in
# the splits rule. A first H200 run (2026-12-01) swept a wider set: 8 warps were 1.45x slower
# than 4 at 128k keys, 32-key tiles 1.25x; decode.GPU_CONFIG is the winner of the run in
# book/data/decode_h200.json.
TUNE_CANDIDATES = [(64, 0, 4, 3), (64, 3, 4, 3), (64, 0, 4, 4), (64, 3, 4, 4), (32, 0, 4, 4),
                   (64, 1, 4, 3)]
TUNE_SHAPES = [(1, 131072), (8, 131072)]


def tune(bandwidth, window=2048):
    """Time every candidate configuration on TUNE_SHAPES (rotated cache, graph replay); set
    the fastest (least total time) as ``decode.GPU_CONFIG`` / ``PROGRAMS_PER_SM``. Returns the
    rows."""
    import kernels
    from kernels import decode

    dtype = getattr(torch, DTYPE)
    caches = {}
    for batch, context in TUNE_SHAPES:
        torch.manual_seed(0)
        k = torch.randn(batch, HKV, context, D, device="cuda", dtype=dtype)
        caches[batch, context] = (torch.randn(batch, HQ, 1, D, device="cuda", dtype=dtype), k,
                                  torch.randn_like(k))
    results, best = [], None
    for n, a, w, s in TUNE_CANDIDATES:
        decode.GPU_CONFIG = dict(BLOCK_N=n, ANGLES=a, num_warps=w, num_stages=s)
        for per_sm in (1, 2):
            decode.PROGRAMS_PER_SM = per_sm
            total, row_times = 0.0, []
            for (batch, context), (q, k, v) in caches.items():
                try:
                    us = graph_us(lambda: kernels.rerope_decode(q, k, v, window))
                except Exception as error:
                    print(f"  tune {(n, a, w, s)} failed: {_describe_error(error)}", flush=True)
                    us = float("inf")
                total += us
                row_times.append({"B": batch, "context": context, "us": us,
                                  "hbm_fraction": kv_bytes(batch, context) / bandwidth * 1e6 / us})
            results.append({"config": [n, a, w, s], "programs_per_sm": per_sm, "times": row_times})
            print(f"  tune {(n, a, w, s)} per_sm={per_sm}: "
                  + ", ".join(f"B={r['B']} {r['us']:.1f} us" for r in row_times), flush=True)
            if best is None or total < best[0]:
                best = (total, (n, a, w, s), per_sm)
    _, (n, a, w, s), per_sm = best
    decode.GPU_CONFIG = dict(BLOCK_N=n, ANGLES=a, num_warps=w, num_stages=s)
    decode.PROGRAMS_PER_SM = per_sm
    print(f"tuned: {decode.GPU_CONFIG}, {per_sm} programs per SM", flush=True)
    del caches
    gc.collect()
    torch.cuda.empty_cache()
    return results


# --- reading results back (no GPU needed) ---------------------------------------------------------


def write_results(path, rows, meta, sweep=()):
    """Write ``{"meta", "rows", "sweep"}`` to ``path`` atomically (via ``bench.write_results``)."""
    from .bench import write_results as write

    write(path, rows, meta, sweep=list(sweep))


def load_results(path):
    """``(meta, rows)`` of a results file written by this module."""
    from .bench import read_results

    results = read_results(path, what="decode benchmark")
    return results["meta"], results["rows"]


def select_rows(rows, **where):
    """Rows whose fields equal every ``key=value`` of ``where`` (``None`` matches all)."""
    return [row for row in rows
            if all(value is None or row.get(key) == value for key, value in where.items())]


def targets(rows, window=2048):
    """The issue's three targets per (B, context): HBM fraction, speed vs the best SDPA decode
    and vs the re-rotate approach. A list of dicts."""
    out = []
    for row in select_rows(rows, impl="rerope_decode", window=window):
        if row.get("us") is None:
            continue
        shape = dict(B=row["B"], context=row["context"])
        sdpa = [r["us"] for r in select_rows(rows, window=window, **shape)
                if r["impl"].startswith("sdpa_") and r.get("us") is not None]
        rerotate = [r["us"] for r in select_rows(rows, impl="rerotate_torch", **shape)
                    if r.get("us") is not None]
        out.append({**shape, "us": row["us"], "hbm_fraction": row["hbm_fraction"],
                    "vs_best_sdpa": min(sdpa) / row["us"] if sdpa else None,
                    "vs_rerotate": rerotate[0] / row["us"] if rerotate else None})
    return out


def plot_latency(rows, ax=None, *, B=1, window=2048, impls=None, key="us"):
    """Per-step latency (µs, log-log) against context for each impl, the HBM bound dashed."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    impls = impls or [i for i in ("rerotate_torch", "sdpa_flash", "sdpa_cudnn", "rerope_decode",
                                  "hbm_bound") if select_rows(rows, impl=i, B=B)]
    for impl in impls:
        picked = [r for r in select_rows(rows, impl=impl, B=B)
                  if r.get(key) is not None and (impl == "rerotate_torch" or r["window"] == window)]
        picked.sort(key=lambda r: r["context"])
        if not picked:
            continue
        style = dict(linestyle="--", color="k") if impl == "hbm_bound" else dict(marker="o")
        ax.plot([r["context"] for r in picked], [r[key] for r in picked], label=impl, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (keys in the cache)")
    ax.set_ylabel("µs per decode step" + (" (eager)" if key == "us_eager" else ""))
    ax.set_title(f"B={B}, Hq={HQ}, Hkv={HKV}, D={D}, {DTYPE}, window {window}")
    ax.legend(fontsize=8)
    return ax


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--window", type=int, nargs="+", default=list(WINDOWS))
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=ALL_IMPLS)
    parser.add_argument("--quick", action="store_true", help="B=1, contexts 4k and 128k")
    parser.add_argument("--sweep", action="store_true", help="also num_splits and configs")
    parser.add_argument("--tune", action="store_true",
                        help="first pick the launch configuration (TUNE_CANDIDATES) at 128k")
    parser.add_argument("--out", default="decode_bench.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context = [1], [4096, 131072]
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench_decode needs a CUDA GPU", file=sys.stderr)
        return 1
    with torch.no_grad():
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
