"""The ReRoPE backward kernels. Chapters 5 and 7 of the book.

With ``P = softmax(S)``, ``O = P V`` and upstream ``dO``:

    dV = Pᵀ dO          dP = dO Vᵀ          dS = P ∘ (dP − δ),   δ_i = Σ_d dO_id O_id

and, because ``S_ij = sm_scale · (q1_i · k1_j)`` inside the window and ``sm_scale ·
(q2_i · k2_j)`` outside, each ``dS_ij`` flows into exactly one pair of gradients:

    dQ1 = sm_scale · (dS ∘ W) K1      dK1 = sm_scale · (dS ∘ W)ᵀ Q1
    dQ2 = sm_scale · (dS ∘ ¬W) K2     dK2 = sm_scale · (dS ∘ ¬W)ᵀ Q2

with ``W_ij = [|i − j| < w]``.

Three kernels, as in Triton's fused-attention tutorial, none with atomics
(deterministic):

1. ``_bwd_delta_kernel`` — ``δ = rowsum(dO ∘ O)``, one program per query block;
2. ``_bwd_dkdv_kernel`` — one program per (key block, batch · kv head): keeps its keys
   and ``v`` on chip and walks the query tiles of every query head of its group,
   accumulating ``dK, dV``;
3. ``_bwd_dq_kernel`` — one program per (query block, batch · query head): keeps its
   queries and ``dO`` on chip and walks the key tiles, accumulating ``dQ``.

``P`` is recomputed from the saved log-sum-exp. Both walks use the forward's schedule
(:func:`rerope.regions._schedule`) and its operands and mask (:mod:`rerope.forward`):
inside passes touch only the inside product's operands, outside passes only the outside
ones — the band's ``dS`` is split by the same window mask that split its scores.

In the fused-rotation form (``q, k`` as the model holds them, chapter 7) the products'
operands are rotations of the same ``q`` and ``k``, so the chain rule runs on: a
product's gradient is rotated back, ``dq = Rᵀ dq1``, and the two products' parts are
summed in registers before one store — ``dq, dk, dv`` come out directly, and nothing
rotated is ever written.

That form turns, in every program, every tile of the axis it walks: the dK/dV kernel
each query tile once per key block, the dQ kernel each key tile once per query block.
For long sequences the launcher pre-turns instead (``PRETURNED``,
:func:`rerope.attention.preturn_backward`): one pass writes each product's operands
(:func:`rerope.rotary.turn_operands`), the kernels read them as they read the five
tensors, and only the gradients are turned back — once per program, in the store that
sums the two products' parts, as in the fused form.

Each kernel takes one flag group per product, ``INSIDE_FLAGS`` / ``OUTSIDE_FLAGS``:
``None`` for the five tensors, else ``(TURN, SHIFT)`` of that product (its speed, its
offset is not 0); ``PRETURNED`` says whether the operands come turned.
"""

import triton
import triton.language as tl

from .forward import (_halves, _keep, _load_rows, _load_tile, _operand, _program,
                      _slice, _split_halves, _tiles)
from .online_softmax import _scores
from .regions import INSIDE, OUTSIDE, _nth_tile, _schedule, _tile_count
from .rotary import _angles, _logn_scale, _unrotate


@triton.jit
def _bwd_delta_kernel(Out, DO, Delta, so, sdo, n_heads, n_ctx, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """Grid ``(B · H, cdiv(N, BLOCK_M))`` (batch · head first: CUDA allows up to 2³¹ − 1
    programs there, 65535 on the second axis): ``Delta[bh, i] = Σ_d dO[b, h, i, d] ·
    O[b, h, i, d]`` in fp32. ``so``, ``sdo``: the strides of ``Out`` and ``DO``."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch = tl.program_id(0) // n_heads
    head = tl.program_id(0) % n_heads
    dims = tl.arange(0, HEAD_DIM)
    o = _load_rows(_slice(Out, so, batch, head), rows, so, dims, n_ctx, True)
    do = _load_rows(_slice(DO, sdo, batch, head), rows, sdo, dims, n_ctx, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_stats = Delta + tl.program_id(0).to(tl.int64) * n_ctx
    tl.store(row_stats + rows, delta, mask=rows < n_ctx)


# --- shared by both kernels -----------------------------------------------------------


@triton.jit
def _accumulate(acc_a, acc_b, weights, y_a, y_b, TWO_DOTS: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """``acc += weights @ y`` for an operand as :func:`rerope.forward._operand` returns
    it (two halves into two accumulators, or one whole tile)."""
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
        return (tl.zeros([BLOCK, HEAD_DIM], tl.float32),
                tl.zeros([BLOCK, HEAD_DIM], tl.float32))


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
    """Store ``x`` into columns ``COL0 .. COL0 + WIDTH`` of rows ``rows`` of a
    contiguous ``(N, ROW_STRIDE)`` slice; rows ``>= n_rows`` are left alone."""
    ptrs = (Base + rows.to(tl.int64)[:, None] * ROW_STRIDE + COL0
            + tl.arange(0, WIDTH)[None, :])
    tl.store(ptrs, x.to(Base.dtype.element_ty), mask=rows[:, None] < n_rows)


@triton.jit
def _store_halves(Base, rows, n_rows, a, b, HEAD_DIM: tl.constexpr, ADD: tl.constexpr):
    """Store the halves ``[a | b]`` of rows ``rows`` of a contiguous ``(N, HEAD_DIM)``
    slice; with ``ADD``, add them to what this program stored there before.

    The fused form's gradient is a sum over the two products. Adding the second
    product's part to the first one's stored value, instead of keeping the first in
    registers, holds register pressure at plain attention's level (one more rounding to
    the gradient's dtype).
    """
    if ADD:
        tl.debug_barrier()      # every thread's earlier stores visible to the program
        cols = tl.arange(0, HEAD_DIM // 2)[None, :]
        ptrs = Base + rows.to(tl.int64)[:, None] * HEAD_DIM + cols
        ok = rows[:, None] < n_rows
        a = a + tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        b = b + tl.load(ptrs + HEAD_DIM // 2, mask=ok, other=0.0).to(tl.float32)
    _store_rows(Base, rows, n_rows, a, 0, HEAD_DIM // 2, HEAD_DIM)
    _store_rows(Base, rows, n_rows, b, HEAD_DIM // 2, HEAD_DIM // 2, HEAD_DIM)


@triton.jit
def _store_grad(G, rows, positions, n_rows, g_a, g_b, turn, scale, FLAGS: tl.constexpr,
                SIGN: tl.constexpr, PRETURNED: tl.constexpr, HEAD_DIM: tl.constexpr,
                ADD: tl.constexpr):
    """One product's gradient, times ``scale``, stored at rows ``rows`` of ``G``
    (contiguous ``(N, D)``). Five tensors (``FLAGS`` ``None``): as accumulated.
    Otherwise turned back to the inputs by the product's angle at ``positions``
    (``SIGN``: the sign its offset had; pre-turned keys carry no offset) and stored in
    halves (``ADD``: added to the other product's)."""
    if FLAGS is None:
        _store_rows(G, rows, n_rows, g_a * scale, 0, HEAD_DIM, HEAD_DIM)
    else:
        SHIFT: tl.constexpr = FLAGS[1] and not (PRETURNED and SIGN == -1)
        g_a, g_b = _as_halves(g_a, g_b, not PRETURNED and HEAD_DIM >= 32)
        if FLAGS[0] or SHIFT:
            cos, sin = _angles(turn[0], positions, turn[1], FLAGS[0], SHIFT, SIGN,
                               HEAD_DIM // 2)
            g_a, g_b = _unrotate(g_a, g_b, cos, sin)
        _store_halves(G, rows, n_rows, g_a * scale, g_b * scale, HEAD_DIM, ADD)


# --- dK, dV ---------------------------------------------------------------------------


@triton.jit
def _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, DO, Lse, Delta, sq, sdo, keys, walk,
               n_q, q_offset, window, qk_scale, turn, logn_factor,
               PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               TURN: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Accumulate this product's ``dK`` and ``dV`` over the query tiles of ``walk``.

    Works on transposed tiles (keys along dim 0, queries along dim 1) so that the keys,
    ``v`` and the accumulators stay put. ``keys`` are measured like query rows (position
    minus ``q_offset``). ``TURN`` makes each query tile an operand
    (:func:`rerope.forward._operand`): scaled by log-n and turned by ``R(speed · i)``;
    the product's offset was moved onto the resident keys, which turns them by ``R(speed
    · j − offset)`` once per program instead of every query tile by ``R(offset)``
    (``R(a) x · R(b) y`` depends on ``b − a`` only).
    """
    offs_m = tl.arange(0, BLOCK_M)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_M)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_M)):
        start_m = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_M), BLOCK_M)
        queries = start_m + offs_m
        q_a, q_b = _operand(Qa, Qb, start_m, sq, n_q, queries + q_offset, turn,
                            logn_factor, TURN, BLOCK_M, HEAD_DIM, MASKED, TMA)
        do = _load_tile(DO, start_m, sdo, n_q, BLOCK_M, HEAD_DIM, MASKED, TMA)
        if MASKED:
            lse = tl.load(Lse + queries, mask=queries < n_q, other=0.0)
            delta = tl.load(Delta + queries, mask=queries < n_q, other=0.0)
        else:
            lse = tl.load(Lse + queries)
            delta = tl.load(Delta + queries)
        two_dots: tl.constexpr = TURN is not None and HEAD_DIM >= 32
        scores_t = _scores(k_a, k_b, q_a, q_b, two_dots, DOT_PRECISION)
        p_t = tl.math.exp2(scores_t * qk_scale - lse[None, :])   # Pᵀ (BLOCK_N, BLOCK_M)
        if MASKED:
            q_rows = queries[None, :]
            keep = _keep(q_rows, keys[:, None], q_rows < n_q, window, PRODUCT, CAUSAL)
            p_t = tl.where(keep, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk_a, dk_b = _accumulate(dk_a, dk_b, ds_t, q_a, q_b, two_dots, DOT_PRECISION)
    return dk_a, dk_b, dv


@triton.jit
def _dkdv_product(dv, v, K, sk, Q, sq, DO, sdo, Lse, Delta, DK, batch, kv_head, start_n,
                  keys, walks, stats_stride, q_per_kv, n_q, n_k, window, qk_scale, sm_scale,
                  turn, logn_factor, PRODUCT: tl.constexpr, FLAGS: tl.constexpr,
                  LOGN: tl.constexpr, PRETURNED: tl.constexpr, ADD: tl.constexpr,
                  CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  TMA: tl.constexpr):
    """Everything one product gives a key block: its key operand (``K`` is the block's
    ``(N, D)`` slice; turned by ``R(speed·j − offset)``), its three ``walks`` for every
    query head of the group, then its ``dK`` stored at ``DK`` (:func:`_store_grad`).
    Returns ``dV`` so far. ``PRETURNED``: the operands came turned (read as five
    tensors, keys by ``R(speed·j)`` only), the ``dK`` is turned back by that angle and
    summed as in the fused form. Query head ``h``'s log-sum-exps and deltas start at
    ``Lse + h * stats_stride`` and ``Delta + h * stats_stride``."""
    FUSED: tl.constexpr = FLAGS is not None and not PRETURNED
    KEYS: tl.constexpr = (FLAGS[0], FLAGS[1], -1, False) if FUSED else None
    QUERIES: tl.constexpr = (FLAGS[0], False, 1, LOGN) if FUSED else None
    q_offset = n_k - n_q                  # queries are the last n_q positions
    keys_q = keys - q_offset              # key positions measured like query rows
    Ka, Kb = _halves(K, sk, n_k, BLOCK_N, HEAD_DIM, FUSED, TMA)
    k_a, k_b = _operand(Ka, Kb, start_n, sk, n_k, keys, turn, 0.0, KEYS, BLOCK_N,
                        HEAD_DIM, True, TMA)
    dk_a, dk_b = _zeros(BLOCK_N, HEAD_DIM, FUSED and HEAD_DIM >= 32)
    for g in range(q_per_kv):             # every query head that shares this K/V head
        head = kv_head * q_per_kv + g
        Qa, Qb = _halves(_slice(Q, sq, batch, head), sq, n_q, BLOCK_M, HEAD_DIM, FUSED,
                         TMA)
        do = _tiles(_slice(DO, sdo, batch, head), sdo, n_q, BLOCK_M, HEAD_DIM, TMA)
        row_stats = head * stats_stride   # Lse, Delta: this batch entry's head 0
        lse, delta = Lse + row_stats, Delta + row_stats
        dk_a, dk_b, dv = _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, do, lse, delta,
                                    sq, sdo, keys_q, walks[0], n_q, q_offset, window,
                                    qk_scale, turn, logn_factor, PRODUCT, False, CAUSAL,
                                    QUERIES, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
        dk_a, dk_b, dv = _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, do, lse, delta,
                                    sq, sdo, keys_q, walks[1], n_q, q_offset, window,
                                    qk_scale, turn, logn_factor, PRODUCT, True, CAUSAL,
                                    QUERIES, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
        dk_a, dk_b, dv = _dkdv_pass(dk_a, dk_b, dv, k_a, k_b, v, Qa, Qb, do, lse, delta,
                                    sq, sdo, keys_q, walks[2], n_q, q_offset, window,
                                    qk_scale, turn, logn_factor, PRODUCT, True, CAUSAL,
                                    QUERIES, BLOCK_M, HEAD_DIM, DOT_PRECISION, TMA)
    _store_grad(DK, keys, keys, n_k, dk_a, dk_b, turn, sm_scale, FLAGS, -1, PRETURNED,
                HEAD_DIM, ADD)
    return dv


@triton.jit
def _bwd_dkdv_kernel(
    Q1, Q2, K1, K2, V, DO, Lse, Delta, DK1, DK2, DV, Tables,
    sq1, sq2, sk1, sk2, sv, sdo,
    n_heads, q_per_kv, n_q, n_k, window, qk_scale, sm_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, HEADS_FIRST: tl.constexpr,
    LOGN: tl.constexpr, INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
    PRETURNED: tl.constexpr,
):
    """Grid ``(cdiv(Nk, BLOCK_N), B * Hkv)``, or ``(B * Hkv, cdiv(Nk, BLOCK_N))`` with
    ``HEADS_FIRST`` (:func:`rerope.forward._program`; causal, the first key blocks have
    the most queries and come first either way). Gradients are contiguous ``(B, Hkv, Nk,
    D)``: ``DK1, DK2, DV`` in the five-tensor form; ``DK1`` (= dk) and ``DV`` otherwise.

    ``PRETURNED``: the five tensors are the products' operands pre-turned from one ``q``
    and one ``k`` (:func:`rerope.rotary.turn_operands`: keys by ``R(speed·j)``, queries
    by log-n and ``R(speed·i + offset)``); each product's ``dK`` is turned back by its
    key angle (``Tables`` and flags as in the fused form) and the two are summed into
    ``DK1`` (= dk)."""
    bh, block, _ = _program(HEADS_FIRST)
    n_kv_heads = n_heads // q_per_kv
    batch = (bh // n_kv_heads).to(tl.int64)
    kv_head = (bh % n_kv_heads).to(tl.int64)
    out_offset = bh.to(tl.int64) * n_k * HEAD_DIM
    stats = batch * n_heads * n_q
    _dkdv_rows(Q1, Q2, K1, K2, V, DO, Lse + stats, Delta + stats, DK1 + out_offset,
               DK2 + out_offset, DV + out_offset, Tables, sq1, sq2, sk1, sk2, sv, sdo,
               batch, kv_head, block * BLOCK_N, n_q, q_per_kv, n_q, n_k, window,
               qk_scale, sm_scale, logn_factor, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, TMA,
               LOGN, INSIDE_FLAGS, OUTSIDE_FLAGS, PRETURNED)


@triton.jit
def _dkdv_rows(Q1, Q2, K1, K2, V, DO, Lse, Delta, DK1, DK2, DV, Tables,
               sq1, sq2, sk1, sk2, sv, sdo, batch, kv_head, start_n, stats_stride,
               q_per_kv, n_q, n_k, window, qk_scale, sm_scale, logn_factor,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, TMA: tl.constexpr, LOGN: tl.constexpr,
               INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
               PRETURNED: tl.constexpr):
    """One dK/dV program's work: key rows ``start_n .. start_n + BLOCK_N`` of key/value
    head ``kv_head`` of batch entry ``batch``, a sequence of ``n_k`` keys whose last
    ``n_q`` positions are queries. ``Lse``, ``Delta``: this batch entry's query head
    0's row statistics, head ``h``'s ``h * stats_stride`` further. ``DK1, DK2, DV``:
    this (batch, kv head)'s contiguous ``(n_k, D)`` gradients. Tensors, strides and flags
    otherwise as :func:`_bwd_dkdv_kernel` takes them; the packed variable-length kernel
    (:mod:`rerope.varlen`) passes base pointers moved to the sequence's first row and
    ``batch`` 0.
    """
    FP32: tl.constexpr = Q1.dtype.element_ty == tl.float32
    DOT_PRECISION: tl.constexpr = "tf32x3" if FP32 else "tf32"       # 3xTF32: near fp32
    FUSED: tl.constexpr = INSIDE_FLAGS is not None and not PRETURNED
    ONE_GRAD: tl.constexpr = INSIDE_FLAGS is not None      # dk: both products' parts
    q_offset = n_k - n_q
    keys = start_n + tl.arange(0, BLOCK_N)
    V = _tiles(_slice(V, sv, batch, kv_head), sv, n_k, BLOCK_N, HEAD_DIM, TMA)
    v = _load_tile(V, start_n, sv, n_k, BLOCK_N, HEAD_DIM, True, TMA)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_n - q_offset, BLOCK_N, BLOCK_M, n_q, window, CAUSAL, False)
    if FUSED:                             # one q and one k serve both products
        Q2, sq2, K2, sk2 = Q1, sq1, K1, sk1

    # the inside passes give that product's dK (and part of dV), stored before the
    # outside passes give the other's (added to it where one dk sums both): only two
    # fp32 accumulators are filled at any time, as in plain attention
    DK = DK1
    dv = _dkdv_product(dv, v, _slice(K1, sk1, batch, kv_head), sk1, Q1, sq1, DO, sdo,
                       Lse, Delta, DK, batch, kv_head, start_n, keys,
                       (inside_clean, band, edge_inside), stats_stride, q_per_kv, n_q,
                       n_k, window, qk_scale, sm_scale, (Tables[0], Tables[1]),
                       logn_factor, INSIDE, INSIDE_FLAGS, LOGN, PRETURNED, False, CAUSAL,
                       BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    if not ONE_GRAD:
        DK = DK2
    dv = _dkdv_product(dv, v, _slice(K2, sk2, batch, kv_head), sk2, Q2, sq2, DO, sdo,
                       Lse, Delta, DK, batch, kv_head, start_n, keys,
                       (outside_clean, band, edge_outside), stats_stride, q_per_kv, n_q,
                       n_k, window, qk_scale, sm_scale, (Tables[2], Tables[3]),
                       logn_factor, OUTSIDE, OUTSIDE_FLAGS, LOGN, PRETURNED, ONE_GRAD,
                       CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    _store_rows(DV, keys, n_k, dv, 0, HEAD_DIM, HEAD_DIM)


# --- dQ -------------------------------------------------------------------------------


@triton.jit
def _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, sk, sv, turn, rows, walk,
             n_k, window, qk_scale, PRODUCT: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, TURN: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Accumulate this product's ``dQ`` (shaped like its query operand) over ``walk``;
    ``TURN`` makes each key tile an operand (:func:`rerope.forward._operand`)."""
    offs_n = tl.arange(0, BLOCK_N)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start_n = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        k_a, k_b = _operand(Ka, Kb, start_n, sk, n_k, start_n + offs_n, turn, 0.0, TURN,
                            BLOCK_N, HEAD_DIM, MASKED, TMA)
        v = _load_tile(V, start_n, sv, n_k, BLOCK_N, HEAD_DIM, MASKED, TMA)
        two_dots: tl.constexpr = TURN is not None and HEAD_DIM >= 32
        scores = _scores(q_a, q_b, k_a, k_b, two_dots, DOT_PRECISION)
        p = tl.math.exp2(scores * qk_scale - lse[:, None])
        if MASKED:
            cols = (start_n + offs_n)[None, :]
            keep = _keep(rows[:, None], cols, cols < n_k, window, PRODUCT, CAUSAL)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq_a, dq_b = _accumulate(dq_a, dq_b, ds, k_a, k_b, two_dots, DOT_PRECISION)
    return dq_a, dq_b


@triton.jit
def _dq_product(do, lse, delta, Q, sq, Ka, Kb, sk, V, sv, DQ, turn, logn_factor,
                sm_scale, start_m, n_q, rows, q_rows, walks, n_k, window, qk_scale,
                PRODUCT: tl.constexpr, FLAGS: tl.constexpr, LOGN: tl.constexpr,
                PRETURNED: tl.constexpr, ADD: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Everything one product gives a query block's ``dQ``: its query operand (``Q`` is
    the block's ``(N, D)`` slice), its three ``walks``, then the store at ``DQ``
    (:func:`_store_grad`: turned back to the input queries and scaled by log-n, except
    in the five-tensor form; ``ADD``: added to the other product's)."""
    FUSED: tl.constexpr = FLAGS is not None and not PRETURNED
    QUERIES: tl.constexpr = (FLAGS[0], FLAGS[1], 1, LOGN) if FUSED else None
    KEYS: tl.constexpr = (FLAGS[0], False, 1, False) if FUSED else None
    Qa, Qb = _halves(Q, sq, n_q, BLOCK_M, HEAD_DIM, FUSED, TMA)
    q_a, q_b = _operand(Qa, Qb, start_m, sq, n_q, rows, turn, logn_factor, QUERIES,
                        BLOCK_M, HEAD_DIM, True, TMA)
    dq_a, dq_b = _zeros(BLOCK_M, HEAD_DIM, FUSED and HEAD_DIM >= 32)
    dq_a, dq_b = _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, sk, sv, turn,
                          rows, walks[0], n_k, window, qk_scale, PRODUCT, False, CAUSAL,
                          KEYS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq_a, dq_b = _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, sk, sv, turn,
                          rows, walks[1], n_k, window, qk_scale, PRODUCT, True, CAUSAL,
                          KEYS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    dq_a, dq_b = _dq_pass(dq_a, dq_b, q_a, q_b, do, lse, delta, Ka, Kb, V, sk, sv, turn,
                          rows, walks[2], n_k, window, qk_scale, PRODUCT, True, CAUSAL,
                          KEYS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    scale = sm_scale
    if LOGN and FLAGS is not None:        # the queries were scaled before rotation
        scale = _logn_scale(rows, logn_factor)[:, None] * sm_scale
    _store_grad(DQ, q_rows, rows, n_q, dq_a, dq_b, turn, scale, FLAGS, 1, PRETURNED,
                HEAD_DIM, ADD)


@triton.jit
def _bwd_dq_kernel(
    Q1, Q2, K1, K2, V, DO, Lse, Delta, DQ1, DQ2, Tables,
    sq1, sq2, sk1, sk2, sv, sdo,
    n_heads, q_per_kv, n_q, n_k, window, qk_scale, sm_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, HEADS_FIRST: tl.constexpr,
    LOGN: tl.constexpr, INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
    PRETURNED: tl.constexpr,
):
    """Grid ``(cdiv(Nq, BLOCK_M), B * Hq)``, or ``(B * Hq, cdiv(Nq, BLOCK_M))`` with
    ``HEADS_FIRST`` (:func:`rerope.forward._program`). Gradients are contiguous ``(B,
    Hq, Nq, D)``: ``DQ1, DQ2`` in the five-tensor form; ``DQ1`` (= dq) otherwise (with
    ``PRETURNED``, see :func:`_bwd_dkdv_kernel`: each product's ``dQ`` is turned back by
    its query angle, scaled by log-n, and the two are summed)."""
    bh, block, n_blocks = _program(HEADS_FIRST)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = n_blocks - 1 - block
    batch = (bh // n_heads).to(tl.int64)
    head = (bh % n_heads).to(tl.int64)
    row_stats = bh.to(tl.int64) * n_q
    out_offset = row_stats * HEAD_DIM
    _dq_rows(Q1, Q2, K1, K2, V, DO, Lse + row_stats, Delta + row_stats, DQ1 + out_offset,
             DQ2 + out_offset, Tables, sq1, sq2, sk1, sk2, sv, sdo, batch, head,
             head // q_per_kv, block * BLOCK_M, n_q, n_k, window, qk_scale, sm_scale,
             logn_factor, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, TMA, LOGN, INSIDE_FLAGS,
             OUTSIDE_FLAGS, PRETURNED)


@triton.jit
def _dq_rows(Q1, Q2, K1, K2, V, DO, Lse, Delta, DQ1, DQ2, Tables,
             sq1, sq2, sk1, sk2, sv, sdo, batch, head, kv_head, start_m, n_q, n_k,
             window, qk_scale, sm_scale, logn_factor,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, TMA: tl.constexpr, LOGN: tl.constexpr,
             INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
             PRETURNED: tl.constexpr):
    """One dQ program's work: query rows ``start_m .. start_m + BLOCK_M`` of head
    ``head`` (key/value head ``kv_head``) of batch entry ``batch``, a sequence of ``n_q``
    queries at the last of its ``n_k`` positions. ``Lse``, ``Delta``: this (batch,
    head)'s row statistics from its first query; ``DQ1, DQ2``: its contiguous ``(n_q,
    D)`` gradients. Tensors, strides and flags otherwise as :func:`_bwd_dq_kernel` takes
    them; the packed variable-length kernel (:mod:`rerope.varlen`) passes base pointers
    moved to the sequence's first row and ``batch`` 0.
    """
    FP32: tl.constexpr = Q1.dtype.element_ty == tl.float32
    DOT_PRECISION: tl.constexpr = "tf32x3" if FP32 else "tf32"       # 3xTF32: near fp32
    FUSED: tl.constexpr = INSIDE_FLAGS is not None and not PRETURNED
    ONE_GRAD: tl.constexpr = INSIDE_FLAGS is not None      # dq: both products' parts
    start_pos = n_k - n_q + start_m
    if FUSED:                             # one q and one k serve both products
        Q2, sq2, K2, sk2 = Q1, sq1, K1, sk1
    K1a, K1b = _halves(_slice(K1, sk1, batch, kv_head), sk1, n_k, BLOCK_N, HEAD_DIM,
                       FUSED, TMA)
    K2a, K2b = _halves(_slice(K2, sk2, batch, kv_head), sk2, n_k, BLOCK_N, HEAD_DIM,
                       FUSED, TMA)
    V = _tiles(_slice(V, sv, batch, kv_head), sv, n_k, BLOCK_N, HEAD_DIM, TMA)
    q_rows = start_m + tl.arange(0, BLOCK_M)
    rows = start_pos + tl.arange(0, BLOCK_M)
    DO = _tiles(_slice(DO, sdo, batch, head), sdo, n_q, BLOCK_M, HEAD_DIM, TMA)
    do = _load_tile(DO, start_m, sdo, n_q, BLOCK_M, HEAD_DIM, True, TMA)
    lse = tl.load(Lse + q_rows, mask=q_rows < n_q, other=0.0)
    delta = tl.load(Delta + q_rows, mask=q_rows < n_q, other=0.0)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_pos, BLOCK_M, BLOCK_N, n_k, window, CAUSAL, True)

    # the inside passes, then the outside ones: each product's dQ is stored (five
    # tensors) or turned back and added to the other's before the next (one accumulator
    # at a time)
    DQ = DQ1
    _dq_product(do, lse, delta, _slice(Q1, sq1, batch, head), sq1, K1a, K1b, sk1, V, sv,
                DQ, (Tables[0], Tables[1]), logn_factor, sm_scale, start_m, n_q, rows,
                q_rows, (inside_clean, band, edge_inside), n_k, window, qk_scale,
                INSIDE, INSIDE_FLAGS, LOGN, PRETURNED, False, CAUSAL, BLOCK_M, BLOCK_N,
                HEAD_DIM, DOT_PRECISION, TMA)
    if not ONE_GRAD:
        DQ = DQ2
    _dq_product(do, lse, delta, _slice(Q2, sq2, batch, head), sq2, K2a, K2b, sk2, V, sv,
                DQ, (Tables[2], Tables[3]), logn_factor, sm_scale, start_m, n_q, rows,
                q_rows, (outside_clean, band, edge_outside), n_k, window, qk_scale,
                OUTSIDE, OUTSIDE_FLAGS, LOGN, PRETURNED, ONE_GRAD, CAUSAL, BLOCK_M,
                BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
