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
# the package's kernels: the lean (D64) and pipelined band-twice (D128) walks and their helpers
from rerope.hopper.kernels import (BIG, _block_regions, _load_kv, _regions,  # noqa: E402,F401
                                   _softmax_rt, rerope_fwd_lean_kernel,
                                   rerope_fwd_twice_pp_kernel)

OUTSIDE = gl.constexpr(0)
BAND = gl.constexpr(1)
INSIDE = gl.constexpr(2)


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
    # the package's kernels take two more: the GQA group, and no query turn (q_turn None)
    package_args = (1, None) if lean(config) or fa3_sched(config) else ()
    args = (q1d, q2d, k1d, k2d, vd, od, lse, N, window, sm_scale * LOG2E, *package_args, BLOCK_M, BLOCK_N, D,
            STAGES, CW, return_lse, SPLIT) + ((PIPE, pingpong(config)) if fa3_sched(config) else ())
    grid = (triton.cdiv(N, BLOCK_M), B * H)
    if _warmup:
        kernel_for(config).warmup(*args, grid=grid, num_warps=CW)
        return None
    kernel_for(config)[grid](*args, num_warps=CW)
    o = o.view(B, H, N, D)
    return (o, lse) if return_lse else o
