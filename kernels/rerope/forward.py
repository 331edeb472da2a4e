"""The ReRoPE forward kernel: tiled online softmax, one loop per region. Chapters 4 and 7.

One program per (query block, batch · query head). It keeps a query block on chip and walks
the key axis in ``BLOCK_N`` tiles, in six passes laid out by :func:`rerope.regions._schedule`
(all outside-the-window passes first, then all inside passes, so one query block is live):

* the outside product over the tiles fully outside the window, and the inside product over
  those fully inside — the long, hot loops: one product, no mask, no branch (the product is a
  compile-time constant);
* both products over the thin band of tiles that straddle ``|i - j| = w``, each masked to its
  side of the window;
* the same two over the few tiles that need the causal or end-of-sequence mask.

The online softmax does not care in which order tiles arrive, so visiting a band tile twice,
once per product, is exact.

The kernel reads its operands in one of two forms (the compile-time flag ``SPLIT``):

* **five tensors** (chapter 4): the inside product is ``q1 · k1``, the outside one ``q2 · k2``,
  tensors the caller built;
* **q and k as the model holds them** (chapter 7): raw, or already rotated by RoPE at their
  positions. Each product rotates what it reads, in registers — the query block once per
  program, each key tile as it arrives — by the angles of :mod:`rerope.rotary`, loading the
  two halves of the head dim separately, so a score is two ``D/2``-wide products into one
  accumulator. Nothing rotated is ever written to memory.

Queries may be the last ``Nq`` of ``Nk`` positions (``Nq <= Nk``, chunked prefill): positions
are absolute, query row ``r`` sits at ``Nk - Nq + r``.

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
from .rotary import _angles, _logn_scale, _rotate


@triton.jit
def _load_rows(Base, idx, stride_n, stride_d, dims, n_ctx, MASKED: tl.constexpr):
    """Load rows ``idx`` (columns ``dims``) of a ``(N, D)`` slice; zeros past ``n_ctx``.

    Row offsets are 64-bit: a strided view (a packed QKV buffer at long context, say) can put
    rows more than 2³¹ elements apart.
    """
    ptrs = Base + idx.to(tl.int64)[:, None] * stride_n + dims[None, :] * stride_d
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
def _keep(q_pos, k_pos, valid, window, PRODUCT: tl.constexpr, CAUSAL: tl.constexpr):
    """Which scores of a masked tile count for this product: valid, causal, on the product's side
    of the window (``|i - j| < w`` inside).

    ``q_pos``/``k_pos`` are query/key positions broadcast to the tile, ``valid`` the in-range
    entries: ``(BLOCK_M, 1)``, ``(1, BLOCK_N)`` in the forward and dQ kernels, where queries run
    down the tile, and the transposed shapes in dK/dV — one mask for every kernel.
    """
    diff = q_pos - k_pos
    keep = (diff < window) & (diff > -window)
    if PRODUCT == OUTSIDE:
        keep = ~keep
    keep = keep & valid
    if CAUSAL:
        keep = keep & (k_pos <= q_pos)
    return keep


@triton.jit
def _program(HEADS_FIRST: tl.constexpr):
    """``(batch · head, block, blocks)`` of this program. The grid is ``(B · H, blocks)`` with
    ``HEADS_FIRST``, else ``(blocks, B · H)``; the GPU starts programs in grid order, first axis
    fastest (the launcher's choice: :func:`rerope.attention.heads_first`)."""
    if HEADS_FIRST:
        return tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    else:
        return tl.program_id(1), tl.program_id(0), tl.num_programs(0)


# --- operands: the five tensors as stored, or halves of q and k rotated in registers ------------


@triton.jit
def _halves(Base, stride_n, stride_d, n_rows, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
            SPLIT: tl.constexpr, TMA: tl.constexpr):
    """``(a, b)`` tile sources for :func:`_load_tile`: the two halves of the head dim
    (``SPLIT``), or the whole row twice."""
    if SPLIT:
        return (_tiles(Base, stride_n, n_rows, BLOCK, HEAD_DIM // 2, TMA),
                _tiles(Base + (HEAD_DIM // 2) * stride_d, stride_n, n_rows, BLOCK,
                       HEAD_DIM // 2, TMA))
    else:
        whole = _tiles(Base, stride_n, n_rows, BLOCK, HEAD_DIM, TMA)
        return whole, whole


@triton.jit
def _join_halves(a, b):
    """``[a | b]`` along the last dimension."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _split_halves(x):
    """The inverse of :func:`_join_halves`: ``(x[:, :D/2], x[:, D/2:])``."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _pair(a, b, TWO_DOTS: tl.constexpr):
    """Halves as the products take them: two halves (``TWO_DOTS``) or one joined tile twice
    (``D/2 < 16``, below ``tl.dot``'s minimum width)."""
    if TWO_DOTS:
        return a, b
    else:
        whole = _join_halves(a, b)
        return whole, whole


@triton.jit
def _operand(Xa, Xb, start, sx_n, sx_d, n_rows, positions, Table, Offset, logn_factor,
             TURN: tl.constexpr, SHIFT: tl.constexpr, SHIFT_SIGN: tl.constexpr,
             LOGN: tl.constexpr, SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr,
             BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
             TMA: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of ``q`` or ``k`` (at ``positions``), ready for a product.

    Five-tensor form: the tile as stored. ``SPLIT``: the two halves, scaled by log-n (``LOGN``,
    queries only) and rotated in fp32 by :func:`rerope.rotary._angles` (``TURN``: by
    ``speed · p``, ``SHIFT``: by ``± offset``), rounded once to the input dtype.
    """
    if SPLIT:
        a = _load_tile(Xa, start, sx_n, sx_d, n_rows, BLOCK, HEAD_DIM // 2, MASKED, TMA)
        b = _load_tile(Xb, start, sx_n, sx_d, n_rows, BLOCK, HEAD_DIM // 2, MASKED, TMA)
        if LOGN or TURN or SHIFT:
            a32, b32 = a.to(tl.float32), b.to(tl.float32)
            if LOGN:
                scale = _logn_scale(positions, logn_factor)[:, None]
                a32, b32 = a32 * scale, b32 * scale
            if TURN or SHIFT:
                cos, sin = _angles(Table, positions, Offset, TURN, SHIFT, SHIFT_SIGN,
                                   HEAD_DIM // 2)
                a32, b32 = _rotate(a32, b32, cos, sin)
            a, b = a32.to(a.dtype), b32.to(b.dtype)
        return _pair(a, b, TWO_DOTS)
    else:
        whole = _load_tile(Xa, start, sx_n, sx_d, n_rows, BLOCK, HEAD_DIM, MASKED, TMA)
        return whole, whole


@triton.jit
def _scores(x_a, x_b, y_a, y_b, TWO_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``x · yᵀ`` for operands as :func:`_operand` returns them: one dot, or two
    ``D/2``-wide dots into one accumulator (so ``rotate_half`` needs no data movement)."""
    s = tl.dot(x_a, tl.trans(y_a), input_precision=DOT_PRECISION)
    if TWO_DOTS:
        s = tl.dot(x_b, tl.trans(y_b), s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, Table, sk_n, sk_d, sv_n, sv_d, rows, walk,
              n_k, window, qk_scale,
              PRODUCT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              TURN: tl.constexpr, SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    """Fold the key tiles of ``walk`` into the online-softmax state, with one product.

    ``q_a, q_b`` is the product's query operand and ``Ka, Kb`` its key sources (``q1``/``K1``
    for ``PRODUCT == INSIDE``, ``q2``/``K2`` for ``OUTSIDE`` in the five-tensor form); with
    ``TURN`` each key tile is rotated by ``R(speed · j)`` from ``Table`` as it arrives.
    ``MASKED`` tiles get the window, causal and sequence-end masks; the others none at all.
    """
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
        if MASKED:
            cols = (start_n + offs_n)[None, :]
            scores = tl.where(_keep(rows[:, None], cols, cols < n_k, window, PRODUCT, CAUSAL),
                              scores, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _fwd_product(acc, l_i, m_i, Q, sq_n, sq_d, start_m, n_q, rows, Ka, Kb, sk_n, sk_d, V, sv_n,
                 sv_d, Table, Offset, logn_factor, clean, band, edge, n_k, window, qk_scale,
                 PRODUCT: tl.constexpr, CAUSAL: tl.constexpr, TURN: tl.constexpr,
                 SHIFT: tl.constexpr, TURN_KEYS: tl.constexpr, LOGN: tl.constexpr,
                 SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 TMA: tl.constexpr):
    """Everything one product adds to a query block: its query operand (``Q`` is the block's
    ``(N, D)`` slice), then its three walks — the tiles entirely on its side of the window
    (no mask), the band, its masked edge tiles. ``TURN_KEYS``: each key tile is turned as it
    arrives (off when the launcher pre-turned this product's keys, or its speed is 0)."""
    Qa, Qb = _halves(Q, sq_n, sq_d, n_q, BLOCK_M, HEAD_DIM, SPLIT, TMA)
    q_a, q_b = _operand(Qa, Qb, start_m, sq_n, sq_d, n_q, rows, Table, Offset, logn_factor, TURN,
                        SHIFT, 1, LOGN, SPLIT, TWO_DOTS, BLOCK_M, HEAD_DIM, True, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, Table, sk_n, sk_d, sv_n, sv_d,
                              rows, clean, n_k, window, qk_scale, PRODUCT, False, CAUSAL, TURN_KEYS,
                              SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, Table, sk_n, sk_d, sv_n, sv_d,
                              rows, band, n_k, window, qk_scale, PRODUCT, True, CAUSAL, TURN_KEYS,
                              SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, Table, sk_n, sk_d, sv_n, sv_d,
                              rows, edge, n_k, window, qk_scale, PRODUCT, True, CAUSAL, TURN_KEYS,
                              SPLIT, TWO_DOTS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA)
    return acc, l_i, m_i


@triton.jit
def _rerope_fwd_kernel(
    Q1, Q2, K1, K2, V, Out, Lse, TabIn, OffIn, TabOut, OffOut,
    sq1_b, sq1_h, sq1_n, sq1_d, sq2_b, sq2_h, sq2_n, sq2_d,
    sk1_b, sk1_h, sk1_n, sk1_d, sk2_b, sk2_h, sk2_n, sk2_d,
    sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
    n_heads, group, n_q, n_k, window, qk_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    SPLIT: tl.constexpr, TWO_DOTS: tl.constexpr, LOGN: tl.constexpr,
    TURN_IN: tl.constexpr, SHIFT_IN: tl.constexpr, TURN_OUT: tl.constexpr,
    SHIFT_OUT: tl.constexpr, TURN_K_IN: tl.constexpr, TURN_K_OUT: tl.constexpr,
    HEADS_FIRST: tl.constexpr = False,
):
    """Grid ``(cdiv(Nq, BLOCK_M), B * Hq)``, or ``(B * Hq, cdiv(Nq, BLOCK_M))`` with
    ``HEADS_FIRST`` (:func:`_program`). Writes ``Out`` and ``Lse`` (log2 units, ``(B·Hq, Nq)``).

    Five-tensor form (``SPLIT`` off): ``Q1, Q2, K1, K2`` as given; the tables are not read.
    ``SPLIT``: ``Q1``/``K1`` are the model's ``q``/``k`` (``Q2`` is not read); the
    inside product rotates by ``TabIn``/``OffIn``, the outside one by ``TabOut``/``OffOut``
    (:mod:`rerope.rotary`: ``TURN_*`` where the product's speed is not 0, ``SHIFT_*`` where its
    offset is not 0); ``LOGN`` scales the queries by log-n (``logn_factor``). ``TURN_K_IN`` /
    ``TURN_K_OUT``: the product turns its key tiles here; where it is off although ``TURN_*``
    is on, the launcher passed that product's keys already turned (``K1`` / ``K2``, see
    :func:`rerope.rotary.turn_keys`), otherwise ``K1`` is ``k`` for both products.
    """
    bh, block, n_blocks = _program(HEADS_FIRST)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = n_blocks - 1 - block
    start_m = block * BLOCK_M                # a row of q; its position is n_k - n_q + row
    start_pos = n_k - n_q + start_m
    batch = bh // n_heads
    head = bh % n_heads
    kv_head = head // group                  # grouped-query attention: shared K/V heads
    b64, h64, kv64 = batch.to(tl.int64), head.to(tl.int64), kv_head.to(tl.int64)
    K1a, K1b = _halves(K1 + b64 * sk1_b + kv64 * sk1_h, sk1_n, sk1_d, n_k, BLOCK_N, HEAD_DIM,
                       SPLIT, TMA)
    if SPLIT:                                # one q serves both products
        Q2, sq2_b, sq2_h, sq2_n, sq2_d = Q1, sq1_b, sq1_h, sq1_n, sq1_d
    if SPLIT and TURN_K_IN == TURN_IN and TURN_K_OUT == TURN_OUT:     # and one k
        K2a, K2b = K1a, K1b
    else:
        K2a, K2b = _halves(K2 + b64 * sk2_b + kv64 * sk2_h, sk2_n, sk2_d, n_k, BLOCK_N, HEAD_DIM,
                           SPLIT, TMA)
    V = _tiles(V + b64 * sv_b + kv64 * sv_h, sv_n, n_k, BLOCK_N, HEAD_DIM, TMA)

    rows = start_pos + tl.arange(0, BLOCK_M)
    # the running max starts at -inf; _softmax_step keeps a row that has seen only masked
    # scores at exactly zero weight
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_pos, BLOCK_M, BLOCK_N, n_k, window, CAUSAL, True)

    # every outside pass, then every inside pass: only one query operand is live at a time
    acc, l_i, m_i = _fwd_product(acc, l_i, m_i, Q2 + b64 * sq2_b + h64 * sq2_h, sq2_n, sq2_d,
                                 start_m, n_q, rows, K2a, K2b, sk2_n, sk2_d, V, sv_n, sv_d,
                                 TabOut, OffOut, logn_factor, outside_clean, band, edge_outside,
                                 n_k, window, qk_scale, OUTSIDE, CAUSAL, TURN_OUT, SHIFT_OUT,
                                 TURN_K_OUT, LOGN, SPLIT, TWO_DOTS, BLOCK_M, BLOCK_N, HEAD_DIM,
                                 DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_product(acc, l_i, m_i, Q1 + b64 * sq1_b + h64 * sq1_h, sq1_n, sq1_d,
                                 start_m, n_q, rows, K1a, K1b, sk1_n, sk1_d, V, sv_n, sv_d,
                                 TabIn, OffIn, logn_factor, inside_clean, band, edge_inside,
                                 n_k, window, qk_scale, INSIDE, CAUSAL, TURN_IN, SHIFT_IN,
                                 TURN_K_IN, LOGN, SPLIT, TWO_DOTS, BLOCK_M, BLOCK_N, HEAD_DIM,
                                 DOT_PRECISION, TMA)

    q_rows = start_m + tl.arange(0, BLOCK_M)
    tl.store(Lse + bh.to(tl.int64) * n_q + q_rows, m_i + tl.math.log2(l_i),
             mask=q_rows < n_q)
    out = acc / l_i[:, None]
    dims = tl.arange(0, HEAD_DIM)
    out_ptrs = (Out + b64 * so_b + h64 * so_h + q_rows.to(tl.int64)[:, None] * so_n
                + dims[None, :] * so_d)
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=q_rows[:, None] < n_q)
