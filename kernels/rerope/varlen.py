"""Packed variable-length ReRoPE: the serving engines' prefill, FlashAttention's varlen layout.

A serving engine hands attention a token-major packed batch: ``q`` ``(total_q, Hq, D)``, ``k,
v`` ``(total_k, Hkv, D)`` and cumulative lengths ``cu_seqlens_q``, ``cu_seqlens_k`` ``(B + 1,)``
(``flash_attn_varlen_func``'s convention; vLLM's ``query_start_loc``). Sequence ``b``'s queries
are the last ``Lq_b`` of its ``Lk_b`` positions: a whole prompt (``Lq_b = Lk_b``) or a chunk
after a cached prefix (chunked prefill, prefix caching).

The kernels here are thin entry points over the rectangular kernels' own per-program work
(:func:`rerope.forward._fwd_rows`, :func:`rerope.backward._dq_rows`,
:func:`rerope.backward._dkdv_rows`): a program reads its sequence's start and length from the
cumulative lengths, moves the base pointers to the sequence's first row and runs the same code
as a ``(1, H, L, D)`` call of :func:`rerope.rerope` would — one copy of the math. Programs past
a sequence's end return at once; the grid is sized by ``max_seqlen_*``.

Paged keys (``block_table``): the forward reads keys and values from the page pool in place,
as :func:`rerope.rerope_decode` does: each key tile's rows are found through the sequence's
block-table row (:func:`rerope.forward._paged_tile`: one table entry per tile when a page holds
whole tiles, one per page when a tile holds a few whole pages, else one per key), the
rotations at the keys' logical positions. Keys pre-turned before the kernel (long sequences,
:func:`turn_keys`) are read from the pool once and written packed, as ``k`` would be.
"""

import functools
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from ._validate import (KERNEL_DTYPES, as_frequencies, check_alike, check_block_table,
                        check_flag, check_int32)
from .attention import (_arg_key, _first_order_only, _lifted, _needs_grad, _use_tma,
                        fused_settings, heads_first)
from .attention import preturn_keys as _rectangular_preturn
from .backward import _bwd_delta_kernel, _dkdv_rows, _dq_rows
from .caches import CACHE_SIZE, LRUCache
from .forward import _fwd_rows, _key_rows, _program, _tile_pages
from .launch import Launcher, _capability, _ensure_scratch_allocator
from .online_softmax import LOG2E, natural_lse
from .rotary import _turn_operand
from .runtime import INTERPRET

# --- the entry kernels ---------------------------------------------------------------------


@triton.jit
def _spans(Cu, batch):
    """``(q0, n_q, k0, n_k)`` of sequence ``batch``: its first query row and query count,
    its first key row and key count, from ``Cu``, the cumulative lengths ``(cu_seqlens_q,
    cu_seqlens_k)``."""
    q0 = tl.load(Cu[0] + batch)
    n_q = tl.load(Cu[0] + batch + 1) - q0
    k0 = tl.load(Cu[1] + batch)
    n_k = tl.load(Cu[1] + batch + 1) - k0
    return q0.to(tl.int64), n_q, k0.to(tl.int64), n_k


@triton.jit
def _rows_of(X, first, strides, PAGED: tl.constexpr):
    """``X`` moved to a sequence's first row ``first``; a page pool (``PAGED``) stays at
    page 0, its rows found through the block table."""
    if PAGED:
        return X
    else:
        return X + first * strides[2]


@triton.jit(do_not_specialize=["total_q", "total_k", "max_seqlen_q", "max_seqlen_k"])
def _varlen_fwd_kernel(
    Q, K1, K2, V, Out, Lse, Tables, Cu, Pages, sq, sk1, sk2, sv, so,
    n_heads, q_per_kv, total_q, total_k, max_seqlen_q, max_seqlen_k, window,
    qk_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, HEADS_FIRST: tl.constexpr,
    LOGN: tl.constexpr, INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_q, BLOCK_M), B · Hq)``, or ``(B · Hq, cdiv(max_seqlen_q,
    BLOCK_M))`` with ``HEADS_FIRST`` (:func:`rerope.forward._program`; the same rule as
    :func:`rerope.rerope`'s, on ``max_seqlen_k``). ``Q``, ``Out`` ``(total_q, Hq, D)``,
    ``K1, K2, V`` ``(total_k, Hkv, D)`` (strides as ``(0, head, row, dim)``): the
    model's ``k`` for both products, or a product's keys pre-turned where its
    ``TURN_KEYS`` flag is off (:func:`turn_keys`); ``Lse`` ``(Hq, total_q)`` log2 units.
    A sequence whose lengths are out of range (``Lq > Lk``, above ``max_seqlen_*``, rows
    outside the tensors) gets NaN rows (no host check on a GPU).

    Paged (``PAGE_SIZE > 0``): ``V`` and the keys not pre-turned are page pools
    ``(num_blocks, PAGE_SIZE, Hkv, D)`` (strides as ``(page, head, slot, dim)``) read in
    place through ``Pages``, ``(block_table, its two strides, num_blocks)`` (with ``TMA``,
    one copy per tile where a page holds whole tiles); pre-turned keys are packed as ``k``
    would be (``total_k`` rows, sequence ``b`` from ``cu_seqlens_k[b]``). ``0``: ``Pages``
    is not read."""
    PAGED: tl.constexpr = PAGE_SIZE > 0
    bh, block, n_blocks = _program(HEADS_FIRST)
    if CAUSAL:   # the last query blocks have the most keys: start them first
        block = n_blocks - 1 - block
    batch = bh // n_heads
    head = bh % n_heads
    q0, n_q, k0, n_k = _spans(Cu, batch)
    start_m = block * BLOCK_M
    bad = ((n_q < 0) | (n_q > n_k) | (n_q > max_seqlen_q) | (n_k > max_seqlen_k)
           | (q0 < 0) | (q0 + n_q > total_q) | (k0 < 0) | (k0 + n_k > total_k))
    if bad:                       # poison what rows of Out this sequence may own
        rows = q0 + start_m + tl.arange(0, BLOCK_M)
        ok = (rows >= 0) & (rows < total_q) & (start_m + tl.arange(0, BLOCK_M)
                                                < tl.minimum(tl.maximum(n_q, 0),
                                                             max_seqlen_q))
        dims = tl.arange(0, HEAD_DIM)
        nan = tl.full([BLOCK_M, HEAD_DIM], float("nan"), tl.float32)
        tl.store(Out + head * so[1] + rows[:, None] * so[2] + dims[None, :] * so[3],
                 nan.to(Out.dtype.element_ty), mask=ok[:, None])
        tl.store(Lse + head.to(tl.int64) * total_q + rows,
                 tl.full([BLOCK_M], float("nan"), tl.float32), mask=ok)
    elif start_m < n_q:
        zero = batch * 0
        pages = ((Pages[0] + batch.to(tl.int64) * Pages[1], Pages[2], Pages[3]) if PAGED
                 else None)       # this sequence's block-table row
        # a product's keys are pre-turned (packed, not paged) where TURN_KEYS != TURN
        K1 = _rows_of(K1, k0, sk1, PAGED and INSIDE_FLAGS[2] == INSIDE_FLAGS[0])
        K2 = _rows_of(K2, k0, sk2, PAGED and OUTSIDE_FLAGS[2] == OUTSIDE_FLAGS[0])
        _fwd_rows(Q + q0 * sq[2], Q, K1, K2, _rows_of(V, k0, sv, PAGED), Out + q0 * so[2],
                  Lse + head.to(tl.int64) * total_q + q0, Tables, pages, sq, sq, sk1, sk2,
                  sv, so, zero, head, head // q_per_kv, start_m, n_q, n_k, window,
                  qk_scale, logn_factor, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, TMA, LOGN,
                  INSIDE_FLAGS, OUTSIDE_FLAGS, PAGE_SIZE)


@triton.jit(do_not_specialize=["total_q", "total_k"])
def _varlen_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Tables, Cu, sq, sk, sv, sdo,
    n_heads, q_per_kv, total_q, total_k, window, qk_scale, sm_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, HEADS_FIRST: tl.constexpr,
    LOGN: tl.constexpr, INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_q, BLOCK_M), B · Hq)``: :func:`rerope.backward._dq_rows` of
    one sequence's query block. ``Lse``, ``Delta`` ``(Hq, total_q)``; ``DQ`` contiguous
    ``(Hq, total_q, D)``."""
    bh, block, n_blocks = _program(HEADS_FIRST)
    if CAUSAL:
        block = n_blocks - 1 - block
    batch = bh // n_heads
    head = bh % n_heads
    q0, n_q, k0, n_k = _spans(Cu, batch)
    start_m = block * BLOCK_M
    if start_m < n_q:
        zero = batch * 0
        stats = head.to(tl.int64) * total_q + q0
        _dq_rows(Q + q0 * sq[2], Q, K + k0 * sk[2], K, V + k0 * sv[2], DO + q0 * sdo[2],
                 Lse + stats, Delta + stats, DQ + stats * HEAD_DIM, DQ + stats * HEAD_DIM,
                 Tables, sq, sq, sk, sk, sv, sdo, zero, head, head // q_per_kv, start_m,
                 n_q, n_k, window, qk_scale, sm_scale, logn_factor, HEAD_DIM, BLOCK_M,
                 BLOCK_N, CAUSAL, TMA, LOGN, INSIDE_FLAGS, OUTSIDE_FLAGS, False)


@triton.jit(do_not_specialize=["total_q", "total_k"])
def _varlen_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, Tables, Cu, sq, sk, sv, sdo,
    n_heads, q_per_kv, total_q, total_k, window, qk_scale, sm_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, HEADS_FIRST: tl.constexpr,
    LOGN: tl.constexpr, INSIDE_FLAGS: tl.constexpr, OUTSIDE_FLAGS: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_k, BLOCK_N), B · Hkv)``: :func:`rerope.backward._dkdv_rows`
    of one sequence's key block, for every query head of its group. ``DK, DV`` contiguous
    ``(Hkv, total_k, D)``."""
    bh, block, _ = _program(HEADS_FIRST)
    n_kv_heads = n_heads // q_per_kv
    batch = bh // n_kv_heads
    kv_head = bh % n_kv_heads
    q0, n_q, k0, n_k = _spans(Cu, batch)
    start_n = block * BLOCK_N
    if start_n < n_k:
        zero = batch * 0
        grads = (kv_head.to(tl.int64) * total_k + k0) * HEAD_DIM
        _dkdv_rows(Q + q0 * sq[2], Q, K + k0 * sk[2], K, V + k0 * sv[2], DO + q0 * sdo[2],
                   Lse + q0, Delta + q0, DK + grads, DK + grads, DV + grads, Tables,
                   sq, sq, sk, sk, sv, sdo, zero, kv_head, start_n, total_q, q_per_kv,
                   n_q, n_k, window, qk_scale, sm_scale, logn_factor, HEAD_DIM, BLOCK_M,
                   BLOCK_N, CAUSAL, TMA, LOGN, INSIDE_FLAGS, OUTSIDE_FLAGS, False)


@triton.jit(do_not_specialize=["total_k"])
def _varlen_turn_keys_kernel(K, Out1, Out2, Tables, CuK, Pages, sk, n_heads, total_k,
                             HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                             FIRST: tl.constexpr, SECOND: tl.constexpr,
                             PAGE_SIZE: tl.constexpr):
    """Grid ``(B · Hkv, cdiv(max_seqlen_k, BLOCK))``: rows of one key head of one sequence
    read once and turned for each product that pre-turns its keys (``FIRST`` / ``SECOND``:
    ``None``, or ``(TURN, SHIFT)`` of the inside / outside product; ``Tables`` as the
    forward's), by :func:`rerope.rotary._turn_operand` at their positions within their
    sequence, the arithmetic of the turn in registers: stored to ``Out1`` / ``Out2``,
    contiguous ``(total_k, Hkv, D)``, packed as ``k`` (sequence ``b`` from
    ``cu_seqlens_k[b]``; rows past ``total_k`` are not written). ``PAGE_SIZE > 0``: ``K``
    is a page pool read in place through ``Pages`` as the forward reads it
    (:func:`rerope.forward._paged_tile`); a key on a page outside the pool reads 0 (the
    forward makes its rows NaN)."""
    batch = tl.program_id(0) // n_heads
    head = tl.program_id(0) % n_heads
    _, _, k0, n_k = _spans((CuK, CuK), batch)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = (rows < n_k) & (k0 + rows < total_k)
    if PAGE_SIZE > 0:
        table = (Pages[0] + batch.to(tl.int64) * Pages[1], Pages[2], sk[0], sk[0], Pages[3])
        page = _tile_pages(table, tl.program_id(1) * BLOCK, n_k, BLOCK, PAGE_SIZE)
        src_rows, _, on_pool = _key_rows(table, page, rows, sk[2], sk[2], BLOCK, PAGE_SIZE)
        keep = keep & on_pool
    else:
        src_rows = (k0 + rows.to(tl.int64)) * sk[2]
    keep = keep[:, None]
    half = tl.arange(0, HEAD_DIM // 2)[None, :]
    src = K + head.to(tl.int64) * sk[1] + src_rows[:, None]
    a = tl.load(src + half * sk[3], mask=keep, other=0.0)
    b = tl.load(src + (half + HEAD_DIM // 2) * sk[3], mask=keep, other=0.0)
    dst = ((k0 + rows.to(tl.int64))[:, None] * n_heads + head) * HEAD_DIM + half
    if FIRST is not None:
        a1, b1 = _turn_operand(a, b, rows, (Tables[0], Tables[1]), 0.0, FIRST, False,
                               HEAD_DIM // 2)
        tl.store(Out1 + dst, a1, mask=keep)
        tl.store(Out1 + dst + HEAD_DIM // 2, b1, mask=keep)
    if SECOND is not None:
        a2, b2 = _turn_operand(a, b, rows, (Tables[2], Tables[3]), 0.0, SECOND, False,
                               HEAD_DIM // 2)
        tl.store(Out2 + dst, a2, mask=keep)
        tl.store(Out2 + dst + HEAD_DIM // 2, b2, mask=keep)


_KERNELS = {"fwd": _varlen_fwd_kernel, "dq": _varlen_dq_kernel, "dkdv": _varlen_dkdv_kernel}


@functools.lru_cache(maxsize=CACHE_SIZE)
def _autotuned(kernel, head_dim, capability, elem_bytes, autotune=True):
    """A varlen kernel wrapped in ``triton.autotune`` over the rectangular kernel's
    configurations for the fused form (:func:`rerope.configs.launch_configs`: the same
    per-program work, the same shared memory). Tuned once per head dim and flags, not per
    length: the lengths change with every serving step."""
    return triton.autotune(
        configs=configs.launch_configs(kernel, head_dim, capability, elem_bytes, True,
                                       autotune),
        key=["HEAD_DIM", "CAUSAL", "LOGN"] + (["PAGE_SIZE"] if kernel == "fwd" else []),
    )(_KERNELS[kernel])


_LAUNCHERS = LRUCache()


def _launch(kernel, blocks_of, rows, programs, args, config, **constexprs):
    """Launch a varlen kernel over ``(cdiv(rows, meta[blocks_of]), programs)``, or
    ``(programs, cdiv(rows, meta[blocks_of]))`` with the constexpr ``HEADS_FIRST``: autotuned
    on a GPU, the interpreter's configuration on CPU; the :class:`rerope.launch.Launcher`
    is kept per launch shape and argument kinds (:func:`rerope.attention._arg_key`: ints
    by value, since Triton specialises on them)."""

    def grid(blocks):
        return (programs, blocks) if constexprs["HEADS_FIRST"] else (blocks, programs)

    key = (kernel, rows, programs, config.autotune, tuple(constexprs.items()),
           tuple(map(_arg_key, args)))
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        if INTERPRET:
            meta = configs.INTERPRETER_CONFIG
            launcher = Launcher(_KERNELS[kernel], grid(triton.cdiv(rows, meta[blocks_of])),
                                **constexprs, **meta)
        else:
            if constexprs["TMA"]:
                _ensure_scratch_allocator()
            tuned = _autotuned(kernel, constexprs["HEAD_DIM"], _capability(args[0].device),
                               args[0].element_size(), config.autotune)
            launcher = Launcher(tuned, lambda meta: grid(triton.cdiv(rows, meta[blocks_of])),
                                **constexprs)
        _LAUNCHERS.put(key, launcher)
    launcher(*args)


# --- checks ------------------------------------------------------------------------------


def _check_tensor(name, t, rank, shape_text):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {shape_text}, got shape "
                         f"{tuple(t.shape)}")


def _check_max_seqlen(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_cu_seqlens(name, cu, device, batch=None):
    check_int32(name, cu, lambda shape: len(shape) == 1 and shape[0] >= 2,
                "(B + 1,) with B >= 1 (cumulative sequence lengths starting at 0)", device)
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} has {cu.shape[0]} entries but cu_seqlens_q has "
                         f"{batch + 1}: one entry per sequence plus one")


def _check_lengths_on_host(cu_q, cu_k, max_q, max_k, total_q, total_k):
    """The cumulative lengths' values (CPU tensors: no sync): start at 0, never decrease,
    ``Lq_b <= Lk_b``, within the ``max_seqlen_*``, ending at the tensors' row counts
    (``total_k`` ``None``: paged, no such bound)."""
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if int(cu[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
        steps = cu[1:] - cu[:-1]
        if bool((steps < 0).any()):
            b = int((steps < 0).nonzero()[0])
            raise ValueError(f"{name} must not decrease (cumulative lengths), but "
                             f"{name}[{b + 1}] = {int(cu[b + 1])} < {name}[{b}] = "
                             f"{int(cu[b])}")
        if total is not None and int(cu[-1]) != total:
            what = "q" if name.endswith("q") else "k"
            raise ValueError(f"{name}[-1] = {int(cu[-1])} does not match {what}'s "
                             f"{total} rows (total_{what})")
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    for name, lengths, most in (("max_seqlen_q", len_q, max_q), ("max_seqlen_k", len_k, max_k)):
        if bool((lengths > most).any()):
            b = int((lengths > most).nonzero()[0])
            raise ValueError(f"{name} = {most} is too small: sequence {b} has "
                             f"{int(lengths[b])}")
    longer = len_q > len_k
    if bool(longer.any()):
        b = int(longer.nonzero()[0])
        raise ValueError(f"sequence {b} has {int(len_q[b])} queries (cu_seqlens_q) but "
                         f"{int(len_k[b])} keys (cu_seqlens_k): its queries are the last "
                         "of its key positions, so Lq <= Lk is needed")


def _check_pages_on_host(block_table, lengths, page_size, num_blocks):
    """Every entry a sequence's keys use (``j < cdiv(Lk_b, block_size)``) names a page of
    the pool (CPU tensors only)."""
    starts = torch.arange(block_table.shape[1])[None, :] * page_size
    bad = (starts < lengths[:, None].long()) & ((block_table < 0)
                                                | (block_table >= num_blocks))
    if bool(bad.any()):
        row, entry = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {entry}] = {int(block_table[row, entry])} is not a page of "
            f"the pool: k and v have num_blocks = {num_blocks} pages, and sequence {row} "
            f"uses entries 0 to {-(-int(lengths[row]) // page_size) - 1}")


def _check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, block_table):
    """Every argument's type, shape and dtype; the values of the cumulative lengths and the
    block table where they are on the CPU. Returns ``(B, Hq, Hkv, D)``."""
    _check_tensor("q", q, 3, "(total_q, Hq, D)")
    paged = block_table is not None
    kv_rank, kv_text = (4, "(num_blocks, block_size, Hkv, D)") if paged else (
        3, "(total_k, Hkv, D)")
    _check_tensor("k", k, kv_rank, kv_text)
    _check_tensor("v", v, kv_rank, kv_text)
    check_alike({"q": q, "k": k, "v": v})
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q has unsupported dtype {q.dtype}; expected one of "
                        f"{', '.join(str(d) for d in KERNEL_DTYPES)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v disagree: k has shape {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv, d_k = k.shape[-2], k.shape[-1]
    if d_k != d:
        raise ValueError(f"k has head dim {d_k}, expected {d} like q")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    _check_max_seqlen("max_seqlen_q", max_q)
    _check_max_seqlen("max_seqlen_k", max_k)
    _check_cu_seqlens("cu_seqlens_q", cu_q, q.device)
    batch = cu_q.shape[0] - 1
    _check_cu_seqlens("cu_seqlens_k", cu_k, q.device, batch)
    if paged:
        check_block_table(block_table, batch, q.device)
        if k.shape[0] < 1:
            raise ValueError("k and v have no pages (num_blocks = 0)")
        capacity = block_table.shape[1] * k.shape[1]
        if max_k > capacity:
            raise ValueError(f"max_seqlen_k = {max_k} exceeds the block table's capacity "
                             f"{block_table.shape[1]} pages x {k.shape[1]} keys = "
                             f"{capacity}")
    if cu_q.device.type == "cpu" and cu_k.device.type == "cpu":
        _check_lengths_on_host(cu_q, cu_k, max_q, max_k, q.shape[0],
                               None if paged else k.shape[0])
        if paged and block_table.device.type == "cpu":
            _check_pages_on_host(block_table, cu_k[1:] - cu_k[:-1], k.shape[1], k.shape[0])
    return batch, hq, hkv, d


# --- plan, launches, autograd ----------------------------------------------------------------


@dataclass(frozen=True)
class VarlenPlan:
    """A checked ``rerope_varlen`` call's settings (:func:`rerope.attention.fused_settings`:
    the same checks and rotation operands as :func:`rerope.rerope`, tables for
    ``max_seqlen_k`` positions)."""

    config: configs.Config
    window: int
    causal: bool
    scale: float
    operands: object
    lift: bool


_PLANS = LRUCache()


def table_rows(max_k):
    """The positions the rotation tables cover for a call of at most ``max_k`` keys per
    sequence: the next power of two (at least 256), so that a serving loop whose longest
    sequence grows by a token per step keeps its plan and tables."""
    return max(256, 1 << (int(max_k) - 1).bit_length())


def _plan(q, max_k, settings):
    config = configs.current()
    max_k = table_rows(max_k)
    try:
        key = (q.dtype, q.device, q.shape[-1], max_k, settings, tuple(map(type, settings)),
               config)
        plan = _PLANS.get(key)
    except TypeError:                     # unhashable settings: the checks say what is wrong
        key, plan = None, None
    if plan is None:
        window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq, group = settings
        window, scale, _, operands = fused_settings(
            q, max_k, window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq,
            group)
        plan = VarlenPlan(config, window, causal, scale, operands, _lifted(q))
        if key is not None:
            _PLANS.put(key, plan)
    return plan


def _views(*tensors):
    """The ``(batch, head, row, dim)`` strides the kernels index, of ``(rows, H, D)``
    tensors: no batch stride (the sequence's first row moves the base pointer); of
    ``(num_blocks, block_size, H, D)`` page pools, ``(page, head, slot, dim)``."""
    return [(0, t.stride(1), t.stride(0), t.stride(2)) if t.dim() == 3 else
            (t.stride(0), t.stride(2), t.stride(1), t.stride(3)) for t in tensors]


def _flags(operands):
    f = operands.flags
    return dict(LOGN=operands.logn_factor != 0.0,
                INSIDE_FLAGS=(f["TURN_IN"], f["SHIFT_IN"], f["TURN_IN"]),
                OUTSIDE_FLAGS=(f["TURN_OUT"], f["SHIFT_OUT"], f["TURN_OUT"]))


def _tma(plan, *tensors):
    """TMA descriptors as the rectangular kernels decide them, on ``(1, H, rows, D)``
    views of the packed tensors (every sequence's first row then is aligned too: rows are
    ``H · D`` elements apart)."""
    return _use_tma(plan.config.tma, *(t.transpose(0, 1)[None] for t in tensors))


def preturn_keys(max_q, max_k, q_per_kv, config):
    """Whether the forward turns a product's keys once before the kernel
    (:func:`turn_keys`), as :func:`rerope.attention.preturn_keys` decides for one sequence of
    ``max_seqlen_k`` keys and ``max_seqlen_q`` queries (the longest sequence dominates the
    call's time)."""
    return _rectangular_preturn(max_k, max_q, q_per_kv, config)


def turn_keys(k, cu_k, max_k, operands, outside=True, block_table=None):
    """``(k1, k2)``: each product's keys turned once at their positions within their
    sequence where that product turns keys (a new contiguous ``(total_k, Hkv, D)`` tensor,
    packed as ``k``), else ``k`` itself; the outside product's only where it has a tile
    (``outside``: some sequence has more keys than the window). Paged (``block_table``):
    ``k`` is the page pool, read in place, and the turned keys are packed by
    ``cu_k`` into ``B · max_k`` rows (no host sync for ``cu_k[-1]``)."""
    f = operands.flags
    first = (True, False) if f["TURN_IN"] else None
    second = (True, False) if f["TURN_OUT"] and outside else None
    if first is None and second is None:
        return k, k
    batch = cu_k.shape[0] - 1
    hkv, d = k.shape[-2], k.shape[-1]
    rows = k.shape[0] if block_table is None else batch * max_k
    outs = [torch.empty(rows, hkv, d, dtype=k.dtype, device=k.device) if p is not None
            else k for p in (first, second)]
    pages, page_size = _pages(k, block_table)
    grid = (batch * hkv, triton.cdiv(max_k, 64))
    _varlen_turn_keys_kernel[grid](k, outs[0], outs[1], operands.tables, cu_k, pages,
                                   _views(k)[0], hkv, rows, HEAD_DIM=d, BLOCK=64,
                                   FIRST=first, SECOND=second, PAGE_SIZE=page_size)
    return outs[0], outs[1]


def _pages(k, block_table):
    """``(Pages, PAGE_SIZE)`` as the kernels take them: ``(block_table, its strides,
    num_blocks)`` and the pool's ``block_size``, or ``(None, 0)`` for contiguous keys."""
    if block_table is None:
        return None, 0
    return (block_table, *block_table.stride(), k.shape[0]), k.shape[1]


def _pool_rows(t):
    """A page pool ``(num_blocks, block_size, H, D)`` as the ``(rows, H, D)`` tensor a TMA
    descriptor over it spans (row ``page · block_size + slot``), or ``None`` where its
    pages are not ``block_size`` slots apart; a ``(rows, H, D)`` tensor as it is."""
    if t.dim() == 3:
        return t
    if t.stride(0) != t.shape[1] * t.stride(1):
        return None
    return t.as_strided((t.shape[0] * t.shape[1], *t.shape[2:]), t.stride()[1:])


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, plan, preturn=None, block_table=None):
    """Launch the forward; ``(out, lse)``, ``lse`` ``(Hq, total_q)`` in log2 units.
    ``preturn``: whether products that turn keys get them turned once first (``None``:
    :func:`preturn_keys`). ``block_table``: ``k, v`` are page pools, read in place."""
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    batch = cu_q.shape[0] - 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    operands = plan.operands
    flags = _flags(operands)
    if preturn is None:
        preturn = preturn_keys(max_q, max_k, hq // hkv, plan.config)
    k1 = k2 = k
    if preturn and (operands.flags["TURN_IN"] or operands.flags["TURN_OUT"]):
        k1, k2 = turn_keys(k, cu_k, max_k, operands, max_k > plan.window, block_table)
        inside, outside = flags["INSIDE_FLAGS"], flags["OUTSIDE_FLAGS"]
        flags.update(INSIDE_FLAGS=(*inside[:2], inside[2] and k1 is k),
                     OUTSIDE_FLAGS=(*outside[:2], outside[2] and k2 is k))
    pages, page_size = _pages(k, block_table)
    if block_table is None:
        total_k, tma = k.shape[0], _tma(plan, q, k1, k2, v)
    else:      # pools as (page, head, slot, dim); pre-turned keys packed in B · max_k rows
        total_k = batch * max_k
        rows = [_pool_rows(t) for t in (k1, k2, v)]
        tma = all(r is not None for r in rows) and _tma(plan, q, *rows)
    args = [q, k1, k2, v, out, lse, operands.tables, (cu_q, cu_k), pages,
            *_views(q, k1, k2, v, out), hq, hq // hkv, total_q, total_k, max_q, max_k,
            plan.window, plan.scale * LOG2E, operands.logn_factor]
    _launch("fwd", "BLOCK_M", max_q, batch * hq, args, plan.config, HEAD_DIM=d,
            CAUSAL=plan.causal, TMA=tma,
            HEADS_FIRST=heads_first(max_k, batch * hq, plan.config), PAGE_SIZE=page_size,
            **flags)
    return out, lse


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, plan):
    """The three backward launches; ``(dq, dk, dv)`` in the inputs' layouts' shapes."""
    total_q, hq, d = q.shape
    total_k, hkv = k.shape[0], k.shape[1]
    batch = cu_q.shape[0] - 1
    dout = dout.contiguous()
    delta = torch.empty_like(lse)
    # heads-major gradients: each (sequence, head)'s rows are one contiguous (L, D) slice
    dq = torch.zeros(hq, total_q, d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(hkv, total_k, d, dtype=k.dtype, device=k.device)
    dv = torch.zeros(hkv, total_k, d, dtype=v.dtype, device=v.device)
    if total_q == 0:
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
    o4, do4 = out.transpose(0, 1)[None], dout.transpose(0, 1)[None]
    grid = (hq, triton.cdiv(total_q, configs.DELTA_BLOCK_M))
    _bwd_delta_kernel[grid](o4, do4, delta, o4.stride(), do4.stride(), hq, total_q,
                            HEAD_DIM=d, BLOCK_M=configs.DELTA_BLOCK_M)
    operands = plan.operands
    common = dict(HEAD_DIM=d, CAUSAL=plan.causal, TMA=_tma(plan, q, k, v, dout),
                  HEADS_FIRST=heads_first(max_k, batch * hq, plan.config),
                  **_flags(operands))
    tail = [operands.tables, (cu_q, cu_k), *_views(q, k, v, dout), hq, hq // hkv, total_q,
            total_k, plan.window, plan.scale * LOG2E, plan.scale, operands.logn_factor]
    _launch("dkdv", "BLOCK_N", max_k, batch * hkv,
            [q, k, v, dout, lse, delta, dk, dv, *tail], plan.config, **common)
    _launch("dq", "BLOCK_M", max_q, batch * hq, [q, k, v, dout, lse, delta, dq, *tail],
            plan.config, **common)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


class _VarlenAttention(torch.autograd.Function):
    """Autograd for the contiguous form (packed training): the forward saves ``out`` and
    the log2 log-sum-exp; the backward runs the two varlen gradient kernels."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, plan, return_lse):
        out, lse = _forward(q, k, v, cu_q, cu_k, max_q, max_k, plan)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, plan)
        if not return_lse:
            return out
        lse = natural_lse(lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, *_lse_grad):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, plan = ctx.args
        dq, dk, dv = _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, plan)
        return dq, dk, dv, None, None, None, None, None, None


@torch.compiler.disable
def rerope_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, *,
                  causal=True, sm_scale=None, base=10000.0, inv_freq=None, leaky=None,
                  logn_len=None, group=None, rotated=False, block_table=None,
                  return_lse=False):
    """(Leaky) ReRoPE or Self-Extend attention over a packed batch of variable-length
    sequences, FlashAttention's ``flash_attn_varlen_func`` layout; differentiable in ``q, k,
    v`` (contiguous form).

    Sequence ``b`` owns query rows ``cu_seqlens_q[b] … cu_seqlens_q[b+1] - 1`` (``Lq_b`` of
    them) and key rows ``cu_seqlens_k[b] … cu_seqlens_k[b+1] - 1`` (``Lk_b``), ``Lq_b <=
    Lk_b``. Its keys sit at positions ``0 … Lk_b - 1`` and its queries are the LAST ``Lq_b``
    of them: query ``n`` at position ``i = Lk_b - Lq_b + n`` (a whole prompt when ``Lq_b =
    Lk_b``; a prefill chunk after ``Lk_b - Lq_b`` cached keys otherwise). With ``causal`` the
    mask is aligned to the bottom right corner of each sequence's score matrix (query ``n``
    attends keys ``j <= Lk_b - Lq_b + n``), as :func:`rerope.rerope` aligns it; sequences
    never attend each other. Every relative position (and log-n's and Self-Extend's absolute
    ones) follows from these positions, as in :func:`rerope.rerope`, which a sequence alone
    (``(1, H, L, D)``) matches.

    Args:
        q: ``(total_q, Hq, D)``, the packed queries; fp16, bf16 or fp32, ``D`` in 16, 32,
            64, 128, 256. Raw, or RoPE-rotated at their positions (``rotated``). Any
            strides.
        k: ``(total_k, Hkv, D)``, the packed keys (``Hq`` a multiple of ``Hkv``: grouped-query
            attention by indexing), ``q``'s dtype and device; raw or rotated like ``q``.
            Paged (``block_table`` given): a page pool ``(num_blocks, block_size, Hkv, D)``.
        v: shaped like ``k``: ``(total_k, Hkv, D)``, or the value page pool.
        cu_seqlens_q: int32 ``(B + 1,)`` on ``q``'s device: ``0``, then the cumulative query
            counts; the last entry is ``total_q``. Zero-length sequences are allowed.
        cu_seqlens_k: int32 ``(B + 1,)`` on ``q``'s device: ``0``, then the cumulative key
            counts (the last is ``total_k`` in the contiguous form; paged, it only gives
            each sequence's key count ``Lk_b``).
        max_seqlen_q: int ``>= 1``, at least every ``Lq_b`` (sizes the grid).
        max_seqlen_k: int ``>= max_seqlen_q``, at least every ``Lk_b`` (sizes the grid and
            the rotation table).
        window: int ``>= 1``, as in :func:`rerope.rerope`.
        causal: bool, mask keys after the query (aligned as above).
        sm_scale: float or ``None`` (``1/sqrt(D)``), as in :func:`rerope.rerope`.
        base: float ``> 1``, the RoPE base.
        inv_freq: ``None`` or the ``D/2`` RoPE frequencies (then ``base`` stays default).
        leaky: ``None`` or the Leaky ReRoPE factor ``> 1``.
        logn_len: ``None`` or a training length ``> 1`` (log-n query scaling at each
            query's position within its sequence).
        group: ``None`` or Self-Extend's group size (divides ``window``; causal only).
        rotated: bool, ``q`` and ``k`` already carry RoPE at their positions.
        block_table: ``None`` (contiguous ``k, v``), or int32 ``(B, max_blocks)`` on
            ``q``'s device: ``k, v`` are page pools ``(num_blocks, block_size, Hkv, D)`` as
            :func:`rerope.rerope_decode` takes them, key ``j`` of sequence ``b`` in slot ``j
            % block_size`` of page ``block_table[b, j // block_size]``;
            ``max_blocks · block_size >= max_seqlen_k``; any ``block_size``; entries past a
            sequence's ``cdiv(Lk_b, block_size)`` pages are never read. Forward only; the
            pages are read in place (no copy of the keys and values).
        return_lse: bool; also return the log-sum-exps.

    Returns:
        ``(total_q, Hq, D)`` in ``q``'s dtype; with ``return_lse``, ``(out, lse)``, ``lse``
        ``(Hq, total_q)`` float32 (FlashAttention's varlen layout), ``log Σ_j exp(s_ij)``
        over the row's unmasked scaled scores (natural log), not differentiable.

    Checks: ``TypeError``/``ValueError`` naming the argument for wrong types, dtypes
    (``cu_seqlens_*`` and ``block_table`` must be int32), shapes that disagree, lengths out
    of range (non-increasing or mismatched ``cu_seqlens``, ``Lq_b > Lk_b``, a
    ``max_seqlen_*`` too small) and pages outside the pool. The values are read only where
    ``cu_seqlens_*`` (and ``block_table``) are CPU tensors; on a GPU they are not checked
    (that would need a host sync): a sequence with lengths out of range comes back as NaN
    rows (those within ``max_seqlen_q`` of its start; its log-sum-exps too), and the rows
    of a sequence that read a page outside the pool come back NaN.

    CUDA tensors, or CPU tensors under Triton's CPU interpreter. Under ``torch.compile`` the
    call runs eagerly (``torch.compiler.disable``: a graph break), never traced into Triton.
    """
    check_flag("return_lse", return_lse)
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  block_table)
    inv_freq = as_frequencies(inv_freq)
    settings = (window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq, group)
    plan = _plan(q, int(max_seqlen_k), settings)
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    dtype = q.dtype
    if block_table is not None:
        if _needs_grad(q, k, v):
            raise ValueError("the paged form of rerope_varlen is forward-only: call it "
                             "under torch.no_grad(), or pass contiguous k, v for gradients")
    if plan.lift:
        q, k, v = q.float(), k.float(), v.float()
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if block_table is None and _needs_grad(q, k, v):
        result = _VarlenAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, plan,
                                        return_lse)
    else:
        out, lse = _forward(q, k, v, cu_q, cu_k, max_q, max_k, plan,
                            block_table=block_table)
        result = (out, natural_lse(lse)) if return_lse else out
    if plan.lift:
        return (result[0].to(dtype), result[1]) if return_lse else result.to(dtype)
    return result
