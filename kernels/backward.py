"""The ReRoPE backward kernels. Chapter 5 of the book.

With ``P = softmax(S)``, ``O = P V`` and upstream ``dO``:

    dV = Pᵀ dO          dP = dO Vᵀ          dS = P ∘ (dP − δ),   δ_i = Σ_d dO_id O_id

and, because ``S_ij = sm_scale · (q1_i · k1_j)`` inside the window and ``sm_scale · (q2_i · k2_j)``
outside, each ``dS_ij`` flows into exactly one pair of gradients:

    dQ1 = sm_scale · (dS ∘ W) K1     dK1 = sm_scale · (dS ∘ W)ᵀ Q1        W_ij = [|i − j| < w]
    dQ2 = sm_scale · (dS ∘ ¬W) K2    dK2 = sm_scale · (dS ∘ ¬W)ᵀ Q2

Three kernels, as in Triton's fused-attention tutorial, none with atomics (deterministic):

1. ``_bwd_delta_kernel`` — ``δ = rowsum(dO ∘ O)``, one program per query block;
2. ``_bwd_dkdv_kernel`` — one program per (key block, batch · kv head): keeps ``k1, k2, v`` on chip
   and walks the query tiles of every query head of its group, accumulating ``dK1, dK2, dV``;
3. ``_bwd_dq_kernel`` — one program per (query block, batch · query head): keeps ``q1, q2, dO``
   on chip and walks the key tiles, accumulating ``dQ1, dQ2``.

``P`` is recomputed from the saved log-sum-exp. Both walks use the forward's schedule
(:func:`kernels.regions._schedule`): ``q1·k1`` passes touch only the 1-tensors and their
gradients, ``q2·k2`` passes only the 2-tensors — the band's ``dS`` is split by the same window
mask that split its scores.
"""

import triton
import triton.language as tl

from .forward import _in_window, _keep, _load_rows, _load_tile, _tiles
from .regions import INSIDE, OUTSIDE, _nth_tile, _schedule, _tile_count


@triton.jit
def _bwd_delta_kernel(Out, DO, Delta, so_b, so_h, so_n, so_d, sdo_b, sdo_h, sdo_n, sdo_d,
                      n_heads, n_ctx, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``Delta[bh, i] = Σ_d dO[b, h, i, d] · O[b, h, i, d]`` in fp32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch = (tl.program_id(1) // n_heads).to(tl.int64)
    head = (tl.program_id(1) % n_heads).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    o = _load_rows(Out + batch * so_b + head * so_h, rows, so_n, so_d, dims, n_ctx, True)
    do = _load_rows(DO + batch * sdo_b + head * sdo_h, rows, sdo_n, sdo_d, dims, n_ctx, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + tl.program_id(1).to(tl.int64) * n_ctx + rows, delta, mask=rows < n_ctx)


@triton.jit
def _dkdv_pass(dk, dv, k, v, Q, DO, Lse, Delta, sq_n, sq_d, sdo_n, sdo_d, keys, walk,
               n_ctx, window, qk_scale,
               PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
               TMA: tl.constexpr):
    """Accumulate ``dK`` (of this product) and ``dV`` over the query tiles of ``walk``.

    Works on transposed tiles (keys along dim 0, queries along dim 1) so that ``k``, ``v`` and
    the accumulators stay put. ``k``/``Q`` are ``k1``/``Q1`` (``INSIDE``) or ``k2``/``Q2``.
    """
    offs_m = tl.arange(0, BLOCK_M)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_M)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_M)):
        start_m = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_M), BLOCK_M)
        queries = start_m + offs_m
        q = _load_tile(Q, start_m, sq_n, sq_d, n_ctx, BLOCK_M, HEAD_DIM, MASKED, TMA)
        do = _load_tile(DO, start_m, sdo_n, sdo_d, n_ctx, BLOCK_M, HEAD_DIM, MASKED, TMA)
        if MASKED:
            lse = tl.load(Lse + queries, mask=queries < n_ctx, other=0.0)
            delta = tl.load(Delta + queries, mask=queries < n_ctx, other=0.0)
        else:
            lse = tl.load(Lse + queries)
            delta = tl.load(Delta + queries)
        scores_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t = tl.math.exp2(scores_t * qk_scale - lse[None, :])       # Pᵀ: (BLOCK_N, BLOCK_M)
        if MASKED:
            keep = _in_window(keys, queries, window)
            if PRODUCT == OUTSIDE:
                keep = ~keep
            keep = keep & (queries[None, :] < n_ctx)
            if CAUSAL:
                keep = keep & (queries[None, :] >= keys[:, None])
            p_t = tl.where(keep, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q1, Q2, K1, K2, V, DO, Lse, Delta, DK1, DK2, DV,
    sq1_b, sq1_h, sq1_n, sq1_d, sq2_b, sq2_h, sq2_n, sq2_d,
    sk1_b, sk1_h, sk1_n, sk1_d, sk2_b, sk2_h, sk2_n, sk2_d,
    sv_b, sv_h, sv_n, sv_d, sdo_b, sdo_h, sdo_n, sdo_d,
    n_heads, n_kv_heads, group, n_ctx, window, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), B * Hkv)``. ``DK1, DK2, DV`` are contiguous ``(B, Hkv, N, D)``."""
    start_n = tl.program_id(0) * BLOCK_N
    batch = (tl.program_id(1) // n_kv_heads).to(tl.int64)
    kv_head = (tl.program_id(1) % n_kv_heads).to(tl.int64)
    keys = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    v = _load_tile(_tiles(V + batch * sv_b + kv_head * sv_h, sv_n, n_ctx, BLOCK_N, HEAD_DIM, TMA),
                   start_n, sv_n, sv_d, n_ctx, BLOCK_N, HEAD_DIM, True, TMA)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_n, BLOCK_N, BLOCK_M, n_ctx, window, CAUSAL, False)
    out_offset = tl.program_id(1).to(tl.int64) * n_ctx * HEAD_DIM
    out_ptrs = keys[:, None] * HEAD_DIM + dims[None, :]
    key_ok = keys[:, None] < n_ctx

    # phase 1: the q1·k1 passes give dK1 (and part of dV); store dK1 before phase 2 so that
    # only two fp32 accumulators (dK, dV) are ever live, as in plain attention
    k1 = _load_tile(_tiles(K1 + batch * sk1_b + kv_head * sk1_h, sk1_n, n_ctx, BLOCK_N, HEAD_DIM,
                           TMA), start_n, sk1_n, sk1_d, n_ctx, BLOCK_N, HEAD_DIM, True, TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(group):                       # every query head that shares this K/V head
        head = kv_head * group + g
        q1 = _tiles(Q1 + batch * sq1_b + head * sq1_h, sq1_n, n_ctx, BLOCK_M, HEAD_DIM, TMA)
        do = _tiles(DO + batch * sdo_b + head * sdo_h, sdo_n, n_ctx, BLOCK_M, HEAD_DIM, TMA)
        row_stats = (batch * n_heads + head) * n_ctx
        lse, delta = Lse + row_stats, Delta + row_stats
        dk, dv = _dkdv_pass(dk, dv, k1, v, q1, do, lse, delta, sq1_n, sq1_d, sdo_n, sdo_d, keys,
                            inside_clean, n_ctx, window, qk_scale,
                            INSIDE, False, CAUSAL, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
        dk, dv = _dkdv_pass(dk, dv, k1, v, q1, do, lse, delta, sq1_n, sq1_d, sdo_n, sdo_d, keys,
                            band, n_ctx, window, qk_scale,
                            INSIDE, True, CAUSAL, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
        dk, dv = _dkdv_pass(dk, dv, k1, v, q1, do, lse, delta, sq1_n, sq1_d, sdo_n, sdo_d, keys,
                            edge_inside, n_ctx, window, qk_scale,
                            INSIDE, True, CAUSAL, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
    tl.store(DK1 + out_offset + out_ptrs, (dk * sm_scale).to(DK1.dtype.element_ty), mask=key_ok)

    # phase 2: the q2·k2 passes give dK2 and the rest of dV
    k2 = _load_tile(_tiles(K2 + batch * sk2_b + kv_head * sk2_h, sk2_n, n_ctx, BLOCK_N, HEAD_DIM,
                           TMA), start_n, sk2_n, sk2_d, n_ctx, BLOCK_N, HEAD_DIM, True, TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(group):
        head = kv_head * group + g
        q2 = _tiles(Q2 + batch * sq2_b + head * sq2_h, sq2_n, n_ctx, BLOCK_M, HEAD_DIM, TMA)
        do = _tiles(DO + batch * sdo_b + head * sdo_h, sdo_n, n_ctx, BLOCK_M, HEAD_DIM, TMA)
        row_stats = (batch * n_heads + head) * n_ctx
        lse, delta = Lse + row_stats, Delta + row_stats
        dk, dv = _dkdv_pass(dk, dv, k2, v, q2, do, lse, delta, sq2_n, sq2_d, sdo_n, sdo_d, keys,
                            outside_clean, n_ctx, window, qk_scale,
                            OUTSIDE, False, CAUSAL, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
        dk, dv = _dkdv_pass(dk, dv, k2, v, q2, do, lse, delta, sq2_n, sq2_d, sdo_n, sdo_d, keys,
                            band, n_ctx, window, qk_scale,
                            OUTSIDE, True, CAUSAL, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
        dk, dv = _dkdv_pass(dk, dv, k2, v, q2, do, lse, delta, sq2_n, sq2_d, sdo_n, sdo_d, keys,
                            edge_outside, n_ctx, window, qk_scale,
                            OUTSIDE, True, CAUSAL, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
    tl.store(DK2 + out_offset + out_ptrs, (dk * sm_scale).to(DK2.dtype.element_ty), mask=key_ok)
    tl.store(DV + out_offset + out_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _dq_pass(dq, q, do, lse, delta, K, V, sk_n, sk_d, sv_n, sv_d, rows, walk,
             n_ctx, window, qk_scale,
             PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
             TMA: tl.constexpr):
    """Accumulate ``dQ`` of this product (``dQ1`` with ``q1, K1``; ``dQ2`` with ``q2, K2``)."""
    offs_n = tl.arange(0, BLOCK_N)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start_n = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(K, start_n, sk_n, sk_d, n_ctx, BLOCK_N, HEAD_DIM, MASKED, TMA)
        v = _load_tile(V, start_n, sv_n, sv_d, n_ctx, BLOCK_N, HEAD_DIM, MASKED, TMA)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(scores * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_keep(rows, cols, n_ctx, window, PRODUCT, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q1, Q2, K1, K2, V, DO, Lse, Delta, DQ1, DQ2,
    sq1_b, sq1_h, sq1_n, sq1_d, sq2_b, sq2_h, sq2_n, sq2_d,
    sk1_b, sk1_h, sk1_n, sk1_d, sk2_b, sk2_h, sk2_n, sk2_d,
    sv_b, sv_h, sv_n, sv_d, sdo_b, sdo_h, sdo_n, sdo_d,
    n_heads, group, n_ctx, window, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_M), B * Hq)``. ``DQ1, DQ2`` are contiguous ``(B, Hq, N, D)``."""
    block = tl.program_id(0)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = tl.num_programs(0) - 1 - block
    start_m = block * BLOCK_M
    batch = (tl.program_id(1) // n_heads).to(tl.int64)
    head = (tl.program_id(1) % n_heads).to(tl.int64)
    kv_head = head // group
    K1 = _tiles(K1 + batch * sk1_b + kv_head * sk1_h, sk1_n, n_ctx, BLOCK_N, HEAD_DIM, TMA)
    K2 = _tiles(K2 + batch * sk2_b + kv_head * sk2_h, sk2_n, n_ctx, BLOCK_N, HEAD_DIM, TMA)
    V = _tiles(V + batch * sv_b + kv_head * sv_h, sv_n, n_ctx, BLOCK_N, HEAD_DIM, TMA)
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    do = _load_tile(_tiles(DO + batch * sdo_b + head * sdo_h, sdo_n, n_ctx, BLOCK_M, HEAD_DIM, TMA),
                    start_m, sdo_n, sdo_d, n_ctx, BLOCK_M, HEAD_DIM, True, TMA)
    row_stats = tl.program_id(1).to(tl.int64) * n_ctx
    lse = tl.load(Lse + row_stats + rows, mask=rows < n_ctx, other=0.0)
    delta = tl.load(Delta + row_stats + rows, mask=rows < n_ctx, other=0.0)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_m, BLOCK_M, BLOCK_N, n_ctx, window, CAUSAL, True)
    out_offset = tl.program_id(1).to(tl.int64) * n_ctx * HEAD_DIM
    out_ptrs = rows[:, None] * HEAD_DIM + dims[None, :]
    row_ok = rows[:, None] < n_ctx

    # phase 1: dQ1 from the q1·k1 passes, stored before phase 2 (one accumulator live at a time)
    q1 = _load_tile(_tiles(Q1 + batch * sq1_b + head * sq1_h, sq1_n, n_ctx, BLOCK_M, HEAD_DIM, TMA),
                    start_m, sq1_n, sq1_d, n_ctx, BLOCK_M, HEAD_DIM, True, TMA)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_pass(dq, q1, do, lse, delta, K1, V, sk1_n, sk1_d, sv_n, sv_d, rows, inside_clean,
                  n_ctx, window, qk_scale,
                  INSIDE, False, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq = _dq_pass(dq, q1, do, lse, delta, K1, V, sk1_n, sk1_d, sv_n, sv_d, rows, band,
                  n_ctx, window, qk_scale,
                  INSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq = _dq_pass(dq, q1, do, lse, delta, K1, V, sk1_n, sk1_d, sv_n, sv_d, rows, edge_inside,
                  n_ctx, window, qk_scale,
                  INSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    tl.store(DQ1 + out_offset + out_ptrs, (dq * sm_scale).to(DQ1.dtype.element_ty), mask=row_ok)

    # phase 2: dQ2 from the q2·k2 passes
    q2 = _load_tile(_tiles(Q2 + batch * sq2_b + head * sq2_h, sq2_n, n_ctx, BLOCK_M, HEAD_DIM, TMA),
                    start_m, sq2_n, sq2_d, n_ctx, BLOCK_M, HEAD_DIM, True, TMA)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_pass(dq, q2, do, lse, delta, K2, V, sk2_n, sk2_d, sv_n, sv_d, rows, outside_clean,
                  n_ctx, window, qk_scale,
                  OUTSIDE, False, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq = _dq_pass(dq, q2, do, lse, delta, K2, V, sk2_n, sk2_d, sv_n, sv_d, rows, band,
                  n_ctx, window, qk_scale,
                  OUTSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq = _dq_pass(dq, q2, do, lse, delta, K2, V, sk2_n, sk2_d, sv_n, sv_d, rows, edge_outside,
                  n_ctx, window, qk_scale,
                  OUTSIDE, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    tl.store(DQ2 + out_offset + out_ptrs, (dq * sm_scale).to(DQ2.dtype.element_ty), mask=row_ok)
