"""Decoding with a KV cache: split-KV ("flash-decoding") ReRoPE attention. Chapter 8.

A decode step has one query (or a few speculative ones) per sequence against a long
cache, so it does almost no arithmetic per byte: it is bound by reading K and V once
from memory. Two things keep it there:

* **Split-KV.** One program per (batch row, KV head) would leave most of a GPU idle at
  batch 1 (8 KV heads, 132 SMs). The keys of each row are cut into ``num_splits``
  chunks; a program folds one chunk for every query of one KV head (grouped-query
  attention: its ``q_per_kv`` query heads times ``Nq`` queries form the ``M`` rows of
  the tile, so each K/V tile is loaded once for all of them) and writes a partial output
  and its log-sum-exp; a second launch, :func:`_decode_merge_kernel`, combines the
  partials exactly (the online softmax's merge rule, :func:`_merge_rows`).
* **One cache, rotated on the fly.** The kernel reads the cache the model already keeps
  — keys RoPE-rotated at their positions (``rotated=True``, the Llama convention) or raw
  (``rotated=False``) — and applies each product's rotation in registers, with the
  speeds and offsets of :func:`rerope.rotary.rotation_plan` (no re-rotated copy, no
  second cache). With a rotated cache the product inside the window needs no rotation at
  all (``q_rot · k_rot`` is RoPE's score), and outside it the key is turned back by
  ``R(-j)``: ``R(w - i) q_rot · R(-j) k_rot = R(w) q · k``, ReRoPE's clamped score.
* **Contiguous or paged.** The cache is ``(B, Hkv, Nmax, D)`` (any strides), or a paged
  pool ``(num_blocks, block_size, Hkv, D)`` with a block table, FlashAttention's layout
  (``block_table=``): only where a key tile is loaded from changes
  (:func:`rerope.forward._key_rows`, the ``PAGE_SIZE`` constexpr); positions, rotations,
  regions and splits stay logical.
* **Tiles by the copy engine where chunks are long.** On Hopper a contiguous fp16/bf16
  cache is read through TMA tensor descriptors (the ``TMA`` constexpr, :func:`use_tma`)
  where each split covers at least ``TMA_MIN_KEYS`` keys, pointer loads elsewhere.

Regions along a row's keys ``0 … L-1`` (queries at ``L-Nq … L-1``, causal): keys before
``L - Nq - w + 1`` are outside the window for every query — nearly all of a long cache —
and get the one-product loop with no mask at all; then at most a few masked tiles where
the window edge falls (both products, each masked to its side); then the last ``w``
keys, inside for every query, with a mask only on the tiles that hold the window edge or
the causal diagonal of the ``Nq`` queries.

Key angles come from :func:`rerope.rotary.rope_table`, without reading a table row per
key (that would add as many bytes as the keys themselves): a tile starting at key ``j0``
needs ``R(σ (j0 + r))`` for ``r < BLOCK_N``, and ``R(σ j0) R(σ r)`` splits it in two.
The kernel holds the table's first ``BLOCK_N`` rows in registers, turns each key by
``R(σ r)``, and turns the tile's ``BLOCK_M`` query rows by ``R(-σ j0)`` instead of the
keys by ``R(σ j0)`` (one table row per tile): ``q · R(σ j0) R(σ r) k = R(-σ j0) q · R(σ
r) k``.

The host side is validate → plan → run (:func:`decode_plan`, :class:`DecodePlan`): a
plan is made once per layout class and settings, and everything that grows with the
cache (its length, the split count, the rotation tables' rows) is an argument of the
launch, so a decode loop over a growing cache uses one plan.
"""

import functools
import threading
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import configs
from ._validate import (Frequencies, as_frequencies, check_alike, check_block_table,
                        check_flag, check_head_dim, check_int32, check_logn_overflow,
                        check_qkv, check_rope_args, check_sm_scale)
from .caches import CACHE_SIZE, LRUCache
from .forward import _key_rows, _tile_pages
from .launch import (Launcher, PlanCache, _capability, _ensure_scratch_allocator,
                     _tma_layout_ok, signature)
from .online_softmax import LOG2E, _scores, _softmax_step, natural_lse
from .regions import INSIDE, OUTSIDE, _nth_tile, _tile_count
from .rotary import (_logn_scale, _rotate, _table_rows, _unrotate, logn_factor,
                     rotation_tables)
from .runtime import INTERPRET, dot_precision, launching, prepare_for_device

MAX_QUERIES = 16          # Nq per row: one token, or a few speculative ones

# The split kernel's launch configuration on a GPU, chosen on the H200 (perf/NOTES.md):
# BLOCK_N keys per tile; PROGRAMS_PER_SM programs of it are resident per SM (the splits
# rule). Config.decode_config (REROPE_DECODE_CONFIG) replaces both, also under the
# interpreter.
GPU_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)
HEAD_DIM_CONFIGS = {64: dict(BLOCK_N=128, num_warps=4, num_stages=3)}
PROGRAMS_PER_SM = 2
# Short test caches still cross several tiles under the interpreter.
INTERPRETER_CONFIG = dict(BLOCK_N=16)
# Paged caches: a power of two, so that a page holds whole key tiles or a tile whole
# pages.
PAGE_SIZES = (16, 32, 64, 128, 256)
# rows per program: from the smallest tl.dot to what registers hold
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64
# TMA descriptors only where each split reads this many keys: each program builds its
# own after reading its row's length, a latency that short chunks do not earn back.
TMA_HEAD_DIMS = (64, 128)
TMA_MIN_KEYS = 2048

# The splits rule (see :func:`default_num_splits`).
MIN_KEYS_PER_SPLIT = 256  # no shorter chunks: the merge would cost more than they gain
MAX_SPLITS = 128
MERGE_SPLITS_BLOCK = 64   # partials the merge folds per step
MERGE_TILE = 8192         # at most this many partial elements per step (registers)
MERGE_ROWS = 1            # rows per merge program: its programs run side by side
TABLE_MARGIN = 256        # rotation table rows past the keys: whole tiles read unmasked


# --- the split kernel -----------------------------------------------------------------


@triton.jit
def _decode_pass(state, q, kv, turn, row, walk, PRODUCT: tl.constexpr,
                 MASKED: tl.constexpr, TURN: tl.constexpr, ROW_PER_KEY: tl.constexpr,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, dtype: tl.constexpr):
    """Fold the key tiles of ``walk`` (``(lo1, hi1, lo2, hi2)``) into ``state``.

    ``state``: the softmax state ``(acc, l_i, m_i)``; ``q``: the query halves, already
    rotated for this product (fp32); ``kv``: ``(K, V, sk_n, sk_d, sv_n, sv_d, pages)``
    from :func:`_kv_sources`; ``turn``: ``(Table, cos_r, sin_r)`` of :func:`_product`;
    ``row``: ``(positions, n_keys, window, qk_scale)``. With ``TURN`` each key tile is
    turned by ``R(σ r)`` (``cos_r, sin_r``: the table's first ``BLOCK_N`` rows) and the
    queries by ``R(-σ j0)``, or with ``ROW_PER_KEY`` each key by its own table row
    (Self-Extend where its group does not divide ``BLOCK_N``). ``MASKED`` tiles keep
    only keys ``j < n_keys``, ``j <= i`` and on this product's side of the window; loads
    past ``n_keys`` read nothing (a poisoned cache stays unread).

    ``PAGE_SIZE > 0`` (paged): ``K, V`` point at page 0 of this KV head and ``pages`` is
    ``(BlockTable row, its stride, sk_page, sv_page, num_blocks)``; key ``j`` lives in
    slot ``j % PAGE_SIZE`` of page ``BlockTable[j // PAGE_SIZE]`` (:func:`_key_rows`).
    ``TMA`` (contiguous caches only): ``K, V`` are tensor descriptors of this row's
    ``n_keys`` keys, ``K``'s blocks half a head wide; rows at and past ``n_keys`` come
    back as zeros without being read, as the masked pointer loads do. ``dtype``: the
    cache's element type.
    """
    acc, l_i, m_i = state
    q_a, q_b = q
    K, V, sk_n, sk_d, sv_n, sv_d, pages = kv
    Table, cos_r, sin_r = turn
    positions, n_keys, window, qk_scale = row
    offs_n = tl.arange(0, BLOCK_N)
    halves = tl.arange(0, HALF)
    qd_a, qd_b = q_a.to(dtype), q_b.to(dtype)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        cols = start + offs_n
        if TMA:         # the bulk tensor-copy engine; zeros past n_keys (no mask)
            k_a = K.load([start, 0])
            k_b = K.load([start, HALF])
            v = V.load([start, 0])
        else:
            if PAGE_SIZE > 0:
                page = _tile_pages(pages, start, n_keys, BLOCK_N, PAGE_SIZE)
                k_rows, v_rows, paged_ok = _key_rows(pages, page, cols, sk_n, sv_n,
                                                     BLOCK_N, PAGE_SIZE)
                live = paged_ok[:, None]
                if MASKED:
                    live = live & (cols < n_keys)[:, None]
            else:
                k_rows, v_rows = cols.to(tl.int64) * sk_n, cols.to(tl.int64) * sv_n
                live = (cols < n_keys)[:, None]
            k_ptrs = K + k_rows[:, None] + halves[None, :] * sk_d
            v_ptrs = V + v_rows[:, None] + tl.arange(0, 2 * HALF)[None, :] * sv_d
            if MASKED or PAGE_SIZE > 0:
                k_a = tl.load(k_ptrs, mask=live, other=0.0)
                k_b = tl.load(k_ptrs + HALF * sk_d, mask=live, other=0.0)
                v = tl.load(v_ptrs, mask=live, other=0.0)
            else:       # whole tiles below n_keys: no mask at all
                k_a = tl.load(k_ptrs)
                k_b = tl.load(k_ptrs + HALF * sk_d)
                v = tl.load(v_ptrs)
        if TURN:
            if ROW_PER_KEY:
                cos, sin = _table_rows(Table, cols, HALF)
            else:        # the queries take the tile's turn R(σ j0), inverted
                row0 = Table + start.to(tl.int64) * (2 * HALF)
                cos_0 = tl.load(row0 + halves)[None, :]
                sin_0 = tl.load(row0 + HALF + halves)[None, :]
                qt_a, qt_b = _unrotate(q_a, q_b, cos_0, sin_0)
                qd_a, qd_b = qt_a.to(dtype), qt_b.to(dtype)
                cos, sin = cos_r, sin_r
            k_a, k_b = _rotate(k_a.to(tl.float32), k_b.to(tl.float32), cos, sin)
            k_a, k_b = k_a.to(dtype), k_b.to(dtype)
        scores = _scores(qd_a, qd_b, k_a, k_b, True, DOT_PRECISION)
        if MASKED:
            distance = positions[:, None] - cols[None, :]
            if PRODUCT == INSIDE:
                keep = (distance < window) & (distance >= 0)
            else:
                keep = distance >= window
            keep = keep & (cols[None, :] < n_keys)
            scores = tl.where(keep, scores, float("-inf"))
        if PAGE_SIZE > 0:   # a block-table entry out of range: the row comes out NaN
            scores = tl.where(paged_ok[None, :], scores, float("nan"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _kv_sources(K, V, sk_n, sv_n, n_keys, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                TMA: tl.constexpr):
    """How :func:`_decode_pass` reads the keys and values of one row (``K, V`` at its
    slot 0): with ``TMA`` two tensor descriptors over its ``n_keys`` keys (rows past
    them read as zeros, unread), ``K``'s blocks half a head wide; otherwise the pointers
    themselves."""
    if TMA:
        shape = [n_keys, 2 * HALF]
        return (tl.make_tensor_descriptor(K, shape=shape, strides=[sk_n, 1],
                                          block_shape=[BLOCK_N, HALF]),
                tl.make_tensor_descriptor(V, shape=shape, strides=[sv_n, 1],
                                          block_shape=[BLOCK_N, 2 * HALF]))
    else:
        return K, V


@triton.jit
def _product(q_a, q_b, Table, Offset, positions, TURN: tl.constexpr,
             ROW_PER_KEY: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """One product's operands for :func:`_decode_pass`: the query halves (fp32) rotated
    by ``R(σ i + offset)`` (the offset's ``[cos | sin]`` vector, turned by the table
    rows of the positions when the product turns keys), and its ``turn``: ``(Table,
    cos_r, sin_r)`` with the table's first ``BLOCK_N`` rows where the keys are turned
    tile by tile."""
    freqs = tl.arange(0, HALF)
    cos = tl.load(Offset + freqs)[None, :]
    sin = tl.load(Offset + HALF + freqs)[None, :]
    if TURN:
        cos_p, sin_p = _table_rows(Table, positions, HALF)
        cos, sin = cos_p * cos - sin_p * sin, sin_p * cos + cos_p * sin
    q_a, q_b = _rotate(q_a, q_b, cos, sin)
    cos_r = tl.zeros([BLOCK_N, HALF], tl.float32)   # unread unless turned tile by tile
    sin_r = tl.zeros([BLOCK_N, HALF], tl.float32)
    if TURN and not ROW_PER_KEY:
        cos_r, sin_r = _table_rows(Table, tl.arange(0, BLOCK_N), HALF)
    return (q_a, q_b), (Table, cos_r, sin_r)


@triton.jit
def _chunk_walks(n_keys, n_queries, window, split, num_splits, BLOCK_N: tl.constexpr):
    """The keys of one split and how they are walked: ``(lo, c1, c2, c3, hi)``.

    The row's ``n_keys`` keys are cut into ``num_splits`` tile-aligned chunks of equal
    length (the last shorter, spare ones empty); this split owns ``[lo, hi)``, walked as
    ``[lo, c1)`` outside the window for every query, one product, no mask | ``[c1, c2)``
    the window's edge: both products, masked | ``[c2, c3)`` inside for every query and
    causal-visible to all, no mask | ``[c3, hi)`` the causal edge of the ``Nq`` queries
    (and the ragged last tile), masked. Queries sit at ``n_keys - n_queries …``; all
    operands stay non-negative before dividing.
    """
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, n_keys), lo)
    all_outside = n_keys - n_queries - window + 1   # below: outside for every query
    some_inside = tl.maximum(n_keys - window, 0)    # from here: inside for every query
    all_visible = n_keys - n_queries + 1            # below: visible to every query
    c1 = tl.minimum(tl.maximum(tl.maximum(all_outside, 0) // BLOCK_N * BLOCK_N, lo), hi)
    c2 = tl.minimum(tl.maximum(tl.cdiv(some_inside, BLOCK_N) * BLOCK_N, c1), hi)
    c3 = tl.minimum(tl.maximum(all_visible // BLOCK_N * BLOCK_N, c2), hi)
    return lo, c1, c2, c3, hi


@triton.jit
def _chunk_map_kernel(Out, n_keys, n_queries, window, num_splits,
                      BLOCK_N: tl.constexpr):
    """One program per split: write :func:`_chunk_walks` (the book draws it, tests
    check it)."""
    split = tl.program_id(0)
    lo, c1, c2, c3, hi = _chunk_walks(n_keys, n_queries, window, split, num_splits,
                                      BLOCK_N)
    base = Out + split * 5
    tl.store(base, lo)
    tl.store(base + 1, c1)
    tl.store(base + 2, c2)
    tl.store(base + 3, c3)
    tl.store(base + 4, hi)


def chunk_map(n_keys, n_queries, window, num_splits, block_n):
    """``(num_splits, 5)`` int tensor of ``(lo, c1, c2, c3, hi)`` per split, computed by
    the kernel's own :func:`_chunk_walks` (see there for what the five cut points
    mean)."""
    device = "cpu" if INTERPRET else "cuda"
    out = torch.zeros(num_splits, 5, dtype=torch.int32, device=device)
    with launching():       # a direct launch: the interpreter's lock (rerope.runtime)
        _chunk_map_kernel[(num_splits,)](out, n_keys, n_queries, min(window, n_keys),
                                         num_splits, BLOCK_N=block_n)
    return out.cpu()


# What grows with the cache is not specialised on: a growing cache reuses one compiled
# kernel.
@triton.jit(do_not_specialize=["num_blocks", "n_max", "num_splits", "window"])
def _decode_split_kernel(
    Q, K, V, SeqLens, BlockTable, Out, Lse,
    q_strides, k_strides, v_strides, table_strides, num_blocks,
    n_kv_heads, q_per_kv, n_queries, n_max, num_splits, window, qk_scale, logn_factor,
    TableIn, OffsetIn, TableOut, OffsetOut,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TURN_IN: tl.constexpr, TURN_OUT: tl.constexpr, ROW_PER_KEY: tl.constexpr,
    LOGN: tl.constexpr, WRITE_LSE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(B · Hkv, num_splits, cdiv(q_per_kv · Nq, BLOCK_M))``: one chunk of one
    row's keys for the ``BLOCK_M`` (head, query) rows of one KV head.

    Writes the chunk's normalised output to ``Out`` (partials ``(num_splits, B · Hq ·
    Nq, D)`` fp32, or the final output when ``num_splits == 1``, then ``WRITE_LSE`` is
    off) and its log-sum-exp (log2 units, ``-inf`` for a chunk with no visible key) to
    ``Lse``. Row ``b`` has ``SeqLens[b]`` keys (``n_max`` where ``SeqLens`` is None); a
    length out of range (``< Nq`` or ``> n_max``) gives NaN.

    ``PAGE_SIZE > 0`` (paged): ``K, V`` are ``(num_blocks, PAGE_SIZE, Hkv, D)`` pools
    (their strides given in ``(page, head, slot, dim)`` order) and ``BlockTable`` ``(B,
    max_blocks)`` maps a row's logical page ``j // PAGE_SIZE`` to its page; ``n_max =
    max_blocks · PAGE_SIZE``. A row with an entry outside ``[0, num_blocks)`` among its
    pages gets NaN. ``TMA`` (contiguous only, :func:`use_tma`): K and V tiles through
    tensor descriptors.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    # the KV heads of one chunk side by side (they read the same rows of the angle
    # table)
    batch = tl.program_id(0) // n_kv_heads
    kv_head = tl.program_id(0) % n_kv_heads
    split = tl.program_id(1)
    if SeqLens is None:
        seq_len = n_max
    else:
        seq_len = tl.load(SeqLens + batch)
    bad_length = (seq_len < n_queries) | (seq_len > n_max)
    n_keys = tl.minimum(tl.maximum(seq_len, n_queries), n_max)

    # rows of the tile: (head of the group, query); query n sits at position L - Nq + n
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_per_kv = q_per_kv * n_queries
    row_ok = rows < rows_per_kv
    head = kv_head * q_per_kv + rows // n_queries
    query = rows % n_queries
    positions = n_keys - n_queries + query

    lo, c1, c2, c3, hi = _chunk_walks(n_keys, n_queries, window, split, num_splits,
                                      BLOCK_N)

    sq_b, sq_h, sq_n, sq_d = q_strides
    sk_b, sk_h, sk_n, sk_d = k_strides
    sv_b, sv_h, sv_n, sv_d = v_strides
    b64 = batch.to(tl.int64)
    K = K + kv_head.to(tl.int64) * sk_h
    V = V + kv_head.to(tl.int64) * sv_h
    if PAGE_SIZE > 0:    # this row's block table: the keys' rows come from it per tile
        table_row = BlockTable + b64 * table_strides[0]
        pages = (table_row, table_strides[1], sk_b, sv_b, num_blocks)
    else:                # contiguous: this row's keys from slot 0
        K = K + b64 * sk_b
        V = V + b64 * sv_b
        pages = (BlockTable, 0, sk_b, sv_b, num_blocks)
    kv_dtype = V.dtype.element_ty
    Ks, Vs = _kv_sources(K, V, sk_n, sv_n, n_keys, BLOCK_N, HALF, TMA)
    kv = (Ks, Vs, sk_n, sk_d, sv_n, sv_d, pages)
    halves = tl.arange(0, HALF)
    q_ptrs = (Q + b64 * sq_b + head[:, None].to(tl.int64) * sq_h + query[:, None] * sq_n
              + halves[None, :] * sq_d)
    q_a = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_b = tl.load(q_ptrs + HALF * sq_d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if LOGN:
        scale = _logn_scale(positions, logn_factor)[:, None]
        q_a, q_b = q_a * scale, q_b * scale
    row = (positions, n_keys, window, qk_scale)
    state = (tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), tl.zeros([BLOCK_M], tl.float32),
             tl.full([BLOCK_M], float("-inf"), tl.float32))

    # outside the window: the long loop, then the masked tiles around the window edge
    q_out, turn = _product(q_a, q_b, TableOut, OffsetOut, positions, TURN_OUT,
                           ROW_PER_KEY, BLOCK_N, HALF)
    state = _decode_pass(state, q_out, kv, turn, row, (lo, c1, c1, c1), OUTSIDE, False,
                         TURN_OUT, ROW_PER_KEY, BLOCK_N, HALF, PAGE_SIZE, TMA,
                         DOT_PRECISION, kv_dtype)
    state = _decode_pass(state, q_out, kv, turn, row, (c1, c2, c2, c2), OUTSIDE, True,
                         TURN_OUT, ROW_PER_KEY, BLOCK_N, HALF, PAGE_SIZE, TMA,
                         DOT_PRECISION, kv_dtype)
    # inside the window: the last `window` keys
    q_in, turn = _product(q_a, q_b, TableIn, OffsetIn, positions, TURN_IN, ROW_PER_KEY,
                          BLOCK_N, HALF)
    state = _decode_pass(state, q_in, kv, turn, row, (c2, c3, c3, c3), INSIDE, False,
                         TURN_IN, ROW_PER_KEY, BLOCK_N, HALF, PAGE_SIZE, TMA,
                         DOT_PRECISION, kv_dtype)
    acc, l_i, m_i = _decode_pass(state, q_in, kv, turn, row, (c1, c2, c3, hi), INSIDE,
                                 True, TURN_IN, ROW_PER_KEY, BLOCK_N, HALF, PAGE_SIZE,
                                 TMA, DOT_PRECISION, kv_dtype)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if bad_length:               # out-of-range cache_seqlens: poison the row's output
        out = tl.full([BLOCK_M, HEAD_DIM], float("nan"), tl.float32)
        lse = tl.zeros([BLOCK_M], tl.float32)
    # (split, B · Hq · Nq rows) in order: row (b, h, n) of KV head program_id(0)'s rows
    n_rows = tl.num_programs(0).to(tl.int64) * rows_per_kv
    flat = (split.to(tl.int64) * n_rows + tl.program_id(0).to(tl.int64) * rows_per_kv
            + rows)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(Out + flat[:, None] * HEAD_DIM + dims[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        tl.store(Lse + flat, lse, mask=row_ok)


# --- the merge kernel -----------------------------------------------------------------


@triton.jit
def _merge_rows(Part, PartLse, Out, FinalLse, first, count, n_rows, num_splits,
                HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, SPLITS_BLOCK: tl.constexpr,
                LSE_BLOCK: tl.constexpr):
    """Merge the partials of rows ``first … first + min(count, ROWS) - 1``: ``out = Σ_s
    2^(lse_s − m) o_s / Σ_s 2^(lse_s − m)``, ``m`` the row's largest ``lse_s``.

    ``Part`` ``(S, rows, D)`` fp32 and ``PartLse`` ``(S, rows)`` contiguous (``rows =
    n_rows``); ``Out`` ``(rows, D)`` contiguous. ``ROWS × SPLITS_BLOCK`` partials per
    step. When every split fits in one step (``num_splits <= SPLITS_BLOCK``) the
    log-sum-exps and the partials are loaded together, one round trip to memory; else a
    first pass finds ``m`` (``LSE_BLOCK`` log-sum-exps per load, one load for up to
    ``LSE_BLOCK`` splits) and a second folds the partials. Chunks without a visible key
    have ``lse = −inf`` and weigh nothing. Each partial is read once: the loads skip L1
    (``.cg``). ``FinalLse`` (``None``: not written): the merged rows' log-sum-exps
    (log2 units), ``(rows,)``.
    """
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, SPLITS_BLOCK)
    r = tl.arange(0, ROWS)
    row_ok = r < count
    rows = first + r.to(tl.int64)
    if num_splits <= SPLITS_BLOCK:      # one step: everything loaded at once
        ok = row_ok[:, None] & (splits < num_splits)[None, :]
        lse = tl.load(PartLse + splits[None, :] * n_rows + rows[:, None], mask=ok,
                      other=float("-inf"), cache_modifier=".cg")
        at = (splits[None, :, None] * n_rows + rows[:, None, None]) * HEAD_DIM
        part = tl.load(Part + at + dims[None, None, :], mask=ok[:, :, None], other=0.0,
                       cache_modifier=".cg")
        m_max = tl.where(row_ok, tl.max(lse, 1), 0.0)
        weight = tl.math.exp2(lse - m_max[:, None])
        acc = (tl.zeros([ROWS, HEAD_DIM], tl.float32)
               + tl.sum(weight[:, :, None] * part, 1))
        total = tl.zeros([ROWS, SPLITS_BLOCK], tl.float32) + weight
    else:
        lse_splits = tl.arange(0, LSE_BLOCK)
        m = tl.full([ROWS, LSE_BLOCK], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, LSE_BLOCK):
            ok = row_ok[:, None] & (s0 + lse_splits < num_splits)[None, :]
            lse = tl.load(PartLse + (s0 + lse_splits)[None, :] * n_rows + rows[:, None],
                          mask=ok, other=float("-inf"), cache_modifier=".cg")
            m = tl.maximum(m, lse)
        m_max = tl.where(row_ok, tl.max(m, 1), 0.0)
        total = tl.zeros([ROWS, SPLITS_BLOCK], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for s0 in range(0, num_splits, SPLITS_BLOCK):
            ok = row_ok[:, None] & (s0 + splits < num_splits)[None, :]
            lse = tl.load(PartLse + (s0 + splits)[None, :] * n_rows + rows[:, None],
                          mask=ok, other=float("-inf"), cache_modifier=".cg")
            weight = tl.math.exp2(lse - m_max[:, None])
            at = ((s0 + splits)[None, :, None] * n_rows
                  + rows[:, None, None]) * HEAD_DIM
            part = tl.load(Part + at + dims[None, None, :], mask=ok[:, :, None],
                           other=0.0, cache_modifier=".cg")
            acc += tl.sum(weight[:, :, None] * part, 1)
            total += weight
    norm = tl.where(row_ok, tl.sum(total, 1), 1.0)
    out = acc / norm[:, None]
    tl.store(Out + rows[:, None] * HEAD_DIM + dims[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if FinalLse is not None:      # log2 Σ_s 2^lse_s = m + log2 Σ_s 2^(lse_s - m)
        tl.store(FinalLse + rows, m_max + tl.math.log2(norm), mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(Part, PartLse, Out, FinalLse, n_rows, num_splits,
                         HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                         SPLITS_BLOCK: tl.constexpr, LSE_BLOCK: tl.constexpr):
    """Grid ``(cdiv(B · Hq · Nq, ROWS),)``: :func:`_merge_rows` of ``ROWS`` rows
    each (``FinalLse``: ``None``, or where the merged log-sum-exps go)."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    _merge_rows(Part, PartLse, Out, FinalLse, first, n_rows - first, n_rows, num_splits,
                HEAD_DIM, ROWS, SPLITS_BLOCK, LSE_BLOCK)


# --- the rules: launch configuration, splits, TMA, merge steps ------------------------


@functools.lru_cache(maxsize=CACHE_SIZE)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device):
    """Streaming multiprocessors of ``device`` (132 on an H200; 132 under the
    interpreter, so the splits rule gives the same numbers there)."""
    if INTERPRET or device.type != "cuda":
        return 132
    index = device.index
    return _sm_count(index if index is not None else torch.cuda.current_device())


def launch_config(head_dim, config=None):
    """The split kernel's launch configuration (``BLOCK_N``, ``num_warps``,
    ``num_stages``) and programs per SM for ``head_dim`` under ``config`` (default: the
    active :class:`rerope.configs.Config`): its ``decode_config`` where set, else
    ``HEAD_DIM_CONFIGS`` or ``GPU_CONFIG`` and ``PROGRAMS_PER_SM``
    (``INTERPRETER_CONFIG``'s ``BLOCK_N`` under the interpreter). Returns ``(dict,
    programs_per_sm)``."""
    config = configs.current() if config is None else config
    if config.decode_config:
        block_n, warps, stages, per_sm = config.decode_config
        return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages), per_sm
    if INTERPRET:
        return dict(INTERPRETER_CONFIG), PROGRAMS_PER_SM
    return dict(HEAD_DIM_CONFIGS.get(head_dim, GPU_CONFIG)), PROGRAMS_PER_SM


def block_m(q_per_kv, n_queries):
    """Rows per program: one KV head's query heads × queries, a power of two in
    [16, 64]."""
    rows = triton.next_power_of_2(q_per_kv * n_queries)
    return min(max(MIN_BLOCK_M, rows), MAX_BLOCK_M)


def _split_cap(batch, kv_heads, q_per_kv, n_queries, sms, programs_per_sm):
    """The most splits per row that fit in one wave of resident programs (at least
    1)."""
    blocks = triton.cdiv(q_per_kv * n_queries, block_m(q_per_kv, n_queries))
    programs = batch * kv_heads * blocks
    if programs == 0:           # an empty batch (or no query head): nothing to spread
        return 1
    return max(1, min((programs_per_sm * sms) // programs, MAX_SPLITS))


def default_num_splits(batch, kv_heads, q_per_kv, n_queries, n_max, sms=132,
                       programs_per_sm=PROGRAMS_PER_SM):
    """How many chunks to cut each row's keys into: as many as fit in one wave of
    resident programs (``programs_per_sm`` per SM; a partial second wave would leave SMs
    idle for its whole duration), but chunks of at least ``MIN_KEYS_PER_SPLIT`` keys, at
    most ``MAX_SPLITS``.

    From shapes only (``n_max``, never the data), so a CUDA graph replays it. Hq=32,
    Hkv=8, Nq=1 on 132 SMs: batch 1, 128k keys: 33 splits (264 programs); batch 1, 4k:
    16; batch 8: 4; batch 33 and more: 1.
    """
    cap = _split_cap(batch, kv_heads, q_per_kv, n_queries, sms, programs_per_sm)
    return max(1, min(cap, triton.cdiv(n_max, MIN_KEYS_PER_SPLIT)))


def use_tma(k_cache, v_cache, paged, keys_per_split, mode=None):
    """Whether the split kernel reads K and V tiles through TMA tensor descriptors
    (``TMA``; ``k_cache, v_cache`` as the kernel sees them, ``keys_per_split`` the cache
    slots of one split, ``cdiv(Nmax, num_splits)``: shapes only). Never for a paged
    cache (a tile's keys are not one box of memory). ``mode`` (default: the active
    configuration's ``tma``): ``"off"`` never; ``"on"`` wherever the layout allows
    (under the interpreter too: the tests run this path on CPU); ``"auto"``, on a GPU
    where :func:`rerope.configs.tma_pays` (Hopper or newer, 16-bit, ``D <= 128``), for
    head dims in ``TMA_HEAD_DIMS`` and splits of at least ``TMA_MIN_KEYS`` keys. The
    layout: 16-byte aligned starts, unit stride along ``D``, 16-byte aligned key, head
    and batch strides (:func:`rerope.launch._tma_layout_ok`).
    """
    mode = configs.current().tma if mode is None else mode
    if paged or mode == "off":
        return False
    d = k_cache.shape[-1]
    if mode != "on" and (INTERPRET or d not in TMA_HEAD_DIMS
                         or keys_per_split < TMA_MIN_KEYS or not configs.tma_pays(
                             _capability(k_cache.device), k_cache.element_size(), d)):
        return False
    return _tma_layout_ok(k_cache) and _tma_layout_ok(v_cache)


def merge_blocks(num_splits, head_dim, rows=MERGE_ROWS):
    """How the merge walks the partials (:func:`_merge_rows`) when it merges ``rows``
    rows at once: ``(splits, lse)``, ``splits`` partials per row and step (a power of
    two, at most ``MERGE_SPLITS_BLOCK`` and ``MERGE_TILE`` partial elements per step:
    registers), and up to ``lse`` log-sum-exps per load of the first pass
    (``MAX_SPLITS``: one load). The merge takes one step when ``num_splits <=
    splits``."""
    splits = triton.next_power_of_2(num_splits)
    tile = max(1, MERGE_TILE // (rows * head_dim))
    return (min(splits, MERGE_SPLITS_BLOCK, triton.next_power_of_2(tile + 1) // 2),
            min(splits, triton.next_power_of_2(MAX_SPLITS)))


# --- validation -----------------------------------------------------------------------


def _check_lengths_on_host(cache_seqlens, n_queries, n_max):
    """``Nq <= cache_seqlens[b] <= Nmax`` for every row (CPU tensors only: no sync
    needed)."""
    short = cache_seqlens < n_queries
    if bool(short.any()):
        row = int(short.nonzero()[0])
        raise ValueError(
            f"cache_seqlens[{row}] = {int(cache_seqlens[row])} is less than the number "
            f"of queries Nq = {n_queries}: the queries sit at the last Nq positions of "
            "the cache, so every row needs at least Nq cached keys")
    long = cache_seqlens > n_max
    if bool(long.any()):
        row = int(long.nonzero()[0])
        raise ValueError(f"cache_seqlens[{row}] = {int(cache_seqlens[row])} exceeds "
                         f"the cache size Nmax = {n_max}")


def _check_block_table_on_host(block_table, cache_seqlens, page_size, num_blocks):
    """Every entry a row's keys use (``j < cdiv(cache_seqlens[b], page_size)``) names a
    page of the cache (CPU tensors only)."""
    starts = torch.arange(block_table.shape[1])[None, :] * page_size
    used = starts < cache_seqlens[:, None].long()
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, entry = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {entry}] = {int(block_table[row, entry])} is not a "
            f"page of the cache: k_cache and v_cache have num_blocks = {num_blocks} "
            f"pages, and row {row} uses entries 0 to "
            f"{-(-int(cache_seqlens[row]) // page_size) - 1}")


def _check_paged_args(q, k_cache, v_cache, block_table, cache_seqlens):
    """The paged layout's tensors; returns ``(B, Hq, Hkv, Nq, Nmax, D)`` with ``Nmax``
    the table's capacity ``max_blocks_per_seq · block_size``."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have rank 4 (B, Hq, Nq, D), got shape "
                         f"{tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"with a block_table, {name} must be a paged cache of "
                             f"rank 4 (num_blocks, block_size, Hkv, D), got shape "
                             f"{tuple(t.shape)}")
    check_alike({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache pages disagree: k_cache has shape "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} "
                         "(both (num_blocks, block_size, Hkv, D))")
    batch, hq, n_queries, d = q.shape
    num_blocks, page_size, hkv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(f"k_cache has head dim {d_k}, expected {d} like q")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads "
                         f"({hkv})")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"block_size {page_size} (k_cache.shape[1]) is not supported: "
                         f"pages of {', '.join(map(str, PAGE_SIZES))} keys")
    if num_blocks < 1:
        raise ValueError("k_cache and v_cache have no pages (num_blocks = 0)")
    check_block_table(block_table, batch, q.device, "max_blocks_per_seq", "batch row")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required with a block_table (the number of "
                         "valid keys of each row): an int32 tensor of shape (B,)")
    if n_queries < 1:
        raise ValueError(f"q must have sequence length N >= 1, got {n_queries}")
    n_max = block_table.shape[1] * page_size
    if n_queries > n_max:
        raise ValueError(f"q has {n_queries} queries but the block table holds {n_max} "
                         "keys")
    return batch, hq, hkv, n_queries, n_max, d


def _check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table, window,
                       sm_scale, base, leaky, logn_len, rotated, num_splits, inv_freq,
                       group):
    """Every check of a :func:`rerope_decode` call (``ValueError`` / ``TypeError``
    naming the argument); returns ``(B, Hq, Hkv, Nq, Nmax, D)``."""
    if block_table is None:
        batch, hq, hkv, n_queries, n_max, d = check_qkv(
            {"q": q}, {"k_cache": k_cache, "v_cache": v_cache}, fewer_queries=True)
        keys = k_cache
    else:
        batch, hq, hkv, n_queries, n_max, d = _check_paged_args(
            q, k_cache, v_cache, block_table, cache_seqlens)
        keys = k_cache[:1, :1, :1].expand(batch, hkv, n_max, d)     # the logical shape
    check_head_dim(d)
    check_rope_args(q, keys, window, base, leaky, logn_len, rotated, inv_freq, group)
    check_sm_scale(sm_scale)
    if n_queries > MAX_QUERIES:
        raise ValueError(f"q has {n_queries} queries per row; rerope_decode takes 1 to "
                         f"{MAX_QUERIES} (use rerope.rerope for a prefill)")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits must be an int >= 1 or None, got "
                            f"{type(num_splits).__name__} {num_splits!r}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if cache_seqlens is not None:
        check_int32("cache_seqlens", cache_seqlens, lambda shape: shape == (batch,),
                    f"({batch},) (one length per batch row) or None", q.device)
    check_logn_overflow(logn_len, n_max, q.dtype)
    return batch, hq, hkv, n_queries, n_max, d


def rerope_decode(q, k_cache, v_cache, window, cache_seqlens=None, sm_scale=None,
                  base=10000.0, leaky=None, logn_len=None, rotated=True,
                  num_splits=None, inv_freq=None, block_table=None, group=None,
                  return_lse=False):
    """(Leaky) ReRoPE or Self-Extend attention of a few new queries against a KV cache
    (forward only).

    The decode step of generation: each batch row's ``Nq`` newest tokens attend,
    causally, to the row's cached keys, whose last ``Nq`` entries are those tokens
    themselves (append the new ``k, v`` to the cache first, then count them in
    ``cache_seqlens``). Split-KV: the keys are cut into ``num_splits`` chunks folded in
    parallel and merged by log-sum-exp. No host synchronisation and no allocation that
    depends on data: the call can be captured in a CUDA graph (call it once before
    capturing: the first call compiles and builds the RoPE table).

    Grouped-query and multi-query attention: the cache may have fewer heads than ``q``
    (``Hq`` a multiple of ``Hkv``); query head ``h`` attends cache head ``h // (Hq /
    Hkv)``, by indexing: the cache is never repeated in memory.

    Row ``b`` holds ``L = cache_seqlens[b]`` keys (``L = Nmax`` without
    ``cache_seqlens``), at positions ``0 … L - 1``; its queries are the last ``Nq`` of
    them: query ``n`` sits at position ``i = L - Nq + n`` and attends keys ``j <= i``,
    the causal mask aligned to the bottom right corner of the row's score matrix. For
    ``Nq = 2``, ``L = 5`` (1 = attended, 0 = masked)::

        1 1 1 1 0
        1 1 1 1 1

    Args:
        q: ``(B, Hq, Nq, D)``, the new queries, ``1 <= Nq <= 16`` (one token, or a
            few speculative ones), at positions ``L - Nq … L - 1`` of their row; fp16,
            bf16 or fp32, ``D`` in 16, 32, 64, 128, 256. RoPE-rotated at those positions
            if ``rotated``, raw otherwise.
        k_cache: ``(B, Hkv, Nmax, D)``, the key cache, ``q``'s dtype and device. Slot
            ``j`` holds the key of position ``j`` (RoPE-rotated at ``j`` if
            ``rotated``). Any strides, e.g. a transposed view of a ``(B, Nmax, Hkv, D)``
            buffer. Paged: see ``block_table``.
        v_cache: ``(B, Hkv, Nmax, D)``, the value cache, ``q``'s dtype and device
            (paged: as ``k_cache``).
        window: int ``>= 1``, ReRoPE's window ``w``: relative positions ``i - j < w``
            use plain RoPE, the others are clamped to ``w`` (or grow as ``w + (i - j -
            w) / leaky``).
        cache_seqlens: ``None`` (every row uses the whole cache) or an int32 tensor
            ``(B,)`` on ``q``'s device: the number of valid slots ``L`` per row, between
            ``Nq`` and ``Nmax``. Slots at and beyond it are never read. Values out of
            range raise ``ValueError`` for CPU tensors; on a GPU they are not checked
            (that would need a host sync) and the rows concerned come back as NaN.
        sm_scale: float, the score scale; ``1 / sqrt(D)`` when ``None``. Between about
            1.2e-38 and 1.1e26 (``ValueError`` otherwise: the scaled fp32 scores must
            stay finite; :func:`rerope._validate.check_sm_scale`).
        base: float ``> 1``, the RoPE base (10000.0 for Llama 2).
        leaky: ``None`` for ReRoPE, or Leaky ReRoPE's factor ``κ > 1``.
        logn_len: ``None``, or a training length ``> 1``: queries are scaled by
            ``max(1, log(i + 1) / log(logn_len))`` at their position ``i``.
        rotated: bool; ``True`` (the default, the Llama/Hugging Face convention) if
            ``q`` and ``k_cache`` carry RoPE at their positions, ``False`` if they are
            raw.
        num_splits: ``None`` (chosen from the shapes, :func:`default_num_splits`) or an
            int ``>= 1``: chunks per row. More splits than key tiles is allowed (the
            spare ones are empty).
        inv_freq: ``None`` (the frequencies ``base ** (-2t / D)``), or RoPE's ``D / 2``
            angular frequencies, a 1-D floating-point tensor ``(D / 2,)`` (any device)
            or a sequence of positive finite floats (a model's own, e.g.
            ``model.model.rotary_emb.inv_freq`` for ``llama3``, ``linear`` or YaRN
            RoPE); ``base`` must then stay at its default. As in :func:`rerope.rerope`:
            a tensor is read on the host on every call (for a GPU tensor a sync, which a
            CUDA graph capture refuses), a :class:`rerope.rope.Frequencies` never is.
        block_table: ``None`` (the contiguous layout above), or a paged cache as
            FlashAttention's ``flash_attn_with_kvcache`` keeps it: an int32 tensor ``(B,
            max_blocks_per_seq)`` on ``q``'s device, and then ``k_cache`` and
            ``v_cache`` are page pools ``(num_blocks, block_size, Hkv, D)``, any
            strides, ``block_size`` one of 16, 32, 64, 128, 256. Logical slot ``j`` of
            row ``b`` (the key of position ``j``, rotated at ``j`` if ``rotated``) is
            slot ``j % block_size`` of page ``block_table[b, j // block_size]``; the
            cache size is ``Nmax = max_blocks_per_seq * block_size``. ``cache_seqlens``
            is then required. Entries for pages past a row's length are never read (they
            may hold anything). An entry the row does use that is not in ``[0,
            num_blocks)`` raises ``ValueError`` for CPU tensors; on a GPU (no host sync)
            its keys are not read and the row comes back as NaN.
        group: ``None``, or Self-Extend's group size ``G`` (an int ``>= 1`` dividing
            ``window``; not with ``leaky``), as in :func:`rerope.rerope`: beyond the
            window the relative position is ``⌊i/G⌋ - ⌊j/G⌋ + window - window/G``, on
            the model's own cache (the keys are turned from ``j`` to ``⌊j/G⌋`` in
            registers). Tiles split their angles as for ReRoPE when ``G`` divides
            ``BLOCK_N``; otherwise one table row per key (``ROW_PER_KEY``).
        return_lse: bool; also return each query row's log-sum-exp (the merge kernel
            writes it with the output; one split: the split kernel). Under
            ``torch.compile`` through its own op, ``torch.ops.rerope.rerope_decode_lse``.

    Returns:
        ``(B, Hq, Nq, D)``, the attention output, in ``q``'s dtype and on its device
        (empty for an empty batch). With ``return_lse``, ``(out, lse)``: ``lse`` ``(B, Hq,
        Nq)`` float32, ``log Σ_j exp(s_ij)`` over the row's visible scaled scores (natural
        log, as FlashAttention's); 0 for a row whose ``cache_seqlens`` is out of range.

    The call is :func:`decode_plan` then :meth:`DecodePlan.run`: its checks and plan are
    made once per layout class and settings, so a decode loop over a growing cache
    reuses one plan.

    Forward only: with grad mode on, inputs that require grad raise ``ValueError`` (use
    :func:`rerope.rerope`). CUDA tensors, or CPU tensors under Triton's CPU interpreter
    (:mod:`rerope.runtime`). Allocates the output and, when ``num_splits > 1``, uses fp32
    partials ``(num_splits, B, Hq, Nq, D)`` and their log-sum-exps, merged by a second
    launch: a buffer each host thread keeps per device and reuses while their shape
    repeats (on a GPU from the default stream only; up to ``SCRATCH_BYTES``; a new one
    per call otherwise, see :func:`_partials`). Where K and V are read through TMA
    descriptors (:func:`use_tma`), Triton also asks for a small scratch buffer per launch
    (the descriptors, 128 bytes each, two per program), from torch's allocator unless the
    caller installed one (``triton.set_allocator``).

    Threads and non-finite inputs: as :func:`rerope.rerope` says.
    """
    check_flag("return_lse", return_lse)
    if torch.compiler.is_compiling():   # an opaque op for the compiler (see _decode_op)
        inv_freq = as_frequencies(inv_freq)
        op = _decode_lse_op if return_lse else _decode_op
        return op(q, k_cache, v_cache, cache_seqlens, window, sm_scale, base, leaky,
                  logn_len, rotated, num_splits,
                  None if inv_freq is None else list(inv_freq), block_table, group)
    _check_forward_only(q, k_cache, v_cache)
    return _call(q, k_cache, v_cache, cache_seqlens, block_table,
                 (window, sm_scale, base, leaky, logn_len, rotated, num_splits,
                  as_frequencies(inv_freq), group), return_lse)


def _call(q, k_cache, v_cache, cache_seqlens, block_table, settings, return_lse=False,
          types=None, heads_last=False):
    """A call: its kept step and arguments where this exact signature ran before
    (:data:`_STEPS`), else its plan. ``types``: ``tuple(map(type, settings))`` where the
    caller keeps it with ``settings``. ``heads_last`` (one query per row, no log-sum-exp: a
    Hugging Face generation step): the result as ``(B, 1, Hq, D)``, the layout a model's
    attention returns, which a kept step allocates directly (:func:`_outputs`)."""
    try:
        exact = (_exact_key(q, k_cache, v_cache, cache_seqlens, block_table, settings,
                            types), return_lse)
        kept = _STEPS.get(exact)
    except (AttributeError, TypeError):   # not tensors, unhashable settings: checks say
        exact, kept = None, None
    if kept is not None:
        step, n_max, args = kept
        if cache_seqlens is not None:
            cache_seqlens = step.plan._checked_lengths(n_max, cache_seqlens, block_table,
                                                       k_cache)
        return _run_step(step, n_max, args, q, k_cache, v_cache, cache_seqlens,
                         block_table, heads_last)[0]
    plan = _plan_for(q, k_cache, v_cache, cache_seqlens, block_table, settings)
    out = plan._run(q, k_cache, v_cache, cache_seqlens, block_table, exact, return_lse)
    return out.transpose(1, 2) if heads_last else out


# --- plan and run ---------------------------------------------------------------------


class _Launches(NamedTuple):
    """The launches of one split count: the split kernel, then (several splits) the
    merge."""

    split: Launcher
    merge: Optional[Launcher]


class _Tables:
    """A plan's rotation tables (:func:`rerope.rotary.rotation_tables`), grown with the
    cache; the outgrown ones stay alive for CUDA graphs that captured their
    addresses."""

    def __init__(self):
        self.rows, self.tables, self.retired = -1, None, []


@dataclass(frozen=True)
class DecodePlan:
    """A checked decode call, ready to run: what :func:`decode_plan` returns.

    Made once per layout class and settings (the plan's ``key``): the tensors' shapes
    but the cache's length, dtypes, devices, alignment and the stride classes Triton
    compiles for, the settings and the :class:`rerope.configs.Config`. What grows with
    the cache is read per :meth:`run` and passed to the launch: the cache's length
    ``Nmax`` (checked), the split count (the caller's ``num_splits``, else
    :func:`default_num_splits` of ``Nmax``), whether TMA pays at that split length, and
    the rotation tables' rows. Its launches are bound once and kept (``steps``, a
    :class:`_Step`) for every ``Nmax`` with the same split count, TMA choice and tables.
    """

    key: tuple                   # the layout class, settings and Config it was made for
    settings: tuple              # rerope_decode's arguments after the tensors, checked
    config: configs.Config
    batch: int
    q_heads: int
    kv_heads: int
    n_queries: int
    head_dim: int
    page_size: int               # keys per page of a paged cache, 0 for contiguous
    window: int
    num_splits: Optional[int]    # the caller's; None: the rule, per length
    split_cap: int               # the rule's most splits: one wave of programs
    tma_min_keys: Optional[int]  # TMA where a split reads this many keys; None: never
    qk_scale: float              # sm_scale · log2(e): the kernel's exp2
    logn_factor: float
    lift: bool                   # bf16 under the interpreter: computed on fp32 copies
    constexprs: dict             # the split kernel's, but WRITE_LSE and TMA
    merge_options: dict          # the merge kernel's warps: the split kernel's
    rotation: tuple              # rotation_tables' arguments after the number of keys
    tables: _Tables = field(default_factory=_Tables, compare=False)
    # (num_splits, tma) -> _Launches
    launches: dict = field(default_factory=dict, compare=False)
    steps: dict = field(default_factory=dict, compare=False)   # return_lse -> _Step

    def run(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None):
        """Run the plan on tensors of its layout class (``ValueError`` otherwise); the
        cache may have grown since (any ``Nmax``). Arguments and result as
        :func:`rerope_decode`'s."""
        try:
            key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table)
            same = key == self.key[0]
        except (AttributeError, TypeError):
            same = False
        if not same:
            raise ValueError("the tensors do not match this DecodePlan (shapes other "
                             "than the cache's length, dtypes, devices, alignment or "
                             "stride classes differ): make a plan for them with "
                             "rerope.decode.decode_plan")
        _check_forward_only(q, k_cache, v_cache)
        return self._run(q, k_cache, v_cache, cache_seqlens, block_table)

    @property
    def bound(self):
        """Whether the plan has run and every launch it made skips Triton's Python
        launch path (:attr:`rerope.launch.Launcher.bound`)."""
        launchers = [launcher for launches in list(self.launches.values())
                     for launcher in launches if launcher is not None]
        return bool(launchers) and all(launcher.bound for launcher in launchers)

    def _run(self, q, k_cache, v_cache, cache_seqlens, block_table, exact=None,
             return_lse=False):
        n_max = self._cache_length(q, k_cache, v_cache, cache_seqlens, block_table)
        if q.numel() == 0:                         # an empty batch: nothing to attend
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            if return_lse:
                return out, torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            return out
        if cache_seqlens is not None:
            cache_seqlens = self._checked_lengths(n_max, cache_seqlens, block_table,
                                                  k_cache)
        return _launch(self, n_max, q, k_cache, v_cache, cache_seqlens, block_table,
                       exact, return_lse)

    def _checked_lengths(self, n_max, cache_seqlens, block_table, k_cache):
        """``cache_seqlens`` (not ``None``) as the kernel reads it (contiguous), checked
        against ``n_max`` with the block table's entries where that is free (CPU
        tensors)."""
        if cache_seqlens.device.type == "cpu":   # free to read; on a GPU, a sync
            _check_lengths_on_host(cache_seqlens, self.n_queries, n_max)
            if block_table is not None:
                _check_block_table_on_host(block_table, cache_seqlens, self.page_size,
                                           k_cache.shape[0])
        return cache_seqlens.contiguous()    # read with unit stride

    def _cache_length(self, q, k_cache, v_cache, cache_seqlens, block_table):
        """``Nmax`` of this call, checked: the one part of the validation the plan's key
        does not cover (a failure reruns the whole of it for its message)."""
        if self.page_size:
            n_max = block_table.shape[1] * self.page_size
            ok = n_max >= self.n_queries and k_cache.shape[0] == v_cache.shape[0] >= 1
        else:
            n_max = k_cache.shape[2]
            ok = v_cache.shape[2] == n_max >= self.n_queries
        if not ok:
            _check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table,
                               *self.settings)
        if self.settings[4] is not None:      # logn_len: the scale at the last position
            check_logn_overflow(self.settings[4], n_max, q.dtype)
        return n_max

    def splits_for(self, n_max):
        """``(num_splits, tma)``: how a run over a cache of ``n_max`` slots launches."""
        rule = max(1, min(self.split_cap, -(-n_max // MIN_KEYS_PER_SPLIT)))
        splits = self.num_splits or rule
        tma = self.tma_min_keys is not None and -(-n_max // splits) >= self.tma_min_keys
        return splits, tma

    def _step_range(self, n_max):
        """``(lo, hi)``: the cache sizes from ``lo`` to ``hi`` slots that launch as
        ``n_max`` does (the same :meth:`splits_for`) on the rotation tables held now (rows
        for ``hi``): the sizes a :class:`_Step` made for ``n_max`` fits."""
        num_splits, tma = self.splits_for(n_max)
        lo, hi = 1, self.tables.rows - TABLE_MARGIN
        if not self.num_splits and self.split_cap > 1:   # the rule: a split per 256 keys
            if num_splits > 1:
                lo = (num_splits - 1) * MIN_KEYS_PER_SPLIT + 1
            if num_splits < self.split_cap:
                hi = min(hi, num_splits * MIN_KEYS_PER_SPLIT)
        if self.tma_min_keys is not None:   # TMA above (tma_min_keys - 1) · splits keys
            edge = (self.tma_min_keys - 1) * num_splits
            lo, hi = (max(lo, edge + 1), hi) if tma else (lo, min(hi, edge))
        return lo, hi

    def _launches(self, num_splits, tma, return_lse=False):
        """The launches for ``num_splits`` splits (made on first use, then kept); with
        ``return_lse`` the split kernel writes its log-sum-exps whatever the split count
        (one split: the final ones)."""
        launches = self.launches.get((num_splits, tma, return_lse))
        if launches is None:
            q_per_kv = self.q_heads // self.kv_heads
            grid = (self.batch * self.kv_heads, num_splits,
                    triton.cdiv(q_per_kv * self.n_queries, self.constexprs["BLOCK_M"]))
            split = Launcher(_decode_split_kernel, grid, **self.constexprs,
                             WRITE_LSE=num_splits > 1 or return_lse, TMA=tma)
            merge = None
            if num_splits > 1:
                n_rows = self.batch * self.q_heads * self.n_queries
                splits_block, lse_block = merge_blocks(num_splits, self.head_dim)
                grid = (triton.cdiv(n_rows, MERGE_ROWS),)
                merge = Launcher(_decode_merge_kernel, grid, HEAD_DIM=self.head_dim,
                                 ROWS=MERGE_ROWS, SPLITS_BLOCK=splits_block,
                                 LSE_BLOCK=lse_block, **self.merge_options)
            if tma and not INTERPRET:
                _ensure_scratch_allocator()   # descriptors live in a scratch buffer
            launches = self.launches[(num_splits, tma, return_lse)] = _Launches(split,
                                                                                merge)
        return launches

    def _rotation_tables(self, n_max):
        """The four tables of :func:`rerope.rotary.rotation_tables`, with rows for
        ``n_max``."""
        held = self.tables
        if held.rows < n_max + TABLE_MARGIN:
            tables = rotation_tables(n_max, *self.rotation).tables
            if held.tables is not None:
                held.retired.append(held.tables)
            rows = [t.shape[0] for t in tables[::2] if t.dim() == 2]
            held.rows = min(rows or [1 << 62])
            held.tables = tables
        return held.tables


def _launch(plan, n_max, q, k_cache, v_cache, cache_seqlens, block_table, exact=None,
            return_lse=False):
    """Run ``plan`` for a cache of ``n_max`` slots, lengths and block table checked:
    allocate the output (and partials), launch the split kernel, then the merge (several
    splits). Through the plan's kept step where it fits ``n_max``, else a new one, kept
    once its launches are bound (:class:`_Step`). With ``exact`` (the call's exact
    signature), keep the step with this call's arguments for it (:data:`_STEPS`)."""
    step = plan.steps.get(return_lse)
    made = step is None or not step.lo <= n_max <= step.hi
    if made:
        step, launches = _make_step(plan, n_max, return_lse)
    out, args = _run_step(step, n_max, None, q, k_cache, v_cache, cache_seqlens,
                          block_table)
    if made:
        if not (launches.split.bound or INTERPRET):
            return out
        step = plan.steps[return_lse] = _make_step(plan, n_max, return_lse)[0]   # bound
    if exact is not None:
        _STEPS.put(exact, (step, n_max, args))
    return out


def _make_step(plan, n_max, return_lse):
    """``(step, launches)``: the :class:`_Step` of ``plan`` for a cache of ``n_max``
    slots, and the :class:`_Launches` it binds."""
    num_splits, tma = plan.splits_for(n_max)
    launches = plan._launches(num_splits, tma, return_lse)
    tables = plan._rotation_tables(n_max)
    merge = launches.merge
    if merge is not None:
        merge = merge.fixed(plan.batch * plan.q_heads * plan.n_queries, num_splits)
    split = launches.split.fixed(plan.qk_scale, plan.logn_factor, *tables)
    return (_Step(plan, num_splits, *plan._step_range(n_max), split, merge, return_lse),
            launches)


def _cache_args(plan, n_max, num_splits, q, k_cache, v_cache, block_table):
    """The split kernel's arguments from ``q_strides`` to ``window`` (what a call's cache
    length decides, passed per launch): the strides, the pool's pages, the head and query
    counts, ``n_max``, the split count and the window clipped to ``n_max``."""
    k_strides, v_strides = k_cache.stride(), v_cache.stride()
    if plan.page_size:    # pools (page, slot, head, dim) in the kernel's order
        k_strides = (k_strides[0], k_strides[2], k_strides[1], k_strides[3])
        v_strides = (v_strides[0], v_strides[2], v_strides[1], v_strides[3])
        table_strides, num_blocks = block_table.stride(), k_cache.shape[0]
    else:
        table_strides, num_blocks = (0, 0), 0
    return (q.stride(), k_strides, v_strides, table_strides, num_blocks, plan.kv_heads,
            plan.q_heads // plan.kv_heads, plan.n_queries, n_max, num_splits,
            min(plan.window, n_max))


def _result(plan, out, final_lse, dtype):
    """``out`` in the caller's dtype, and with ``final_lse`` (not ``None``) the public
    log-sum-exp: natural log, ``(B, Hq, Nq)``."""
    out = out.to(dtype) if plan.lift else out
    if final_lse is None:
        return out
    return out, natural_lse(final_lse).view(out.shape[:3])


def _outputs(plan, num_splits, q, return_lse=False, heads_last=False):
    """``(out, part, lse, final_lse)``: the output, the partials and their log-sum-exps
    (the output itself for one split; else :func:`_partials`), and the merged rows'
    log-sum-exps (``return_lse``; else ``None``; one split: the split kernel's own).
    ``heads_last`` (one query per row): ``out`` is ``(B, 1, Hq, D)``, the same memory as
    ``(B, Hq, 1, D)``, with the strides of its transpose."""
    if heads_last:
        h, d = plan.q_heads, plan.head_dim
        out = torch.empty_strided((plan.batch, 1, h, d), (h * d, d, d, 1), dtype=q.dtype,
                                  device=q.device)
    else:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    n_rows = plan.batch * plan.q_heads * plan.n_queries
    final = (torch.empty(n_rows, dtype=torch.float32, device=q.device) if return_lse
             else None)
    if num_splits == 1:
        return out, out, out if final is None else final, final
    part, lse = _partials(num_splits, n_rows, plan.head_dim, q.device)
    return out, part, lse, final


# A thread keeps its partials buffer up to this size between calls; larger ones are made
# per call (a caller's num_splits may be large; a model's decode step needs ~0.3 MiB).
SCRATCH_BYTES = 16 << 20


class _Scratch(threading.local):
    """This thread's partials buffers: ``device -> ((num_splits, n_rows, d), part, lse)``
    (:func:`_partials`)."""

    def __init__(self):
        self.held = {}


_SCRATCH = _Scratch()


def _partials(num_splits, n_rows, d, device):
    """``(part, lse)``: the split kernel's partials ``(num_splits, n_rows, d)`` and their
    log-sum-exps ``(num_splits, n_rows)``, fp32 views of one allocation (the log-sum-exps
    start 64-byte aligned).

    This thread's buffer for this device where its shape matches (a model's layers, step
    after step), else a new one, kept in its place. Reuse is safe because the
    split kernel writes every element before the merge reads it (stale values are never
    read), and a buffer is only touched by work that runs in order: one per host thread
    (two threads' launches would interleave), and on a GPU only from the legacy default
    stream (stream 0: work on it is ordered; CUDA graphs cannot capture it, and
    cudagraph trees warm up on a stream of their own into a private pool, whose blocks a
    kept buffer must not hold). Other streams, and buffers over ``SCRATCH_BYTES``, get a
    new allocation per call, freed with the call's tensors as before; so does every call
    while torch fills uninitialised memory (``torch.use_deterministic_algorithms`` with
    ``torch.utils.deterministic.fill_uninitialized_memory``: an element a kernel fails to
    write then shows as NaN, as in a fresh buffer)."""
    shape = (num_splits, n_rows, d)
    reuse = (device.type != "cuda"
             or torch._C._cuda_getCurrentRawStream(device.index) == 0)
    if reuse:
        held = _SCRATCH.held.get(device)
        if (held is not None and held[0] == shape
                and not (torch.are_deterministic_algorithms_enabled()
                         and torch.utils.deterministic.fill_uninitialized_memory)):
            return held[1], held[2]
    work = torch.empty(num_splits * n_rows * (d + 1), dtype=torch.float32, device=device)
    part = work.as_strided(shape, (n_rows * d, d, 1))
    lse = work.as_strided((num_splits, n_rows), (n_rows, 1), num_splits * n_rows * d)
    if reuse and work.numel() * 4 <= SCRATCH_BYTES:
        _SCRATCH.held[device] = (shape, part, lse)
    return part, lse


class _Step(NamedTuple):
    """A plan's launches for one split count, bound (:meth:`Launcher.fixed`) to all but
    what a call gives: its tensors and what its cache's length decides
    (:func:`_cache_args`). A plan keeps one per ``return_lse`` (``plan.steps``) and uses
    it for every cache size from ``lo`` to ``hi`` slots, so a cache that grows by a key
    per call binds no launch again."""

    plan: DecodePlan
    num_splits: int
    lo: int                      # it fits caches of lo to hi slots: its split count,
    hi: int                      # TMA choice and rotation tables (DecodePlan._step_range)
    split: object
    merge: object
    return_lse: bool = False


_STEPS = LRUCache()
"""``(exact signature, return_lse) -> (step, n_max, args)``: a call signature met before,
shapes and strides exactly (:func:`_exact_key`), with its plan's :class:`_Step`, its cache
size and the step's per-call arguments (:func:`_cache_args`), so a repeated call is a
lookup, an allocation and the launches (the checks its signature passed hold again;
lengths and block tables on the CPU are still read)."""


def _exact_key(q, k_cache, v_cache, cache_seqlens, block_table, settings, types=None):
    """A call's exact signature: every tensor's shape, strides, dtype, device and 16-byte
    alignment, the settings (and their types: ``types``, computed when ``None``) and the
    Config."""
    return (signature(q, k_cache, v_cache, cache_seqlens, block_table), settings,
            tuple(map(type, settings)) if types is None else types, configs.current())


def _run_step(step, n_max, args, q, k_cache, v_cache, cache_seqlens, block_table,
              heads_last=False):
    """Launch ``step`` for a call it fits, on a cache of ``n_max`` slots (lengths and
    block table checked, ``cache_seqlens`` contiguous): ``(result, args)``, ``args`` the
    call's :func:`_cache_args` (given, or computed when ``None``); ``heads_last``: as
    :func:`_outputs`."""
    plan = step.plan
    dtype = q.dtype
    if plan.lift:                         # bf16 under the interpreter: fp32 copies
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    if args is None:
        args = _cache_args(plan, n_max, step.num_splits, q, k_cache, v_cache,
                           block_table)
    out, part, lse, final_lse = _outputs(plan, step.num_splits, q, step.return_lse,
                                         heads_last)
    step.split(q, k_cache, v_cache, cache_seqlens, block_table, part, lse, *args)
    if step.merge is not None:
        step.merge(part, lse, out, final_lse)
    return _result(plan, out, final_lse, dtype), args


def _layout(t, size=0):
    """What a compiled kernel depends on in a tensor besides its shape: dtype, device,
    16-byte alignment, and its strides' classes (:func:`_stride_classes`)."""
    return t.dtype, t.device, t.data_ptr() % 16 == 0, _stride_classes(t.stride(), size)


_CLASSES = {}    # (strides, element size) -> classes: one dict hit per tensor and call


def _stride_classes(strides, size):
    """Per stride what Triton specialises on (1, a multiple of 16, 64-bit) and, given
    the element ``size``, what TMA asks (a multiple of 16 bytes)."""
    classes = _CLASSES.get((strides, size))
    if classes is None:
        if len(_CLASSES) >= 4096:      # bounded: a long run of new layouts starts over
            _CLASSES.clear()
        classes = _CLASSES[strides, size] = tuple(
            [(s == 1, s % 16 == 0, s * size % 16 == 0, s >> 31) for s in strides])
    return classes


def _call_key(q, k_cache, v_cache, cache_seqlens, block_table):
    """The tensors' part of a plan's key: everything but the cache's length (``Nmax``:
    the slot axis of a contiguous cache, the pages of a pool and the block table's
    width)."""
    if block_table is None:
        k_shape = k_cache.shape[:2] + k_cache.shape[3:]
        v_shape = v_cache.shape[:2] + v_cache.shape[3:]
        table = None
    else:
        k_shape, v_shape = k_cache.shape[1:], v_cache.shape[1:]
        table = (block_table.shape[0], _layout(block_table))
    lengths = (None if cache_seqlens is None else
               (cache_seqlens.shape, _layout(cache_seqlens)))
    size = k_cache.element_size()
    return (q.shape, _layout(q), k_shape, _layout(k_cache, size), v_shape,
            _layout(v_cache, size), lengths, table)


PLANS = PlanCache()
"""The plans of ``rerope_decode`` (and of ``rerope``'s decode steps), keyed by layout class,
settings and :class:`rerope.Config` (a :class:`rerope.launch.PlanCache`: ``len(PLANS)``,
``PLANS.built``, ``PLANS.clear()``)."""


def decode_plan(q, k_cache, v_cache, window, cache_seqlens=None, sm_scale=None,
                base=10000.0, leaky=None, logn_len=None, rotated=True, num_splits=None,
                inv_freq=None, block_table=None, group=None):
    """The :class:`DecodePlan` of a :func:`rerope_decode` call (the same arguments,
    checked the same way): made and checked on the first call of its layout class and
    settings under the active :class:`rerope.configs.Config`, then returned as it is,
    also for a cache that has grown since. ``plan.run(q, k_cache, v_cache,
    cache_seqlens, block_table)`` runs it."""
    return _plan_for(q, k_cache, v_cache, cache_seqlens, block_table,
                     (window, sm_scale, base, leaky, logn_len, rotated, num_splits,
                      as_frequencies(inv_freq), group))


def _plan_for(q, k_cache, v_cache, cache_seqlens, block_table, settings):
    """The plan of a call (settings as :attr:`DecodePlan.settings`): the kept one of its
    key, or a new one once the call passes every check."""
    config = configs.current()
    try:
        key = (_call_key(q, k_cache, v_cache, cache_seqlens, block_table), settings,
               tuple(map(type, settings)), config)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):   # not tensors, unhashable settings: checks say
        key, plan = None, None
    if plan is None:
        _check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table, *settings)
        plan = _make_plan(key, q, k_cache, v_cache, block_table, settings, config)
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _make_plan(key, q, k_cache, v_cache, block_table, settings, config):
    (window, sm_scale, base, leaky, logn_len, rotated, num_splits, inv_freq,
     group) = settings
    batch, hq, n_queries, d = q.shape
    paged = block_table is not None
    hkv = k_cache.shape[2] if paged else k_cache.shape[1]
    q_per_kv = hq // hkv
    launch, programs_per_sm = launch_config(d, config)
    options = {} if INTERPRET else {k: launch[k] for k in ("num_warps", "num_stages")}
    # no cache holds more keys than an int32 length counts: the window's tables beyond
    # that are never read
    rotation = (d, min(int(window), 2**31 - 1), leaky, rotated, q.device, base,
                inv_freq, group)
    flags = rotation_tables(1, *rotation).flags
    prepared, _ = prepare_for_device(q, k_cache, v_cache)   # what the kernel sees
    tma_min_keys = None
    if use_tma(prepared[1], prepared[2], paged, 1 << 62, config.tma):
        tma_min_keys = 0 if config.tma == "on" else TMA_MIN_KEYS
    return DecodePlan(
        key=key, settings=settings, config=config, batch=batch, q_heads=hq,
        kv_heads=hkv,
        n_queries=n_queries, head_dim=d, page_size=k_cache.shape[1] if paged else 0,
        window=int(window), num_splits=num_splits,
        split_cap=_split_cap(batch, hkv, q_per_kv, n_queries, sm_count(q.device),
                             programs_per_sm),
        tma_min_keys=tma_min_keys,
        qk_scale=(d ** -0.5 if sm_scale is None else float(sm_scale)) * LOG2E,
        logn_factor=logn_factor(logn_len), lift=prepared[0].dtype != q.dtype,
        constexprs=dict(HEAD_DIM=d, BLOCK_M=block_m(q_per_kv, n_queries),
                        BLOCK_N=launch["BLOCK_N"], TURN_IN=flags["TURN_IN"],
                        TURN_OUT=flags["TURN_OUT"],
                        # Self-Extend's ⌊(j0 + r)/G⌋ splits only where G divides the
                        # tile
                        ROW_PER_KEY=(group is not None
                                     and launch["BLOCK_N"] % group != 0),
                        LOGN=logn_len is not None,
                        PAGE_SIZE=k_cache.shape[1] if paged else 0,
                        DOT_PRECISION=dot_precision(prepared[0].dtype), **options),
        merge_options={k: v for k, v in options.items() if k == "num_warps"},
        rotation=rotation)


def _check_forward_only(q, k_cache, v_cache):
    """``rerope_decode`` has no backward: refuse inputs that want one rather than return
    an output silently cut from the graph."""
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if getattr(t, "requires_grad", False):
                raise ValueError(
                    f"{name} requires grad, but rerope_decode is forward-only (no "
                    "backward): use rerope.rerope for gradients, or call rerope_decode "
                    "under torch.no_grad() / torch.inference_mode()")


# Under torch.compile the op is opaque: the compiler calls it as it is (its launches are
# captured whole by mode="reduce-overhead"'s CUDA graphs) instead of tracing into
# Triton's launcher. The output is a fresh contiguous tensor of q's shape, in q's dtype.
@torch.library.custom_op("rerope::rerope_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: Optional[torch.Tensor], window: int,
               sm_scale: Optional[float], base: float, leaky: Optional[float],
               logn_len: Optional[float], rotated: bool,
               num_splits: Optional[int], inv_freq: Optional[list[float]] = None,
               block_table: Optional[torch.Tensor] = None,
               group: Optional[int] = None) -> torch.Tensor:
    # inv_freq comes checked by rerope_decode: kept as it is (no per-call conversion)
    return _call(q, k_cache, v_cache, cache_seqlens, block_table,
                 (window, sm_scale, base, leaky, logn_len, rotated, num_splits,
                  None if inv_freq is None else Frequencies(inv_freq), group))


@_decode_op.register_fake
def _(q, *args):
    return q.new_empty(q.shape)


@torch.library.custom_op("rerope::rerope_decode_lse", mutates_args=())
def _decode_lse_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_seqlens: Optional[torch.Tensor], window: int,
                   sm_scale: Optional[float], base: float, leaky: Optional[float],
                   logn_len: Optional[float], rotated: bool,
                   num_splits: Optional[int], inv_freq: Optional[list[float]] = None,
                   block_table: Optional[torch.Tensor] = None,
                   group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_decode_op` with ``return_lse=True``: ``(out, lse)``, ``lse`` ``(B, Hq, Nq)``
    float32."""
    return _call(q, k_cache, v_cache, cache_seqlens, block_table,
                 (window, sm_scale, base, leaky, logn_len, rotated, num_splits,
                  None if inv_freq is None else Frequencies(inv_freq), group), True)


@_decode_lse_op.register_fake
def _(q, *args):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
