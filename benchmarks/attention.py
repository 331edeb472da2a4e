"""How fast is fused ReRoPE attention? A benchmark against what a user could run instead.

Run it on a CUDA GPU from the repository root, with ``rerope`` importable (``pip install -e .``,
or ``PYTHONPATH=kernels:.`` in a checkout)::

    python -m benchmarks.attention                      # the full grid (meant to take < 8 min on an H200)
    python -m benchmarks.attention --quick              # a small subset, for smoke tests
    python -m benchmarks.attention --n 8192 --d 64 --dtype float16 --causal true \\
        --impl rerope,sdpa_cudnn --mode fwd      # one corner of the grid

Each case is one implementation (``impl``), one mode (``fwd`` or ``fwd+bwd``) and one shape
``(B, H, N, D, window, dtype, causal)``. The implementations:

- ``rerope``: ours, ``rerope.rerope_attention`` on the five tensors ``q1, q2, k1, k2, v``.
- ``rerope_raw`` and ``rerope_rotated``: ours from ``q, k, v`` as a model holds them,
  ``rerope.rerope`` (rotation inside the kernels), raw or already RoPE-rotated.
- ``rope_sdpa_cudnn``: what *plain* RoPE attention costs a user: rotate ``q, k`` in torch the way
  Hugging Face models do (``q·cos + rotate_half(q)·sin`` with cos/sin tables built once, in the
  input dtype), then SDPA's cuDNN backend. The bar ``rerope_raw`` has to clear.
- ``naive``: ``rerope.reference.rerope_attention``, two full ``N × N`` score matrices.
- ``flex_two_pass``: ReRoPE as two FlexAttention passes merged by log-sum-exp (defined below):
  the strongest alternative a user can write without a custom kernel.
- ``sdpa_flash`` and ``sdpa_cudnn``: PyTorch's fused *plain* attention on ``q1, k1, v``
  (FlashAttention-2 and cuDNN backends). Not ReRoPE: the speed of light ReRoPE can approach.
- ``rope_inputs``: the time to build ``q1, q2, k1, k2`` from raw ``q, k`` with
  ``rerope.rope.rerope_inputs``, the price of the five-tensor interface.

For every case we report the median time over repetitions measured with CUDA events (after a
warm-up that absorbs Triton autotuning and ``torch.compile``), the throughput counted as plain
attention (:func:`attention_flops`), and the peak memory. Results go to a JSON file
(``--out``, default ``bench.json``)::

    {"meta": {"gpu", "torch", "triton", "date", ...},
     "rows": [{"impl", "mode", "causal", "B", "H", "N", "D", "window", "dtype",
               "ms", "tflops", "peak_gb", ("skipped")}]}

A row that could not be measured (out of memory, or an error) has ``ms = null`` and a
``skipped`` reason. :func:`load_results`, :func:`select_rows`, :func:`summary` and
:func:`plot_tflops` read such a file back; they are pure functions and need no GPU. The timing,
the metadata and the file's writing and reading are :mod:`benchmarks.harness`'s, shared with
the other benchmarks here.
"""

import argparse
import dataclasses
import functools
import gc
import itertools
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:  # torch >= 2.9: the LSE is requested with `return_aux`; `return_lse` is deprecated
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # older torch: only `return_lse=True`
    AuxRequest = None

from .harness import (describe_error, environment, event_times_ms, l2_flush_buffer, read_results,
                      repetitions, select_rows, write_results)


# %%
# What we compare, and on which shapes
# ------------------------------------

IMPLS = ("rerope", "rerope_raw", "rerope_rotated", "naive", "flex_two_pass", "sdpa_flash",
         "sdpa_cudnn", "rope_sdpa_cudnn", "rope_inputs")
FROM_QKV = ("rerope_raw", "rerope_rotated")    # ReRoPE impls that take q, k, v
MODES = ("fwd", "fwd+bwd")
DTYPES = ("float16", "bfloat16")

DEFAULT_BATCH = 1
DEFAULT_HEADS = 32
DEFAULT_WINDOW = 2048
DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_REPS = 20
DEFAULT_OUT = "bench.json"

# `--quick`: enough to run every implementation in both modes, both inside and beyond the window.
QUICK_SEQ_LENS = (1024, 4096)
QUICK_HEAD_DIMS = (64,)
QUICK_DTYPES = ("float16",)
QUICK_REPS = 5

# Timing: warm-up calls before anything is measured (the first one compiles / autotunes), the
# least number of timed repetitions, and a time budget per case that caps the repetitions of slow
# cases so that the default grid stays within minutes.
WARMUP_CALLS = 2
MIN_REPS = 3
TIME_BUDGET_S = 0.5

# Before timing, ours and the Flex two-pass are checked against the naive reference here.
CHECK_SHAPE = dict(B=1, H=2, N=512, window=160)


# %%
# Counting work and memory
# ------------------------
# All attention implementations are credited with the FLOPs of *plain* attention, whatever they
# really execute (the naive method computes two N × N products, the Flex passes skip masked
# blocks). So TFLOP/s compare like with like: a higher number is a faster run of the same job.

def attention_flops(B, H, N, D, causal, mode):
    """FLOPs of plain attention: ``4·B·H·N²·D``, halved if causal, ×3.5 for forward +
    backward.

    Forward: two ``N × N × D`` matmuls (``Q Kᵀ`` and ``P V``) of ``2·N²·D`` FLOPs each.
    Backward: five such matmuls (``dV``, ``dP``, ``dQ``, ``dK`` and the recomputed
    ``Q Kᵀ``), 2.5 times the forward, hence 3.5 in total. Causal attention does half the
    work.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    flops = 4.0 * B * H * N * N * D
    if causal:
        flops *= 0.5
    if mode == "fwd+bwd":
        flops *= 3.5
    return flops


# The naive method keeps several N × N tensors alive: both score matrices, the selected scores,
# the float32 softmax and the probabilities, then their gradients. Measured on the H200: 41 GB
# peak at B=1 H=32 N=8192 (19 bytes per score); we budget 24 to be safe.
NAIVE_BYTES_PER_SCORE = 24
# Besides: five inputs, their five gradients, the output and the upstream gradient.
NAIVE_HEAD_VECTORS = 12


def naive_peak_bytes(B, H, N, D, element_size):
    """Estimated peak memory (bytes) of the naive reference, forward+backward."""
    return NAIVE_BYTES_PER_SCORE * B * H * N * N + NAIVE_HEAD_VECTORS * B * H * N * D * element_size


# %%
# The strongest alternative: ReRoPE as two FlexAttention passes
# -------------------------------------------------------------
# FlexAttention's ``score_mod`` edits one score ``q·k``; ReRoPE needs two different dot products.
# But the keys of a query split into two disjoint sets, each with its own product: ``|i - j| < w``
# (``q1·k1``) and the rest (``q2·k2``). Attention over a union of disjoint key sets is the
# log-sum-exp merge of attention over each set (the same identity that makes FlashAttention's
# online softmax work): with ``o_a, lse_a`` and ``o_b, lse_b`` from the two passes,
#
#     lse = log(exp(lse_a) + exp(lse_b)),    o = exp(lse_a - lse)·o_a + exp(lse_b - lse)·o_b.
#
# FlexAttention returns the LSE in natural-log units (it computes in base 2 internally and
# converts) and the merge is ordinary differentiable torch, so forward+backward just works.

@functools.lru_cache(maxsize=None)
def rerope_mask_mods(window, causal):
    """The two FlexAttention ``mask_mod`` functions of ReRoPE: ``(in_window, outside_window)``.

    Cached, so that each ``(window, causal)`` always gives the same function objects: compiled
    code guards on them, and new objects would force a recompilation.
    """
    def in_window(batch, head, q_idx, kv_idx):
        near = (q_idx - kv_idx < window) & (kv_idx - q_idx < window)
        return near & (q_idx >= kv_idx) if causal else near

    def outside_window(batch, head, q_idx, kv_idx):
        far = (q_idx - kv_idx >= window) | (kv_idx - q_idx >= window)
        return far & (q_idx >= kv_idx) if causal else far

    return in_window, outside_window


@functools.lru_cache(maxsize=16)
def rerope_block_masks(seq_len, window, causal, device):
    """Block masks ``(in_window, outside_window)`` for one length, shared by batch and heads."""
    return tuple(create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
                 for mask_mod in rerope_mask_mods(window, causal))


def merge_attention_passes(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from attention over each set.

    ``out_*`` are ``(B, H, N, D)``, ``lse_*`` natural-log ``(B, H, N)``. A row where one pass has
    no keys has ``lse = -inf`` there (and output 0): it gets weight 0, without NaN in the output
    or the gradients. A row where both passes are empty gets output 0.
    """
    lse_max = torch.maximum(lse_a, lse_b)
    lse_max = torch.where(torch.isneginf(lse_max), 0.0, lse_max)   # no exp(-inf - -inf) = NaN
    weight_a = torch.exp(lse_a - lse_max)
    weight_b = torch.exp(lse_b - lse_max)
    total = weight_a + weight_b
    total = torch.where(total == 0, 1.0, total)
    merged = (out_a.float() * (weight_a / total)[..., None]
              + out_b.float() * (weight_b / total)[..., None])
    return merged.to(out_a.dtype)


def _flex_attention_with_lse(query, key, value, block_mask, scale):
    """One FlexAttention pass returning ``(output, lse)``, whichever LSE API this torch has."""
    enable_gqa = query.shape[1] != key.shape[1]
    if AuxRequest is None:
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa, return_lse=True)
    out, aux = flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _two_flex_passes(q1, q2, k1, k2, v, mask_in_window, mask_outside_window, scale):
    out_in, lse_in = _flex_attention_with_lse(q1, k1, v, mask_in_window, scale)
    out_out, lse_out = _flex_attention_with_lse(q2, k2, v, mask_outside_window, scale)
    return merge_attention_passes(out_in, lse_in, out_out, lse_out)


@functools.cache
def _compiled_two_flex_passes():
    """``torch.compile`` of the two passes and the merge (compiled once, on first use).

    Without ``torch.compile`` FlexAttention falls back to an unfused path that materialises the
    scores. Shapes are static (``dynamic=False``), so every new ``(N, D, dtype, causal)``
    compiles afresh, in the warm-up: a grid of shapes needs more than dynamo's default limit of
    8 recompilations, after which it would silently run the slow unfused path.
    """
    dynamo_config = torch._dynamo.config
    for name, at_least in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                           ("accumulated_recompile_limit", 8192),
                           ("accumulated_cache_size_limit", 8192)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), at_least))
    return torch.compile(_two_flex_passes, dynamic=False)


def flex_two_pass_rerope(q1, q2, k1, k2, v, window, causal=True, sm_scale=None, *, compiled=True):
    """ReRoPE attention as two FlexAttention passes merged by log-sum-exp.

    Same signature and meaning as ``rerope.rerope_attention``. ``compiled=False`` runs
    FlexAttention unfused (slow, forward only on CPU): for tests.
    """
    block_masks = rerope_block_masks(q1.shape[-2], window, causal, str(q1.device))
    two_passes = _compiled_two_flex_passes() if compiled else _two_flex_passes
    return two_passes(q1, q2, k1, k2, v, *block_masks, sm_scale)


# %%
# One case: inputs, the function to time, and the timing
# ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """The problem size of a case. ``dtype`` is torch's name, e.g. ``"float16"``."""
    B: int
    H: int
    N: int
    D: int
    window: int
    dtype: str
    causal: bool


def _rerope_attention_impl(impl):
    """The function ``(q1, q2, k1, k2, v, window, causal=...)`` behind a ReRoPE ``impl``."""
    if impl == "rerope":
        import rerope
        return rerope.rerope_attention
    if impl == "naive":
        import rerope.reference
        return rerope.reference.rerope_attention
    if impl == "flex_two_pass":
        return flex_two_pass_rerope
    raise ValueError(f"not a ReRoPE attention implementation: {impl!r}")


def build_case(impl, shape, device="cuda"):
    """Fresh random inputs for ``impl`` and a function running its forward on them.

    Returns ``(forward, leaves)``: ``forward()`` returns the output (a tuple for ``rope_inputs``),
    ``leaves`` are the inputs that require grad, the ones a backward pass differentiates. Inputs
    require grad in both modes (as in Triton's tutorial), so the forward is the training forward.
    """
    dtype = getattr(torch, shape.dtype)

    def randn_heads():
        return torch.randn(shape.B, shape.H, shape.N, shape.D, device=device, dtype=dtype,
                           requires_grad=True)

    if impl == "rope_inputs":
        from rerope.rope import rerope_inputs
        q_raw, k_raw = randn_heads(), randn_heads()
        return (lambda: rerope_inputs(q_raw, k_raw, shape.window)), [q_raw, k_raw]

    if impl in FROM_QKV:
        import rerope
        q, k, v = randn_heads(), randn_heads(), randn_heads()
        rotated = impl == "rerope_rotated"

        def rerope_from_qkv():
            return rerope.rerope(q, k, v, shape.window, causal=shape.causal, rotated=rotated)
        return rerope_from_qkv, [q, k, v]

    if impl == "rope_sdpa_cudnn":
        from rerope.rope import rotate_half, rope_frequencies
        q, k, v = randn_heads(), randn_heads(), randn_heads()
        angles = (torch.arange(shape.N, device=device, dtype=torch.float64)[:, None]
                  * rope_frequencies(shape.D, device=device)[None, :])
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)   # built once, as models do

        def rope_then_cudnn():
            q_rot = q * cos + rotate_half(q) * sin
            k_rot = k * cos + rotate_half(k) * sin
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=shape.causal)
        return rope_then_cudnn, [q, k, v]

    if impl in ("sdpa_flash", "sdpa_cudnn"):
        backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        q_rot, k_rot, v = randn_heads(), randn_heads(), randn_heads()

        def plain_attention():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=shape.causal)
        return plain_attention, [q_rot, k_rot, v]

    attention = _rerope_attention_impl(impl)
    q1, q2, k1, k2, v = (randn_heads() for _ in range(5))
    def rerope_attention():
        return attention(q1, q2, k1, k2, v, shape.window, causal=shape.causal)
    return rerope_attention, [q1, q2, k1, k2, v]


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def time_cuda(step, reps=DEFAULT_REPS, budget_s=TIME_BUDGET_S):
    """Median milliseconds of ``step()`` over up to ``reps`` runs, timed with CUDA events.

    The L2 cache is flushed before every run (not timed), so no run profits from the previous
    one's data. Slow steps get fewer runs (at least ``MIN_REPS``) to stay near ``budget_s``.
    """
    flush = l2_flush_buffer()
    (estimate_ms,) = event_times_ms(step, 1, flush=flush)
    count = repetitions(max(estimate_ms, 1e-3) * 1e-3, budget_s, MIN_REPS, reps)
    return statistics.median(event_times_ms(step, count, flush=flush))


def measure_case(impl, mode, shape, reps=DEFAULT_REPS):
    """Time one case. Returns ``(ms, peak_bytes, warmup_s)``.

    ``fwd+bwd`` runs the forward, then ``torch.autograd.grad`` with a fixed random upstream
    gradient: gradients are returned, not accumulated into ``.grad``, so nothing is zeroed
    between runs. Peak memory is ``torch.cuda.max_memory_allocated()`` over one step after the
    warm-up, inputs included.
    """
    torch.manual_seed(0)
    forward, leaves = build_case(impl, shape)
    warmup_start = time.perf_counter()
    if mode == "fwd":
        def step():
            forward()
    else:
        # The first forward also compiles / autotunes; its outputs give the gradients' shapes.
        upstream = tuple(torch.randn_like(out) for out in _as_tuple(forward()))

        def step():
            torch.autograd.grad(_as_tuple(forward()), leaves, grad_outputs=upstream)

    for _ in range(WARMUP_CALLS):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - warmup_start

    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_bytes = torch.cuda.max_memory_allocated()
    return time_cuda(step, reps), peak_bytes, warmup_s


def naive_skip_reason(shape):
    """Why the naive method must be skipped for ``shape`` (it would not fit), or ``None``."""
    element_size = torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
    needed = naive_peak_bytes(shape.B, shape.H, shape.N, shape.D, element_size)
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if needed > 0.95 * free:
        return f"naive needs ~{needed / 1e9:.0f} GB, {free / 1e9:.0f} GB free"
    return None


# %%
# Is the competitor right? A check against the naive reference
# ------------------------------------------------------------
# A fast wrong answer proves nothing, so before timing we compare the ReRoPE implementations
# (ours and the Flex two-pass) with ``rerope.reference`` on a small shape, forward and gradients.

CHECK_TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}   # max |error| / max |reference|


def check_against_reference(impls, dtype, D, causal):
    """Compare each ReRoPE impl in ``impls`` with the naive reference. Returns one line per impl."""
    import rerope.reference
    shape = Shape(D=D, dtype=dtype, causal=causal, **CHECK_SHAPE)
    lines = []
    for impl in impls:
        torch.manual_seed(0)
        forward, leaves = build_case(impl, shape)
        out = forward()
        upstream = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, upstream)
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        if impl in FROM_QKV:
            expected = rerope.reference.rerope(*leaves64, shape.window, causal=causal,
                                               rotated=impl == "rerope_rotated")
        else:
            expected = rerope.reference.rerope_attention(*leaves64, shape.window, causal=causal)
        expected_grads = torch.autograd.grad(expected, leaves64, upstream.double())
        error = max((got.double() - want).abs().max().item() / want.abs().max().item()
                    for got, want in zip((out, *grads), (expected, *expected_grads)))
        verdict = "ok" if error <= CHECK_TOLERANCE[dtype] else "MISMATCH"
        lines.append(f"check {impl} vs naive ({dtype}, D={D}, causal={causal}, N={shape.N}, "
                     f"window={shape.window}): max relative error {error:.1e} {verdict}")
    return lines


# %%
# Results: rows, the JSON file, a table, ratios, a plot
# -----------------------------------------------------

ROW_KEYS = ("impl", "mode", "causal", "B", "H", "N", "D", "window", "dtype",
            "ms", "tflops", "peak_gb")
SHAPE_KEYS = ("mode", "causal", "B", "H", "N", "D", "window", "dtype")


def make_row(impl, mode, shape, ms=None, peak_bytes=None, skipped=None):
    """One result row. ``tflops`` uses the plain-attention count (none for ``rope_inputs``)."""
    row = dict(impl=impl, mode=mode, causal=shape.causal, B=shape.B, H=shape.H, N=shape.N,
               D=shape.D, window=shape.window, dtype=shape.dtype, ms=ms, tflops=None,
               peak_gb=None if peak_bytes is None else peak_bytes / 1e9)
    if ms is not None and impl != "rope_inputs":
        flops = attention_flops(shape.B, shape.H, shape.N, shape.D, shape.causal, mode)
        row["tflops"] = flops / (ms * 1e-3) / 1e12
    if skipped is not None:
        row["skipped"] = skipped
    return row


def load_results(path):
    """The rows of a results file written by this module (a list of dicts)."""
    return read_results(path)["rows"]


def summary(rows, baselines=("sdpa_cudnn", "flex_two_pass"), **where):
    """How ``rerope`` compares with each baseline, shape by shape.

    ``where`` restricts the shapes, e.g. ``summary(rows, N=8192, D=64, mode="fwd+bwd")``.
    Returns one dict per shape that has a ``rerope`` time, sorted, with the shape fields,
    ``rerope_ms``, and per baseline ``<baseline>_ms`` and ``speedup_vs_<baseline>`` =
    ``baseline ms / rerope ms`` (the same FLOPs, so also rerope's TFLOP/s over the baseline's:
    above 1 means rerope is faster). ``None`` where the baseline has no time.
    """
    times = {}
    for row in select_rows(rows, **where):
        if row.get("ms") is not None:
            times[tuple(row[key] for key in SHAPE_KEYS), row["impl"]] = row["ms"]
    results = []
    for (shape_key, impl), rerope_ms in times.items():
        if impl != "rerope":
            continue
        result = dict(zip(SHAPE_KEYS, shape_key), rerope_ms=rerope_ms)
        for baseline in baselines:
            baseline_ms = times.get((shape_key, baseline))
            result[f"{baseline}_ms"] = baseline_ms
            speedup = None if baseline_ms is None else baseline_ms / rerope_ms
            result[f"speedup_vs_{baseline}"] = speedup
        results.append(result)
    return sorted(results, key=lambda r: (r["mode"], not r["causal"], r["dtype"], r["D"], r["N"]))


def format_table(rows):
    """A plain-text table of result rows, one line each."""
    header = (f"{'impl':<14}{'mode':<9}{'causal':<8}{'N':>6}{'D':>5}  {'dtype':<9}"
              f"{'ms':>10}{'TFLOP/s':>9}{'peak GB':>9}  note")
    lines = [header, "-" * len(header)]
    for row in rows:
        ms = "-" if row["ms"] is None else f"{row['ms']:.3f}"
        tflops = "-" if row.get("tflops") is None else f"{row['tflops']:.1f}"
        peak = "-" if row.get("peak_gb") is None else f"{row['peak_gb']:.2f}"
        lines.append(f"{row['impl']:<14}{row['mode']:<9}{str(row['causal']):<8}{row['N']:>6}"
                     f"{row['D']:>5}  {row['dtype']:<9}{ms:>10}{tflops:>9}{peak:>9}  "
                     f"{row.get('skipped', '')}")
    return "\n".join(lines)


def plot_tflops(rows, ax=None, *, mode="fwd+bwd", causal=True, D=64, dtype="float16", impls=None,
                title=None, H=DEFAULT_HEADS):
    """Draw TFLOP/s against N, one line per implementation, for one ``(mode, causal, D, dtype, H)``.

    Rows without a throughput (skipped cases, ``rope_inputs``) are left out. Returns the axes.
    """
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    chosen = [row for row in select_rows(rows, mode=mode, causal=causal, D=D, dtype=dtype, H=H)
              if row.get("tflops") is not None]
    for impl in impls or [impl for impl in IMPLS if any(row["impl"] == impl for row in chosen)]:
        points = sorted((row["N"], row["tflops"]) for row in chosen if row["impl"] == impl)
        if points:
            seq_lens, tflops = zip(*points)
            ax.plot(seq_lens, tflops, marker="o", label=impl)
    ax.set_xscale("log", base=2)
    seq_lens = sorted({row["N"] for row in chosen})
    ax.set_xticks(seq_lens, [str(n) for n in seq_lens])
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (plain-attention count)")
    ax.set_title(title or f"{mode}, {'causal' if causal else 'non-causal'}, D={D}, {dtype}")
    ax.grid(True, alpha=0.3)
    if ax.get_lines():            # an empty legend would warn (on stderr)
        ax.legend()
    return ax


# %%
# The command line
# ----------------

def _comma_list(convert, choices=None):
    """An argparse type: ``"a,b"`` -> ``[convert("a"), convert("b")]``, each in ``choices``."""
    def parse(text):
        values = [convert(item.strip()) for item in text.split(",") if item.strip()]
        for value in values:
            if choices is not None and value not in choices:
                allowed = ", ".join(map(str, choices))
                raise argparse.ArgumentTypeError(f"{value!r} is not one of {allowed}")
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values
    return parse


def _parse_bool(text):
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv=None):
    """Parse the command line; ``--quick`` fills in the small grid where a flag is not given."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=_comma_list(int), help="sequence lengths, e.g. 4096,8192")
    parser.add_argument("--d", type=_comma_list(int), help="head dims, e.g. 64,128")
    parser.add_argument("--dtype", type=_comma_list(str, DTYPES), help="float16 and/or bfloat16")
    parser.add_argument("--causal", type=_comma_list(_parse_bool), help="true, false or true,false")
    parser.add_argument("--impl", type=_comma_list(str, IMPLS), help=f"any of {','.join(IMPLS)}")
    parser.add_argument("--mode", type=_comma_list(str, MODES), help="fwd and/or fwd+bwd")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--heads", type=int, default=DEFAULT_HEADS)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--reps", type=int,
                        help=f"most timed runs per case (default {DEFAULT_REPS})")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"JSON results file (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="a small subset, for smoke tests")
    parser.add_argument("--skip-check", action="store_true",
                        help="skip the correctness check against the naive reference")
    args = parser.parse_args(argv)
    args.n = args.n or list(QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS)
    args.d = args.d or list(QUICK_HEAD_DIMS if args.quick else DEFAULT_HEAD_DIMS)
    args.dtype = args.dtype or list(QUICK_DTYPES if args.quick else DTYPES)
    args.causal = args.causal or [True, False]
    args.impl = args.impl or list(IMPLS)
    args.mode = args.mode or list(MODES)
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else DEFAULT_REPS
    for name in ("batch", "heads", "window", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def benchmark_meta(args):
    """The ``meta`` block of the results file."""
    return {**environment(), "args": vars(args)}


def run_case(impl, mode, shape, reps, reported_errors):
    """Measure one case and return ``(row, progress_text)``; never raises for a failed case.

    Out-of-memory and other errors make a skipped row (an error's traceback is printed once per
    ``(impl, kind of error)``); the failed case's memory is released before the next one.
    """
    skipped = naive_skip_reason(shape) if impl == "naive" else None
    if skipped is None:
        try:
            ms, peak_bytes, warmup_s = measure_case(impl, mode, shape, reps)
            row = make_row(impl, mode, shape, ms, peak_bytes)
            tflops = "" if row["tflops"] is None else f"{row['tflops']:7.1f} TFLOP/s"
            return row, (f"{ms:9.3f} ms {tflops:>15} {row['peak_gb']:7.2f} GB"
                         f"  (warm-up {warmup_s:.1f} s)")
        except torch.OutOfMemoryError:
            skipped = "out of memory"
        except Exception as error:
            skipped = f"error: {describe_error(error)}"
            if (impl, type(error)) not in reported_errors:
                reported_errors.add((impl, type(error)))
                traceback.print_exc()
    gc.collect()                 # the failed case's tensors are garbage now: free them
    torch.cuda.empty_cache()
    return make_row(impl, mode, shape, skipped=skipped), f"skipped: {skipped}"


def run_benchmark(args):
    """Run every case of the grid in ``args``; print progress and write the JSON as it goes."""
    started = time.perf_counter()
    meta = benchmark_meta(args)
    print(f"benchmarks.attention on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}",
          flush=True)

    checked = [impl for impl in ("rerope", *FROM_QKV, "flex_two_pass") if impl in args.impl]
    if checked and not args.skip_check:
        meta["checks"] = []
        for causal in args.causal:
            try:
                lines = check_against_reference(checked, args.dtype[0], args.d[0], causal)
            except Exception as error:     # report, then time anyway: the rows show what fails
                lines = [f"check (causal={causal}) failed: {describe_error(error)}"]
            print("\n".join(lines), flush=True)
            meta["checks"] += lines

    # Shapes that share compiled code (same dtype, D, causal) run together, N growing.
    grid = [(Shape(args.batch, args.heads, n, d, args.window, dtype, causal), impl, mode)
            for dtype, d, causal, n, impl, mode in itertools.product(
                args.dtype, args.d, args.causal, sorted(args.n), args.impl, args.mode)]
    rows, reported_errors = [], set()
    for index, (shape, impl, mode) in enumerate(grid, start=1):
        row, outcome = run_case(impl, mode, shape, args.reps, reported_errors)
        masking = "causal" if shape.causal else "full"
        print(f"[{index:>3}/{len(grid)}] {impl:<13} {mode:<7} {masking:<6} N={shape.N:<6} "
              f"D={shape.D:<3} {shape.dtype:<8} {outcome}", flush=True)
        rows.append(row)
        meta["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_results(args.out, rows, meta)

    print()
    print(format_table(rows))
    print(f"\nwrote {len(rows)} rows to {args.out}; elapsed {time.perf_counter() - started:.0f} s",
          flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.attention needs a CUDA GPU and torch finds none "
              "(torch.cuda.is_available() is False).", file=sys.stderr)
        return 1
    run_benchmark(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
