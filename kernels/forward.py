"""The ReRoPE forward kernel: tiled online softmax, one loop per region. Chapter 4 of the book.

One program per (query block, batch · query head). It keeps a query block on chip and walks
the key axis in ``BLOCK_N`` tiles, in six passes laid out by :func:`kernels.regions._schedule`
(all ``q2 · k2`` passes first with ``q2`` loaded, then all ``q1 · k1`` passes with ``q1``):

* ``q2 · k2`` over the tiles fully outside the window, and ``q1 · k1`` over those fully inside —
  the long, hot loops: one product, no mask, no branch (the product is a compile-time constant);
* ``q1 · k1`` and then ``q2 · k2`` over the thin band of tiles that straddle ``|i - j| = w``,
  each masked to its side of the window;
* the same two over the few tiles that need the causal or end-of-sequence mask.

The online softmax does not care in which order tiles arrive, so visiting a band tile twice,
once per product, is exact.

Numerics as FlashAttention-2: fp32 accumulators, scores turned into log2 units by
``qk_scale = sm_scale · log2(e)`` (inside one fused multiply-add) so every exponential is an
``exp2``, and the per-row log-sum-exp (log2 units) saved for the backward pass.

Tiles are read through :func:`_tiles` / :func:`_load_tile`: TMA tensor descriptors on Hopper
(fp16/bf16, aligned layouts), pointer loads elsewhere; the launcher picks (``TMA``).
"""

import triton
import triton.language as tl

from .online_softmax import _softmax_step
from .regions import INSIDE, OUTSIDE, _nth_tile, _schedule, _tile_count


@triton.jit
def _load_rows(Base, idx, stride_n, stride_d, dims, n_ctx, MASKED: tl.constexpr):
    """Load rows ``idx`` (all ``HEAD_DIM`` columns) of a ``(N, D)`` slice; zeros past ``n_ctx``."""
    ptrs = Base + idx[:, None] * stride_n + dims[None, :] * stride_d
    if MASKED:
        return tl.load(ptrs, mask=idx[:, None] < n_ctx, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _tiles(Base, stride_n, n_ctx, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """How a kernel reads ``BLOCK``-row tiles of one ``(N, D)`` slice starting at ``Base``.

    With ``TMA`` (Hopper and newer, row stride 16-byte aligned, unit column stride): a tensor
    descriptor, so tiles arrive by the bulk tensor-copy engine, zero-filled past ``n_ctx``.
    Otherwise the pointer itself, for :func:`_load_tile`'s pointer loads.
    """
    if TMA:
        return tl.make_tensor_descriptor(Base, shape=[n_ctx, HEAD_DIM], strides=[stride_n, 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    else:
        return Base


@triton.jit
def _load_tile(src, start, stride_n, stride_d, n_ctx, BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of the slice behind ``src`` (from :func:`_tiles`)."""
    if TMA:
        return src.load([start, 0])
    else:
        return _load_rows(src, start + tl.arange(0, BLOCK), stride_n, stride_d,
                          tl.arange(0, HEAD_DIM), n_ctx, MASKED)


@triton.jit
def _in_window(rows, cols, window):
    """``|i - j| < window`` for a tile (``rows`` along dim 0, ``cols`` along dim 1)."""
    diff = rows[:, None] - cols[None, :]
    return (diff < window) & (diff > -window)


@triton.jit
def _keep(rows, cols, n_ctx, window, PRODUCT: tl.constexpr, CAUSAL: tl.constexpr):
    """Which scores of a masked tile count for this product: in range, causal, right side of
    the window. ``rows``/``cols`` are query/key indices (dims 0/1)."""
    keep = _in_window(rows, cols, window)
    if PRODUCT == OUTSIDE:
        keep = ~keep
    keep = keep & (cols[None, :] < n_ctx)
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return keep


@triton.jit
def _fwd_pass(acc, l_i, m_i, q, K, V, sk_n, sk_d, sv_n, sv_d, rows, walk, n_ctx, window, qk_scale,
              PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    """Fold the key tiles of ``walk`` into the online-softmax state, with one product.

    ``q``/``K`` are ``q1``/``K1`` for ``PRODUCT == INSIDE`` and ``q2``/``K2`` for ``OUTSIDE``
    (``K``, ``V`` as :func:`_tiles` gives them). ``MASKED`` tiles get the window, causal and
    sequence-end masks; the others none at all.
    """
    offs_n = tl.arange(0, BLOCK_N)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start_n = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        k = _load_tile(K, start_n, sk_n, sk_d, n_ctx, BLOCK_N, HEAD_DIM, MASKED, TMA)
        v = _load_tile(V, start_n, sv_n, sv_d, n_ctx, BLOCK_N, HEAD_DIM, MASKED, TMA)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            cols = start_n + offs_n
            scores = tl.where(_keep(rows, cols, n_ctx, window, PRODUCT, CAUSAL), scores,
                              float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _rerope_fwd_kernel(
    Q1, Q2, K1, K2, V, Out, Lse,
    sq1_b, sq1_h, sq1_n, sq1_d, sq2_b, sq2_h, sq2_n, sq2_d,
    sk1_b, sk1_h, sk1_n, sk1_d, sk2_b, sk2_h, sk2_n, sk2_d,
    sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
    n_heads, group, n_ctx, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_M), B * Hq)``. Writes ``Out`` and ``Lse`` (log2 units, ``(B·Hq, N)``)."""
    block = tl.program_id(0)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = tl.num_programs(0) - 1 - block
    start_m = block * BLOCK_M
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group                      # grouped-query attention: shared K/V heads
    b64, h64, kv64 = batch.to(tl.int64), head.to(tl.int64), kv_head.to(tl.int64)
    K1 = _tiles(K1 + b64 * sk1_b + kv64 * sk1_h, sk1_n, n_ctx, BLOCK_N, HEAD_DIM, TMA)
    K2 = _tiles(K2 + b64 * sk2_b + kv64 * sk2_h, sk2_n, n_ctx, BLOCK_N, HEAD_DIM, TMA)
    V = _tiles(V + b64 * sv_b + kv64 * sv_h, sv_n, n_ctx, BLOCK_N, HEAD_DIM, TMA)

    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    # a finite start for the running max: a row may meet a fully masked tile first
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_m, BLOCK_M, BLOCK_N, n_ctx, window, CAUSAL, True)

    # every q2·k2 pass, then every q1·k1 pass: only one query block is live at a time
    q2 = _load_tile(_tiles(Q2 + b64 * sq2_b + h64 * sq2_h, sq2_n, n_ctx, BLOCK_M, HEAD_DIM, TMA),
                    start_m, sq2_n, sq2_d, n_ctx, BLOCK_M, HEAD_DIM, True, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q2, K2, V, sk2_n, sk2_d, sv_n, sv_d, rows,
                              outside_clean, n_ctx, window, qk_scale,
                              OUTSIDE, False, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q2, K2, V, sk2_n, sk2_d, sv_n, sv_d, rows,
                              band, n_ctx, window, qk_scale,
                              OUTSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q2, K2, V, sk2_n, sk2_d, sv_n, sv_d, rows,
                              edge_outside, n_ctx, window, qk_scale,
                              OUTSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    q1 = _load_tile(_tiles(Q1 + b64 * sq1_b + h64 * sq1_h, sq1_n, n_ctx, BLOCK_M, HEAD_DIM, TMA),
                    start_m, sq1_n, sq1_d, n_ctx, BLOCK_M, HEAD_DIM, True, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q1, K1, V, sk1_n, sk1_d, sv_n, sv_d, rows,
                              inside_clean, n_ctx, window, qk_scale,
                              INSIDE, False, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q1, K1, V, sk1_n, sk1_d, sv_n, sv_d, rows,
                              band, n_ctx, window, qk_scale,
                              INSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q1, K1, V, sk1_n, sk1_d, sv_n, sv_d, rows,
                              edge_inside, n_ctx, window, qk_scale,
                              INSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)

    row_stats = tl.program_id(1).to(tl.int64) * n_ctx
    tl.store(Lse + row_stats + rows, m_i + tl.math.log2(l_i), mask=rows < n_ctx)
    out = acc / l_i[:, None]
    out_ptrs = Out + b64 * so_b + h64 * so_h + rows[:, None] * so_n + dims[None, :] * so_d
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=rows[:, None] < n_ctx)
