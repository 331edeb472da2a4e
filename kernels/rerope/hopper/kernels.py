"""The Gluon forward for Hopper (sm_90): warp-specialised ReRoPE attention, written for **Triton
3.6** (``triton.experimental.gluon``; its API changed in every release from 3.4 to 3.8).

Imported only where :func:`rerope.hopper.supported` says this Triton has that API (it is not
imported, let alone compiled, anywhere else). Causal, five tensors (the form of
:func:`rerope.rerope_attention`), fp16/bf16, D 64 or 128. Shapes: every tensor is seen through a
TMA descriptor over its ``(B·H·N, D)`` view (contiguous ``(B, H, N, D)``), ``N % 128 == 0``; the
grid is ``(cdiv(N, BLOCK_M), B·Hq)``, heaviest query blocks first; a query head ``h`` reads
key/value head ``h // group`` (grouped-query attention by indexing).

Each program runs one query block with ``gl.warp_specialize``: a **producer** warp TMA-loads the
block's Q tiles once (Q1 and Q2 of every consumer) and then one key tile and one value tile per
ring slot; **consumer** partitions of four warps (a warp group each, 64 rows) compute S = Q Kᵀ
and O += P V with ``warpgroup_mma`` and the online softmax in registers, and free the slot. A
block's key tiles lie in three regions (:func:`_regions`): all outside the window (Q2 K2ᵀ), the
band (both products), all inside (Q1 K1ᵀ). The band's tiles are visited twice, once per product,
each visit masked to its side of the window, so a ring slot holds one key tile, as plain
attention's.

``rerope``'s form (``Q_TURN``, a constexpr; its tables in ``q_turn``): the producer loads only
``q`` (one tile a partition), and each consumer turns it into both products' queries in shared
memory before its first step (:func:`_turn_q`: rerope.rotary.turn_operands' arithmetic on the
tile, once per program), so ``rerope`` writes no turned copy of ``q``, only of ``k``.

Two walks, one per head dim (what measured best on Hopper, ``perf/NOTES.md`` v19–v21):

* ``rerope_fwd_lean_kernel`` (D64): FlashAttention-3's head-dim-64 tiling, 192-row blocks as
  three consumers of 64 rows. Every unmasked tile runs plain attention's loop body
  (:func:`_tile`); the masked visits (the diagonal, the band twice) run in one loop that decides
  per step which Q, which mask, or that nothing of the tile is kept (it only frees the slot).
* ``rerope_fwd_twice_pp_kernel`` (D128): 128-row blocks as two consumers of 64 rows, one loop
  that classifies each step at run time (:func:`_step_pp`), with FlashAttention-3's
  intra-warpgroup overlap (``PIPE``: S of step k is computed while P V of step k - 1 runs).

``perf/gluon/`` keeps the plain-attention kernel and the variants that measured slower; they
share the helpers here. ``perf/gluon/README.md`` tells the whole story.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = 0.6931471805599453
# SPLIT=3: registers of each 4-warp worker consumer partition (FA3: 160 with three consumer warp
# groups). 4 + 4 + 4 + 1 warps pad to 16, so 65536 / 512 = 128 a thread at launch; with the
# producer at 24 the default (first consumer) partition gets 512 - 2 * 160 - 24 = 168.
SPLIT3_REGS = gl.constexpr(160)


# ----------------------------------------------------------------------------------------------
# the query block: rows, key tiles, regions (every kernel's prologue)
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _block_rows(N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, RAGGED: gl.constexpr = False,
                group=1):
    """This program's query block (grid ``(cdiv(N, BLOCK_M), B * Hq)``, heaviest blocks, i.e.
    most key tiles, first): (m0, its first row in the sequence; q_row, its first row in the
    ``(B*Hq*N, D)`` view; kv_row0, its key/value head's first row in the ``(B*Hkv*N, D)`` view,
    head ``(b·Hq + h) // group = b·Hkv + h // group`` for ``group = Hq / Hkv``; n_tiles, the key
    tiles it sees under the causal mask). RAGGED (SPLIT=3: BLOCK_M 192 need not divide N): the
    last block may end past N; its key tiles stop at N (N % BLOCK_N == 0), so no tile of the
    next head is loaded."""
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    m_block = gl.num_programs(0) - 1 - pid_m  # heaviest query blocks first
    m0 = m_block * BLOCK_M
    q_row = bh * N + m0
    kv_row0 = (bh // group) * N
    if RAGGED:
        n_tiles = gl.cdiv(gl.minimum(m0 + BLOCK_M, N), BLOCK_N)
    else:
        n_tiles = gl.cdiv(m0 + BLOCK_M, BLOCK_N)
    return m0, q_row, kv_row0, n_tiles


@gluon.jit
def _regions(m0, window, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(n_out, n_in) for query rows [m0, m0+BLOCK_M): tiles [0, n_out) are all-outside
    ((t+1)*BLOCK_N - 1 <= m0 - window), [n_in, n_tiles) all-inside (m0+BLOCK_M-1 - t*BLOCK_N <
    window), between them the band. Non-negative operands only (integer division truncates)."""
    n_out = gl.maximum(m0 - window + 1, 0) // BLOCK_N
    n_in = (gl.maximum(m0 + BLOCK_M - 1 - window, -1) + BLOCK_N) // BLOCK_N
    n_in = gl.minimum(gl.maximum(n_in, n_out), n_tiles)
    return n_out, n_in


@gluon.jit
def _block_regions(N, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   RAGGED: gl.constexpr = False, group=1):
    """The prologue of all three kernels: _block_rows' (m0, q_row, kv_row0, n_tiles) of this
    program's query block, then its regions (n_out, n_in), computed once for every partition.
    RAGGED (SPLIT=3): the block may end past N (n_tiles stops at N; the regions are those of the
    whole 192 rows, which only moves inside tiles of rows past N into the band: still exact)."""
    m0, q_row, kv_row0, n_tiles = _block_rows(N, BLOCK_M, BLOCK_N, RAGGED, group)
    n_out, n_in = _regions(m0, window, n_tiles, BLOCK_M, BLOCK_N)
    return m0, q_row, kv_row0, n_tiles, n_out, n_in


# ----------------------------------------------------------------------------------------------
# the ring: barriers, loads, the producer
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """The ring's mbarriers, initialised: ``q_bar`` (Q arrived), and per slot ``k_ready`` /
    ``v_ready`` (its K / V tile arrived) and ``kv_empty`` (one arrival per consumer partition:
    the slot may be refilled)."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for j in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(j), count=1)
        mbarrier.init(v_ready.index(j), count=1)
        mbarrier.init(kv_empty.index(j), count=SPLIT)
    return q_bar, k_ready, v_ready, kv_empty


@gluon.jit
def _invalidate_ring(q_bar, k_ready, v_ready, kv_empty, STAGES: gl.constexpr):
    """Invalidate :func:`_ring_barriers`' mbarriers at the kernel's end."""
    mbarrier.invalidate(q_bar)
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(j))
        mbarrier.invalidate(v_ready.index(j))
        mbarrier.invalidate(kv_empty.index(j))


@gluon.jit
def _q_sub_row(q_row, j, SUB_M: gl.constexpr, SPLIT: gl.constexpr, q_last):
    """Row of Q sub-tile j in the (B*H*N, D) view. SPLIT=3 (BLOCK_M 192, which need not divide
    N): a sub-tile past the head's end belongs to a draining partition (_drain) and is never
    read, so the head's last sub-tile ``q_last`` is loaded in its place (nothing read from
    another head or past the tensor)."""
    row = q_row + j * SUB_M
    if SPLIT == 3:
        row = gl.minimum(row, q_last)
    return row


@gluon.jit
def _load_q(q1_desc, q2_desc, q_smem, q_bar, q_row, q_last, SPLIT: gl.constexpr,
            Q_TURN: gl.constexpr):
    """The block's Q tiles, once: partition j's Q2 into q_smem[2j], Q1 into q_smem[2j + 1]; with
    Q_TURN only ``q`` (q1_desc) into q_smem[2j + 1], which the partition turns (_turn_q)."""
    SUB_M: gl.constexpr = q1_desc.block_type.shape[0]
    if Q_TURN is None:
        mbarrier.expect(q_bar, 2 * SPLIT * q1_desc.block_type.nbytes)
    else:
        mbarrier.expect(q_bar, SPLIT * q1_desc.block_type.nbytes)
    for j in gl.static_range(SPLIT):
        row = _q_sub_row(q_row, j, SUB_M, SPLIT, q_last)  # SPLIT=3: see _q_sub_row
        if Q_TURN is None:
            tma.async_copy_global_to_shared(q2_desc, [row, 0], q_bar, q_smem.index(2 * j))
        tma.async_copy_global_to_shared(q1_desc, [row, 0], q_bar, q_smem.index(2 * j + 1))


@gluon.jit
def _load_kv(k, t, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Step k of the walk: key tile t of k_desc (K1 or K2) and of V into ring slot k %
    STAGES."""
    s = k % STAGES
    mbarrier.wait(kv_empty.index(s),
                  ((k // STAGES) & 1) ^ 1)  # first round passes (parity trick)
    row = kv_row0 + t * BLOCK_N
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(s), k_smem.index(s))
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(s), v_smem.index(s))


# ----------------------------------------------------------------------------------------------
# the query turn in the kernel (rerope's fused form: Q_TURN)
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _q_operand(xa, xb, positions, tab, off, logn_factor, FLAGS: gl.constexpr,
               LOGN: gl.constexpr, HALF: gl.constexpr, layout: gl.constexpr):
    """One product's query operand from the halves ``xa, xb`` of the rows at ``positions``: the
    arithmetic of rerope.rotary._turn_operand (fp32, rounded once): scaled by log-n, turned by
    ``R(speed * p + offset)`` (``FLAGS``: ``(TURN, SHIFT)``: read row p of the table ``tab``,
    add the angle ``off`` by the angle-addition formulas)."""
    a = xa.to(gl.float32)
    b = xb.to(gl.float32)
    if LOGN:
        scale = gl.maximum(gl.log2(positions.to(gl.float32) + 1.0) * logn_factor, 1.0)[:, None]
        a = a * scale
        b = b * scale
    if FLAGS[0] or FLAGS[1]:
        cols = gl.arange(0, HALF, gl.SliceLayout(0, layout))[None, :]
        if FLAGS[1]:
            cos_o = gl.load(off + cols)
            sin_o = gl.load(off + HALF + cols)
        if FLAGS[0]:
            row = tab + positions.to(gl.int64)[:, None] * (2 * HALF) + cols
            cos = gl.load(row)
            sin = gl.load(row + HALF)
            if FLAGS[1]:
                cos, sin = cos * cos_o - sin * sin_o, sin * cos_o + cos * sin_o
        else:
            zero = gl.zeros([positions.shape[0], HALF], gl.float32, layout)
            cos = zero + cos_o
            sin = zero + sin_o
        a, b = a * cos - b * sin, b * cos + a * sin
    return a.to(xa.dtype), b.to(xb.dtype)


@gluon.jit
def _turn_q(q_smem, ME: gl.constexpr, m0, q_turn, Q_TURN: gl.constexpr,
            BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr):
    """Q_TURN = (FIRST, SECOND, LOGN): the producer loaded this partition's rows of ``q`` (rows
    [m0, m0 + BLOCK_M) of the head, at those positions) into q_smem[2 ME + 1]; write the
    outside product's operand (SECOND = its (TURN, SHIFT)) to q_smem[2 ME] and, where it
    changes, the inside product's (FIRST) over q_smem[2 ME + 1] (each thread rewrites only the
    elements it read). ``q_turn``: (table, offset) of each product and the log-n factor, as
    rerope.rotary.turn_operands takes them. Ends with the fence and the partition's barrier
    that make the stores visible to its wgmmas."""
    HALF: gl.constexpr = HEAD_D // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HALF // 8), HALF // 8],
                                            [4, 1], [1, 0])
    FIRST: gl.constexpr = Q_TURN[0]
    SECOND: gl.constexpr = Q_TURN[1]
    LOGN: gl.constexpr = Q_TURN[2]
    x = q_smem.index(2 * ME + 1)
    xa = x.slice(0, HALF, dim=1).load(layout)
    xb = x.slice(HALF, HALF, dim=1).load(layout)
    positions = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
    a, b = _q_operand(xa, xb, positions, q_turn[2], q_turn[3], q_turn[4], SECOND, LOGN,
                      HALF, layout)
    q2 = q_smem.index(2 * ME)
    q2.slice(0, HALF, dim=1).store(a)
    q2.slice(HALF, HALF, dim=1).store(b)
    if LOGN or FIRST[0] or FIRST[1]:
        a, b = _q_operand(xa, xb, positions, q_turn[0], q_turn[1], q_turn[4], FIRST,
                          LOGN, HALF, layout)
        x.slice(0, HALF, dim=1).store(a)
        x.slice(HALF, HALF, dim=1).store(b)
    fence_async_shared()
    gl.thread_barrier()


# ----------------------------------------------------------------------------------------------
# a consumer's step: S = Q K^T, online softmax, O += P V; the epilogue
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _tile(i, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, m0,
          qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, ME: gl.constexpr,
          PINGPONG: gl.constexpr):
    """One key tile. PINGPONG=1: the S = Q K^T issue is this partition's GEMM section i, ordered
    with the other partition's by the ``turn`` barriers (see rerope_fwd._consumer_pp)."""
    s = i % STAGES
    phase = (i // STAGES) & 1

    # S = Q K^T (K tile viewed transposed in shared memory; wgmma handles the transpose)
    mbarrier.wait(k_ready.index(s), phase)
    if PINGPONG:
        mbarrier.wait(turn.index(ME), (i & 1) ^ (1 - ME))
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_tile = k_smem.index(s)
    qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - ME), count=1)
    # deps keeps the operands alive until the wgmma is done; with several deps it returns a
    # tuple
    qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_smem, k_tile))
    # online softmax (log2 domain); MASK is a constexpr here, so the branch compiles away
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, i, m0, MASK, qk_scale, BLOCK_M, BLOCK_N,
                                  s_layout)
    acc = _pv_and_free(acc, p, alpha, v_smem, v_ready, kv_empty, s, phase, o_layout)
    return acc, m_i, l_i


@gluon.jit
def _pv_and_free(acc, p, alpha, v_smem, v_ready, kv_empty, s, phase, o_layout: gl.constexpr):
    """The end of a key tile's step in ring slot ``s``: rescale ``acc`` by ``alpha``, O += P V
    (P from registers, once V's tile is in), then free the slot for the producer."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(s), phase)
    v_tile = v_smem.index(s)
    acc = warpgroup_mma(p, v_tile, acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
    # every warp group of the partition has finished reading K and V of slot s
    gl.thread_barrier()
    mbarrier.arrive(kv_empty.index(s), count=1)
    return acc


@gluon.jit
def _softmax(qk, m_i, l_i, i, m0, masked, qk_scale, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online-softmax step for tile i (``masked``: a diagonal tile, run-time or constexpr).
    Returns p (fp32), the new m_i, l_i and alpha = exp2(m_old - m_new)."""
    qk = qk * qk_scale
    if masked:
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        qk = gl.where(rows[:, None] >= cols[None, :], qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


BIG = gl.constexpr(1 << 30)  # "no upper bound" for i - j in _softmax_rt's mask


@gluon.jit
def _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """_softmax_mode with the mask chosen at run time (keep lo <= i - j < hi where ``masked``);
    -inf-safe (m_use) on every visit."""
    qk = qk * qk_scale
    if masked:
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        d = rows[:, None] - cols[None, :]
        qk = gl.where((d >= lo) & (d < hi), qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _epilogue(acc, m_i, l_i, o_smem, o_desc, lse_ptr, q_row, BLOCK_M: gl.constexpr,
              STORE_LSE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """A consumer's end (plain and ReRoPE kernels): O = acc / l written to ``o_smem`` (a Q
    buffer the partition no longer reads) and TMA-stored at rows [q_row, q_row + BLOCK_M); LSE
    (natural log) of those rows if STORE_LSE; waits for the store."""
    acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_smem.store(acc.to(o_smem.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], o_smem)
    if STORE_LSE:
        rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        gl.store(lse_ptr + q_row + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def _drain(k_ready, kv_empty, n_steps, STAGES: gl.constexpr):
    """A consumer partition whose rows all lie past N (SPLIT=3, the grid's last query block when
    192 does not divide N) computes and stores nothing, but kv_empty counts SPLIT arrivals a
    round, so it releases every ring step's slot once that step's K tile is in: waiting for
    k_ready first keeps its arrival in the slot's current round (the next round's K cannot
    arrive before this round's release)."""
    for i in range(n_steps):
        s = i % STAGES
        mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(s), count=1)


# ----------------------------------------------------------------------------------------------
# D128: the band-twice walk in one loop, FlashAttention-3's overlap (PIPE)
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _ring_barriers_pp(STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """_ring_barriers' q_bar, k_ready, v_ready, with the slot's empty barrier split in two:
    ``k_empty`` (the K tile was read: released right after S = Q K^T is waited for) and
    ``v_empty`` (released after P V), each counting SPLIT arrivals; plus ``turn`` (2 barriers,
    count 1): the ping-pong order of the two consumer partitions (see _consumer_pp)."""
    q_bar, k_ready, v_ready, k_empty = _ring_barriers(STAGES, SPLIT)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(v_empty.index(j), count=SPLIT)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    return q_bar, k_ready, v_ready, k_empty, v_empty, turn


@gluon.jit
def _load_kv_pp(k, t, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                kv_row0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """_load_kv with separate empties: K of step k goes in as soon as K of step k - STAGES was
    read by every consumer, V when V of step k - STAGES was (parity trick for the first round,
    as before)."""
    s = k % STAGES
    ph = ((k // STAGES) & 1) ^ 1
    row = kv_row0 + t * BLOCK_N
    mbarrier.wait(k_empty.index(s), ph)
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(s), k_smem.index(s))
    mbarrier.wait(v_empty.index(s), ph)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _producer_pp(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                 k_ready, v_ready, k_empty, v_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, q_last=0,
                 Q_TURN: gl.constexpr = None):
    """_producer_twice's step list (outside walk K2 over [0, n_in), inside walk K1 over [n_out,
    n_tiles));
    Q of partition j: Q2 in q_smem[2j], Q1 in q_smem[2j + 1] (_load_q)."""
    _load_q(q1_desc, q2_desc, q_smem, q_bar, q_row, q_last, SPLIT, Q_TURN)
    for t in range(0, n_in):  # outside walk: K2
        _load_kv_pp(t, t, k2_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                    kv_row0, BLOCK_N, STAGES)
    off = n_in - n_out
    for t in range(n_out, n_tiles):  # inside walk: K1
        _load_kv_pp(t + off, t, k1_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty,
                    v_empty, kv_row0, BLOCK_N, STAGES)


@gluon.jit
def _step_pp(k, n_out, n_in, n_full, window):
    """What step k of the walk is, decided at run time (one loop instead of _consumer_twice's
    five): returns (t, ins, masked, lo, hi): key tile t; ins = 0 outside walk (Q2 K2^T), 1
    inside walk (Q1 K1^T); the visit keeps lo <= i - j < hi when ``masked``. Same visits as
    _consumer_twice: outside, t >= n_out: i-j >= w (MASK_OUT); inside, t < n_in: 0 <= i-j < w
    (MASK_IN); inside, t >= n_full: i-j >= 0 (MASK_CAUSAL); else unmasked (emulate_rerope.py
    checks the equality)."""
    ins = (k >= n_in).to(gl.int32)
    t = k - (n_in - n_out) * ins
    band_in = (ins == 1) & (t < n_in)
    masked = ((ins == 0) & (t >= n_out)) | band_in | ((ins == 1) & (t >= n_full))
    lo = window * (1 - ins)
    hi = BIG + (window - BIG) * band_in.to(gl.int32)
    return t, ins, masked, lo, hi


@gluon.jit
def _consumer_pp(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                 v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr, STORE_LSE: gl.constexpr,
                 ME: gl.constexpr, PIPE: gl.constexpr, PINGPONG: gl.constexpr, q_turn=None,
                 Q_TURN: gl.constexpr = None):
    """Consumer partition ME (0 or 1) of rerope_fwd_twice_pp_kernel: the BAND_TWICE walk (steps
    k = 0 .. n_steps-1, n_steps = n_in + n_tiles - n_out, classified by _step_pp) in ONE loop.

    PIPE=1 (FA3's intra-warpgroup overlap): iteration k issues S_k = Q K_k^T and O += P_{k-1}
    V_{k-1}, waits for S_k only (num_outstanding=1; wgmma groups retire in issue order), frees K
    slot k, runs softmax k while the P V wgmma still runs, then waits for it, frees V slot k-1
    and rescales O by alpha_k. (acc after k = (acc after k-1 + P_{k-1} V_{k-1}) * alpha_k, so
    acc + P_last V_last at the end is the usual online softmax: exact.) PIPE=0: S_k, softmax,
    P_k V_k in turn.

    PINGPONG=1 (FA3's warp-scheduler barriers, with mbarriers: Gluon 3.6 has no named-barrier
    op): step k's "GEMM section" (PIPE=1: issuing S_k and P_{k-1} V_{k-1}; PIPE=0: issuing S_k)
    of partition ME starts with ``wait(turn[ME], (k & 1) ^ (1 - ME))`` and ends with one
    ``arrive(turn[1 - ME])``, so the sections run in the order 0_0, 1_0, 0_1, 1_1, ... and one
    partition's softmax overlaps the other's wgmmas. Deadlock / phase argument:
    * turn[1] is only arrived on by partition 0, once per step, so its phase c completes at
      partition 0's arrive c, which comes after partition 0's wait c; partition 1's wait k
      (parity k & 1) needs phase k. turn[0] likewise: partition 1's arrive c completes its phase
      c; partition 0's wait k (parity (k & 1) ^ 1) needs phase k - 1 (k = 0: a fresh barrier's
      "phase -1" counts as completed, the parity trick), i.e. partition 1's arrive k - 1.
    * no aliasing of the parity: partition 1's arrive c needs its wait c, which needs partition
      0's arrive c. While partition 0 waits at k it has arrived k times (0..k-1), so turn[0] has
      completed at most phases 0..k-1: the phase it waits for (k - 1) is the last completed one
      or the current one, never older (where the parity would lie). Symmetric: while partition 1
      waits at k, turn[1] has completed at most phases 0..k (partition 0's arrive k+1 needs
      partition 1's arrive k). perf/gluon/emulate_rerope.py --protocol checks this on random
      interleavings.
    * both partitions walk the same n_steps steps (the regions are computed once per block and
      passed to everyone) and do one section per step (the last P V, after the loop, is outside
      the turns), so every wait has its arrive; the last arrive of partition 1 completes a phase
      no one waits for (harmless; the barriers are invalidated after the join).
    * against the ring: the first unfinished section in the turn order belongs to a partition
      whose turn wait is satisfied; it can only block on k_ready of step k or v_ready of step k
      - 1. Every partition that is further along in the order has already released K of steps <
      k and V of steps < k - 1, or will without waiting on a barrier (only on its own wgmmas);
      the producer needs exactly those releases (K of step k - STAGES, V of step k - 1 - STAGES,
      STAGES >= 1) to load K_k and V_{k-1}, so it does, and the blocked partition moves on. The
      ring's own parity waits cannot alias: the producer refills slot s for step k + STAGES only
      after every consumer released step k, which comes after that consumer's ready-wait for
      step k. Ordering is a scheduling hint only (no data flows through ``turn``): the arrive is
      made by the partition's first thread after it issued its wgmmas, without a thread_barrier
      first."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    n_full = gl.maximum(m0 // BLOCK_N,
                        n_in)  # inside tiles from here on may cross this half's diagonal
    n_steps = n_in + n_tiles - n_out  # >= 1

    mbarrier.wait(q_bar, 0)
    if Q_TURN is not None:
        _turn_q(q_smem, ME, m0, q_turn, Q_TURN, BLOCK_M, HEAD_D)
    if PIPE:
        # step 0: S_0 and softmax_0 only
        t, ins, masked, lo, hi = _step_pp(0, n_out, n_in, n_full, window)
        mbarrier.wait(k_ready.index(0), 0)
        if PINGPONG:
            mbarrier.wait(turn.index(ME), 1 - ME)
        q_tile = q_smem.index(2 * ME + ins)
        k_tile = k_smem.index(0)
        qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - ME), count=1)
        qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_tile, k_tile))
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(0), count=1)
        p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale, BLOCK_M,
                                         BLOCK_N, s_layout)
        for k in range(1, n_steps):
            s = k % STAGES
            sp = (k - 1) % STAGES
            t, ins, masked, lo, hi = _step_pp(k, n_out, n_in, n_full, window)
            mbarrier.wait(k_ready.index(s), (k // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(ME), (k & 1) ^ (1 - ME))
            q_tile = q_smem.index(2 * ME + ins)
            k_tile = k_smem.index(s)
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False,
                               is_async=True)
            mbarrier.wait(v_ready.index(sp), ((k - 1) // STAGES) & 1)
            v_tile = v_smem.index(sp)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc,
                                is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - ME), count=1)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_tile, k_tile))
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(s), count=1)
            p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale,
                                             BLOCK_M, BLOCK_N, s_layout)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        last = n_steps - 1
        sl = last % STAGES
        mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
        v_tile = v_smem.index(sl)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc,
                            is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
        gl.thread_barrier()
        mbarrier.arrive(v_empty.index(sl), count=1)
    else:
        for k in range(0, n_steps):
            s = k % STAGES
            phase = (k // STAGES) & 1
            t, ins, masked, lo, hi = _step_pp(k, n_out, n_in, n_full, window)
            mbarrier.wait(k_ready.index(s), phase)
            if PINGPONG:
                mbarrier.wait(turn.index(ME), (k & 1) ^ (1 - ME))
            q_tile = q_smem.index(2 * ME + ins)
            k_tile = k_smem.index(s)
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False,
                               is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - ME), count=1)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_tile, k_tile))
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(s), count=1)
            p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale,
                                             BLOCK_M, BLOCK_N, s_layout)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            mbarrier.wait(v_ready.index(s), phase)
            v_tile = v_smem.index(s)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc,
                                is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(s), count=1)

    o_smem = q_smem.index(2 * ME + 1)  # this partition's Q1 buffer (no longer read)
    _epilogue(acc, m_i, l_i, o_smem, o_desc, lse_ptr, q_row, BLOCK_M, STORE_LSE, s_layout,
              o_layout)


@gluon.jit
def _drain_pp(k_ready, v_ready, k_empty, v_empty, n_steps, STAGES: gl.constexpr):
    """_drain for the split empties: a SPLIT=3 partition past N releases K and V of every
    step once they are in (k_empty / v_empty count SPLIT arrivals)."""
    for k in range(n_steps):
        s = k % STAGES
        phase = (k // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.wait(v_ready.index(s), phase)
        mbarrier.arrive(v_empty.index(s), count=1)


@gluon.jit
def _consumer_pp_or_drain(N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                          k_empty, v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles,
                          qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                          CONSUMER_WARPS: gl.constexpr, STORE_LSE: gl.constexpr,
                          ME: gl.constexpr, PIPE: gl.constexpr, PINGPONG: gl.constexpr,
                          q_turn=None, Q_TURN: gl.constexpr = None):
    """SPLIT=3's second and third consumers of rerope_fwd_twice_pp_kernel: _consumer_pp if rows
    [m0, m0 + BLOCK_M) lie in the sequence, else _drain_pp over the walk's n_in + n_tiles -
    n_out steps."""
    if m0 < N:
        _consumer_pp(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                     v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M,
                     BLOCK_N, HEAD_D, STAGES, CONSUMER_WARPS, STORE_LSE, ME, PIPE, PINGPONG,
                     q_turn, Q_TURN)
    else:
        _drain_pp(k_ready, v_ready, k_empty, v_empty, n_in + n_tiles - n_out, STAGES)


@gluon.jit(do_not_specialize=["window"])
def rerope_fwd_twice_pp_kernel(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, o_desc, lse_ptr, N,
                               window, qk_scale, group, q_turn, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                               STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                               STORE_LSE: gl.constexpr, SPLIT: gl.constexpr, PIPE: gl.constexpr,
                               PINGPONG: gl.constexpr, Q_TURN: gl.constexpr = None):
    """BAND_TWICE (same walk, arguments, grid, shared-memory ring) with FA3's scheduling: PIPE=1
    intra-warpgroup overlap, PINGPONG=1 ordered GEMM sections of the two consumer partitions
    (SPLIT=2 only); K and V slots freed separately (k_empty / v_empty). See _consumer_pp.
    SPLIT=3 (BLOCK_M 192, PINGPONG=0): three 4-warp consumers, those past N draining the
    ring."""
    m0, q_row, kv_row0, n_tiles, n_out, n_in = _block_regions(N, window, BLOCK_M, BLOCK_N,
                                                              SPLIT == 3, group)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q1_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * SPLIT, SUB_M, HEAD_D],
                                       q1_desc.layout)  # Q2_j, Q1_j
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, k_empty, v_empty, turn = _ring_barriers_pp(STAGES, SPLIT)

    if SPLIT == 1:
        gl.static_assert(PINGPONG == 0, "PINGPONG needs SPLIT=2")
        gl.warp_specialize(
            [
                (_consumer_pp,
                 (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M,
                  BLOCK_N, HEAD_D, STAGES, CONSUMER_WARPS, STORE_LSE, 0, PIPE, PINGPONG, q_turn,
                  Q_TURN)),
                (_producer_pp, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem,
                                v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, q_row,
                                kv_row0, n_out, n_in, n_tiles, BLOCK_N, STAGES, SPLIT, 0,
                                Q_TURN)),
            ],
            [1],
            [24],
        )
    elif SPLIT == 2:
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=2: two 4-warp consumer partitions")
        gl.warp_specialize(
            [
                (_consumer_pp,
                 (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, SUB_M,
                  BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 0, PIPE, PINGPONG, q_turn,
                  Q_TURN)),
                (_consumer_pp,
                 (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, q_row + SUB_M, m0 + SUB_M, window, n_out, n_in, n_tiles,
                  qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 1, PIPE, PINGPONG,
                  q_turn, Q_TURN)),
                (_producer_pp, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem,
                                v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, q_row,
                                kv_row0, n_out, n_in, n_tiles, BLOCK_N, STAGES, SPLIT, 0,
                                Q_TURN)),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.static_assert(SPLIT == 3, "SPLIT is 1, 2 or 3")
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=3: three 4-warp consumer partitions")
        gl.static_assert(PINGPONG == 0, "PINGPONG needs SPLIT=2")
        q_last = q_row - m0 + N - SUB_M  # this head's last Q sub-tile
        gl.warp_specialize(
            [
                (_consumer_pp,
                 (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, SUB_M,
                  BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 0, PIPE, 0, q_turn, Q_TURN)),
                (_consumer_pp_or_drain,
                 (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, q_row + SUB_M, m0 + SUB_M, window, n_out, n_in, n_tiles,
                  qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 1, PIPE, 0, q_turn,
                  Q_TURN)),
                (_consumer_pp_or_drain,
                 (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                  v_empty, turn, q_row + 2 * SUB_M, m0 + 2 * SUB_M, window, n_out, n_in,
                  n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 2, PIPE, 0,
                  q_turn, Q_TURN)),
                (_producer_pp, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem,
                                v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, q_row,
                                kv_row0, n_out, n_in, n_tiles, BLOCK_N, STAGES, SPLIT, q_last,
                                Q_TURN)),
            ],
            [4, 4, 1],
            [SPLIT3_REGS, SPLIT3_REGS, 24],  # the default partition gets 168
        )

    _invalidate_ring(q_bar, k_ready, v_ready, k_empty, STAGES)
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(v_empty.index(j))
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))


# ----------------------------------------------------------------------------------------------
# LEAN walk (config[6] == 2; rerope_fwd_lean_kernel, SPLIT=3): plain's loop body on
# every unmasked tile, all masked visits in one run-time-classified loop, compact code.
# ----------------------------------------------------------------------------------------------
# Ring steps of a query block (the producer's order; one K tile + V a slot, plain's ring):
#   k in [0, n_out):                 K2 tile k                           (outside)
#   k in [n_out, n_u), n_u = n_out + n_tiles - n_in: K1 tile n_in + k - n_out (inside)
#   k in [n_u, n_u + 2 nb), nb = n_in - n_out: band tile n_out + (k - n_u) // 2, K2 for even
#                                    k - n_u (keep i - j >= w), K1 for odd (keep 0 <= i - j < w)
# A consumer partition (rows [m0, m0 + 64), n_full = max(m0 // BLOCK_N, n_in)) does
#   U: outside steps, then inside steps with t < n_full: _tile, unmasked, Q2 / Q1 chosen
#      once per walk (an outer 2-trip loop, so the body is compiled once);
#   M: its diagonal steps (t >= n_full, keep i - j >= 0), then the band visits: per step at run
#   time its Q, mask bounds and its own i - j range over the tile decide: skip (nothing of the
#   tile is kept for these rows: wait for the slot, release it), unmasked or masked
#   (_softmax_rt, -inf-safe).
@gluon.jit
def _producer_lean(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                   k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, q_last,
                   Q_TURN: gl.constexpr = None):
    """The LEAN step list above; Q of partition j: Q2 in q_smem[2j], Q1 in q_smem[2j + 1]
    (_load_q)."""
    _load_q(q1_desc, q2_desc, q_smem, q_bar, q_row, q_last, SPLIT, Q_TURN)
    for t in range(0, n_out):  # outside: K2
        _load_kv(t, t, k2_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
                 BLOCK_N, STAGES)
    for t in range(n_in, n_tiles):  # inside: K1
        _load_kv(n_out + t - n_in, t, k1_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
                 kv_empty, kv_row0, BLOCK_N, STAGES)
    n_u = n_out + n_tiles - n_in
    for jj in range(0, 2 * (n_in - n_out)):  # band tiles, twice: K2 then K1
        t = n_out + jj // 2
        if jj % 2 == 0:
            _load_kv(n_u + jj, t, k2_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty,
                     kv_row0, BLOCK_N, STAGES)
        else:
            _load_kv(n_u + jj, t, k1_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty,
                     kv_row0, BLOCK_N, STAGES)


@gluon.jit
def _consumer_lean(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                   q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                   STORE_LSE: gl.constexpr, ME: gl.constexpr, q_turn=None,
                   Q_TURN: gl.constexpr = None):
    """Consumer partition ME (BLOCK_M = 64 rows from m0) of rerope_fwd_lean_kernel: phases U and
    M of the LEAN walk (comment above _producer_lean)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    n_full = gl.maximum(m0 // BLOCK_N, n_in)  # inside tiles from here on may cross the diagonal

    mbarrier.wait(q_bar, 0)
    if Q_TURN is not None:
        _turn_q(q_smem, ME, m0, q_turn, Q_TURN, BLOCK_M, HEAD_D)
    # U: r = 0 outside (Q2; tiles [0, n_out), step k = t), r = 1 inside below the diagonal (Q1;
    # tiles [n_in, n_full), k = t + n_out - n_in). Plain's unmasked step (-inf-free: every score
    # of an unmasked tile is finite, so the running max is finite after the first one).
    for r in range(2):
        q_tile = q_smem.index(2 * ME + r)
        k_off = (n_out - n_in) * r
        for t in range(n_in * r, n_out + (n_full - n_out) * r):
            acc, m_i, l_i = _tile(t + k_off, acc, m_i, l_i, q_tile, k_smem, v_smem, k_ready,
                                  v_ready, kv_empty, kv_empty, m0, qk_scale, BLOCK_M, BLOCK_N,
                                  STAGES, False, s_layout, o_layout, 0, 0)
    # M: diagonal steps j < n_diag (tile n_full + j, Q1, keep i - j >= 0), then the band visits
    p_rows_hi: gl.constexpr = BLOCK_M - 1
    n_diag = n_tiles - n_full
    k0 = n_out + n_full - n_in
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for j in range(0, n_diag + 2 * (n_in - n_out)):
        k = k0 + j
        jb = gl.maximum(j - n_diag, 0)
        band = (j >= n_diag).to(gl.int32)
        ins = 1 - band * (1 - (jb & 1))  # band: even visit outside (Q2 K2), odd inside (Q1 K1)
        t = band * (n_out + jb // 2) + (1 - band) * (n_full + j)
        lo = window * (1 - ins)  # keep lo <= i - j < hi
        hi = BIG + (window - BIG) * (band * ins)
        d_min = m0 - t * BLOCK_N - (BLOCK_N - 1)  # this partition's i - j over tile t
        d_max = m0 + p_rows_hi - t * BLOCK_N
        s = k % STAGES
        phase = (k // STAGES) & 1
        if (d_max < lo) | (d_min >= hi):
            # no key of the tile is kept for these rows: only release the slot (after its K and
            # V are in, so that no phase of the ring's barriers is skipped)
            mbarrier.wait(k_ready.index(s), phase)
            mbarrier.wait(v_ready.index(s), phase)
            mbarrier.arrive(kv_empty.index(s), count=1)
        else:
            masked = (d_min < lo) | (d_max >= hi)
            q_tile = q_smem.index(2 * ME + ins)
            mbarrier.wait(k_ready.index(s), phase)
            k_tile = k_smem.index(s)
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False,
                               is_async=True)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_tile, k_tile))
            p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale,
                                             BLOCK_M, BLOCK_N, s_layout)
            acc = _pv_and_free(acc, p, alpha, v_smem, v_ready, kv_empty, s, phase, o_layout)

    _epilogue(acc, m_i, l_i, q_smem.index(2 * ME + 1), o_desc, lse_ptr, q_row, BLOCK_M,
              STORE_LSE, s_layout, o_layout)


@gluon.jit
def _consumer_lean_or_drain(N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                            kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                            STAGES: gl.constexpr, STORE_LSE: gl.constexpr, ME: gl.constexpr,
                            q_turn=None, Q_TURN: gl.constexpr = None):
    """The second and third consumers: _consumer_lean if rows [m0, m0 + 64) lie in the sequence,
    else _drain over the walk's n_tiles + n_in - n_out steps (partition 0 always
    computes, so every step's V is waited for before its slot is refilled)."""
    if m0 < N:
        _consumer_lean(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                       kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M,
                       BLOCK_N, HEAD_D, STAGES, STORE_LSE, ME, q_turn, Q_TURN)
    else:
        _drain(k_ready, kv_empty, n_tiles + n_in - n_out, STAGES)


@gluon.jit(do_not_specialize=["window"])
def rerope_fwd_lean_kernel(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, o_desc, lse_ptr, N,
                           window, qk_scale, group, q_turn, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                           CONSUMER_WARPS: gl.constexpr, STORE_LSE: gl.constexpr,
                           SPLIT: gl.constexpr, Q_TURN: gl.constexpr = None):
    """LEAN walk (config[6] == 2), SPLIT=3 only (BLOCK_M 192, three 4-warp consumers of 64 rows,
    160 registers, the first 168; producer 24): plain attention's ring (one K tile + V a slot,
    k_ready / v_ready / kv_empty counting 3), Q1 and Q2 of every partition resident."""
    gl.static_assert(SPLIT == 3, "the LEAN walk is written for SPLIT=3")
    gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=3: three 4-warp consumer partitions")
    m0, q_row, kv_row0, n_tiles, n_out, n_in = _block_regions(N, window, BLOCK_M, BLOCK_N, True,
                                                              group)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q1_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * SPLIT, SUB_M, HEAD_D], q1_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = _ring_barriers(STAGES, SPLIT)
    q_last = q_row - m0 + N - SUB_M  # this head's last Q sub-tile
    gl.warp_specialize(
        [
            (_consumer_lean, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                              kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                              SUB_M, BLOCK_N, HEAD_D, STAGES, STORE_LSE, 0, q_turn, Q_TURN)),
            (_consumer_lean_or_drain,
             (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
              q_row + SUB_M, m0 + SUB_M, window, n_out, n_in, n_tiles, qk_scale, SUB_M, BLOCK_N,
              HEAD_D, STAGES, STORE_LSE, 1, q_turn, Q_TURN)),
            (_consumer_lean_or_drain,
             (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
              q_row + 2 * SUB_M, m0 + 2 * SUB_M, window, n_out, n_in, n_tiles, qk_scale, SUB_M,
              BLOCK_N, HEAD_D, STAGES, STORE_LSE, 2, q_turn, Q_TURN)),
            (_producer_lean, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem,
                              v_smem, q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0, n_out,
                              n_in, n_tiles, BLOCK_N, STAGES, SPLIT, q_last, Q_TURN)),
        ],
        [4, 4, 1],
        [SPLIT3_REGS, SPLIT3_REGS, 24],  # the default partition gets 168
    )
    _invalidate_ring(q_bar, k_ready, v_ready, kv_empty, STAGES)


# ----------------------------------------------------------------------------------------------
# host helpers
# ----------------------------------------------------------------------------------------------
SMEM_LIMIT_SM90 = 232448  # bytes of shared memory one CTA may use on H100/H200 (227 KiB)


def smem_layout(block_shape, gl_dtype):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl_dtype)


def _gl_dtype(torch_dtype):
    import torch
    return {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[torch_dtype]


def check_n(N, config):
    """The sequence lengths a config takes (plain and ReRoPE wrappers): N % BLOCK_M == 0 and N %
    BLOCK_N == 0; SPLIT=3 (BLOCK_M 192, three 4-warp consumers) only N % 64 == 0 and N % BLOCK_N
    == 0, i.e. the same N as the 128-row configs: the grid is cdiv(N, 192) and in the last block
    a 64-row sub-tile past N drains the ring (_drain) instead of computing."""
    BLOCK_M, BLOCK_N, _, CONSUMER_WARPS, SPLIT = config[:5]
    if SPLIT == 3:
        assert CONSUMER_WARPS == 4 and BLOCK_M == 192, \
            "SPLIT=3: three 4-warp consumers of 64 rows"
        assert N % (BLOCK_M // SPLIT) == 0 and N % BLOCK_N == 0, \
            f"SPLIT=3: N must be a multiple of {BLOCK_N}"
    else:
        assert SPLIT in (1, 2), "SPLIT is 1, 2 or 3"
        assert N % BLOCK_M == 0 and N % BLOCK_N == 0, \
            f"prototype: N must be a multiple of {max(BLOCK_M, BLOCK_N)}"
