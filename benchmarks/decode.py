"""How fast is a ReRoPE decode step? ``rerope.rerope_decode`` against what a user could run.

Run it on a CUDA GPU from the repository root, with ``rerope`` importable (``pip install -e .``,
or ``PYTHONPATH=kernels:.`` in a checkout)::

    python -m benchmarks.decode                  # the whole grid below (~3 min on an H200)
    python -m benchmarks.decode --quick          # D=128, bf16, B=1, 4k and 128k only
    python -m benchmarks.decode --no-extras      # the main grid only

The main grid: ``Nq = 1`` new query per row against a full cache of ``context`` keys,
``D ∈ {64, 128}``, ``B ∈ {1, 8, 32}``, ``context ∈ {4k, 32k, 128k}``, ``Hq = 32``,
``Hkv = 8``, bf16 (windows 2048 and 512) and fp16 (window 2048), the cache holding RoPE-rotated
keys (as a Llama model keeps it). The extras (bf16, window 2048): ``Nq ∈ {2, 4, 8}``
(speculative decoding) at B=8; the paged layout (``page_size`` 16 to 256, the same data in
random non-monotone pages, ``layout="paged"``); the raw-key cache (``rotated=False``); and, in
``sweep``, the number of splits at D=128. The implementations (``impl``):

- ``rerope_decode``: ours, split-KV with the rotation done in the kernel.
- ``rerotate_torch``: what the author's Hugging Face patch does, in torch: rebuild the unrotated
  keys ``k2 = R(-j) k_rot`` for the whole cache, then two matmuls (``q_rot · k_rot`` inside the
  window, ``R(w) q · k2`` outside), a select, a softmax and ``· v`` (D=128, B ≤ 8 only).
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``: PyTorch's fused *plain* attention decode
  on the same cache (``enable_gqa``): not ReRoPE, the speed of light ReRoPE can approach. Their
  time does not depend on the window: measured once per shape (rows with ``window`` 2048). For
  ``Nq > 1`` they run without a causal mask (the mask of the last ``Nq - 1`` keys costs nothing
  measurable; the bytes are the same). ``flash_attn_kvcache``: ``flash_attn_with_kvcache``
  if importable.
- ``hbm_bound``: the time to read the valid K and V once at the **read bandwidth** measured in
  the same run (``meta.read_tb_s``: the fastest of a few Triton kernels that sum a 2 GiB bf16
  buffer, :func:`triton_read_bandwidth`; ``meta.copy_tb_s``, a device copy counting read and
  write bytes, is recorded too).

Per step we report ``us``: the median GPU time of one step replayed from a CUDA graph, the L2
cache flushed before each replay (in a model the other layers' caches evict it), timed with CUDA
events; and ``us_eager``: the wall-clock time per step of back-to-back eager calls (host included:
what a Python decode loop sees). ``hbm_fraction = hbm_bound / us``. Every kernel variant is
compiled first in parallel worker processes (:func:`precompile`); with ``WAIT_PID`` set (a
process sharing the GPU, e.g. a test run) the timing waits for that process to end
(:func:`benchmarks.harness.wait_for_gpu_sharer`). A
``rerope_decode`` row's ``tma`` says whether it read K and V through TMA descriptors
(:func:`rerope.decode.use_tma`). JSON like
:mod:`benchmarks.attention`::

    {"meta": {"gpu", "torch", "triton", "cuda", "date", "read_tb_s", "copy_tb_s", ...},
     "rows": [{"impl", "B", "Hq", "Hkv", "D", "dtype", "window", "context", "Nq",
               "us", "us_eager", "hbm_fraction", ("num_splits"), ("layout", "page_size"),
               ("tma"), ("rotated"), ("skipped")}],
     "sweep": [...]}      # num_splits variants

:func:`load_results`, :func:`select_rows` and :func:`plot_latency` read the file back; they need
no GPU. Timing, metadata and the file go through :mod:`benchmarks.harness`.
"""

import argparse
import gc
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from .harness import (back_to_back_us, describe_error, environment, event_times_ms,
                      l2_flush_buffer, read_results, repetitions, select_rows, wait_for_gpu_sharer)
from .harness import write_results as write_results_file

IMPLS = ("rerope_decode", "rerotate_torch", "sdpa_flash", "sdpa_cudnn", "flash_attn_kvcache")
# impls whose time does not depend on ReRoPE's window: measured once per shape (window 2048)
WINDOW_FREE = ("rerotate_torch", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
               "flash_attn_kvcache")
# sdpa_efficient (memory-efficient attention) has no GQA decode path in torch 2.11 ("No available
# kernel"): not in the default list.
ALL_IMPLS = IMPLS + ("sdpa_efficient",)
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)
WINDOWS = (2048, 512)
HQ, HKV, D, DTYPE = 32, 8, 128, "bfloat16"
D_DEFAULT = D        # the head dim of rows written before D was a grid axis
BASE = 10000.0

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
    times_ms = event_times_ms(lambda: dst.copy_(src), reps, sync_each=True)
    del src, dst
    return 2 * nbytes / (statistics.median(times_ms) * 1e-3)


def read_bandwidth(nbytes=COPY_BYTES, reps=10):
    """Bytes/s a max-reduction over a large tensor reads (``meta.read_tb_s``; torch's reduction
    kernel, 3.5 TB/s on the H200: below the copy, so not a ceiling; the bound uses the copy)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    src.amax()
    torch.cuda.synchronize()
    times_ms = event_times_ms(src.amax, reps, sync_each=True)
    del src
    return nbytes / (statistics.median(times_ms) * 1e-3)


def _read_kernel_factory():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(X, Out, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """Sum ``BLOCK · ITERS`` contiguous elements per program (fp32), one partial each."""
        base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in tl.static_range(ITERS):          # unrolled: ITERS loads in flight
            acc += tl.load(X + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(Out + tl.program_id(0), tl.sum(acc, 0))
    return read_kernel


# (BLOCK, ITERS, num_warps), the loop unrolled. On the H200 (book/data/decode_h200.json,
# meta.read_configs_tb_s) 1024 x 16 read fastest, 4.52 TB/s; a rolled 2048 x 32 loop read 4.37.
READ_CONFIGS = ((1024, 16, 4), (2048, 32, 4), (2048, 8, 4), (4096, 8, 8), (1024, 64, 4),
                (8192, 4, 8))


def triton_read_bandwidth(nbytes=COPY_BYTES, reps=10, configs=READ_CONFIGS):
    """Bytes/s of the fastest of a few Triton read-only kernels (a sum of a large bf16 buffer
    into per-program partials; nothing written but the partials): ``meta.read_tb_s``, the bound
    ``hbm_bound`` and ``hbm_fraction`` use. Returns ``(bytes/s, {config: bytes/s})``."""
    kernel = _read_kernel_factory()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    want, scale = src.sum(dtype=torch.float64).item(), src.abs().sum(dtype=torch.float64).item()
    found = {}
    for block, iters, warps in configs:
        programs = src.numel() // (block * iters)
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        run = lambda: kernel[(programs,)](src, out, BLOCK=block, ITERS=iters, num_warps=warps)
        run()
        torch.cuda.synchronize()
        if abs(out.sum(dtype=torch.float64).item() - want) > 1e-4 * scale:   # it read it all
            raise RuntimeError(f"read kernel {block, iters, warps}: wrong sum")
        times_ms = event_times_ms(run, reps, sync_each=True)
        found[f"BLOCK={block},ITERS={iters},warps={warps}"] = (
            programs * block * iters * 2 / (statistics.median(times_ms) * 1e-3))
    del src
    return max(found.values()), found


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
    flush = l2_flush_buffer()
    graph.replay()
    torch.cuda.synchronize()
    (estimate_ms,) = event_times_ms(graph.replay, 1)
    count = repetitions(estimate_ms * 1e-3, TIME_BUDGET_S, MIN_REPS, MAX_REPS)
    times_ms = event_times_ms(graph.replay, count, flush=flush)
    del graph, flush
    return statistics.median(times_ms) * 1e3


def eager_us(step):
    """Wall-clock µs per step of back-to-back eager calls (host and GPU), after a warm-up."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    count = repetitions(time.perf_counter() - start, TIME_BUDGET_S, MIN_REPS, MAX_REPS)
    return back_to_back_us(step, count, warmup=0)


# --- the implementations ------------------------------------------------------------------------


def rope_cos_sin(n, d, base, device, dtype):
    """Hugging Face style ``(n, d)`` cos/sin caches (halves repeated), in the model dtype."""
    from rerope.rope import rope_frequencies

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
    import rerope

    if impl == "rerope_decode":
        return lambda: rerope.rerope_decode(q, k_cache, v_cache, window)
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
    """One result row; ``extra`` may override ``D``, ``dtype``, ``Nq`` (and add fields)."""
    row = dict(impl=impl, B=batch, Hq=HQ, Hkv=HKV, D=D, dtype=DTYPE, window=window,
               context=context, Nq=1, us=us, us_eager=us_eager,
               hbm_fraction=None if us is None or bound_us is None else bound_us / us)
    row.update(extra)
    return row


def measure(impl, step, batch, window, context, bound_us, eager=True, **extra):
    try:
        us_eager = eager_us(step) if eager else None
        us = graph_us(step)
        return make_row(impl, batch, window, context, us, us_eager, bound_us, **extra)
    except torch.OutOfMemoryError:
        skipped = "out of memory"
    except Exception as error:   # report and go on: the row says what failed
        traceback.print_exc()
        skipped = f"error: {describe_error(error)}"
    gc.collect()
    torch.cuda.empty_cache()
    return make_row(impl, batch, window, context, skipped=skipped, **extra)


def check_accuracy(q, k_cache, v_cache, window):
    """rerope_decode against a float32 reference on the benchmark's inputs (first 16k keys)."""
    import rerope
    from rerope import reference

    n = min(k_cache.shape[2], 16384)
    k, v = k_cache[:1, :, :n], v_cache[:1, :, :n]
    got = rerope.rerope_decode(q[:1], k, v, window).float()
    want = reference.rerope(q[:1].float(), k.float(), v.float(), window, rotated=True)
    err = (got - want).abs().max().item()
    return {"context": n, "window": window, "D": q.shape[-1], "dtype": str(q.dtype)[6:],
            "Nq": q.shape[2], "max_abs_err": err, "max_abs_ref": want.abs().max().item()}


def paged_copy(k_cache, v_cache, page_size, seed=0):
    """``(B, Hkv, N, D)`` caches scattered into random, non-monotone pages of ``page_size`` keys
    (the flash-attn layout ``(num_blocks, page_size, Hkv, D)``, 16 spare pages, unused slots
    NaN): ``(k_pages, v_pages, block_table)``."""
    batch, hkv, n, d = k_cache.shape
    per_row = n // page_size
    blocks = -(-batch * per_row // 16) * 16 + 16
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(blocks, generator=gen)[:batch * per_row].view(batch, per_row)
    table = table.to(torch.int32).to(k_cache.device)
    pools = []
    for x in (k_cache, v_cache):
        pool = torch.full((blocks, page_size, hkv, d), float("nan"), dtype=x.dtype,
                          device=x.device)
        pool[table.flatten().long()] = (x.view(batch, hkv, per_row, page_size, d)
                                        .permute(0, 2, 3, 1, 4).reshape(-1, page_size, hkv, d))
        pools.append(pool)
    return pools[0], pools[1], table


# --- the grid ------------------------------------------------------------------------------------

HEAD_DIMS = (64, 128)
# decode_config tuples (BLOCK_N, num_warps, num_stages, programs_per_SM) timed beside
# the default (decode.launch_config) in the sweep, per head dim; none now
# (perf/NOTES.md)
CONFIG_VARIANTS = {}
SPEC_QUERIES = (2, 4, 8)
PAGE_SIZES = (16, 32, 64, 128, 256)


def grid(args):
    """The cases of one run, grouped by cache: ``{(D, B, context, dtype): [case, ...]}``. A case
    is ``(impl, window, extra)``; ``extra`` carries ``Nq``, ``page_size``, ``rotated``,
    ``num_splits`` where they differ from the defaults."""
    groups = {}

    def add(d, batch, context, dtype, impl, window, **extra):
        groups.setdefault((d, batch, context, dtype), []).append((impl, window, extra))

    for d in args.head_dim:
        for dtype in args.dtype:
            for batch in args.batch:
                for context in args.context:
                    for window in (args.window if dtype == args.dtype[0] else args.window[:1]):
                        add(d, batch, context, dtype, "rerope_decode", window)
                    for impl in ("sdpa_flash", "sdpa_cudnn"):   # window-independent
                        if impl in args.impl:
                            add(d, batch, context, dtype, impl, args.window[0])
                    if ("rerotate_torch" in args.impl and dtype == args.dtype[0]
                            and batch <= 8 and d == 128):   # slow: the D=128 rows of old
                        add(d, batch, context, dtype, "rerotate_torch", args.window[0])
        if not args.no_extras:
            dtype = args.dtype[0]
            for context in (32768, 131072):
                for nq in SPEC_QUERIES:                      # speculative decoding
                    for impl in ("rerope_decode", "sdpa_flash", "sdpa_cudnn"):
                        add(d, 8, context, dtype, impl, args.window[0], Nq=nq)
            for batch, context in ((1, 131072), (8, 32768), (8, 131072), (32, 32768)):
                for page in PAGE_SIZES:
                    add(d, batch, context, dtype, "rerope_decode", args.window[0],
                        page_size=page)
            add(d, 1, 131072, dtype, "rerope_decode", args.window[0], rotated=False)
            for batch, context in ((1, 131072), (8, 131072), (32, 32768)):
                for variant in CONFIG_VARIANTS.get(d, ()):  # launch configurations
                    add(d, batch, context, dtype, "rerope_decode", args.window[0],
                        config=tuple(variant), sweep=True)
            if d == 128:                                     # the number of splits
                for batch, context in ((1, 4096), (1, 131072), (8, 4096), (8, 131072)):
                    for splits in SPLITS_SWEEP:
                        add(d, batch, context, dtype, "rerope_decode", args.window[0],
                            num_splits=splits, sweep=True)
    return groups


def _rerope_call(q, k, v, window, extra):
    """A no-argument ``rerope_decode`` step for a case (paged: scatter the caches first)."""
    import rerope

    kwargs = {"num_splits": extra.get("num_splits"), "rotated": extra.get("rotated", True)}
    if extra.get("page_size"):
        k_pages, v_pages, table = paged_copy(k, v, extra["page_size"])
        lengths = torch.full((k.shape[0],), k.shape[2], dtype=torch.int32, device=k.device)
        return lambda: rerope.rerope_decode(q, k_pages, v_pages, window, cache_seqlens=lengths,
                                            block_table=table, **kwargs)
    return lambda: rerope.rerope_decode(q, k, v, window, **kwargs)


def warm_spec(d, batch, context, dtype, window, extra):
    """What decides the split kernel's compiled variant for a case (see :func:`warm`)."""
    from rerope import decode

    nq = extra.get("Nq", 1)
    splits = extra.get("num_splits") or decode.default_num_splits(batch, HKV, HQ // HKV, nq,
                                                                  context, 132)
    return (d, batch, nq, dtype, window, splits, extra.get("page_size"),
            extra.get("rotated", True), extra.get("config"))


_TUNED = None     # the decode_config --tune chose, for every later row without its own


def _launch_config(config):
    """``with _launch_config(config):`` run under
    ``rerope.using_config(decode_config=config)`` (``None``: the tuned one, else the
    default)."""
    import contextlib

    import rerope

    config = config or _TUNED
    return contextlib.nullcontext() if config is None else rerope.using_config(
        decode_config=tuple(config))


def warm(spec):
    """Compile one variant on a small cache with the same specialisation (worker process)."""
    d, batch, nq, dtype, window, splits, page, rotated, config = spec
    with _launch_config(config):
        _warm(d, batch, nq, dtype, window, splits, page, rotated)
    return spec


def _warm(d, batch, nq, dtype, window, splits, page, rotated):
    n = 4096
    dt = getattr(torch, dtype)
    q = torch.randn(batch, HQ, nq, d, device="cuda", dtype=dt)
    k = torch.randn(batch, HKV, n, d, device="cuda", dtype=dt)
    step = _rerope_call(q, k, torch.randn_like(k), window,
                        {"num_splits": splits, "page_size": page, "rotated": rotated})
    step()
    torch.cuda.synchronize()


def precompile(groups, workers=15):
    """Compile every split-kernel variant the grid uses in parallel worker processes (Triton's
    on-disk cache then serves the timed process). Returns the number of variants."""
    import concurrent.futures
    import multiprocessing

    specs = sorted({warm_spec(d, batch, context, dtype, window, extra)
                    for (d, batch, context, dtype), cases in groups.items()
                    for impl, window, extra in cases if impl == "rerope_decode"}, key=str)
    from benchmarks import decode as bench_decode     # by its import name (also when run with -m)

    with concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(bench_decode.warm, specs))
    return len(specs)


def run(args):
    import rerope
    from rerope import decode

    global TIME_BUDGET_S
    TIME_BUDGET_S = args.time_budget
    started = time.perf_counter()
    meta = {**environment(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "config": dict(decode.GPU_CONFIG),
            "programs_per_sm": decode.launch_config(128)[1],
            "head_dim_configs": {str(d): decode.launch_config(d)[0]
                                 for d in args.head_dim},
            "args": vars(args)}
    meta["tma"] = {"mode": rerope.config().tma, "head_dims": list(decode.TMA_HEAD_DIMS),
                   "min_keys_per_split": decode.TMA_MIN_KEYS}
    rows, sweep = [], []
    groups = grid(args)
    if not args.no_precompile:
        meta["precompiled"] = precompile(groups)
        meta["precompile_s"] = round(time.perf_counter() - started, 1)
        print(f"precompiled {meta['precompiled']} variants in {meta['precompile_s']} s", flush=True)
    wait_for_gpu_sharer()
    meta["timing_started_s"] = round(time.perf_counter() - started, 1)
    bandwidth = copy_bandwidth()
    meta["copy_tb_s"] = bandwidth / 1e12
    read, reads = triton_read_bandwidth()
    meta["read_tb_s"] = read / 1e12
    meta["read_configs_tb_s"] = {k: v / 1e12 for k, v in reads.items()}
    meta["amax_tb_s"] = read_bandwidth() / 1e12
    meta["bound"] = ("hbm_bound = valid K and V bytes / read_tb_s (the fastest Triton read-only "
                     "kernel of READ_CONFIGS, same run)")
    print(f"bench_decode on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}; "
          f"read {meta['read_tb_s']:.2f} TB/s, copy {meta['copy_tb_s']:.2f} TB/s", flush=True)
    if args.tune:
        meta["tuning"] = tune(read)
        meta["decode_config"] = list(_TUNED)
    meta["checks"] = []
    for (d, batch, context, dtype), cases in groups.items():
        if time.perf_counter() - started > args.budget_s:
            print("time budget spent: stopping", flush=True)
            meta["stopped_early"] = True
            break
        dt = getattr(torch, dtype)
        torch.manual_seed(0)
        nqs = sorted({extra.get("Nq", 1) for _, _, extra in cases})
        k_cache = torch.randn(batch, HKV, context, d, device="cuda", dtype=dt)
        v_cache = torch.randn_like(k_cache)
        queries = {nq: torch.randn(batch, HQ, nq, d, device="cuda", dtype=dt) for nq in nqs}
        bound_us = kv_bytes(batch, context, d=d) / read * 1e6
        if batch == 1 and context == max(args.context):
            for nq in nqs:
                meta["checks"].append(check_accuracy(queries[nq], k_cache, v_cache,
                                                     args.window[0]))
                print("check:", meta["checks"][-1], flush=True)
        windows = sorted({w for _, w, _ in cases}, reverse=True)
        for window in windows:
            rows.append(make_row("hbm_bound", batch, window, context, bound_us, None, bound_us,
                                 D=d, dtype=dtype))
        for impl, window, extra in cases:
            extra = dict(extra)
            nq = extra.pop("Nq", 1)
            is_sweep = extra.pop("sweep", False)
            q = queries[nq]
            config = extra.pop("config", None)
            info = dict(D=d, dtype=dtype, Nq=nq, **extra)
            if config is not None:
                info["config"] = list(config)
            try:
                if impl == "rerope_decode":
                    info.setdefault("num_splits", decode.default_num_splits(
                        batch, HKV, HQ // HKV, nq, context, meta["sms"]))
                    info["layout"] = "paged" if extra.get("page_size") else "contiguous"
                    info["tma"] = decode.use_tma(k_cache, v_cache, bool(extra.get("page_size")),
                                                 -(-context // info["num_splits"]))
                    step = _rerope_call(q, k_cache, v_cache, window, {**extra, **info})
                    if extra.get("page_size"):     # the paged call must give the same output
                        want = rerope.rerope_decode(q, k_cache, v_cache, window,
                                                    num_splits=info["num_splits"])
                        info["max_abs_diff_vs_contiguous"] = (
                            step().float() - want.float()).abs().max().item()
                else:
                    step = build_step(impl, q, k_cache, v_cache, window,
                                      rope_cos_sin(context + window + 1, d, BASE, "cuda", dt)
                                      if impl == "rerotate_torch" else None)
                with _launch_config(config):
                    row = measure(impl, step, batch, window, context, bound_us,
                                  eager=not is_sweep, **info)
            except Exception as error:
                row = make_row(impl, batch, window, context,
                               skipped=f"error: {describe_error(error)}", **info)
            (sweep if is_sweep else rows).append(row)
            us = "-" if row["us"] is None else f"{row['us']:9.1f} us"
            frac = "" if row["hbm_fraction"] is None else f" {row['hbm_fraction']:.2f} bound"
            print(f"D={d} {dtype} B={batch} ctx={context:<6} w={window:<4} Nq={nq} {impl:<15} "
                  f"{extra} {us}{frac} {row.get('skipped', '')}", flush=True)
            step = None
            gc.collect()
        write_results(args.out, rows, meta, sweep)
        del k_cache, v_cache, queries
        gc.collect()
        torch.cuda.empty_cache()
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_results(args.out, rows, meta, sweep)
    print(f"wrote {len(rows)} rows to {args.out} in {meta['elapsed_s']} s", flush=True)
    return rows


SPLITS_SWEEP = (1, 2, 4, 8, 12, 16, 24, 33, 48, 66, 96, 128)


# (BLOCK_N, num_warps, num_stages) tried by --tune, each at 1 and 2 programs per SM in
# the splits rule (measured on the H200: perf/NOTES.md).
TUNE_CANDIDATES = [(64, 4, 3), (64, 4, 4), (32, 4, 4), (128, 4, 3)]
TUNE_SHAPES = [(1, 131072), (8, 131072)]


def tune(bandwidth, window=2048):
    """Time every candidate configuration on TUNE_SHAPES (rotated cache, graph replay);
    the fastest (least total time) becomes the ``decode_config`` of the rows after.
    Returns the rows."""
    global _TUNED
    import rerope

    dtype = getattr(torch, DTYPE)
    caches = {}
    for batch, context in TUNE_SHAPES:
        torch.manual_seed(0)
        k = torch.randn(batch, HKV, context, D, device="cuda", dtype=dtype)
        caches[batch, context] = (torch.randn(batch, HQ, 1, D, device="cuda", dtype=dtype), k,
                                  torch.randn_like(k))
    results, best = [], None
    for n, w, s in TUNE_CANDIDATES:
        for per_sm in (1, 2):
            total, row_times = 0.0, []
            for (batch, context), (q, k, v) in caches.items():
                try:
                    with rerope.using_config(decode_config=(n, w, s, per_sm)):
                        us = graph_us(lambda: rerope.rerope_decode(q, k, v, window))
                except Exception as error:
                    print(f"  tune {(n, w, s)} failed: {describe_error(error)}",
                          flush=True)
                    us = float("inf")
                total += us
                row_times.append({"B": batch, "context": context, "us": us,
                                  "hbm_fraction": kv_bytes(batch, context) / bandwidth * 1e6 / us})
            results.append({"config": [n, w, s], "programs_per_sm": per_sm,
                            "times": row_times})
            print(f"  tune {(n, w, s)} per_sm={per_sm}: "
                  + ", ".join(f"B={r['B']} {r['us']:.1f} us" for r in row_times), flush=True)
            if best is None or total < best[0]:
                best = (total, (n, w, s, per_sm))
    _TUNED = best[1]
    print(f"tuned: decode_config={_TUNED}", flush=True)
    del caches
    gc.collect()
    torch.cuda.empty_cache()
    return results


# --- reading results back (no GPU needed) ---------------------------------------------------------


def write_results(path, rows, meta, sweep=()):
    """Write ``{"meta", "rows", "sweep"}`` to ``path`` atomically."""
    write_results_file(path, rows, meta, sweep=list(sweep))


def load_results(path):
    """``(meta, rows)`` of a results file written by this module."""
    results = read_results(path, what="decode benchmark")
    return results["meta"], results["rows"]


def is_plain(row):
    """A row of the main grid: contiguous cache, rotated, default splits (no paged, raw-cache
    or sweep fields). Rows of files older than issue 19 have none of these fields."""
    return (row.get("layout", "contiguous") == "contiguous" and row.get("rotated", True)
            and not row.get("page_size"))


def targets(rows, window=2048, D=None, dtype=None, Nq=1, layout="contiguous"):
    """The targets per (D, dtype, B, context, Nq) at ``window``: the fraction of the read bound,
    speed against the faster SDPA decode (``sdpa_flash``/``sdpa_cudnn``, measured once per
    shape: their time does not depend on the window) and against the re-rotate approach. For
    ``layout="paged"`` one entry per page size, against the same shape's SDPA. A list of
    dicts."""
    out = []
    for row in select_rows(rows, impl="rerope_decode", window=window, D=D, dtype=dtype, Nq=Nq):
        paged = bool(row.get("page_size"))
        if row.get("us") is None or paged != (layout == "paged") or not row.get("rotated", True):
            continue
        shape = dict(B=row["B"], context=row["context"], D=row.get("D", D_DEFAULT),
                     dtype=row.get("dtype", DTYPE), Nq=row.get("Nq", 1))
        sdpa = [r["us"] for r in select_rows(rows, **shape)
                if r["impl"].startswith("sdpa_") and r.get("us") is not None]
        rerotate = [r["us"] for r in select_rows(rows, impl="rerotate_torch", **shape)
                    if r.get("us") is not None]
        contiguous = [r["us"] for r in select_rows(rows, impl="rerope_decode", window=window,
                                                   **shape)
                      if is_plain(r) and r.get("us") is not None]
        entry = {**shape, "window": window, "us": row["us"], "hbm_fraction": row["hbm_fraction"],
                 "vs_best_sdpa": min(sdpa) / row["us"] if sdpa else None,
                 "vs_rerotate": rerotate[0] / row["us"] if rerotate else None}
        if paged:
            entry.update(page_size=row["page_size"],
                         vs_contiguous=contiguous[0] / row["us"] if contiguous else None)
        out.append(entry)
    return out


IMPL_COLORS = {"rerope_decode": "tab:red", "sdpa_cudnn": "tab:green", "sdpa_flash": "tab:orange",
               "rerotate_torch": "tab:blue", "flash_attn_kvcache": "tab:purple"}


def plot_latency(rows, ax=None, *, B=1, window=2048, impls=None, key="us", D=D,
                 dtype=DTYPE):
    """Per-step latency (µs, log-log) against context for each impl (one query, contiguous
    rotated cache, head dim ``D``, ``dtype``), the read bound dashed."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    rows = [r for r in rows if r.get("D", D_DEFAULT) == D and r.get("dtype", DTYPE) == dtype
            and r.get("Nq", 1) == 1 and is_plain(r)]
    impls = impls or [i for i in ("rerotate_torch", "sdpa_flash", "sdpa_cudnn", "rerope_decode",
                                  "hbm_bound") if select_rows(rows, impl=i, B=B)]
    for impl in impls:
        picked = [r for r in select_rows(rows, impl=impl, B=B)
                  if r.get(key) is not None and (impl in WINDOW_FREE or r["window"] == window)]
        picked.sort(key=lambda r: r["context"])
        if not picked:
            continue
        style = (dict(linestyle="--", color="k") if impl == "hbm_bound" else
                 dict(marker="o", color=IMPL_COLORS.get(impl)))
        ax.plot([r["context"] for r in picked], [r[key] for r in picked], label=impl, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (keys in the cache)")
    ax.set_ylabel("µs per decode step" + (" (eager)" if key == "us_eager" else ""))
    ax.set_title(f"B={B}, Hq={HQ}, Hkv={HKV}, D={D}, {dtype}, window {window}")
    ax.legend(fontsize=8)
    return ax


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"],
                        choices=["bfloat16", "float16"])
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--window", type=int, nargs="+", default=list(WINDOWS))
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=ALL_IMPLS)
    parser.add_argument("--quick", action="store_true",
                        help="D=128, bf16, B=1, contexts 4k and 128k, no extras")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip the Nq > 1, paged, raw-cache and num_splits rows")
    parser.add_argument("--no-precompile", action="store_true",
                        help="compile in the timing process (no parallel warm-up)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="stop starting new cache groups after this many seconds")
    parser.add_argument("--time-budget", type=float, default=TIME_BUDGET_S,
                        help="seconds of repetitions per case and timing mode")
    parser.add_argument("--tune", action="store_true",
                        help="first pick the launch configuration (TUNE_CANDIDATES) at 128k")
    parser.add_argument("--out", default="decode_bench.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.head_dim, args.dtype, args.batch = [128], ["bfloat16"], [1]
        args.context = [4096, 131072]
        args.no_extras = True
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode needs a CUDA GPU", file=sys.stderr)
        return 1
    with torch.no_grad():
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
