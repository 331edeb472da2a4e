"""Causal five-tensor ReRoPE attention forward for Hopper (sm_90) in Gluon, **Triton 3.6.0**.

UNMEASURED PROTOTYPE (issue 38, step 2): cross-compiles for sm_90 (``cross_compile.py --rerope``);
checked and timed on a GPU by ``device_rerope.sh``. Not part of the ``rerope`` package.

Score (natural units) ``s_ij = sm_scale * (q1_i . k1_j if i - j < window else q2_i . k2_j)``, causal
``j <= i``; ``o_i = softmax_j(s_ij) @ v``. Same structure as ``plain_fwd.py`` (1-warp TMA producer,
consumer partition(s) with ``warpgroup_mma``), with the key tiles of a query block ``[m0, m0+BLOCK_M)``
in three consecutive regions (``_regions``):

* OUTSIDE ``[0, n_out)``: every pair has ``i - j >= window``: S = Q2 K2^T only (loads K2, V);
* BAND ``[n_out, n_in)``: both products, selected elementwise by ``i - j < window``, causal mask
  applied too (the band may contain the diagonal when window < BLOCK_M) (loads K1, K2, V);
* INSIDE ``[n_in, n_tiles)``: every pair has ``i - j < window``: S = Q1 K1^T (loads K1, V); causal
  mask on the tiles from the consumer's own diagonal on (``n_full = m0_sub // BLOCK_N``).

The regions are computed once per program in the kernel from the whole BLOCK_M block and passed to
the producer and to every consumer, so all partitions walk the same tile sequence; a tile that is
BAND for the block may be all-inside / all-outside for one SPLIT half: the select is still exact.
Ring slots hold a K1, a K2 and a V tile (one ``k_ready`` barrier expecting the bytes of the K tiles
the region loads, one ``v_ready``, one ``kv_empty``). Q1 and Q2 are loaded once (two buffers;
the output goes out through Q1's buffer).

``config = (BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE[, BAND_TWICE])`` as in plain_fwd (PIPE
must be 0 here). D128 uses BLOCK_N 64 by default: 2 x 32 KB of Q + STAGES x 3 tiles of 32 KB at BLOCK_N
128 would not fit 227 KB with 2 stages.

BAND_TWICE = 1 (``rerope_fwd_twice_kernel``, same arguments): ring slots hold ONE key tile and a V tile,
as plain attention's, and each band tile is visited twice, once per product, each visit masked to its
side of the window with its own P V (exact: the online softmax does not depend on tile order). The
outside walk runs over tiles [0, n_in) with Q2, K2 (band tiles masked to i - j >= window), then the
inside walk over [n_out, n_tiles) with Q1, K1 (band tiles masked to 0 <= i - j < window, causal mask
from the partition's diagonal). D128 with BLOCK_N 128 and 2 stages: 2 x 32 KB of Q + 2 x 64 KB = 192 KB.

BAND_TWICE with PIPE = 1 (sixth field) and/or PINGPONG = 1 (eighth field, default 0; ``rerope_fwd_twice_pp_kernel``,
UNMEASURED): the same walk in one run-time-classified loop, FA3's intra-warpgroup overlap (PIPE) and
ordered wgmma sections of the two consumer partitions through two ``turn`` mbarriers (PINGPONG, SPLIT=2),
K and V slots freed separately. See ``_consumer_pp`` (deadlock argument) and README.md.

SPLIT = 3 (D64, UNMEASURED; ``SPLIT3_CONFIGS``): FlashAttention-3's head-dim-64 tiling, BLOCK_M 192
as three 4-warp consumer partitions of 64 rows (160 registers each, the first 168; producer 24), in
``rerope_fwd_causal_kernel`` (band tiles in two 64-key halves, ``_band_tile_halves``: two 64 x 128
fp32 accumulators do not fit 160 registers) and ``rerope_fwd_twice_pp_kernel`` (BAND_TWICE with
SPLIT=3 always goes there; PINGPONG stays 0). The grid is cdiv(N, 192) with N % 128 == 0 as for
every config: key tiles stop at N, and a 64-row part of the last block that lies past N drains
the ring (``plain_fwd._drain`` / ``_drain_pp``) instead of computing.
"""
import math
import os
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain_fwd import (LOG2E, SMEM_LIMIT_SM90, SPLIT3_REGS, _block_rows, _drain,  # noqa: E402,F401
                       _epilogue, _gl_dtype, _invalidate_ring, _pv_and_free, _q_sub_row,
                       _ring_barriers, _softmax, check_n, smem_layout)
from plain_fwd import _tile as _plain_tile  # noqa: E402

OUTSIDE = gl.constexpr(0)
BAND = gl.constexpr(1)
INSIDE = gl.constexpr(2)


@gluon.jit
def _regions(m0, window, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(n_out, n_in) for query rows [m0, m0+BLOCK_M): tiles [0, n_out) are all-outside
    ((t+1)*BLOCK_N - 1 <= m0 - window), [n_in, n_tiles) all-inside (m0+BLOCK_M-1 - t*BLOCK_N < window),
    between them the band. Non-negative operands only (integer division truncates)."""
    n_out = gl.maximum(m0 - window + 1, 0) // BLOCK_N
    n_in = (gl.maximum(m0 + BLOCK_M - 1 - window, -1) + BLOCK_N) // BLOCK_N
    n_in = gl.minimum(gl.maximum(n_in, n_out), n_tiles)
    return n_out, n_in


@gluon.jit
def _block_regions(N, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   RAGGED: gl.constexpr = False):
    """The prologue of all three kernels: plain_fwd._block_rows' (m0, q_row, kv_row0, n_tiles) of this
    program's query block, then its regions (n_out, n_in), computed once for every partition.
    RAGGED (SPLIT=3): the block may end past N (n_tiles stops at N; the regions are those of the
    whole 192 rows, which only moves inside tiles of rows past N into the band: still exact)."""
    m0, q_row, kv_row0, n_tiles = _block_rows(N, BLOCK_M, BLOCK_N, RAGGED)
    n_out, n_in = _regions(m0, window, n_tiles, BLOCK_M, BLOCK_N)
    return m0, q_row, kv_row0, n_tiles, n_out, n_in


# ----------------------------------------------------------------------------------------------
# producer
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _load_tile(i, k1_desc, k2_desc, v_desc, k1_smem, k2_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, REGION: gl.constexpr):
    s = i % STAGES
    mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)  # first round passes (parity trick)
    row = kv_row0 + i * BLOCK_N
    if REGION == OUTSIDE:
        mbarrier.expect(k_ready.index(s), k2_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k2_desc, [row, 0], k_ready.index(s), k2_smem.index(s))
    elif REGION == BAND:
        mbarrier.expect(k_ready.index(s), 2 * k1_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k1_desc, [row, 0], k_ready.index(s), k1_smem.index(s))
        tma.async_copy_global_to_shared(k2_desc, [row, 0], k_ready.index(s), k2_smem.index(s))
    else:
        mbarrier.expect(k_ready.index(s), k1_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k1_desc, [row, 0], k_ready.index(s), k1_smem.index(s))
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _producer(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, q_bar,
              k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, q_last=0):
    SUB_M: gl.constexpr = q1_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * SPLIT * q1_desc.block_type.nbytes)
    for j in gl.static_range(SPLIT):
        row = _q_sub_row(q_row, j, SUB_M, SPLIT, q_last)  # SPLIT=3: see plain_fwd._q_sub_row
        tma.async_copy_global_to_shared(q1_desc, [row, 0], q_bar, q1_smem.index(j))
        tma.async_copy_global_to_shared(q2_desc, [row, 0], q_bar, q2_smem.index(j))
    for i in range(0, n_out):
        _load_tile(i, k1_desc, k2_desc, v_desc, k1_smem, k2_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
                   BLOCK_N, STAGES, OUTSIDE)
    for i in range(n_out, n_in):
        _load_tile(i, k1_desc, k2_desc, v_desc, k1_smem, k2_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
                   BLOCK_N, STAGES, BAND)
    for i in range(n_in, n_tiles):
        _load_tile(i, k1_desc, k2_desc, v_desc, k1_smem, k2_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
                   BLOCK_N, STAGES, INSIDE)


# ----------------------------------------------------------------------------------------------
# consumer
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _scores(i, q1_smem, q2_smem, k1_smem, k2_smem, m0, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, REGION: gl.constexpr, s_layout: gl.constexpr):
    """Raw scores of tile i (k_ready already waited): Q2K2^T, Q1K1^T, or the elementwise select."""
    s = i % STAGES
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if REGION == OUTSIDE:
        k2 = k2_smem.index(s)
        qk = warpgroup_mma(q2_smem, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
        qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q2_smem, k2))
    elif REGION == INSIDE:
        k1 = k1_smem.index(s)
        qk = warpgroup_mma(q1_smem, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
        qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q1_smem, k1))
    else:
        k1 = k1_smem.index(s)
        k2 = k2_smem.index(s)
        qk1 = warpgroup_mma(q1_smem, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
        qk2 = warpgroup_mma(q2_smem, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
        qk1, qk2, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk1, qk2, q1_smem, k1, q2_smem, k2))
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        qk = gl.where((rows[:, None] - cols[None, :]) < window, qk1, qk2)
    return qk


@gluon.jit
def _tile(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, k_ready, v_ready, kv_empty, m0, window,
          qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, REGION: gl.constexpr,
          MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One key tile: scores of its region, online softmax (causal mask if MASK), O += P V, free slot."""
    s = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(s), phase)
    qk = _scores(i, q1_smem, q2_smem, k1_smem, k2_smem, m0, window, BLOCK_M, BLOCK_N, STAGES, REGION, s_layout)
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, i, m0, MASK, qk_scale, BLOCK_M, BLOCK_N, s_layout)
    acc = _pv_and_free(acc, p, alpha, v_smem, v_ready, kv_empty, s, phase, o_layout)
    return acc, m_i, l_i


@gluon.jit
def _band_tile_halves(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, k_ready,
                      v_ready, kv_empty, m0, window, qk_scale, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                      o_layout: gl.constexpr):
    """A BAND tile as two halves of BLOCK_N / 2 keys, each its own online-softmax step (select,
    causal mask, O += P V with the half of V): the pair of 64 x 128 fp32 accumulators (128
    registers a thread) does not fit SPLIT=3's 160 (3.9 KB of spills), a pair of 64 x 64 does.
    Exact (the online softmax does not depend on how the keys are grouped)."""
    HALF: gl.constexpr = BLOCK_N // 2
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=s_layout.warps_per_cta, instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s = i % STAGES
    phase = (i // STAGES) & 1
    zero = gl.zeros([BLOCK_M, HALF], gl.float32, h_layout)
    rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, h_layout))
    m_h = gl.convert_layout(m_i, gl.SliceLayout(1, h_layout))  # same rows a thread: no data moved
    l_h = gl.convert_layout(l_i, gl.SliceLayout(1, h_layout))
    mbarrier.wait(k_ready.index(s), phase)
    for h in gl.static_range(2):
        k1 = k1_smem.index(s).slice(h * HALF, HALF)
        k2 = k2_smem.index(s).slice(h * HALF, HALF)
        qk1 = warpgroup_mma(q1_smem, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
        qk2 = warpgroup_mma(q2_smem, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
        qk1, qk2, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0,
                                                  deps=(qk1, qk2, q1_smem, k1, q2_smem, k2))
        cols = i * BLOCK_N + h * HALF + gl.arange(0, HALF, gl.SliceLayout(0, h_layout))
        qk = gl.where((rows[:, None] - cols[None, :]) < window, qk1, qk2)
        # key half 2i + h of width HALF: _softmax's causal mask on cols (2i + h) * HALF + [0, HALF)
        p, m_h, l_h, alpha = _softmax(qk, m_h, l_h, 2 * i + h, m0, True, qk_scale, BLOCK_M, HALF,
                                      h_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        if h == 0:
            mbarrier.wait(v_ready.index(s), phase)
        v_half = v_smem.index(s).slice(h * HALF, HALF)
        acc = warpgroup_mma(p, v_half, acc, is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_half))
    gl.thread_barrier()  # every warp of the partition has read K1, K2 and V of slot s
    mbarrier.arrive(kv_empty.index(s), count=1)
    m_i = gl.convert_layout(m_h, gl.SliceLayout(1, s_layout))
    l_i = gl.convert_layout(l_h, gl.SliceLayout(1, s_layout))
    return acc, m_i, l_i


@gluon.jit
def _consumer(o_desc, lse_ptr, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
              q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
              STORE_LSE: gl.constexpr, BAND_HALVES: gl.constexpr = False):
    """BLOCK_M query rows from m0 (a SPLIT half or the whole block): outside, band, inside tiles.
    BAND_HALVES (SPLIT=3): band tiles in two key halves (_band_tile_halves)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    n_full = gl.maximum(m0 // BLOCK_N, n_in)  # inside tiles from here on may cross this half's diagonal

    mbarrier.wait(q_bar, 0)
    for i in range(0, n_out):
        acc, m_i, l_i = _tile(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, k_ready, v_ready,
                              kv_empty, m0, window, qk_scale, BLOCK_M, BLOCK_N, STAGES, OUTSIDE, False,
                              s_layout, o_layout)
    for i in range(n_out, n_in):
        if BAND_HALVES:
            acc, m_i, l_i = _band_tile_halves(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem,
                                              v_smem, k_ready, v_ready, kv_empty, m0, window,
                                              qk_scale, BLOCK_M, BLOCK_N, STAGES, s_layout,
                                              o_layout)
        else:
            acc, m_i, l_i = _tile(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem, v_smem,
                                  k_ready, v_ready, kv_empty, m0, window, qk_scale, BLOCK_M,
                                  BLOCK_N, STAGES, BAND, True, s_layout, o_layout)
    for i in range(n_in, n_full):
        acc, m_i, l_i = _tile(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, k_ready, v_ready,
                              kv_empty, m0, window, qk_scale, BLOCK_M, BLOCK_N, STAGES, INSIDE, False,
                              s_layout, o_layout)
    for i in range(n_full, n_tiles):
        acc, m_i, l_i = _tile(i, acc, m_i, l_i, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, k_ready, v_ready,
                              kv_empty, m0, window, qk_scale, BLOCK_M, BLOCK_N, STAGES, INSIDE, True,
                              s_layout, o_layout)

    _epilogue(acc, m_i, l_i, q1_smem, o_desc, lse_ptr, q_row, BLOCK_M, STORE_LSE, s_layout, o_layout)


@gluon.jit
def _consumer_or_drain(N, o_desc, lse_ptr, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, q_bar,
                       k_ready, v_ready, kv_empty, q_row, m0, window, n_out, n_in, n_tiles,
                       qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr, STORE_LSE: gl.constexpr):
    """SPLIT=3's second and third consumers: _consumer (band tiles in halves) if rows
    [m0, m0 + BLOCK_M) lie in the sequence, else plain_fwd._drain (one k_ready / kv_empty a tile,
    as here)."""
    if m0 < N:
        _consumer(o_desc, lse_ptr, q1_smem, q2_smem, k1_smem, k2_smem, v_smem, q_bar, k_ready,
                  v_ready, kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M,
                  BLOCK_N, HEAD_D, STAGES, CONSUMER_WARPS, STORE_LSE, True)
    else:
        _drain(k_ready, kv_empty, n_tiles, STAGES)


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------
@gluon.jit(do_not_specialize=["window"])  # window == 1 must not become a constexpr
def rerope_fwd_causal_kernel(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, o_desc, lse_ptr, N, window, qk_scale,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                             STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                             STORE_LSE: gl.constexpr, SPLIT: gl.constexpr):
    """grid (cdiv(N, BLOCK_M), B*H), heaviest query blocks first. SPLIT=1: one consumer partition
    of CONSUMER_WARPS warps; SPLIT=2: two 4-warp consumer partitions on BLOCK_M/2 rows each;
    SPLIT=3 (BLOCK_M 192, FA3's head-dim-64 tiling): three, those past N draining the ring."""
    m0, q_row, kv_row0, n_tiles, n_out, n_in = _block_regions(N, window, BLOCK_M, BLOCK_N,
                                                              SPLIT == 3)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q1_desc.dtype
    q1_smem = gl.allocate_shared_memory(dtype, [SPLIT, SUB_M, HEAD_D], q1_desc.layout)
    q2_smem = gl.allocate_shared_memory(dtype, [SPLIT, SUB_M, HEAD_D], q1_desc.layout)
    k1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    k2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = _ring_barriers(STAGES, SPLIT)

    if SPLIT == 1:
        gl.warp_specialize(
            [
                (_consumer, (o_desc, lse_ptr, q1_smem.index(0), q2_smem.index(0), k1_smem, k2_smem, v_smem, q_bar,
                             k_ready, v_ready, kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, CONSUMER_WARPS, STORE_LSE)),
                (_producer, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k1_smem, k2_smem, v_smem,
                             q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                             BLOCK_N, STAGES, SPLIT)),
            ],
            [1],
            [24],
        )
    elif SPLIT == 2:
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=2: two 4-warp consumer partitions")
        gl.warp_specialize(
            [
                (_consumer, (o_desc, lse_ptr, q1_smem.index(0), q2_smem.index(0), k1_smem, k2_smem, v_smem, q_bar,
                             k_ready, v_ready, kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                             SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE)),
                (_consumer, (o_desc, lse_ptr, q1_smem.index(1), q2_smem.index(1), k1_smem, k2_smem, v_smem, q_bar,
                             k_ready, v_ready, kv_empty, q_row + SUB_M, m0 + SUB_M, window, n_out, n_in, n_tiles,
                             qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE)),
                (_producer, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k1_smem, k2_smem, v_smem,
                             q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                             BLOCK_N, STAGES, SPLIT)),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.static_assert(SPLIT == 3, "SPLIT is 1, 2 or 3")
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=3: three 4-warp consumer partitions")
        q_last = kv_row0 + N - SUB_M
        gl.warp_specialize(
            [
                (_consumer, (o_desc, lse_ptr, q1_smem.index(0), q2_smem.index(0), k1_smem, k2_smem,
                             v_smem, q_bar, k_ready, v_ready, kv_empty, q_row, m0, window, n_out,
                             n_in, n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE,
                             True)),
                (_consumer_or_drain, (N, o_desc, lse_ptr, q1_smem.index(1), q2_smem.index(1),
                                      k1_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                                      q_row + SUB_M, m0 + SUB_M, window, n_out, n_in, n_tiles,
                                      qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE)),
                (_consumer_or_drain, (N, o_desc, lse_ptr, q1_smem.index(2), q2_smem.index(2),
                                      k1_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                                      q_row + 2 * SUB_M, m0 + 2 * SUB_M, window, n_out, n_in,
                                      n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4,
                                      STORE_LSE)),
                (_producer, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k1_smem,
                             k2_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0,
                             n_out, n_in, n_tiles, BLOCK_N, STAGES, SPLIT, q_last)),
            ],
            [4, 4, 1],
            [SPLIT3_REGS, SPLIT3_REGS, 24],  # plain_fwd.SPLIT3_REGS: the default partition gets 168
        )

    _invalidate_ring(q_bar, k_ready, v_ready, kv_empty, STAGES)


# ----------------------------------------------------------------------------------------------
# BAND_TWICE variant (config[6] == 1): ring slots of ONE key tile + V, band tiles visited twice
# ----------------------------------------------------------------------------------------------
# Tile sequence of a query block (the same for the producer and every consumer partition):
#   outside walk, steps k = t for t in [0, n_in):            Q2 K2^T; t >= n_out masked to i-j >= w
#   inside walk,  steps k = n_in + t - n_out, t in [n_out, n_tiles): Q1 K1^T; t < n_in masked to
#                 0 <= i-j < w, t >= n_full (this partition's diagonal) masked to i-j >= 0.
# Ring slot / phase come from the step k, the key rows from the tile t.
NO_MASK = gl.constexpr(0)
MASK_OUT = gl.constexpr(1)   # keep i - j >= window (implies causal)
MASK_IN = gl.constexpr(2)    # keep 0 <= i - j < window
MASK_CAUSAL = gl.constexpr(3)  # keep i - j >= 0


@gluon.jit
def _load_kv(k, t, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Step k of the walk: key tile t of k_desc (K1 or K2) and of V into ring slot k % STAGES."""
    s = k % STAGES
    mbarrier.wait(kv_empty.index(s), ((k // STAGES) & 1) ^ 1)  # first round passes (parity trick)
    row = kv_row0 + t * BLOCK_N
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(s), k_smem.index(s))
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _producer_twice(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k_smem, v_smem, q_bar,
                    k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
    SUB_M: gl.constexpr = q1_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * SPLIT * q1_desc.block_type.nbytes)
    for j in gl.static_range(SPLIT):
        tma.async_copy_global_to_shared(q2_desc, [q_row + j * SUB_M, 0], q_bar, q2_smem.index(j))
        tma.async_copy_global_to_shared(q1_desc, [q_row + j * SUB_M, 0], q_bar, q1_smem.index(j))
    for t in range(0, n_in):  # outside walk: K2
        _load_kv(t, t, k2_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0, BLOCK_N, STAGES)
    off = n_in - n_out
    for t in range(n_out, n_tiles):  # inside walk: K1
        _load_kv(t + off, t, k1_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
                 BLOCK_N, STAGES)


@gluon.jit
def _softmax_mode(qk, m_i, l_i, t, m0, window, qk_scale, MODE: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online-softmax step of key tile t under mask MODE. A masked visit may hide a whole row
    (e.g. the outside walk of a row i < window): m stays -inf there, so exponents are taken
    against m_use = 0 instead of -inf (no NaN from -inf - -inf); p = 0, alpha = 0 or 1."""
    qk = qk * qk_scale
    if MODE == NO_MASK:
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_use = m_new
    else:
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        d = rows[:, None] - cols[None, :]
        if MODE == MASK_OUT:
            keep = d >= window
        elif MODE == MASK_IN:
            keep = (d >= 0) & (d < window)
        else:
            keep = d >= 0
        qk = gl.where(keep, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _tile_twice(k, t, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, m0, window, qk_scale,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Step k (ring slot k % STAGES) = key tile t: S = Q K^T (Q, K of this walk), masked online
    softmax, O += P V, free the slot."""
    s = k % STAGES
    phase = (k // STAGES) & 1
    mbarrier.wait(k_ready.index(s), phase)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_tile = k_smem.index(s)
    qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_smem, k_tile))
    p, m_i, l_i, alpha = _softmax_mode(qk, m_i, l_i, t, m0, window, qk_scale, MODE, BLOCK_M, BLOCK_N, s_layout)
    acc = _pv_and_free(acc, p, alpha, v_smem, v_ready, kv_empty, s, phase, o_layout)
    return acc, m_i, l_i


@gluon.jit
def _consumer_twice(o_desc, lse_ptr, q1_smem, q2_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                    q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    CONSUMER_WARPS: gl.constexpr, STORE_LSE: gl.constexpr):
    """BLOCK_M query rows from m0 (a SPLIT half or the whole block): the outside walk (Q2, K2), then
    the inside walk (Q1, K1); band tiles [n_out, n_in) once in each, masked to their side."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    n_full = gl.maximum(m0 // BLOCK_N, n_in)  # inside tiles from here on may cross this half's diagonal
    off = n_in - n_out

    mbarrier.wait(q_bar, 0)
    for t in range(0, n_out):  # outside walk, all-outside tiles
        acc, m_i, l_i = _tile_twice(t, t, acc, m_i, l_i, q2_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, m0,
                                    window, qk_scale, BLOCK_M, BLOCK_N, STAGES, NO_MASK, s_layout, o_layout)
    for t in range(n_out, n_in):  # outside walk, band tiles: i - j >= window
        acc, m_i, l_i = _tile_twice(t, t, acc, m_i, l_i, q2_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, m0,
                                    window, qk_scale, BLOCK_M, BLOCK_N, STAGES, MASK_OUT, s_layout, o_layout)
    for t in range(n_out, n_in):  # inside walk, band tiles: 0 <= i - j < window
        acc, m_i, l_i = _tile_twice(t + off, t, acc, m_i, l_i, q1_smem, k_smem, v_smem, k_ready, v_ready,
                                    kv_empty, m0, window, qk_scale, BLOCK_M, BLOCK_N, STAGES, MASK_IN,
                                    s_layout, o_layout)
    for t in range(n_in, n_full):  # inside walk, below this half's diagonal
        acc, m_i, l_i = _tile_twice(t + off, t, acc, m_i, l_i, q1_smem, k_smem, v_smem, k_ready, v_ready,
                                    kv_empty, m0, window, qk_scale, BLOCK_M, BLOCK_N, STAGES, NO_MASK,
                                    s_layout, o_layout)
    for t in range(n_full, n_tiles):  # inside walk, diagonal tiles
        acc, m_i, l_i = _tile_twice(t + off, t, acc, m_i, l_i, q1_smem, k_smem, v_smem, k_ready, v_ready,
                                    kv_empty, m0, window, qk_scale, BLOCK_M, BLOCK_N, STAGES, MASK_CAUSAL,
                                    s_layout, o_layout)

    _epilogue(acc, m_i, l_i, q1_smem, o_desc, lse_ptr, q_row, BLOCK_M, STORE_LSE, s_layout, o_layout)


@gluon.jit(do_not_specialize=["window"])  # window == 1 must not become a constexpr
def rerope_fwd_twice_kernel(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, o_desc, lse_ptr, N, window, qk_scale,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                            STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                            STORE_LSE: gl.constexpr, SPLIT: gl.constexpr):
    """BAND_TWICE variant of rerope_fwd_causal_kernel (same arguments, grid and partitions): ring
    slots hold one key tile (K2 in the outside walk, K1 in the inside walk) and a V tile."""
    m0, q_row, kv_row0, n_tiles, n_out, n_in = _block_regions(N, window, BLOCK_M, BLOCK_N)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q1_desc.dtype
    q1_smem = gl.allocate_shared_memory(dtype, [SPLIT, SUB_M, HEAD_D], q1_desc.layout)
    q2_smem = gl.allocate_shared_memory(dtype, [SPLIT, SUB_M, HEAD_D], q1_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = _ring_barriers(STAGES, SPLIT)

    if SPLIT == 1:
        gl.warp_specialize(
            [
                (_consumer_twice, (o_desc, lse_ptr, q1_smem.index(0), q2_smem.index(0), k_smem, v_smem, q_bar,
                                   k_ready, v_ready, kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                                   BLOCK_M, BLOCK_N, HEAD_D, STAGES, CONSUMER_WARPS, STORE_LSE)),
                (_producer_twice, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k_smem, v_smem,
                                   q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                                   BLOCK_N, STAGES, SPLIT)),
            ],
            [1],
            [24],
        )
    else:
        gl.static_assert(SPLIT == 2, "SPLIT is 1 or 2")
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=2: two 4-warp consumer partitions")
        gl.warp_specialize(
            [
                (_consumer_twice, (o_desc, lse_ptr, q1_smem.index(0), q2_smem.index(0), k_smem, v_smem, q_bar,
                                   k_ready, v_ready, kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                                   SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE)),
                (_consumer_twice, (o_desc, lse_ptr, q1_smem.index(1), q2_smem.index(1), k_smem, v_smem, q_bar,
                                   k_ready, v_ready, kv_empty, q_row + SUB_M, m0 + SUB_M, window, n_out, n_in,
                                   n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE)),
                (_producer_twice, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1_smem, q2_smem, k_smem, v_smem,
                                   q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                                   BLOCK_N, STAGES, SPLIT)),
            ],
            [4, 1],
            [240, 24],
        )

    _invalidate_ring(q_bar, k_ready, v_ready, kv_empty, STAGES)


# ----------------------------------------------------------------------------------------------
# BAND_TWICE with FlashAttention-3 scheduling (config[5] PIPE and/or config[7] PINGPONG):
# rerope_fwd_twice_pp_kernel. UNMEASURED.
# ----------------------------------------------------------------------------------------------
BIG = gl.constexpr(1 << 30)  # "no upper bound" for i - j in _softmax_rt's mask


@gluon.jit
def _ring_barriers_pp(STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """_ring_barriers' q_bar, k_ready, v_ready, with the slot's empty barrier split in two:
    ``k_empty`` (the K tile was read: released right after S = Q K^T is waited for) and ``v_empty``
    (released after P V), each counting SPLIT arrivals; plus ``turn`` (2 barriers, count 1): the
    ping-pong order of the two consumer partitions (see _consumer_pp)."""
    q_bar, k_ready, v_ready, k_empty = _ring_barriers(STAGES, SPLIT)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(v_empty.index(j), count=SPLIT)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    return q_bar, k_ready, v_ready, k_empty, v_empty, turn


@gluon.jit
def _load_kv_pp(k, t, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """_load_kv with separate empties: K of step k goes in as soon as K of step k - STAGES was read by
    every consumer, V when V of step k - STAGES was (parity trick for the first round, as before)."""
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
def _producer_pp(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                 k_empty, v_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, q_last=0):
    """_producer_twice's step list (outside walk K2 over [0, n_in), inside walk K1 over [n_out, n_tiles));
    Q of partition j: Q2 in q_smem[2j], Q1 in q_smem[2j + 1]."""
    SUB_M: gl.constexpr = q1_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * SPLIT * q1_desc.block_type.nbytes)
    for j in gl.static_range(SPLIT):
        row = _q_sub_row(q_row, j, SUB_M, SPLIT, q_last)  # SPLIT=3: see plain_fwd._q_sub_row
        tma.async_copy_global_to_shared(q2_desc, [row, 0], q_bar, q_smem.index(2 * j))
        tma.async_copy_global_to_shared(q1_desc, [row, 0], q_bar, q_smem.index(2 * j + 1))
    for t in range(0, n_in):  # outside walk: K2
        _load_kv_pp(t, t, k2_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0,
                    BLOCK_N, STAGES)
    off = n_in - n_out
    for t in range(n_out, n_tiles):  # inside walk: K1
        _load_kv_pp(t + off, t, k1_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0,
                    BLOCK_N, STAGES)


@gluon.jit
def _step_pp(k, n_out, n_in, n_full, window):
    """What step k of the walk is, decided at run time (one loop instead of _consumer_twice's five):
    returns (t, ins, masked, lo, hi): key tile t; ins = 0 outside walk (Q2 K2^T), 1 inside walk
    (Q1 K1^T); the visit keeps lo <= i - j < hi when ``masked``. Same visits as _consumer_twice:
    outside, t >= n_out: i-j >= w (MASK_OUT); inside, t < n_in: 0 <= i-j < w (MASK_IN); inside,
    t >= n_full: i-j >= 0 (MASK_CAUSAL); else unmasked (emulate_rerope.py checks the equality)."""
    ins = (k >= n_in).to(gl.int32)
    t = k - (n_in - n_out) * ins
    band_in = (ins == 1) & (t < n_in)
    masked = ((ins == 0) & (t >= n_out)) | band_in | ((ins == 1) & (t >= n_full))
    lo = window * (1 - ins)
    hi = BIG + (window - BIG) * band_in.to(gl.int32)
    return t, ins, masked, lo, hi


@gluon.jit
def _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                s_layout: gl.constexpr):
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
def _consumer_pp(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                 q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                 STORE_LSE: gl.constexpr, ME: gl.constexpr, PIPE: gl.constexpr, PINGPONG: gl.constexpr):
    """Consumer partition ME (0 or 1) of rerope_fwd_twice_pp_kernel: the BAND_TWICE walk (steps
    k = 0 .. n_steps-1, n_steps = n_in + n_tiles - n_out, classified by _step_pp) in ONE loop.

    PIPE=1 (FA3's intra-warpgroup overlap): iteration k issues S_k = Q K_k^T and O += P_{k-1} V_{k-1},
    waits for S_k only (num_outstanding=1; wgmma groups retire in issue order), frees K slot k,
    runs softmax k while the P V wgmma still runs, then waits for it, frees V slot k-1 and rescales O
    by alpha_k. (acc after k = (acc after k-1 + P_{k-1} V_{k-1}) * alpha_k, so acc + P_last V_last at
    the end is the usual online softmax: exact.) PIPE=0: S_k, softmax, P_k V_k in turn.

    PINGPONG=1 (FA3's warp-scheduler barriers, with mbarriers: Gluon 3.6 has no named-barrier op):
    step k's "GEMM section" (PIPE=1: issuing S_k and P_{k-1} V_{k-1}; PIPE=0: issuing S_k) of
    partition ME starts with ``wait(turn[ME], (k & 1) ^ (1 - ME))`` and ends with one
    ``arrive(turn[1 - ME])``, so the sections run in the order 0_0, 1_0, 0_1, 1_1, ... and one
    partition's softmax overlaps the other's wgmmas. Deadlock / phase argument:
    * turn[1] is only arrived on by partition 0, once per step, so its phase c completes at
      partition 0's arrive c, which comes after partition 0's wait c; partition 1's wait k (parity
      k & 1) needs phase k. turn[0] likewise: partition 1's arrive c completes its phase c; partition
      0's wait k (parity (k & 1) ^ 1) needs phase k - 1 (k = 0: a fresh barrier's "phase -1" counts
      as completed, the parity trick), i.e. partition 1's arrive k - 1.
    * no aliasing of the parity: partition 1's arrive c needs its wait c, which needs partition 0's
      arrive c. While partition 0 waits at k it has arrived k times (0..k-1), so turn[0] has
      completed at most phases 0..k-1: the phase it waits for (k - 1) is the last completed one or
      the current one, never older (where the parity would lie). Symmetric: while partition 1 waits
      at k, turn[1] has completed at most phases 0..k (partition 0's arrive k+1 needs partition 1's
      arrive k). perf/gluon/emulate_rerope.py --protocol checks this on random interleavings.
    * both partitions walk the same n_steps steps (the regions are computed once per block and
      passed to everyone) and do one section per step (the last P V, after the loop, is outside the
      turns), so every wait has its arrive; the last arrive of partition 1 completes a phase no one
      waits for (harmless; the barriers are invalidated after the join).
    * against the ring: the first unfinished section in the turn order belongs to a partition whose
      turn wait is satisfied; it can only block on k_ready of step k or v_ready of step k - 1. Every
      partition that is further along in the order has already released K of steps < k and V of
      steps < k - 1, or will without waiting on a barrier (only on its own wgmmas); the producer
      needs exactly those releases (K of step k - STAGES, V of step k - 1 - STAGES, STAGES >= 1) to
      load K_k and V_{k-1}, so it does, and the blocked partition moves on. The ring's own parity
      waits cannot alias: the producer refills slot s for step k + STAGES only after every consumer
      released step k, which comes after that consumer's ready-wait for step k.
    Ordering is a scheduling hint only (no data flows through ``turn``): the arrive is made by the
    partition's first thread after it issued its wgmmas, without a thread_barrier first."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    n_full = gl.maximum(m0 // BLOCK_N, n_in)  # inside tiles from here on may cross this half's diagonal
    n_steps = n_in + n_tiles - n_out  # >= 1

    mbarrier.wait(q_bar, 0)
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
        p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale, BLOCK_M, BLOCK_N,
                                         s_layout)
        for k in range(1, n_steps):
            s = k % STAGES
            sp = (k - 1) % STAGES
            t, ins, masked, lo, hi = _step_pp(k, n_out, n_in, n_full, window)
            mbarrier.wait(k_ready.index(s), (k // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(ME), (k & 1) ^ (1 - ME))
            q_tile = q_smem.index(2 * ME + ins)
            k_tile = k_smem.index(s)
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(sp), ((k - 1) // STAGES) & 1)
            v_tile = v_smem.index(sp)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - ME), count=1)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_tile, k_tile))
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(s), count=1)
            p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale, BLOCK_M, BLOCK_N,
                                             s_layout)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        last = n_steps - 1
        sl = last % STAGES
        mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
        v_tile = v_smem.index(sl)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
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
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - ME), count=1)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_tile, k_tile))
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(s), count=1)
            p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale, BLOCK_M, BLOCK_N,
                                             s_layout)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            mbarrier.wait(v_ready.index(s), phase)
            v_tile = v_smem.index(s)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(s), count=1)

    o_smem = q_smem.index(2 * ME + 1)  # this partition's Q1 buffer (no longer read)
    _epilogue(acc, m_i, l_i, o_smem, o_desc, lse_ptr, q_row, BLOCK_M, STORE_LSE, s_layout, o_layout)


@gluon.jit
def _drain_pp(k_ready, v_ready, k_empty, v_empty, n_steps, STAGES: gl.constexpr):
    """plain_fwd._drain for the split empties: a SPLIT=3 partition past N releases K and V of every
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
                          k_empty, v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                          STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                          STORE_LSE: gl.constexpr, ME: gl.constexpr, PIPE: gl.constexpr,
                          PINGPONG: gl.constexpr):
    """SPLIT=3's second and third consumers of rerope_fwd_twice_pp_kernel: _consumer_pp if rows
    [m0, m0 + BLOCK_M) lie in the sequence, else _drain_pp over the walk's n_in + n_tiles - n_out
    steps."""
    if m0 < N:
        _consumer_pp(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                     v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M,
                     BLOCK_N, HEAD_D, STAGES, CONSUMER_WARPS, STORE_LSE, ME, PIPE, PINGPONG)
    else:
        _drain_pp(k_ready, v_ready, k_empty, v_empty, n_in + n_tiles - n_out, STAGES)


@gluon.jit(do_not_specialize=["window"])
def rerope_fwd_twice_pp_kernel(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, o_desc, lse_ptr, N, window, qk_scale,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                               STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                               STORE_LSE: gl.constexpr, SPLIT: gl.constexpr, PIPE: gl.constexpr,
                               PINGPONG: gl.constexpr):
    """BAND_TWICE (same walk, arguments, grid, shared-memory ring) with FA3's scheduling:
    PIPE=1 intra-warpgroup overlap, PINGPONG=1 ordered GEMM sections of the two consumer partitions
    (SPLIT=2 only); K and V slots freed separately (k_empty / v_empty). See _consumer_pp. SPLIT=3
    (BLOCK_M 192, PINGPONG=0): three 4-warp consumers, those past N draining the ring."""
    m0, q_row, kv_row0, n_tiles, n_out, n_in = _block_regions(N, window, BLOCK_M, BLOCK_N,
                                                              SPLIT == 3)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q1_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * SPLIT, SUB_M, HEAD_D], q1_desc.layout)  # Q2_j, Q1_j
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, k_empty, v_empty, turn = _ring_barriers_pp(STAGES, SPLIT)

    if SPLIT == 1:
        gl.static_assert(PINGPONG == 0, "PINGPONG needs SPLIT=2")
        gl.warp_specialize(
            [
                (_consumer_pp, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                                turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M, BLOCK_N, HEAD_D,
                                STAGES, CONSUMER_WARPS, STORE_LSE, 0, PIPE, PINGPONG)),
                (_producer_pp, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                                v_ready, k_empty, v_empty, q_row, kv_row0, n_out, n_in, n_tiles, BLOCK_N, STAGES,
                                SPLIT)),
            ],
            [1],
            [24],
        )
    elif SPLIT == 2:
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=2: two 4-warp consumer partitions")
        gl.warp_specialize(
            [
                (_consumer_pp, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                                turn, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D,
                                STAGES, 4, STORE_LSE, 0, PIPE, PINGPONG)),
                (_consumer_pp, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                                turn, q_row + SUB_M, m0 + SUB_M, window, n_out, n_in, n_tiles, qk_scale, SUB_M,
                                BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 1, PIPE, PINGPONG)),
                (_producer_pp, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                                v_ready, k_empty, v_empty, q_row, kv_row0, n_out, n_in, n_tiles, BLOCK_N, STAGES,
                                SPLIT)),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.static_assert(SPLIT == 3, "SPLIT is 1, 2 or 3")
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=3: three 4-warp consumer partitions")
        gl.static_assert(PINGPONG == 0, "PINGPONG needs SPLIT=2")
        q_last = kv_row0 + N - SUB_M
        gl.warp_specialize(
            [
                (_consumer_pp, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                                k_empty, v_empty, turn, q_row, m0, window, n_out, n_in, n_tiles,
                                qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 0, PIPE,
                                0)),
                (_consumer_pp_or_drain, (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                                         v_ready, k_empty, v_empty, turn, q_row + SUB_M, m0 + SUB_M,
                                         window, n_out, n_in, n_tiles, qk_scale, SUB_M, BLOCK_N,
                                         HEAD_D, STAGES, 4, STORE_LSE, 1, PIPE, 0)),
                (_consumer_pp_or_drain, (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                                         v_ready, k_empty, v_empty, turn, q_row + 2 * SUB_M,
                                         m0 + 2 * SUB_M, window, n_out, n_in, n_tiles, qk_scale,
                                         SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, 2, PIPE, 0)),
                (_producer_pp, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem,
                                q_bar, k_ready, v_ready, k_empty, v_empty, q_row, kv_row0, n_out,
                                n_in, n_tiles, BLOCK_N, STAGES, SPLIT, q_last)),
            ],
            [4, 4, 1],
            [SPLIT3_REGS, SPLIT3_REGS, 24],  # plain_fwd.SPLIT3_REGS: the default partition gets 168
        )

    _invalidate_ring(q_bar, k_ready, v_ready, k_empty, STAGES)
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(v_empty.index(j))
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))


# ----------------------------------------------------------------------------------------------
# LEAN walk (config[6] == 2; rerope_fwd_lean_kernel, SPLIT=3, UNMEASURED): plain's loop body on
# every unmasked tile, all masked visits in one run-time-classified loop, compact code.
# ----------------------------------------------------------------------------------------------
# Ring steps of a query block (the producer's order; one K tile + V a slot, plain's ring):
#   k in [0, n_out):                 K2 tile k                           (outside)
#   k in [n_out, n_u), n_u = n_out + n_tiles - n_in: K1 tile n_in + k - n_out (inside)
#   k in [n_u, n_u + 2 nb), nb = n_in - n_out: band tile n_out + (k - n_u) // 2, K2 for even
#                                    k - n_u (keep i - j >= w), K1 for odd (keep 0 <= i - j < w)
# A consumer partition (rows [m0, m0 + 64), n_full = max(m0 // BLOCK_N, n_in)) does
#   U: outside steps, then inside steps with t < n_full: plain_fwd._tile, unmasked, Q2 / Q1 chosen
#      once per walk (an outer 2-trip loop, so the body is compiled once);
#   M: its diagonal steps (t >= n_full, keep i - j >= 0), then the band visits: per step at run
#      time its Q, mask bounds and its own i - j range over the tile decide: skip (nothing of the
#      tile is kept for these rows: wait for the slot, release it), unmasked or masked
#      (_softmax_rt, -inf-safe).
@gluon.jit
def _producer_lean(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                   k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in, n_tiles,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, q_last):
    """The LEAN step list above; Q of partition j: Q2 in q_smem[2j], Q1 in q_smem[2j + 1]."""
    SUB_M: gl.constexpr = q1_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * SPLIT * q1_desc.block_type.nbytes)
    for j in gl.static_range(SPLIT):
        row = _q_sub_row(q_row, j, SUB_M, SPLIT, q_last)  # see plain_fwd._q_sub_row
        tma.async_copy_global_to_shared(q2_desc, [row, 0], q_bar, q_smem.index(2 * j))
        tma.async_copy_global_to_shared(q1_desc, [row, 0], q_bar, q_smem.index(2 * j + 1))
    for t in range(0, n_out):  # outside: K2
        _load_kv(t, t, k2_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0,
                 BLOCK_N, STAGES)
    for t in range(n_in, n_tiles):  # inside: K1
        _load_kv(n_out + t - n_in, t, k1_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty,
                 kv_row0, BLOCK_N, STAGES)
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
                   STORE_LSE: gl.constexpr, ME: gl.constexpr):
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
    # U: r = 0 outside (Q2; tiles [0, n_out), step k = t), r = 1 inside below the diagonal (Q1;
    # tiles [n_in, n_full), k = t + n_out - n_in). Plain's unmasked step (-inf-free: every score
    # of an unmasked tile is finite, so the running max is finite after the first one).
    for r in range(2):
        q_tile = q_smem.index(2 * ME + r)
        k_off = (n_out - n_in) * r
        for t in range(n_in * r, n_out + (n_full - n_out) * r):
            acc, m_i, l_i = _plain_tile(t + k_off, acc, m_i, l_i, q_tile, k_smem, v_smem,
                                        k_ready, v_ready, kv_empty, kv_empty, m0, qk_scale,
                                        BLOCK_M, BLOCK_N, STAGES, False, s_layout, o_layout, 0, 0)
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
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_tile, k_tile))
            p, m_i, l_i, alpha = _softmax_rt(qk, m_i, l_i, t, m0, masked, lo, hi, qk_scale,
                                             BLOCK_M, BLOCK_N, s_layout)
            acc = _pv_and_free(acc, p, alpha, v_smem, v_ready, kv_empty, s, phase, o_layout)

    _epilogue(acc, m_i, l_i, q_smem.index(2 * ME + 1), o_desc, lse_ptr, q_row, BLOCK_M, STORE_LSE,
              s_layout, o_layout)


@gluon.jit
def _consumer_lean_or_drain(N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                            kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                            STAGES: gl.constexpr, STORE_LSE: gl.constexpr, ME: gl.constexpr):
    """The second and third consumers: _consumer_lean if rows [m0, m0 + 64) lie in the sequence,
    else plain_fwd._drain over the walk's n_tiles + n_in - n_out steps (partition 0 always
    computes, so every step's V is waited for before its slot is refilled)."""
    if m0 < N:
        _consumer_lean(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                       q_row, m0, window, n_out, n_in, n_tiles, qk_scale, BLOCK_M, BLOCK_N,
                       HEAD_D, STAGES, STORE_LSE, ME)
    else:
        _drain(k_ready, kv_empty, n_tiles + n_in - n_out, STAGES)


@gluon.jit(do_not_specialize=["window"])
def rerope_fwd_lean_kernel(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, o_desc, lse_ptr, N, window,
                           qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                           CONSUMER_WARPS: gl.constexpr, STORE_LSE: gl.constexpr,
                           SPLIT: gl.constexpr):
    """LEAN walk (config[6] == 2), SPLIT=3 only (BLOCK_M 192, three 4-warp consumers of 64 rows,
    160 registers, the first 168; producer 24): plain_fwd's ring (one K tile + V a slot,
    k_ready / v_ready / kv_empty counting 3), Q1 and Q2 of every partition resident."""
    gl.static_assert(SPLIT == 3, "the LEAN walk is written for SPLIT=3")
    gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=3: three 4-warp consumer partitions")
    m0, q_row, kv_row0, n_tiles, n_out, n_in = _block_regions(N, window, BLOCK_M, BLOCK_N, True)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q1_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * SPLIT, SUB_M, HEAD_D], q1_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k1_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = _ring_barriers(STAGES, SPLIT)
    q_last = kv_row0 + N - SUB_M
    gl.warp_specialize(
        [
            (_consumer_lean, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                              kv_empty, q_row, m0, window, n_out, n_in, n_tiles, qk_scale, SUB_M,
                              BLOCK_N, HEAD_D, STAGES, STORE_LSE, 0)),
            (_consumer_lean_or_drain, (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                                       v_ready, kv_empty, q_row + SUB_M, m0 + SUB_M, window,
                                       n_out, n_in, n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D,
                                       STAGES, STORE_LSE, 1)),
            (_consumer_lean_or_drain, (N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                                       v_ready, kv_empty, q_row + 2 * SUB_M, m0 + 2 * SUB_M,
                                       window, n_out, n_in, n_tiles, qk_scale, SUB_M, BLOCK_N,
                                       HEAD_D, STAGES, STORE_LSE, 2)),
            (_producer_lean, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q_smem, k_smem, v_smem,
                              q_bar, k_ready, v_ready, kv_empty, q_row, kv_row0, n_out, n_in,
                              n_tiles, BLOCK_N, STAGES, SPLIT, q_last)),
        ],
        [4, 4, 1],
        [SPLIT3_REGS, SPLIT3_REGS, 24],  # plain_fwd.SPLIT3_REGS: the default partition gets 168
    )
    _invalidate_ring(q_bar, k_ready, v_ready, kv_empty, STAGES)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------
def default_config(head_dim):
    """(BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE): SPLIT=2 (the plain kernel's winner)."""
    if head_dim == 64:
        return 128, 128, 2, 4, 2, 0
    if head_dim == 128:
        return 128, 64, 2, 4, 2, 0
    raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")


# A seventh config field BAND_TWICE = 1 selects rerope_fwd_twice_kernel (one K tile per ring slot,
# band tiles visited twice); six fields or 0: rerope_fwd_causal_kernel (K1, K2, V per slot).
# An eighth field PINGPONG (default 0) and PIPE (sixth) = 1, with BAND_TWICE = 1, select
# rerope_fwd_twice_pp_kernel (FA3 scheduling, unmeasured): PIPE=1 intra-warpgroup overlap,
# PINGPONG=1 ordered wgmma sections of the two consumer partitions (SPLIT=2).
EXTRA_CONFIGS = {
    64: [(128, 128, 3, 4, 2, 0),
         (128, 128, 2, 4, 2, 0, 1),
         (128, 128, 2, 4, 2, 1, 1, 0), (128, 128, 2, 4, 2, 0, 1, 1), (128, 128, 2, 4, 2, 1, 1, 1),
         (128, 128, 3, 4, 2, 1, 1, 1)],
    128: [(128, 64, 3, 4, 2, 0),
          (128, 128, 2, 4, 2, 0, 1),
          (128, 128, 2, 4, 2, 1, 1, 0), (128, 128, 2, 4, 2, 0, 1, 1), (128, 128, 2, 4, 2, 1, 1, 1)],
}
# SPLIT=3 (unmeasured): FA3's head-dim-64 tiling, BLOCK_M 192 = three 4-warp consumers of 64 rows
# (SPLIT3_REGS = 160 registers each): the three-tiles kernel (band tiles in key halves) with 2 / 3
# stages, and BAND_TWICE (rerope_fwd_twice_pp_kernel, PIPE=0; PIPE=1 spills at 160 registers).
# D64 only.
# LEAN (seventh field 2, rerope_fwd_lean_kernel, unmeasured): plain's loop body on every unmasked
# tile, the masked visits in one run-time loop (README.md, "LEAN walk"); 2 / 3 stages.
LEAN_CONFIGS = [(192, 128, 2, 4, 3, 0, 2), (192, 128, 3, 4, 3, 0, 2)]
SPLIT3_CONFIGS = [(192, 128, 2, 4, 3, 0), (192, 128, 3, 4, 3, 0), (192, 128, 2, 4, 3, 0, 1)]
SPLIT3_CONFIGS += LEAN_CONFIGS
# the three-tiles kernel at SPLIT=3 measured 0.69 of cuDNN (perf/runs/s53, H100) against 0.86 for
# the band-twice one: retired (below); README.md's SPLIT=3 analysis has the why
SPLIT3_RETIRED = [(192, 128, 2, 4, 3, 0), (192, 128, 3, 4, 3, 0)]
EXTRA_CONFIGS[64] += [c for c in SPLIT3_CONFIGS if c not in SPLIT3_RETIRED]
# measured slower (perf/runs/s46 on an H100: 0.75-0.80 of cuDNN against 0.84-0.90; perf/runs/s47 on
# an H200: the BAND_TWICE ones below at 0.74-0.83 against 0.84-0.87): still built by
# all_configs(..., retired=True) / bench_rerope.py --all-configs, no longer timed by default
RETIRED_CONFIGS = {
    64: [(128, 128, 2, 8, 1, 0), (128, 64, 3, 4, 2, 0), (128, 128, 3, 4, 2, 0, 1)] + SPLIT3_RETIRED,
    128: [(128, 64, 2, 8, 1, 0),  # (128, 128, 1, 4, 2, 0) fits but spills
          (128, 64, 2, 4, 2, 0, 1), (128, 64, 3, 4, 2, 0, 1)],
}


def all_configs(head_dim, retired=False):
    return [default_config(head_dim)] + list(EXTRA_CONFIGS[head_dim]) + (
        list(RETIRED_CONFIGS[head_dim]) if retired else [])


def quick_configs(head_dim):
    """bench_rerope.py --quick: the default, the best BAND_TWICE config so far (BLOCK_N 128, 2 stages)
    and its three FA3-scheduled variants (PIPE / PINGPONG / both)."""
    base = (128, 128, 2, 4, 2)
    return [default_config(head_dim), base + (0, 1), base + (1, 1, 0), base + (0, 1, 1), base + (1, 1, 1)]


def d64_configs():
    """bench_rerope.py --d64 (device_rerope.sh D64=1): the best D64 configs so far (the default and
    its 3-stage variant: 0.85-0.88 of cuDNN on the H100), the band-twice SPLIT=3 one (0.86) and
    the LEAN ones (the three-tiles SPLIT=3 ones, 0.69, are retired)."""
    return [default_config(64), (128, 128, 3, 4, 2, 0), (192, 128, 2, 4, 3, 0, 1)] + LEAN_CONFIGS


def band_twice(config):
    """The seventh field: 0 three tiles a ring slot; 1 BAND_TWICE (one K tile + V a slot, band tiles
    visited twice); 2 LEAN (band tiles visited twice too, rerope_fwd_lean_kernel)."""
    return int(config[6]) if len(config) > 6 else 0


def lean(config):
    """1 if config selects rerope_fwd_lean_kernel (seventh field 2; SPLIT=3, PIPE=0)."""
    return int(band_twice(config) == 2)


def pingpong(config):
    """The eighth field PINGPONG (0 when absent)."""
    return int(config[7]) if len(config) > 7 else 0


def fa3_sched(config):
    """1 if config selects rerope_fwd_twice_pp_kernel (BAND_TWICE with PIPE and/or PINGPONG, or with
    SPLIT=3, which only that band-twice kernel has)."""
    return int(bool(band_twice(config) == 1 and (config[5] or pingpong(config) or config[4] == 3)))


def kernel_for(config):
    if lean(config):
        return rerope_fwd_lean_kernel
    if fa3_sched(config):
        return rerope_fwd_twice_pp_kernel
    return rerope_fwd_twice_kernel if band_twice(config) else rerope_fwd_causal_kernel


def rerope_attention(q1, q2, k1, k2, v, window, sm_scale=None, return_lse=False, config=None, _warmup=False):
    """Causal five-tensor ReRoPE forward. All (B, H, N, D), fp16/bf16, D 64/128, N % 128 == 0
    (plain_fwd.check_n).
    config: (BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE[, BAND_TWICE[, PINGPONG]]).
    Returns o (B, H, N, D) [and lse (B, H, N) float32, natural log]. ``_warmup``: only JIT-compile
    (into Triton's on-disk cache; nothing launched), return None."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, N, D = q1.shape
    ts = (q1, q2, k1, k2, v)
    assert all(t.shape == q1.shape and t.dtype == q1.dtype for t in ts), "same shape/dtype for all five"
    assert q1.dtype in (torch.float16, torch.bfloat16)
    assert int(window) >= 1, "window >= 1"
    config = tuple(config or default_config(D))
    BLOCK_M, BLOCK_N, STAGES, CW, SPLIT, PIPE = config[:6]
    assert PIPE == 0 or band_twice(config), "PIPE=1 only with BAND_TWICE=1 (rerope_fwd_twice_pp_kernel)"
    assert pingpong(config) == 0 or (band_twice(config) == 1 and SPLIT == 2), "PINGPONG=1 needs BAND_TWICE=1, SPLIT=2"
    assert not lean(config) or (SPLIT == 3 and PIPE == 0 and pingpong(config) == 0), \
        "LEAN (seventh field 2): SPLIT=3, PIPE=0, PINGPONG=0"
    assert BLOCK_M == 16 * CW * SPLIT
    check_n(N, config)  # N % 128 == 0 for every config (SPLIT=3: grid cdiv(N, 192))
    SUB_M = BLOCK_M // SPLIT
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    flat = [t.contiguous().view(B * H * N, D) for t in ts]
    o = torch.empty_like(flat[0])
    lse = torch.empty((B, H, N), device=q1.device, dtype=torch.float32) if return_lse else o
    gdt = _gl_dtype(q1.dtype)
    q_layout = smem_layout([SUB_M, D], gdt)
    kv_layout = smem_layout([BLOCK_N, D], gdt)
    q1d, q2d, od = (TensorDescriptor.from_tensor(t, [SUB_M, D], q_layout) for t in (flat[0], flat[1], o))
    k1d, k2d, vd = (TensorDescriptor.from_tensor(t, [BLOCK_N, D], kv_layout) for t in flat[2:])
    window = min(int(window), N + 1)  # >= N: everything inside
    args = (q1d, q2d, k1d, k2d, vd, od, lse, N, window, sm_scale * LOG2E, BLOCK_M, BLOCK_N, D, STAGES, CW,
            return_lse, SPLIT) + ((PIPE, pingpong(config)) if fa3_sched(config) else ())
    grid = (triton.cdiv(N, BLOCK_M), B * H)
    if _warmup:
        kernel_for(config).warmup(*args, grid=grid, num_warps=CW)
        return None
    kernel_for(config)[grid](*args, num_warps=CW)
    o = o.view(B, H, N, D)
    return (o, lse) if return_lse else o
