"""The ReRoPE forward kernel: tiled online softmax, one loop per region (chapters 4, 7).

One program per (query block, batch · query head). It keeps a query block on chip and
walks the key axis in ``BLOCK_N`` tiles, in six passes laid out by
:func:`rerope.regions._schedule` (all outside-the-window passes first, then all inside
passes, so one query block is live):

* the outside product over the tiles fully outside the window, and the inside product
  over those fully inside — the long, hot loops: one product, no mask, no branch (the
  product is a compile-time constant);
* both products over the thin band of tiles that straddle ``|i - j| = w``, each masked
  to its side of the window;
* the same two over the few tiles that need the causal or end-of-sequence mask.

The online softmax does not care in which order tiles arrive, so visiting a band tile
twice, once per product, is exact.

The kernel reads its operands in one of two forms (the compile-time flag groups
``INSIDE_FLAGS`` and ``OUTSIDE_FLAGS``: ``None`` for the five tensors, a tuple for the
fused-rotation form):

* **five tensors** (chapter 4): the inside product is ``q1 · k1``, the outside one
  ``q2 · k2``, tensors the caller built;
* **q and k as the model holds them** (chapter 7): raw, or already rotated by RoPE at
  their positions. Each product rotates what it reads, in registers — the query block
  once per program, each key tile as it arrives — by the angles of :mod:`rerope.rotary`,
  loading the two halves of the head dim separately, so a score is two ``D/2``-wide
  products into one accumulator. Nothing rotated is ever written to memory.

Queries may be the last ``Nq`` of ``Nk`` positions (``Nq <= Nk``, chunked prefill):
positions are absolute, query row ``r`` sits at ``Nk - Nq + r``.

Numerics as FlashAttention-2: fp32 accumulators, scores turned into log2 units by
``qk_scale = sm_scale · log2(e)`` (inside one fused multiply-add) so every exponential
is an ``exp2``, and the per-row log-sum-exp (log2 units) saved for the backward pass.

Tiles are read through :func:`_tiles` / :func:`_load_tile`: TMA tensor descriptors on
Hopper (fp16/bf16, aligned layouts), pointer loads elsewhere; the launcher picks
(``TMA``). A paged cache (``rerope_varlen``'s ``block_table``, ``PAGE_SIZE > 0``) is read
in place by :func:`_paged_tile`: a descriptor copy per tile where a page holds whole tiles,
else pointer loads whose rows the block table gives (:func:`_tile_pages`,
:func:`_key_rows`, which :mod:`rerope.decode` shares).

Strides travel as tuples (``x.stride()``: batch, head, row, column), so a kernel takes
one argument per tensor; Triton still specialises each entry (a unit column stride is a
compile-time 1). Compile-time tuples are indexed, never unpacked: Triton 3.4 cannot
unpack them.
"""

import triton
import triton.language as tl

from .online_softmax import _scores, _softmax_step
from .regions import INSIDE, OUTSIDE, _nth_tile, _schedule, _tile_count
from .rotary import _angles, _logn_scale, _rotate


@triton.jit
def _load_rows(Base, idx, strides, dims, n_ctx, MASKED: tl.constexpr):
    """Load rows ``idx`` (columns ``dims``) of an ``(N, D)`` slice with ``strides`` (the
    tensor's four: only the last two are read); zeros past ``n_ctx``.

    Row offsets are 64-bit: a strided view (a packed QKV buffer at long context, say)
    can put rows more than 2³¹ elements apart.
    """
    ptrs = Base + idx.to(tl.int64)[:, None] * strides[2] + dims[None, :] * strides[3]
    if MASKED:
        return tl.load(ptrs, mask=idx[:, None] < n_ctx, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _tiles(Base, strides, n_ctx, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
           TMA: tl.constexpr):
    """How a kernel reads ``BLOCK``-row tiles of one ``(N, D)`` slice starting at
    ``Base``.

    With ``TMA`` (Hopper and newer, row stride 16-byte aligned, unit column stride): a
    tensor descriptor, so tiles arrive by the bulk tensor-copy engine, zero-filled past
    ``n_ctx``. Otherwise the pointer itself, for :func:`_load_tile`'s pointer loads.
    """
    if TMA:
        return tl.make_tensor_descriptor(Base, shape=[n_ctx, HEAD_DIM],
                                         strides=[strides[2], 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    else:
        return Base


@triton.jit
def _load_tile(src, start, strides, n_ctx, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of the slice behind ``src`` (:func:`_tiles`)."""
    if TMA:
        return src.load([start, 0])
    else:
        return _load_rows(src, start + tl.arange(0, BLOCK), strides,
                          tl.arange(0, HEAD_DIM), n_ctx, MASKED)


# Paged keys: block-table entries as one scalar load per page up to this many pages per
# tile, else a gather per key (:func:`_tile_pages`).
MAX_SCALAR_PAGES = tl.constexpr(4)


@triton.jit
def _tile_pages(pages, start, n_keys, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The block-table entries of the key tile from ``start`` (int64): one scalar when a
    page holds the whole tile (``PAGE_SIZE`` a multiple of ``BLOCK_N``, the tile aligned),
    one scalar load per page when the tile holds whole pages, up to ``MAX_SCALAR_PAGES``
    of them, else a gather per key (any page size). Entries at and past ``n_keys`` are
    not read (the table may be shorter than the tile, or hold junk there) and come back 0.

    Why scalars: a K/V address that waits on a tensor load of the same iteration can
    make the pipeliner give that load a stage of its own, and K and V are then
    prefetched one tile ahead instead of ``num_stages - 1``; scalar loads are not
    pipelined, so K and V keep their depth, at one load per page.
    """
    table, st_page, sk_page, sv_page, num_blocks = pages
    if PAGE_SIZE % BLOCK_N == 0:
        return tl.load(table + (start // PAGE_SIZE) * st_page, mask=start < n_keys,
                       other=0).to(tl.int64)
    elif BLOCK_N % PAGE_SIZE == 0 and BLOCK_N // PAGE_SIZE <= MAX_SCALAR_PAGES:
        local = tl.arange(0, BLOCK_N) // PAGE_SIZE
        page = tl.full([BLOCK_N], 0, tl.int64)
        for p in tl.static_range(BLOCK_N // PAGE_SIZE):
            entry = tl.load(table + (start // PAGE_SIZE + p) * st_page,
                            mask=start + p * PAGE_SIZE < n_keys, other=0).to(tl.int64)
            page = tl.where(local == p, entry, page)
        return page
    else:
        cols = start + tl.arange(0, BLOCK_N)
        return tl.load(table + (cols // PAGE_SIZE) * st_page, mask=cols < n_keys,
                       other=0).to(tl.int64)


@triton.jit
def _key_rows(pages, page, cols, sk_slot, sv_slot, BLOCK_N: tl.constexpr,
              PAGE_SIZE: tl.constexpr):
    """Where the keys ``cols`` (one tile) live in a paged cache, given the tile's
    block-table entries ``page`` (:func:`_tile_pages`).

    Returns the K and V row offsets (int64, from page 0 of the KV head) and whether each
    key's block-table entry is a page of the cache (``0 <= page < num_blocks``; the
    loads skip the others).
    """
    table, st_page, sk_page, sv_page, num_blocks = pages
    page = tl.full([BLOCK_N], 0, tl.int64) + page
    ok = (page >= 0) & (page < num_blocks)
    slot = cols % PAGE_SIZE
    return page * sk_page + slot * sk_slot, page * sv_page + slot * sv_slot, ok


@triton.jit
def _keep(q_pos, k_pos, valid, window, PRODUCT: tl.constexpr, CAUSAL: tl.constexpr):
    """Which scores of a masked tile count for this product: valid, causal, on the
    product's side of the window (``|i - j| < w`` inside).

    ``q_pos``/``k_pos`` are query/key positions broadcast to the tile, ``valid`` the
    in-range entries: ``(BLOCK_M, 1)``, ``(1, BLOCK_N)`` in the forward and dQ kernels,
    where queries run down the tile, and the transposed shapes in dK/dV — one mask for
    every kernel.
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
    """``(batch · head, block, blocks)`` of this program. The grid is ``(B · H,
    blocks)`` with ``HEADS_FIRST``, else ``(blocks, B · H)``; the GPU starts programs in
    grid order, first axis fastest (the launcher's choice:
    :func:`rerope.attention.heads_first`)."""
    if HEADS_FIRST:
        return tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    else:
        return tl.program_id(1), tl.program_id(0), tl.num_programs(0)


@triton.jit
def _slice(X, strides, batch, head):
    """The ``(N, D)`` slice of head ``head`` of batch ``batch`` (64-bit offsets)."""
    return X + batch.to(tl.int64) * strides[0] + head.to(tl.int64) * strides[1]


# --- operands: the five tensors as stored, or halves of q and k turned in registers ---


@triton.jit
def _halves(Base, strides, n_rows, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
            FUSED: tl.constexpr, TMA: tl.constexpr):
    """``(a, b)`` tile sources for :func:`_load_tile`: the two halves of the head dim
    (``FUSED``), or the whole row twice."""
    if FUSED:
        return (_tiles(Base, strides, n_rows, BLOCK, HEAD_DIM // 2, TMA),
                _tiles(Base + (HEAD_DIM // 2) * strides[3], strides, n_rows, BLOCK,
                       HEAD_DIM // 2, TMA))
    else:
        whole = _tiles(Base, strides, n_rows, BLOCK, HEAD_DIM, TMA)
        return whole, whole


@triton.jit
def _join_halves(a, b):
    """``[a | b]`` along the last dimension."""
    joined = tl.permute(tl.join(a, b), (0, 2, 1))
    return tl.reshape(joined, (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _split_halves(x):
    """The inverse of :func:`_join_halves`: ``(x[:, :D/2], x[:, D/2:])``."""
    pairs = tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2))
    return tl.split(tl.permute(pairs, (0, 2, 1)))


@triton.jit
def _pair(a, b, TWO_DOTS: tl.constexpr):
    """Halves as the products take them: two halves (``TWO_DOTS``) or one joined tile
    twice (``D/2 < 16``, below ``tl.dot``'s minimum width)."""
    if TWO_DOTS:
        return a, b
    else:
        whole = _join_halves(a, b)
        return whole, whole


@triton.jit
def _operand(Xa, Xb, start, strides, n_rows, positions, turn, logn_factor,
             TURN: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of ``q`` or ``k`` (at ``positions``), ready for a
    product.

    ``TURN``: ``None`` for the five-tensor form (the tile as stored), else ``(TABLE,
    SHIFT, SIGN, LOGN)``: the two halves, scaled by log-n (``LOGN``, queries only) and
    turned in fp32 by :func:`rerope.rotary._angles` (``TABLE``: by ``speed · p`` from
    ``turn[0]``, ``SHIFT``: by ``SIGN ·`` the offset ``turn[1]``), rounded once to the
    input dtype.
    """
    if TURN is not None:
        a = _load_tile(Xa, start, strides, n_rows, BLOCK, HEAD_DIM // 2, MASKED, TMA)
        b = _load_tile(Xb, start, strides, n_rows, BLOCK, HEAD_DIM // 2, MASKED, TMA)
        return _turned(a, b, positions, turn, logn_factor, TURN, HEAD_DIM)
    else:
        whole = _load_tile(Xa, start, strides, n_rows, BLOCK, HEAD_DIM, MASKED, TMA)
        return whole, whole


@triton.jit
def _turned(a, b, positions, turn, logn_factor, TURN: tl.constexpr,
            HEAD_DIM: tl.constexpr):
    """The halves ``a, b`` of rows at ``positions`` made a product's operand, as
    :func:`_operand` describes (``TURN`` a tuple)."""
    if TURN[0] or TURN[1] or TURN[3]:
        a32, b32 = a.to(tl.float32), b.to(tl.float32)
        if TURN[3]:
            scale = _logn_scale(positions, logn_factor)[:, None]
            a32, b32 = a32 * scale, b32 * scale
        if TURN[0] or TURN[1]:
            cos, sin = _angles(turn[0], positions, turn[1], TURN[0], TURN[1], TURN[2],
                               HEAD_DIM // 2)
            a32, b32 = _rotate(a32, b32, cos, sin)
        a, b = a32.to(a.dtype), b32.to(b.dtype)
    return _pair(a, b, HEAD_DIM >= 32)


@triton.jit
def _paged_tile(Ka, Kb, V, sk, sv, pages, start, n_k, turn, TURN: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                PAGED: tl.constexpr, TMA: tl.constexpr):
    """Key tile ``start`` of a paged cache read in place: ``(k_a, k_b, v, on_pool)``,
    the keys made an operand (:func:`_turned`, ``TURN`` a tuple: the fused form only).

    ``PAGED``: ``(PAGE_SIZE, KEYS_PAGED)``; ``pages``: ``(this sequence's block-table
    row, its entry stride, num_blocks)``; ``V`` (and ``Ka, Kb`` with ``KEYS_PAGED``)
    are page 0 of the KV head, ``sv[0]`` / ``sk[0]`` being the page stride, and key
    ``j`` lives in slot ``j % PAGE_SIZE`` of page ``table[j // PAGE_SIZE]``
    (:func:`_tile_pages`, :func:`_key_rows`). Keys the launcher pre-turned
    (``KEYS_PAGED`` off) are rows ``j`` of a contiguous slice. Rotations use the logical
    position ``j``, never the slot. Rows past ``n_k`` (``MASKED``) and rows whose page is
    outside the pool (``on_pool`` false) read zeros.

    With ``TMA`` (a page holds whole tiles: ``_fwd_rows``' rule) ``V`` and the paged
    keys are descriptors over the pool's rows, row ``page · PAGE_SIZE + slot`` (the
    pool's page stride is ``PAGE_SIZE`` slots), and a tile is one bulk copy from its page;
    rows past ``n_k`` then read the page's free slots: ``V``'s are zeroed, the keys' scores
    are masked by the caller.
    """
    cols = start + tl.arange(0, BLOCK_N)
    table = (pages[0], pages[1], sk[0], sv[0], pages[2])
    page = _tile_pages(table, start, n_k, BLOCK_N, PAGED[0])
    if TMA:
        on_pool = tl.full([BLOCK_N], 0, tl.int64) + page
        on_pool = (on_pool >= 0) & (on_pool < pages[2])
        row = (page * PAGED[0] + start % PAGED[0]).to(tl.int32)
        k_row = row if PAGED[1] else start
        a = _load_tile(Ka, k_row, sk, n_k, BLOCK_N, HEAD_DIM // 2, False, True)
        b = _load_tile(Kb, k_row, sk, n_k, BLOCK_N, HEAD_DIM // 2, False, True)
        v = _load_tile(V, row, sv, n_k, BLOCK_N, HEAD_DIM, False, True)
        if MASKED:     # the last page's free slots may hold anything: P = 0 must meet 0
            v = tl.where((cols < n_k)[:, None], v, 0.0)
    else:
        k_rows, v_rows, on_pool = _key_rows(table, page, cols, sk[2], sv[2], BLOCK_N,
                                            PAGED[0])
        if not PAGED[1]:
            k_rows = cols.to(tl.int64) * sk[2]
        live = on_pool
        if MASKED:
            live = live & (cols < n_k)
        halves = tl.arange(0, HEAD_DIM // 2)[None, :] * sk[3]
        a = tl.load(Ka + k_rows[:, None] + halves, mask=live[:, None], other=0.0)
        b = tl.load(Kb + k_rows[:, None] + halves, mask=live[:, None], other=0.0)
        v = tl.load(V + v_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :] * sv[3],
                    mask=live[:, None], other=0.0)
    k_a, k_b = _turned(a, b, cols, turn, 0.0, TURN, HEAD_DIM)
    return k_a, k_b, v, on_pool


@triton.jit
def _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, sk, sv, turn, pages, rows, walk, n_k,
              window, qk_scale, PRODUCT: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, TURN: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
              PAGED: tl.constexpr):
    """Fold the key tiles of ``walk`` into the online-softmax state, with one product.

    ``q_a, q_b`` is the product's query operand and ``Ka, Kb`` its key sources
    (``q1``/``K1`` for ``PRODUCT == INSIDE``, ``q2``/``K2`` for ``OUTSIDE`` in the
    five-tensor form); ``TURN`` says how each key tile becomes an operand
    (:func:`_operand`; ``turn``: its table). ``MASKED`` tiles get the window, causal and
    sequence-end masks; the others none at all. ``PAGED``: ``None``, or the tiles come
    from a page pool through ``pages`` (:func:`_paged_tile`); a key whose page is outside
    the pool makes the row NaN.
    """
    offs_n = tl.arange(0, BLOCK_N)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start_n = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        if PAGED is None:
            k_a, k_b = _operand(Ka, Kb, start_n, sk, n_k, start_n + offs_n, turn, 0.0,
                                TURN, BLOCK_N, HEAD_DIM, MASKED, TMA)
            v = _load_tile(V, start_n, sv, n_k, BLOCK_N, HEAD_DIM, MASKED, TMA)
        else:
            k_a, k_b, v, on_pool = _paged_tile(Ka, Kb, V, sk, sv, pages, start_n, n_k,
                                               turn, TURN, BLOCK_N, HEAD_DIM, MASKED,
                                               PAGED, TMA)
        scores = _scores(q_a, q_b, k_a, k_b, TURN is not None and HEAD_DIM >= 32,
                         DOT_PRECISION)
        if MASKED:
            cols = (start_n + offs_n)[None, :]
            keep = _keep(rows[:, None], cols, cols < n_k, window, PRODUCT, CAUSAL)
            scores = tl.where(keep, scores, float("-inf"))
        if PAGED is not None:
            scores = tl.where(on_pool[None, :], scores, float("nan"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _fwd_product(acc, l_i, m_i, Q, sq, Ka, Kb, sk, V, sv, turn, pages, logn_factor,
                 start_m, rows, walks, n_q, n_k, window, qk_scale, PRODUCT: tl.constexpr,
                 FLAGS: tl.constexpr, LOGN: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Everything one product adds to a query block: its query operand (``Q`` is the
    block's ``(N, D)`` slice), then its three ``walks`` — the tiles entirely on its side
    of the window (no mask), the band, its masked edge tiles. ``FLAGS``: ``None`` (five
    tensors) or the product's ``(TURN, SHIFT, TURN_KEYS)``; ``TURN_KEYS``: each key tile
    is turned as it arrives (off when the launcher pre-turned this product's keys, or
    its speed is 0). ``PAGE_SIZE > 0``: values, and keys not pre-turned, come from a
    page pool (:func:`_paged_tile`, ``pages``)."""
    QUERIES: tl.constexpr = None if FLAGS is None else (FLAGS[0], FLAGS[1], 1, LOGN)
    KEYS: tl.constexpr = None if FLAGS is None else (FLAGS[2], False, 1, False)
    PAGED: tl.constexpr = None if PAGE_SIZE == 0 else (PAGE_SIZE, FLAGS[2] == FLAGS[0])
    Qa, Qb = _halves(Q, sq, n_q, BLOCK_M, HEAD_DIM, FLAGS is not None, TMA)
    q_a, q_b = _operand(Qa, Qb, start_m, sq, n_q, rows, turn, logn_factor, QUERIES,
                        BLOCK_M, HEAD_DIM, True, TMA)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, sk, sv, turn, pages,
                              rows, walks[0], n_k, window, qk_scale, PRODUCT, False, CAUSAL,
                              KEYS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA, PAGED)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, sk, sv, turn, pages,
                              rows, walks[1], n_k, window, qk_scale, PRODUCT, True, CAUSAL,
                              KEYS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA, PAGED)
    acc, l_i, m_i = _fwd_pass(acc, l_i, m_i, q_a, q_b, Ka, Kb, V, sk, sv, turn, pages,
                              rows, walks[2], n_k, window, qk_scale, PRODUCT, True, CAUSAL,
                              KEYS, BLOCK_N, HEAD_DIM, DOT_PRECISION, TMA, PAGED)
    return acc, l_i, m_i


@triton.jit
def _rerope_fwd_kernel(
    Q1, Q2, K1, K2, V, Out, Lse, Tables, sq1, sq2, sk1, sk2, sv, so,
    n_heads, q_per_kv, n_q, n_k, window, qk_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, HEADS_FIRST: tl.constexpr,
    LOGN: tl.constexpr, INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
):
    """Grid ``(cdiv(Nq, BLOCK_M), B * Hq)``, or ``(B * Hq, cdiv(Nq, BLOCK_M))`` with
    ``HEADS_FIRST`` (:func:`_program`). Writes ``Out`` and ``Lse`` (log2 units, ``(B·Hq,
    Nq)``). ``s*``: each tensor's four strides (``x.stride()``).

    Five-tensor form (``INSIDE_FLAGS`` and ``OUTSIDE_FLAGS`` ``None``): ``Q1, Q2, K1,
    K2`` as given; ``Tables`` is not read. Fused-rotation form: ``Q1``/``K1`` are the
    model's ``q``/``k`` (``Q2`` is not read); ``Tables`` is ``(inside table, inside
    offset, outside table, outside offset)`` (:mod:`rerope.rotary`) and each product's
    flags are ``(TURN, SHIFT, TURN_KEYS)``: ``TURN`` where its speed is not 0, ``SHIFT``
    where its offset is not 0, ``TURN_KEYS`` where this kernel turns its key tiles — off
    although ``TURN`` is on, the launcher passed that product's keys already turned
    (``K1`` / ``K2``, see :func:`rerope.rotary.turn_keys`), otherwise ``K1`` is ``k``
    for both products. ``LOGN`` scales the queries by log-n (``logn_factor``).

    The program's work is :func:`_fwd_rows`, which the packed variable-length kernel
    (:mod:`rerope.varlen`) shares.
    """
    bh, block, n_blocks = _program(HEADS_FIRST)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = n_blocks - 1 - block
    batch = bh // n_heads
    head = bh % n_heads
    _fwd_rows(Q1, Q2, K1, K2, V, Out, Lse + bh.to(tl.int64) * n_q, Tables, None, sq1,
              sq2, sk1, sk2, sv, so, batch, head, head // q_per_kv, block * BLOCK_M,
              n_q, n_k, window, qk_scale, logn_factor, HEAD_DIM, BLOCK_M, BLOCK_N,
              CAUSAL, TMA, LOGN, INSIDE_FLAGS, OUTSIDE_FLAGS, 0)


@triton.jit
def _fwd_rows(Q1, Q2, K1, K2, V, Out, Lse, Tables, Pages, sq1, sq2, sk1, sk2, sv, so,
              batch, head, kv_head, start_m, n_q, n_k, window, qk_scale, logn_factor,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, TMA: tl.constexpr, LOGN: tl.constexpr,
              INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
              PAGE_SIZE: tl.constexpr):
    """One forward program's work: query rows ``start_m .. start_m + BLOCK_M`` of head
    ``head`` (key/value head ``kv_head``) of batch entry ``batch`` of a sequence of
    ``n_q`` queries, the last ``n_q`` of its ``n_k`` positions. Writes those rows of
    ``Out`` and their log-sum-exps (log2 units) at ``Lse + row``: ``Lse`` points at this
    (batch, head)'s first query. Tensors, strides and flags as
    :func:`_rerope_fwd_kernel` takes them; a caller with a packed batch
    (:mod:`rerope.varlen`) passes base pointers moved to the sequence's first row and
    ``batch`` 0. ``PAGE_SIZE > 0`` (the fused form): ``V`` and the keys not
    pre-turned are page pools read through ``Pages``, ``(the sequence's block-table
    row, its entry stride, num_blocks)``, their strides' first entry the page stride
    (:func:`_paged_tile`); ``0``: ``Pages`` is not read.
    """
    FP32: tl.constexpr = Q1.dtype.element_ty == tl.float32
    DOT_PRECISION: tl.constexpr = "tf32x3" if FP32 else "tf32"       # 3xTF32: near fp32
    FUSED: tl.constexpr = INSIDE_FLAGS is not None
    # TMA reads a paged tile in one copy only where a page holds whole tiles
    TILE_TMA: tl.constexpr = TMA and PAGE_SIZE % BLOCK_N == 0
    start_pos = n_k - n_q + start_m      # a row of q; its position is n_k - n_q + row
    k1_rows, k2_rows, v_rows = n_k, n_k, n_k     # rows a descriptor spans
    if PAGE_SIZE > 0:                    # a pool's: all of its pages, for paged tensors
        v_rows = Pages[2] * PAGE_SIZE
        if INSIDE_FLAGS[2] == INSIDE_FLAGS[0]:
            k1_rows = v_rows
        if OUTSIDE_FLAGS[2] == OUTSIDE_FLAGS[0]:
            k2_rows = v_rows
    K1a, K1b = _halves(_slice(K1, sk1, batch, kv_head), sk1, k1_rows, BLOCK_N, HEAD_DIM,
                       FUSED, TILE_TMA)
    if FUSED:                                # one q serves both products
        Q2, sq2 = Q1, sq1
    ONE_K: tl.constexpr = FUSED and (INSIDE_FLAGS[2] == INSIDE_FLAGS[0]
                                     and OUTSIDE_FLAGS[2] == OUTSIDE_FLAGS[0])
    if ONE_K:                                # and one k (no product's keys pre-turned)
        K2a, K2b = K1a, K1b
        sk2 = sk1
    else:
        K2a, K2b = _halves(_slice(K2, sk2, batch, kv_head), sk2, k2_rows, BLOCK_N,
                           HEAD_DIM, FUSED, TILE_TMA)
    V = _tiles(_slice(V, sv, batch, kv_head), sv, v_rows, BLOCK_N, HEAD_DIM, TILE_TMA)

    rows = start_pos + tl.arange(0, BLOCK_M)
    # the running max starts at -inf; _softmax_step keeps a row that has seen only
    # masked scores at exactly zero weight
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_pos, BLOCK_M, BLOCK_N, n_k, window, CAUSAL, True)

    # every outside pass, then every inside pass: only one query operand is live at a
    # time
    acc, l_i, m_i = _fwd_product(
        acc, l_i, m_i, _slice(Q2, sq2, batch, head), sq2, K2a, K2b, sk2, V, sv,
        (Tables[2], Tables[3]), Pages, logn_factor, start_m, rows,
        (outside_clean, band, edge_outside), n_q, n_k, window, qk_scale, OUTSIDE,
        OUTSIDE_FLAGS, LOGN, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION,
        TILE_TMA, PAGE_SIZE)
    acc, l_i, m_i = _fwd_product(
        acc, l_i, m_i, _slice(Q1, sq1, batch, head), sq1, K1a, K1b, sk1, V, sv,
        (Tables[0], Tables[1]), Pages, logn_factor, start_m, rows,
        (inside_clean, band, edge_inside), n_q, n_k, window, qk_scale, INSIDE,
        INSIDE_FLAGS, LOGN, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION,
        TILE_TMA, PAGE_SIZE)

    q_rows = start_m + tl.arange(0, BLOCK_M)
    tl.store(Lse + q_rows, m_i + tl.math.log2(l_i), mask=q_rows < n_q)
    out = acc / l_i[:, None]
    dims = tl.arange(0, HEAD_DIM)
    out_ptrs = (_slice(Out, so, batch, head) + q_rows.to(tl.int64)[:, None] * so[2]
                + dims[None, :] * so[3])
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=q_rows[:, None] < n_q)
