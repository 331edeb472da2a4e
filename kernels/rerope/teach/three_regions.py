"""The three-region ReRoPE forward, in its teaching form. Chapter 4 of the book.

One program owns a block of query rows and walks the key tiles in the five runs
that :func:`rerope.regions._window_bounds` cuts: outside | band | inside | band |
outside. An outside tile needs only ``q2 · k2``, an inside tile only ``q1 · k1``; a
band tile needs both, kept entry by entry by ``|i - j| < window``. Each run is its own
loop over chapter 3's :func:`rerope.online_softmax._softmax_step`. The causal and
end-of-sequence masks are applied on every tile (the finished kernel takes them off
the tiles that do not need them).

Checked against the float64 reference and :func:`rerope.rerope_attention` (tests/).
"""

import torch
import triton
import triton.language as tl

from ..online_softmax import LOG2E, _softmax_step
from ..regions import _window_bounds
from ..runtime import dot_precision, kernels_decorated, prepare_for_device

# Decorated in the package's mode (interpreted where rerope chose the interpreter).
_DECORATING = kernels_decorated()
_DECORATING.__enter__()

OUTSIDE: tl.constexpr = tl.constexpr(0)   # every pair |i - j| >= window: q2 · k2
BAND: tl.constexpr = tl.constexpr(1)      # pairs on both sides: both products
INSIDE: tl.constexpr = tl.constexpr(2)    # every pair |i - j| < window: q1 · k1


@triton.jit
def _in_window(rows, cols, window):
    """``|i - j| < window`` for every pair of the tile ``rows × cols``."""
    distance = rows[:, None] - cols[None, :]
    return (distance < window) & (distance > -window)


@triton.jit
def _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                 qk_scale, REGION: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Fold the key tiles ``[lo, hi)`` of one region into the online softmax."""
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        ptrs = cols[:, None] * HEAD_DIM + dims[None, :]
        in_seq = cols[:, None] < n_ctx
        v = tl.load(V + ptrs, mask=in_seq, other=0.0)
        if REGION != INSIDE:      # outside or band: q2 · k2
            k2 = tl.load(K2 + ptrs, mask=in_seq, other=0.0)
            far = tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
        if REGION != OUTSIDE:     # inside or band: q1 · k1
            k1 = tl.load(K1 + ptrs, mask=in_seq, other=0.0)
            near = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        if REGION == OUTSIDE:
            scores = far
        elif REGION == INSIDE:
            scores = near
        else:
            scores = tl.where(_in_window(rows, cols, window), near, far)
        keep = cols[None, :] < n_ctx
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _three_regions_fwd_kernel(Q1, Q2, K1, K2, V, Out, Lse, n_ctx, window, qk_scale,
                              group, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """One program per (query block, batch · query head); contiguous ``(…, N, D)``.

    Query head ``h`` reads key/value head ``h // group`` (grouped-query attention).
    """
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_base = head.to(tl.int64) * n_ctx * HEAD_DIM
    q_ptrs = q_base + rows[:, None] * HEAD_DIM + dims[None, :]
    q1 = tl.load(Q1 + q_ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    q2 = tl.load(Q2 + q_ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    kv = (head // group).to(tl.int64) * n_ctx * HEAD_DIM
    K1, K2, V = K1 + kv, K2 + kv, V + kv
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    end = tl.minimum(start_m + BLOCK_M, n_ctx) if CAUSAL else n_ctx
    below_end, inside_start, inside_end, above_start = _window_bounds(
        start_m, BLOCK_M, BLOCK_N, window)
    # the five runs along the key axis, each cut off where this block's keys end
    cut1, cut2 = tl.minimum(below_end, end), tl.minimum(inside_start, end)
    cut3, cut4 = tl.minimum(inside_end, end), tl.minimum(above_start, end)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, 0, cut1,
                                 n_ctx, window, qk_scale, OUTSIDE, CAUSAL, BLOCK_N,
                                 HEAD_DIM, DOT_PRECISION)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut1, cut2,
                                 n_ctx, window, qk_scale, BAND, CAUSAL, BLOCK_N,
                                 HEAD_DIM, DOT_PRECISION)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut2, cut3,
                                 n_ctx, window, qk_scale, INSIDE, CAUSAL, BLOCK_N,
                                 HEAD_DIM, DOT_PRECISION)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut3, cut4,
                                 n_ctx, window, qk_scale, BAND, CAUSAL, BLOCK_N,
                                 HEAD_DIM, DOT_PRECISION)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut4, end,
                                 n_ctx, window, qk_scale, OUTSIDE, CAUSAL, BLOCK_N,
                                 HEAD_DIM, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(Out + q_ptrs, out.to(Out.dtype.element_ty), mask=rows[:, None] < n_ctx)
    tl.store(Lse + head * n_ctx + rows, m_i + tl.math.log2(l_i), mask=rows < n_ctx)


def three_regions_attention(q1, q2, k1, k2, v, window, causal=True, sm_scale=None,
                            block_m=16, block_n=16):
    """ReRoPE attention from the five tensors through :func:`_three_regions_fwd_kernel`.

    Args:
        q1, q2: ``(B, Hq, N, D)``, fp16 or fp32 (bf16 on a GPU), ``D`` a power of
            two >= 16.
        k1, k2, v: ``(B, Hkv, N, D)``, ``Hq`` a multiple of ``Hkv``.
        window: int >= 1. causal: bool. sm_scale: float, ``1/sqrt(D)`` when ``None``.
        block_m, block_n: the query block and key tile (powers of two >= 16).

    Returns:
        ``(out, lse)``: ``out`` ``(B, Hq, N, D)`` in the inputs' dtype, ``lse``
        ``(B, Hq, N)`` fp32, each row's log-sum-exp of its scaled scores in log2 units.
    """
    from .._validate import (check_flag, check_head_dim, check_qkv, check_sm_scale,
                             check_window)

    _, hq, hkv, n, d = check_qkv({"q1": q1, "q2": q2}, {"k1": k1, "k2": k2, "v": v})
    check_head_dim(d)
    check_window(window)
    check_flag("causal", causal)
    check_sm_scale(sm_scale)
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(block, int) or block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block!r}")
    (q1, q2, k1, k2, v), restore = prepare_for_device(q1, q2, k1, k2, v)
    q1, q2, k1, k2, v = (t.contiguous() for t in (q1, q2, k1, k2, v))
    out = torch.empty_like(q1)
    lse = torch.empty(q1.shape[:-1], dtype=torch.float32, device=q1.device)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    grid = (triton.cdiv(n, block_m), q1.shape[0] * hq)
    _three_regions_fwd_kernel[grid](
        q1, q2, k1, k2, v, out, lse, n, window, scale * LOG2E, hq // hkv,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
        DOT_PRECISION=dot_precision(q1.dtype))
    return restore(out), lse


_DECORATING.__exit__(None, None, None)
