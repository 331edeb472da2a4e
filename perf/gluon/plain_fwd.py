"""Plain causal attention forward for Hopper (sm_90), written in Gluon for **Triton 3.6.0**.

UNMEASURED PROTOTYPE (issue 38, step 1). It cross-compiles for sm_90 with Triton 3.6 (see
``cross_compile.py`` / ``cross_compile_3.6.txt``) but has not yet run on a GPU: correctness and
speed are checked by ``device_plain.sh``. Not part of the ``rerope`` package; nothing imports it.

Structure (FlashAttention-3's, simplified):

* grid ``(cdiv(N, BLOCK_M), B * H)``; the heaviest query blocks (most key tiles) are launched first;
* Q, K, V, O are seen through host-side TMA descriptors over the ``(B*H*N, D)`` view, so a tile
  never straddles two heads as long as ``N % BLOCK_M == 0`` and ``N % BLOCK_N == 0`` (SPLIT=3:
  ``N % 64 == 0``, and a 64-row part of the last block that lies past N loads and stores nothing);
* ``gl.warp_specialize`` splits the CTA into
  - a **producer** partition (1 warp, few registers) that TMA-loads Q once and then K/V tiles into
    a ``STAGES``-deep shared-memory ring, waiting on ``kv_empty`` and signalling ``k_ready`` /
    ``v_ready`` mbarriers (byte-count ``expect``);
  - the **consumer** partition(s): by default one partition of ``CONSUMER_WARPS`` warps = 1 or 2
    warp groups sharing one ``BLOCK_M`` query tile (64 rows per warp group, "cooperative"):
    S = Q Kᵀ with ``warpgroup_mma`` (both operands in shared memory), online softmax in registers
    with exp2 and the scale folded into ``qk_scale = sm_scale * log2(e)``, O += P V with
    ``warpgroup_mma`` (P from registers as a dot operand, V from shared memory), then it frees the
    ring slot; ``SPLIT=2``: two 4-warp consumer partitions, each with its own half of the Q tile;
    ``SPLIT=3`` (D64, BLOCK_M 192: FA3's head-dim-64 tiling): three, 64 rows each, 160 registers
    (the first 168), the producer 24;
* causal masking only on the diagonal tiles (a second loop over those tiles, or a run-time test in
  the ``PIPE=1`` loop, which overlaps softmax i with the PV wgmma of tile i-1, FA3-style);
* epilogue: O / l written through shared memory (Q's buffer, free by then) with a TMA store;
  optional LSE (natural log, float32, ``(B, H, N)``).

``config = (BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE[, 0, PINGPONG])``: ``default_config`` and
``EXTRA_CONFIGS`` list what ``device_plain.sh`` checks and times.

Known simplifications (next steps once it is measured): no ordered ping-pong between the SPLIT
partitions (FA3's named barriers), K and V freed together, no persistent scheduling, no GQA,
N must be a multiple of 128.
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

# the helpers shared with the ReRoPE kernels live in the package (rerope.hopper.kernels)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels"))
from rerope.hopper.kernels import (LN2, SMEM_LIMIT_SM90, SPLIT3_REGS, _block_rows,  # noqa: E402,F401
                                   _drain, _epilogue, _gl_dtype, _invalidate_ring, _pv_and_free,
                                   _q_sub_row, _ring_barriers, _softmax, _tile, check_n,
                                   smem_layout)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# producer: one warp issuing TMA loads
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
              q_row, kv_row0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              SPLIT: gl.constexpr, q_last=0):
    # Q: SPLIT sub-tiles of BLOCK_M // SPLIT rows, one per consumer partition, on one barrier
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, SPLIT * q_desc.block_type.nbytes)
    for j in gl.static_range(SPLIT):
        row = _q_sub_row(q_row, j, SUB_M, SPLIT, q_last)
        tma.async_copy_global_to_shared(q_desc, [row, 0], q_bar, q_smem.index(j))
    for i in range(n_tiles):
        s = i % STAGES
        phase = (i // STAGES) & 1
        # A fresh mbarrier counts as having completed the phase before phase 0, so waiting for
        # parity `phase ^ 1` lets the first STAGES loads through without a pre-arrive.
        mbarrier.wait(kv_empty.index(s), phase ^ 1)
        row = kv_row0 + i * BLOCK_N
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(s), v_smem.index(s))


# ----------------------------------------------------------------------------------------------
# consumer: warp group(s) doing wgmma + online softmax
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _loop_pipelined(acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, m0, n_full, n_tiles,
                    qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    s_layout: gl.constexpr, o_layout: gl.constexpr, ME: gl.constexpr, PINGPONG: gl.constexpr):
    """FA3's intra-warpgroup overlap: in iteration i, S_i = Q K_i and O += P_{i-1} V_{i-1} are both
    issued, the wait for S_i leaves the PV wgmma running (num_outstanding=1) while softmax_i runs,
    then O is waited for, slot i-1 released and O rescaled by alpha_i. Needs n_tiles >= 1.
    PINGPONG=1: issuing S_0, and in iteration i S_i + P_{i-1} V_{i-1}, are GEMM section 0 / i of this
    partition, ordered with the other's by ``turn`` (rerope_fwd._consumer_pp has the argument)."""
    dtype: gl.constexpr = q_smem.dtype
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(ME), 1 - ME)
    k_tile = k_smem.index(0)
    qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - ME), count=1)
    qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_smem, k_tile))
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, 0, m0, 0 >= n_full, qk_scale, BLOCK_M, BLOCK_N, s_layout)

    for i in range(1, n_tiles):
        s = i % STAGES
        sp = (i - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(ME), (i & 1) ^ (1 - ME))
        k_tile = k_smem.index(s)
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp), ((i - 1) // STAGES) & 1)
        v_tile = v_smem.index(sp)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - ME), count=1)
        # wgmma groups retire in order: with one left outstanding, S_i (issued first) is done
        qk, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_smem, k_tile))
        p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, i, m0, i >= n_full, qk_scale, BLOCK_M, BLOCK_N, s_layout)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
        gl.thread_barrier()
        mbarrier.arrive(kv_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

    last = n_tiles - 1
    sl = last % STAGES
    mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
    v_tile = v_smem.index(sl)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile))
    gl.thread_barrier()
    mbarrier.arrive(kv_empty.index(sl), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, q_row, m0,
              n_full, n_tiles, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
              STORE_LSE: gl.constexpr, PIPE: gl.constexpr, ME: gl.constexpr, PINGPONG: gl.constexpr):
    # wgmma accumulator layouts: instr_shape [m=16, n, k=256/16bit]; warps tile M (16 rows each,
    # 4 warps = one warp group = 64 rows).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    if PIPE:
        acc, m_i, l_i = _loop_pipelined(acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, turn,
                                        m0, n_full, n_tiles, qk_scale, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout,
                                        ME, PINGPONG)
    else:
        for i in range(0, n_full):  # tiles wholly below the diagonal: no mask
            acc, m_i, l_i = _tile(i, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, m0,
                                  qk_scale, BLOCK_M, BLOCK_N, STAGES, False, s_layout, o_layout, ME, PINGPONG)
        for i in range(n_full, n_tiles):  # diagonal tiles (for a lower sub-tile maybe one fully masked)
            acc, m_i, l_i = _tile(i, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, m0,
                                  qk_scale, BLOCK_M, BLOCK_N, STAGES, True, s_layout, o_layout, ME, PINGPONG)

    # epilogue: O / l through Q's shared buffer (Q is no longer read) and a TMA store
    _epilogue(acc, m_i, l_i, q_smem, o_desc, lse_ptr, q_row, BLOCK_M, STORE_LSE, s_layout, o_layout)


@gluon.jit
def _consumer_or_drain(N, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                       kv_empty, turn, q_row, m0, n_full, n_tiles, qk_scale,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                       STORE_LSE: gl.constexpr, PIPE: gl.constexpr, ME: gl.constexpr,
                       PINGPONG: gl.constexpr):
    """SPLIT=3's second and third consumer partitions: _consumer on rows [m0, m0 + BLOCK_M) if
    they lie in the sequence (N % 64 == 0: a 64-row sub-tile is all in or all out), else _drain."""
    if m0 < N:
        _consumer(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
                  q_row, m0, n_full, n_tiles, qk_scale, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                  CONSUMER_WARPS, STORE_LSE, PIPE, ME, PINGPONG)
    else:
        _drain(k_ready, kv_empty, n_tiles, STAGES)


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------
@gluon.jit
def attn_fwd_causal_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, N, qk_scale,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                           STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                           STORE_LSE: gl.constexpr, SPLIT: gl.constexpr, PIPE: gl.constexpr,
                           PINGPONG: gl.constexpr):
    """SPLIT=1: one consumer partition of CONSUMER_WARPS warps (= num_warps) on the whole BLOCK_M
    tile. SPLIT=2: two consumer partitions of 4 warps (num_warps=4: the default partition plus a
    4-warp worker), each with its own BLOCK_M/2-row Q sub-tile, sharing the K/V ring (kv_empty
    counts 2 arrivals) and free to drift apart, so one's softmax can overlap the other's wgmma
    (FA3's ping-pong without the explicit ordering barriers). q_desc / o_desc blocks are
    [BLOCK_M // SPLIT, HEAD_D]. PIPE=1: the consumers overlap softmax i with the PV wgmma of tile
    i-1 (_loop_pipelined). PINGPONG=1 (SPLIT=2; unmeasured): the two partitions' wgmma issues take
    turns through two ``turn`` mbarriers (FA3's warp-scheduler barriers; rerope_fwd._consumer_pp)."""
    m0, q_row, kv_row0, n_tiles = _block_rows(N, BLOCK_M, BLOCK_N, SPLIT == 3)
    SUB_M: gl.constexpr = BLOCK_M // SPLIT

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [SPLIT, SUB_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = _ring_barriers(STAGES, SPLIT)
    if PINGPONG:
        gl.static_assert(SPLIT == 2, "PINGPONG needs SPLIT=2")
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
    else:
        turn = kv_empty  # not used

    # Triton 3.6 signature: warp_specialize(functions_and_args, worker_num_warps, worker_num_regs);
    # the first (function, args) pair is the default partition (runs in the kernel's num_warps).
    if SPLIT == 1:
        gl.warp_specialize(
            [
                (_consumer, (o_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                             turn, q_row, m0, m0 // BLOCK_N, n_tiles, qk_scale, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                             CONSUMER_WARPS, STORE_LSE, PIPE, 0, 0)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                             q_row, kv_row0, n_tiles, BLOCK_N, STAGES, SPLIT)),
            ],
            [1],  # worker_num_warps
            [24],  # worker_num_regs
        )
    elif SPLIT == 2:
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=2: two 4-warp consumer partitions")
        gl.warp_specialize(
            [
                (_consumer, (o_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                             turn, q_row, m0, m0 // BLOCK_N, n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D, STAGES, 4,
                             STORE_LSE, PIPE, 0, PINGPONG)),
                (_consumer, (o_desc, lse_ptr, q_smem.index(1), k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                             turn, q_row + SUB_M, m0 + SUB_M, (m0 + SUB_M) // BLOCK_N, n_tiles, qk_scale, SUB_M,
                             BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, PIPE, 1, PINGPONG)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                             q_row, kv_row0, n_tiles, BLOCK_N, STAGES, SPLIT)),
            ],
            [4, 1],  # worker_num_warps
            [240, 24],  # worker_num_regs
        )
    else:
        # FA3's head-dim-64 tiling: three 4-warp consumer partitions of 64 rows (BLOCK_M 192). The
        # first sub-tile always lies in the sequence; the others drain the ring where they do not.
        gl.static_assert(SPLIT == 3, "SPLIT is 1, 2 or 3")
        gl.static_assert(CONSUMER_WARPS == 4, "SPLIT=3: three 4-warp consumer partitions")
        q_last = kv_row0 + N - SUB_M
        m1 = m0 + SUB_M
        m2 = m0 + 2 * SUB_M
        gl.warp_specialize(
            [
                (_consumer, (o_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, q_bar, k_ready,
                             v_ready, kv_empty, turn, q_row, m0, m0 // BLOCK_N, n_tiles, qk_scale,
                             SUB_M, BLOCK_N, HEAD_D, STAGES, 4, STORE_LSE, PIPE, 0, 0)),
                (_consumer_or_drain, (N, o_desc, lse_ptr, q_smem.index(1), k_smem, v_smem, q_bar,
                                      k_ready, v_ready, kv_empty, turn, q_row + SUB_M, m1,
                                      m1 // BLOCK_N, n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D,
                                      STAGES, 4, STORE_LSE, PIPE, 1, 0)),
                (_consumer_or_drain, (N, o_desc, lse_ptr, q_smem.index(2), k_smem, v_smem, q_bar,
                                      k_ready, v_ready, kv_empty, turn, q_row + 2 * SUB_M, m2,
                                      m2 // BLOCK_N, n_tiles, qk_scale, SUB_M, BLOCK_N, HEAD_D,
                                      STAGES, 4, STORE_LSE, PIPE, 2, 0)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                             v_ready, kv_empty, q_row, kv_row0, n_tiles, BLOCK_N, STAGES, SPLIT,
                             q_last)),
            ],
            [4, 4, 1],  # worker_num_warps
            [SPLIT3_REGS, SPLIT3_REGS, 24],  # worker_num_regs (the default partition gets the rest)
        )

    _invalidate_ring(q_bar, k_ready, v_ready, kv_empty, STAGES)
    if PINGPONG:
        mbarrier.invalidate(turn.index(0))
        mbarrier.invalidate(turn.index(1))


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------
def default_config(head_dim):
    """(BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE) — FA3's tile sizes for the causal
    forward; one 8-warp consumer partition (two warp groups in lockstep) on a 128-row Q tile, the
    simple (unpipelined) loop."""
    if head_dim in (64, 128):
        return 128, 128, 2, 8, 1, 0
    raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")


# Variants the device script also checks and times. SPLIT=2: two 4-warp consumer partitions;
# PIPE=1: softmax overlapped with the previous tile's PV wgmma.
EXTRA_CONFIGS = {
    64: [(64, 128, 2, 4, 1, 0), (128, 128, 3, 8, 1, 0), (128, 128, 2, 4, 2, 0), (128, 128, 3, 4, 2, 0),
         (128, 128, 3, 8, 1, 1), (128, 128, 3, 4, 2, 1)],
    128: [(64, 128, 2, 4, 1, 0), (128, 128, 3, 8, 1, 0), (128, 128, 2, 4, 2, 0), (128, 64, 3, 8, 1, 0),
          (128, 128, 2, 8, 1, 1), (128, 128, 3, 8, 1, 1), (128, 128, 2, 4, 2, 1)],
}
# PINGPONG (unmeasured): the eighth field, as in rerope_fwd's config (the seventh, BAND_TWICE there,
# must be 0 here): the SPLIT=2 configs with ordered wgmma sections, without / with PIPE.
EXTRA_CONFIGS[64] += [(128, 128, 2, 4, 2, 0, 0, 1), (128, 128, 2, 4, 2, 1, 0, 1)]
EXTRA_CONFIGS[128] += [(128, 128, 2, 4, 2, 0, 0, 1), (128, 128, 2, 4, 2, 1, 0, 1)]
# SPLIT=3 (unmeasured): FA3's head-dim-64 tiling, BLOCK_M 192 as three 4-warp consumer partitions
# of 64 rows, 2 / 3 stages; D64 only. (PIPE=1 compiles too but spills at 160 registers: not listed.)
SPLIT3_CONFIGS = [(192, 128, 2, 4, 3, 0), (192, 128, 3, 4, 3, 0)]
EXTRA_CONFIGS[64] += SPLIT3_CONFIGS


def pingpong(config):
    """The eighth config field PINGPONG (0 when absent; the seventh must be 0 in plain_fwd)."""
    assert len(config) <= 6 or int(config[6]) == 0, "plain_fwd has no BAND_TWICE (seventh field 0)"
    return int(config[7]) if len(config) > 7 else 0

def attention(q, k, v, sm_scale=None, return_lse=False, config=None, _warmup=False):
    """Causal attention forward. q, k, v: (B, H, N, D), fp16/bf16, D in {64, 128}; same shapes;
    N % 128 == 0 (check_n). ``_warmup``: only JIT-compile (Triton's on-disk cache), return None."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, N, D = q.shape
    assert k.shape == q.shape and v.shape == q.shape, "prototype: same shapes for q, k, v (no GQA)"
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
    config = tuple(config or default_config(D))
    BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE = config[:6]
    PINGPONG = pingpong(config)
    assert PINGPONG == 0 or SPLIT == 2, "PINGPONG=1 needs SPLIT=2"
    assert BLOCK_M == 16 * CONSUMER_WARPS * SPLIT, "one 16-row wgmma slab per warp (64 rows per warp group)"
    SUB_M = BLOCK_M // SPLIT
    check_n(N, config)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    q2, k2, v2 = (t.contiguous().view(B * H * N, D) for t in (q, k, v))
    o = torch.empty_like(q2)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32) if return_lse else o
    gdt = _gl_dtype(q.dtype)
    q_layout = smem_layout([SUB_M, D], gdt)
    kv_layout = smem_layout([BLOCK_N, D], gdt)
    q_desc = TensorDescriptor.from_tensor(q2, [SUB_M, D], q_layout)
    o_desc = TensorDescriptor.from_tensor(o, [SUB_M, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, D], kv_layout)
    grid = (triton.cdiv(N, BLOCK_M), B * H)
    args = (q_desc, k_desc, v_desc, o_desc, lse, N, sm_scale * LOG2E, BLOCK_M, BLOCK_N, D, STAGES,
            CONSUMER_WARPS, return_lse, SPLIT, PIPE, PINGPONG)
    if _warmup:
        attn_fwd_causal_kernel.warmup(*args, grid=grid, num_warps=CONSUMER_WARPS)
        return None
    attn_fwd_causal_kernel[grid](*args, num_warps=CONSUMER_WARPS)
    o = o.view(B, H, N, D)
    return (o, lse) if return_lse else o
