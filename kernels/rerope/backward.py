"""The ReRoPE backward kernels. Chapters 5 and 7 of the book.

With ``P = softmax(S)``, ``O = P V`` and upstream ``dO``:

    dV = Pᵀ dO          dP = dO Vᵀ          dS = P ∘ (dP − δ),   δ_i = Σ_d dO_id O_id

and, because ``S_ij = sm_scale · (q1_i · k1_j)`` inside the window and ``sm_scale · (q2_i · k2_j)``
outside, each ``dS_ij`` flows into exactly one pair of gradients:

    dQ1 = sm_scale · (dS ∘ W) K1     dK1 = sm_scale · (dS ∘ W)ᵀ Q1        W_ij = [|i − j| < w]
    dQ2 = sm_scale · (dS ∘ ¬W) K2    dK2 = sm_scale · (dS ∘ ¬W)ᵀ Q2

Three kernels, as in Triton's fused-attention tutorial, none with atomics (deterministic):

1. ``_bwd_delta_kernel`` — ``δ = rowsum(dO ∘ O)``, one program per query block;
2. ``_bwd_dkdv_kernel`` — one program per (key block, batch · kv head): keeps its keys and ``v``
   on chip and walks the query tiles of every query head of its group, accumulating ``dK, dV``;
3. ``_bwd_dq_kernel`` — one program per (query block, batch · query head): keeps its queries and
   ``dO`` on chip and walks the key tiles, accumulating ``dQ``.

``P`` is recomputed from the saved log-sum-exp. Both walks use the forward's schedule
(:func:`rerope.regions._schedule`) and its operands and mask (:mod:`rerope.forward`): inside
passes touch only the inside product's operands, outside passes only the outside ones — the
band's ``dS`` is split by the same window mask that split its scores.

In the ``SPLIT`` form (``q, k`` as the model holds them, chapter 7) the products' operands are
rotations of the same ``q`` and ``k``, so the chain rule runs on: a product's gradient is rotated
back, ``dq = Rᵀ dq1``, and the two products' parts are summed in registers before one store —
``dq, dk, dv`` come out directly, and nothing rotated is ever written.

That form turns, in every program, every tile of the axis it walks: the dK/dV kernel each query
tile once per key block, the dQ kernel each key tile once per query block. For long sequences
the launcher pre-turns instead (``TURN_BACK``, :func:`rerope.attention.preturn_backward`): one
pass writes each product's operands (:func:`rerope.rotary.turn_operands`), the kernels read
them as they read the five tensors, and only the gradients are turned back — once per program,
in the store that sums the two products' parts, as in the ``SPLIT`` form.
"""

import triton
import triton.language as tl

from .forward import (_halves, _keep, _load_rows, _load_tile, _operand, _program, _scores,
                      _split_halves, _tiles)
from .regions import INSIDE, OUTSIDE, _nth_tile, _schedule, _tile_count
from .rotary import _angles, _logn_scale, _unrotate


@triton.jit
def _bwd_delta_kernel(Out, DO, Delta, so_b, so_h, so_n, so_d, sdo_b, sdo_h, sdo_n, sdo_d,
                      n_heads, n_ctx, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid ``(B · H, cdiv(N, BLOCK_M))`` (batch · head first: CUDA allows up to 2³¹ − 1 programs
    there, 65535 on the second axis): ``Delta[bh, i] = Σ_d dO[b, h, i, d] · O[b, h, i, d]`` in
    fp32."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch = (tl.program_id(0) // n_heads).to(tl.int64)
    head = (tl.program_id(0) % n_heads).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    o = _load_rows(Out + batch * so_b + head * so_h, rows, so_n, so_d, dims, n_ctx, True)
    do = _load_rows(DO + batch * sdo_b + head * sdo_h, rows, sdo_n, sdo_d, dims, n_ctx, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + tl.program_id(0).to(tl.int64) * n_ctx + rows, delta, mask=rows < n_ctx)


# --- shared by both kernels ----------------------------------------------------------------------


@triton.jit
def _accumulate(acc_a, acc_b, weights, y_a, y_b, TWO_DOTS: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """``acc += weights @ y`` for an operand as the ``_*_operand`` helpers return it (two halves
    into two accumulators, or one whole tile)."""
    acc_a = tl.dot(weights.to(y_a.dtype), y_a, acc_a, input_precision=DOT_PRECISION)
    if TWO_DOTS:
        acc_b = tl.dot(weights.to(y_b.dtype), y_b, acc_b, input_precision=DOT_PRECISION)
    return acc_a, acc_b


@triton.jit
def _zeros(BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TWO_DOTS: tl.constexpr):
    """Fresh fp32 accumulators for one product's gradient, shaped like its operand."""
    if TWO_DOTS:
        return (tl.zeros([BLOCK, HEAD_DIM // 2], tl.float32),
                tl.zeros([BLOCK, HEAD_DIM // 2], tl.float32))
    else:
        return tl.zeros([BLOCK, HEAD_DIM], tl.float32), tl.zeros([BLOCK, HEAD_DIM], tl.float32)


@triton.jit
def _as_halves(acc_a, acc_b, TWO_DOTS: tl.constexpr):
    """An accumulator pair as two ``D/2`` halves (splitting a whole-width one)."""
    if TWO_DOTS:
        return acc_a, acc_b
    else:
        return _split_halves(acc_a)


@triton.jit
def _store_rows(Base, rows, n_rows, x, COL0: tl.constexpr, WIDTH: tl.constexpr,
                ROW_STRIDE: tl.constexpr):
    """Store ``x`` into columns ``COL0 .. COL0 + WIDTH`` of rows ``rows`` of a contiguous
    ``(N, ROW_STRIDE)`` slice; rows ``>= n_rows`` are left alone."""
    ptrs = Base + rows.to(tl.int64)[:, None] * ROW_STRIDE + COL0 + tl.arange(0, WIDTH)[None, :]
    tl.store(ptrs, x.to(Base.dtype.element_ty), mask=rows[:, None] < n_rows)


@triton.jit
def _store_halves(Base, rows, n_rows, a, b, HEAD_DIM: tl.constexpr, ADD: tl.constexpr):
    """Store the halves ``[a | b]`` of rows ``rows`` of a contiguous ``(N, HEAD_DIM)`` slice; with
    ``ADD``, add them to what this program stored there before.

    The fused form's gradient is a sum over the two products. Adding the second product's part
    to the first one's stored value, instead of keeping the first in registers, holds register
    pressure at plain attention's level (one more rounding to the gradient's dtype).
    """
    if ADD:
        tl.debug_barrier()      # every thread's earlier stores are visible to the whole program
        cols = tl.arange(0, HEAD_DIM // 2)[None, :]
        ptrs = Base + rows.to(tl.int64)[:, None] * HEAD_DIM + cols
        ok = rows[:, None] < n_rows
        a = a + tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        b = b + tl.load(ptrs + HEAD_DIM // 2, mask=ok, other=0.0).to(tl.float32)
    _store_rows(Base, rows, n_rows, a, 0, HEAD_DIM // 2, HEAD_DIM)
    _store_rows(Base, rows, n_rows, b, HEAD_DIM // 2, HEAD_DIM // 2, HEAD_DIM)


# --- dK, dV --------------------------------------------------------------------------------------


@triton.jit
def _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, DO, Lse, Delta, sq_n, sq_d, sdo_n, sdo_d,
               keys, walk, n_q, q_offset, window, qk_scale, Table, Offset, logn_factor,
               PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               TURN: tl.constexpr, LOGN: tl.constexpr,
               SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
               TMA: tl.constexpr):
    """Accumulate this product's ``dK`` and ``dV`` over the query tiles of ``walk``.

    Works on transposed tiles (keys along dim 0, queries along dim 1) so that the keys, ``v``
    and the accumulators stay put. ``keys`` are measured like query rows (position minus
    ``q_offset``). Each query tile is scaled by log-n and turned by ``R(speed · i)``
    (``TURN``); the product's offset was moved onto the resident keys, which turns them by
    ``R(speed · j − offset)`` once per program instead of every query tile by ``R(offset)``
    (``R(a) x · R(b) y`` depends on ``b − a`` only).
    """
    offs_m = tl.arange(0, BLOCK_M)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_M)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_M)):
        start_m = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_M), BLOCK_M)
        queries = start_m + offs_m
        q_a, q_b = _operand(Qa, Qb, start_m, sq_n, sq_d, n_q, queries + q_offset, Table, Offset,
                            logn_factor, TURN, False, 1, LOGN, SPLIT, TWO_DOTS, BLOCK_M,
                            HEAD_DIM, MASKED, TMA)
        do = _load_tile(DO, start_m, sdo_n, sdo_d, n_q, BLOCK_M, HEAD_DIM, MASKED, TMA)
        if MASKED:
            lse = tl.load(Lse + queries, mask=queries < n_q, other=0.0)
            delta = tl.load(Delta + queries, mask=queries < n_q, other=0.0)
        else:
            lse = tl.load(Lse + queries)
            delta = tl.load(Delta + queries)
        scores_t = _scores(k_a, k_b, q_a, q_b, TWO_DOTS, DOT_PRECISION)
        p_t = tl.math.exp2(scores_t * qk_scale - lse[None, :])       # Pᵀ: (BLOCK_N, BLOCK_M)
        if MASKED:
            q_rows = queries[None, :]
            p_t = tl.where(_keep(q_rows, keys[:, None], q_rows < n_q, window, PRODUCT, CAUSAL),
                           p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk_a, dk_b = _accumulate(dk_a, dk_b, ds_t, q_a, q_b, TWO_DOTS, DOT_PRECISION)
    return dk_a, dk_b, dv


@triton.jit
def _dkdv_product(dv, v, K, sk_n, sk_d, Q, sq_b, sq_h, sq_n, sq_d, DO, sdo_b, sdo_h, sdo_n,
                  sdo_d, Lse, Delta, DK, batch, kv_head, start_n, keys, keys_q, clean, band,
                  edge, n_heads, group, n_q, n_k, q_offset, window, qk_scale, sm_scale, Table,
                  Offset, logn_factor, PRODUCT: tl.constexpr, CAUSAL: tl.constexpr,
                  TURN: tl.constexpr, SHIFT: tl.constexpr, LOGN: tl.constexpr,
                  SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr, ADD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, TURN_BACK: tl.constexpr):
    """Everything one product gives a key block: its key operand (``K`` is the block's
    ``(N, D)`` slice; turned by ``R(speed·j − offset)``), its three walks for every query head
    of the group, then its ``dK`` stored at ``DK`` (turned back to the input keys in the
    ``SPLIT`` form; ``ADD``: added to the other product's). ``TURN_BACK``: the operands came
    pre-turned (five-tensor reads, keys by ``R(speed·j)`` only), the ``dK`` is turned back by
    that angle and summed as in the ``SPLIT`` form. Returns ``dV`` so far."""
    Ka, Kb = _halves(K, sk_n, sk_d, n_k, BLOCK_N, HEAD_DIM, SPLIT, TMA)
    k_a, k_b = _operand(Ka, Kb, start_n, sk_n, sk_d, n_k, keys, Table, Offset, 0.0, TURN, SHIFT,
                        -1, False, SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, True, TMA)
    dk_a, dk_b = _zeros(BLOCK_N, HEAD_DIM, TWO_DOTS)
    for g in range(group):                # every query head that shares this K/V head
        head = kv_head * group + g
        Qa, Qb = _halves(Q + batch * sq_b + head * sq_h, sq_n, sq_d, n_q, BLOCK_M, HEAD_DIM,
                         SPLIT, TMA)
        do = _tiles(DO + batch * sdo_b + head * sdo_h, sdo_n, n_q, BLOCK_M, HEAD_DIM, TMA)
        row_stats = (batch * n_heads + head) * n_q
        lse, delta = Lse + row_stats, Delta + row_stats
        dk_a, dk_b, dv = _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, do, lse, delta, sq_n,
                                    sq_d, sdo_n, sdo_d, keys_q, clean, n_q, q_offset, window,
                                    qk_scale, Table, Offset, logn_factor, PRODUCT, False, CAUSAL,
                                    TURN, LOGN, SPLIT, TWO_DOTS, BLOCK_M, HEAD_DIM,
                                    DOT_PRECISION, TMA)
        dk_a, dk_b, dv = _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, do, lse, delta, sq_n,
                                    sq_d, sdo_n, sdo_d, keys_q, band, n_q, q_offset, window,
                                    qk_scale, Table, Offset, logn_factor, PRODUCT, True, CAUSAL,
                                    TURN, LOGN, SPLIT, TWO_DOTS, BLOCK_M, HEAD_DIM,
                                    DOT_PRECISION, TMA)
        dk_a, dk_b, dv = _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, do, lse, delta, sq_n,
                                    sq_d, sdo_n, sdo_d, keys_q, edge, n_q, q_offset, window,
                                    qk_scale, Table, Offset, logn_factor, PRODUCT, True, CAUSAL,
                                    TURN, LOGN, SPLIT, TWO_DOTS, BLOCK_M, HEAD_DIM,
                                    DOT_PRECISION, TMA)
    if SPLIT:
        dk_a, dk_b = _as_halves(dk_a, dk_b, TWO_DOTS)
        if TURN or SHIFT:
            cos, sin = _angles(Table, keys, Offset, TURN, SHIFT, -1, HEAD_DIM // 2)
            dk_a, dk_b = _unrotate(dk_a, dk_b, cos, sin)
        _store_halves(DK, keys, n_k, dk_a * sm_scale, dk_b * sm_scale, HEAD_DIM, ADD)
    elif TURN_BACK:                       # pre-turned keys carry no offset
        dk_a, dk_b = _as_halves(dk_a, dk_b, False)
        if TURN:
            cos, sin = _angles(Table, keys, Offset, TURN, False, -1, HEAD_DIM // 2)
            dk_a, dk_b = _unrotate(dk_a, dk_b, cos, sin)
        _store_halves(DK, keys, n_k, dk_a * sm_scale, dk_b * sm_scale, HEAD_DIM, ADD)
    else:
        _store_rows(DK, keys, n_k, dk_a * sm_scale, 0, HEAD_DIM, HEAD_DIM)
    return dv


@triton.jit
def _bwd_dkdv_kernel(
    Q1, Q2, K1, K2, V, DO, Lse, Delta, DK1, DK2, DV, TabIn, OffIn, TabOut, OffOut,
    sq1_b, sq1_h, sq1_n, sq1_d, sq2_b, sq2_h, sq2_n, sq2_d,
    sk1_b, sk1_h, sk1_n, sk1_d, sk2_b, sk2_h, sk2_n, sk2_d,
    sv_b, sv_h, sv_n, sv_d, sdo_b, sdo_h, sdo_n, sdo_d,
    n_heads, n_kv_heads, group, n_q, n_k, window, qk_scale, sm_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr, LOGN: tl.constexpr,
    TURN_IN: tl.constexpr, SHIFT_IN: tl.constexpr, TURN_OUT: tl.constexpr,
    SHIFT_OUT: tl.constexpr, TURN_BACK: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False,
):
    """Grid ``(cdiv(Nk, BLOCK_N), B * Hkv)``, or ``(B * Hkv, cdiv(Nk, BLOCK_N))`` with
    ``HEADS_FIRST`` (:func:`rerope.forward._program`; causal, the first key blocks have the most
    queries and come first either way). Gradients are contiguous ``(B, Hkv, Nk, D)``:
    ``DK1, DK2, DV`` in the five-tensor form; ``DK1`` (= dk) and ``DV`` with ``SPLIT``.

    ``TURN_BACK`` (with ``SPLIT`` off): the five tensors are the products' operands pre-turned
    from one ``q`` and one ``k`` (:func:`rerope.rotary.turn_operands`: keys by
    ``R(speed·j)``, queries by log-n and ``R(speed·i + offset)``); each product's ``dK`` is
    turned back by its key angle (``TURN_*``, tables as in the ``SPLIT`` form) and the two are
    summed into ``DK1`` (= dk), as in the ``SPLIT`` form."""
    bh, block, _ = _program(HEADS_FIRST)
    start_n = block * BLOCK_N
    batch = (bh // n_kv_heads).to(tl.int64)
    kv_head = (bh % n_kv_heads).to(tl.int64)
    q_offset = n_k - n_q                  # queries are the last n_q positions
    keys = start_n + tl.arange(0, BLOCK_N)
    keys_q = keys - q_offset              # key positions measured like query rows
    v = _load_tile(_tiles(V + batch * sv_b + kv_head * sv_h, sv_n, n_k, BLOCK_N, HEAD_DIM, TMA),
                   start_n, sv_n, sv_d, n_k, BLOCK_N, HEAD_DIM, True, TMA)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_n - q_offset, BLOCK_N, BLOCK_M, n_q, window, CAUSAL, False)
    out_offset = bh.to(tl.int64) * n_k * HEAD_DIM
    if SPLIT:                             # one q and one k serve both products
        Q2, sq2_b, sq2_h, sq2_n, sq2_d = Q1, sq1_b, sq1_h, sq1_n, sq1_d
        K2, sk2_b, sk2_h, sk2_n, sk2_d = K1, sk1_b, sk1_h, sk1_n, sk1_d

    # the inside passes give that product's dK (and part of dV), stored before the outside
    # passes give the other's (added to it in the SPLIT form): only two fp32 accumulators are
    # filled at any time, as in plain attention
    DK = DK1 + out_offset
    dv = _dkdv_product(dv, v, K1 + batch * sk1_b + kv_head * sk1_h, sk1_n, sk1_d, Q1, sq1_b,
                       sq1_h, sq1_n, sq1_d, DO, sdo_b, sdo_h, sdo_n, sdo_d, Lse, Delta, DK,
                       batch, kv_head, start_n, keys, keys_q, inside_clean, band, edge_inside,
                       n_heads, group, n_q, n_k, q_offset, window, qk_scale, sm_scale, TabIn,
                       OffIn, logn_factor, INSIDE, CAUSAL, TURN_IN, SHIFT_IN, LOGN, SPLIT,
                       TWO_DOTS, False, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA,
                       TURN_BACK)
    if not (SPLIT or TURN_BACK):
        DK = DK2 + out_offset
    dv = _dkdv_product(dv, v, K2 + batch * sk2_b + kv_head * sk2_h, sk2_n, sk2_d, Q2, sq2_b,
                       sq2_h, sq2_n, sq2_d, DO, sdo_b, sdo_h, sdo_n, sdo_d, Lse, Delta, DK,
                       batch, kv_head, start_n, keys, keys_q, outside_clean, band, edge_outside,
                       n_heads, group, n_q, n_k, q_offset, window, qk_scale, sm_scale, TabOut,
                       OffOut, logn_factor, OUTSIDE, CAUSAL, TURN_OUT, SHIFT_OUT, LOGN, SPLIT,
                       TWO_DOTS, SPLIT or TURN_BACK, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION,
                       TMA, TURN_BACK)
    _store_rows(DV + out_offset, keys, n_k, dv, 0, HEAD_DIM, HEAD_DIM)


# --- dQ ------------------------------------------------------------------------------------------


@triton.jit
def _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, Table, sk_n, sk_d, sv_n, sv_d,
             rows, walk, n_k, window, qk_scale,
             PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             TURN: tl.constexpr, SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
             TMA: tl.constexpr):
    """Accumulate this product's ``dQ`` (shaped like its query operand) over ``walk``."""
    offs_n = tl.arange(0, BLOCK_N)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start_n = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        k_a, k_b = _operand(Ka, Kb, start_n, sk_n, sk_d, n_k, start_n + offs_n, Table, Table,
                            0.0, TURN, False, 1, False, SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM,
                            MASKED, TMA)
        v = _load_tile(V, start_n, sv_n, sv_d, n_k, BLOCK_N, HEAD_DIM, MASKED, TMA)
        scores = _scores(q_a, q_b, k_a, k_b, TWO_DOTS, DOT_PRECISION)
        p = tl.math.exp2(scores * qk_scale - lse[:, None])
        if MASKED:
            cols = (start_n + offs_n)[None, :]
            p = tl.where(_keep(rows[:, None], cols, cols < n_k, window, PRODUCT, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq_a, dq_b = _accumulate(dq_a, dq_b, ds, k_a, k_b, TWO_DOTS, DOT_PRECISION)
    return dq_a, dq_b


@triton.jit
def _store_dq(DQ, q_rows, positions, n_q, dq_a, dq_b, Table, Offset, sm_scale, logn_factor,
              TURN: tl.constexpr, SHIFT: tl.constexpr, LOGN: tl.constexpr,
              TWO_DOTS: tl.constexpr, HEAD_DIM: tl.constexpr, ADD: tl.constexpr):
    """One product's ``dQ`` back to the raw queries — rotated back by the product's angle,
    scaled by ``sm_scale`` and the log-n factor — stored (or added: ``ADD``) in halves."""
    dq_a, dq_b = _as_halves(dq_a, dq_b, TWO_DOTS)
    if TURN or SHIFT:
        cos, sin = _angles(Table, positions, Offset, TURN, SHIFT, 1, HEAD_DIM // 2)
        dq_a, dq_b = _unrotate(dq_a, dq_b, cos, sin)
    scale = sm_scale
    if LOGN:                              # the queries were scaled before rotation
        scale = _logn_scale(positions, logn_factor)[:, None] * sm_scale
    _store_halves(DQ, q_rows, n_q, dq_a * scale, dq_b * scale, HEAD_DIM, ADD)


@triton.jit
def _dq_product(do, lse, delta, Q, sq_n, sq_d, start_m, n_q, rows, q_rows, Ka, Kb, sk_n, sk_d, V,
                sv_n, sv_d, Table, Offset, logn_factor, sm_scale, DQ, clean, band, edge, n_k,
                window, qk_scale, PRODUCT: tl.constexpr, CAUSAL: tl.constexpr,
                TURN: tl.constexpr, SHIFT: tl.constexpr, LOGN: tl.constexpr,
                SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr, ADD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, TURN_BACK: tl.constexpr):
    """Everything one product gives a query block's ``dQ``: its query operand (``Q`` is the
    block's ``(N, D)`` slice), its three walks, then the store at ``DQ`` (turned back to the
    input queries in the ``SPLIT`` form and with ``TURN_BACK`` — pre-turned operands, the same
    angles; ``ADD``: added to the other product's)."""
    Qa, Qb = _halves(Q, sq_n, sq_d, n_q, BLOCK_M, HEAD_DIM, SPLIT, TMA)
    q_a, q_b = _operand(Qa, Qb, start_m, sq_n, sq_d, n_q, rows, Table, Offset, logn_factor, TURN,
                        SHIFT, 1, LOGN, SPLIT, TWO_DOTS, BLOCK_M, HEAD_DIM, True, TMA)
    dq_a, dq_b = _zeros(BLOCK_M, HEAD_DIM, TWO_DOTS)
    dq_a, dq_b = _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, Table, sk_n, sk_d,
                          sv_n, sv_d, rows, clean, n_k, window, qk_scale, PRODUCT, False, CAUSAL,
                          TURN, SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq_a, dq_b = _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, Table, sk_n, sk_d,
                          sv_n, sv_d, rows, band, n_k, window, qk_scale, PRODUCT, True, CAUSAL,
                          TURN, SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq_a, dq_b = _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, Table, sk_n, sk_d,
                          sv_n, sv_d, rows, edge, n_k, window, qk_scale, PRODUCT, True, CAUSAL,
                          TURN, SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    if SPLIT or TURN_BACK:
        _store_dq(DQ, q_rows, rows, n_q, dq_a, dq_b, Table, Offset, sm_scale, logn_factor, TURN,
                  SHIFT, LOGN, TWO_DOTS, HEAD_DIM, ADD)
    else:
        _store_rows(DQ, q_rows, n_q, dq_a * sm_scale, 0, HEAD_DIM, HEAD_DIM)


@triton.jit
def _bwd_dq_kernel(
    Q1, Q2, K1, K2, V, DO, Lse, Delta, DQ1, DQ2, TabIn, OffIn, TabOut, OffOut,
    sq1_b, sq1_h, sq1_n, sq1_d, sq2_b, sq2_h, sq2_n, sq2_d,
    sk1_b, sk1_h, sk1_n, sk1_d, sk2_b, sk2_h, sk2_n, sk2_d,
    sv_b, sv_h, sv_n, sv_d, sdo_b, sdo_h, sdo_n, sdo_d,
    n_heads, group, n_q, n_k, window, qk_scale, sm_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr, LOGN: tl.constexpr,
    TURN_IN: tl.constexpr, SHIFT_IN: tl.constexpr, TURN_OUT: tl.constexpr,
    SHIFT_OUT: tl.constexpr, TURN_BACK: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False,
):
    """Grid ``(cdiv(Nq, BLOCK_M), B * Hq)``, or ``(B * Hq, cdiv(Nq, BLOCK_M))`` with
    ``HEADS_FIRST`` (:func:`rerope.forward._program`). Gradients are contiguous ``(B, Hq, Nq, D)``:
    ``DQ1, DQ2`` in the five-tensor form; ``DQ1`` (= dq) with ``SPLIT`` or ``TURN_BACK``
    (pre-turned operands, see :func:`_bwd_dkdv_kernel`: each product's ``dQ`` is turned back by
    its query angle, scaled by log-n, and the two are summed)."""
    bh, block, n_blocks = _program(HEADS_FIRST)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = n_blocks - 1 - block
    start_m = block * BLOCK_M
    start_pos = n_k - n_q + start_m
    batch = (bh // n_heads).to(tl.int64)
    head = (bh % n_heads).to(tl.int64)
    kv_head = head // group
    if SPLIT:                             # one q and one k serve both products
        Q2, sq2_b, sq2_h, sq2_n, sq2_d = Q1, sq1_b, sq1_h, sq1_n, sq1_d
        K2, sk2_b, sk2_h, sk2_n, sk2_d = K1, sk1_b, sk1_h, sk1_n, sk1_d
    K1a, K1b = _halves(K1 + batch * sk1_b + kv_head * sk1_h, sk1_n, sk1_d, n_k, BLOCK_N,
                       HEAD_DIM, SPLIT, TMA)
    K2a, K2b = _halves(K2 + batch * sk2_b + kv_head * sk2_h, sk2_n, sk2_d, n_k, BLOCK_N,
                       HEAD_DIM, SPLIT, TMA)
    V = _tiles(V + batch * sv_b + kv_head * sv_h, sv_n, n_k, BLOCK_N, HEAD_DIM, TMA)
    q_rows = start_m + tl.arange(0, BLOCK_M)
    rows = start_pos + tl.arange(0, BLOCK_M)
    do = _load_tile(_tiles(DO + batch * sdo_b + head * sdo_h, sdo_n, n_q, BLOCK_M, HEAD_DIM, TMA),
                    start_m, sdo_n, sdo_d, n_q, BLOCK_M, HEAD_DIM, True, TMA)
    row_stats = bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_stats + q_rows, mask=q_rows < n_q, other=0.0)
    delta = tl.load(Delta + row_stats + q_rows, mask=q_rows < n_q, other=0.0)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_pos, BLOCK_M, BLOCK_N, n_k, window, CAUSAL, True)
    out_offset = bh.to(tl.int64) * n_q * HEAD_DIM

    # the inside passes, then the outside ones: each product's dQ is stored (five tensors) or
    # turned back and added to the other's (SPLIT) before the next (one accumulator at a time)
    DQ = DQ1 + out_offset
    _dq_product(do, lse, delta, Q1 + batch * sq1_b + head * sq1_h, sq1_n, sq1_d, start_m, n_q,
                rows, q_rows, K1a, K1b, sk1_n, sk1_d, V, sv_n, sv_d, TabIn, OffIn, logn_factor,
                sm_scale, DQ, inside_clean, band, edge_inside, n_k, window, qk_scale, INSIDE,
                CAUSAL, TURN_IN, SHIFT_IN, LOGN, SPLIT, TWO_DOTS, False, BLOCK_M, BLOCK_N,
                HEAD_DIM, DOT_PRECISION, TMA, TURN_BACK)
    if not (SPLIT or TURN_BACK):
        DQ = DQ2 + out_offset
    _dq_product(do, lse, delta, Q2 + batch * sq2_b + head * sq2_h, sq2_n, sq2_d, start_m, n_q,
                rows, q_rows, K2a, K2b, sk2_n, sk2_d, V, sv_n, sv_d, TabOut, OffOut,
                logn_factor, sm_scale, DQ, outside_clean, band, edge_outside, n_k, window,
                qk_scale, OUTSIDE, CAUSAL, TURN_OUT, SHIFT_OUT, LOGN, SPLIT, TWO_DOTS,
                SPLIT or TURN_BACK, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA, TURN_BACK)
