"""Decoding with a KV cache: split-KV ("flash-decoding") ReRoPE attention. Chapter 8 of the book.

A decode step has one query (or a few speculative ones) per sequence against a long cache, so
it does almost no arithmetic per byte: it is bound by reading K and V once from memory. Two
things keep it there:

* **Split-KV.** One program per (batch row, KV head) would leave most of a GPU idle at batch 1
  (8 KV heads, 132 SMs). The keys of each row are cut into ``num_splits`` chunks; a program
  folds one chunk for every query of one KV-head group (grouped-query attention: the group's
  ``Hq / Hkv`` heads times ``Nq`` queries form the ``M`` rows of the tile, so each K/V tile is
  loaded once for all of them) and writes a partial output and its log-sum-exp; the partials
  are combined exactly (the online softmax's merge rule, :func:`_merge_rows`) by the last
  program of each row group to finish, in the same launch (an atomic counter per group says
  which is last: one launch per step) where that merge is one step (:func:`fused_merge`),
  else by :func:`_decode_merge_kernel` in a second launch.
* **One cache, rotated on the fly.** The kernel reads the cache the model already keeps — keys
  RoPE-rotated at their positions (``rotated=True``, the Llama convention) or raw
  (``rotated=False``) — and applies each product's rotation in registers, with the speeds and
  offsets of :func:`rerope.rotary.rotation_plan` (no re-rotated copy, no second cache). With a
  rotated cache the product inside the window needs no rotation at all (``q_rot · k_rot`` is
  RoPE's score), and outside it the key is turned back by ``R(-j)``: ``R(w - i) q_rot ·
  R(-j) k_rot = R(w) q · k``, ReRoPE's clamped score.
* **Contiguous or paged.** The cache is ``(B, Hkv, Nmax, D)`` (any strides), or a paged pool
  ``(num_blocks, block_size, Hkv, D)`` with a block table, FlashAttention's layout
  (``block_table=``): only where a key tile is loaded from changes (:func:`_key_rows`, the
  ``PAGED`` constexpr); positions, rotations, regions and splits stay logical.
* **Tiles by the copy engine where chunks are long.** On Hopper a contiguous fp16/bf16 cache is
  read through TMA tensor descriptors (the ``TMA`` constexpr, :func:`use_tma`) where each split
  covers at least ``TMA_MIN_KEYS`` keys, pointer loads elsewhere. On the H200 that took the
  steps with B >= 8 and >= 32k keys 4-11 % faster (to 0.94-1.00x the faster SDPA); splits of 1024
  keys or fewer were 2-11 % slower with descriptors (each program builds its own after reading
  its row's length), so they keep pointer loads (perf/decode_issue19.md, session 7).

Regions along a row's keys ``0 … L-1`` (queries at ``L-Nq … L-1``, causal): keys before
``L - Nq - w + 1`` are outside the window for every query — nearly all of a long cache — and
get the one-product loop with no mask at all; then at most a few masked tiles where the window
edge falls (both products, each masked to its side); then the last ``w`` keys, inside for every
query, with a mask only on the tiles that hold the window edge or the causal diagonal of the
``Nq`` queries.

Key angles come from :func:`rerope.rotary.rope_table`, without reading a table row per key
(that would add as many bytes as the keys themselves): a tile starting at key ``j0`` needs
``R(σ (j0 + r))`` for ``r < BLOCK_N``, and ``R(σ j0) R(σ r) k`` splits it in two. The kernel
holds the table's first ``BLOCK_N`` rows in registers and turns each key by ``R(σ r)``, and turns
the tile's ``BLOCK_M`` query rows by ``R(-σ j0)`` instead of the keys by ``R(σ j0)`` (one table
row per tile): ``q · R(σ j0) R(σ r) k = R(-σ j0) q · R(σ r) k`` (``ANGLES = 3``; the other
variants of :func:`_decode_pass` were measured too).
"""

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from ._validate import (Frequencies, as_frequencies, check_alike, check_head_dim, check_logn_overflow, check_qkv,
                        check_rope_args, check_sm_scale)
from .caches import CACHE_SIZE, LRUCache
from .launch import (Launcher, _capability, _ensure_scratch_allocator, _tma_layout_ok,
                     signature)
from .online_softmax import LOG2E, _softmax_step
from .regions import INSIDE, OUTSIDE, _nth_tile, _tile_count
from .rotary import (_logn_scale, _rotate, _table_rows, _unrotate, logn_factor,
                     rotation_tables)
from .runtime import (INTERPRET, INTERPRETER_LOCK, dot_precision, launching,
                      prepare_for_device)

MAX_QUERIES = 16          # Nq per row: one token, or a few speculative ones

# Launch configuration. BLOCK_N keys per tile; BLOCK_M rows (group heads × queries) per program,
# at least 16 (the smallest tl.dot), at most MAX_BLOCK_M (more rows: several programs per group).
# The interpreter uses 16-key tiles so that short test caches still cross several tiles.
# ANGLES: how a key tile gets its rotation angles (see _decode_pass). PROGRAMS_PER_SM: how many
# programs of GPU_CONFIG are resident per SM (its ~255 registers per thread allow two), for the
# splits rule (:func:`default_num_splits`). REROPE_DECODE_CONFIG="BLOCK_N,ANGLES,num_warps,
# num_stages,programs per SM" overrides both. Chosen on the H200 by
# ``python -m benchmarks.decode --tune`` (2026-12-01: meta.tuning of book/data/decode_h200.json
# as of commit 10b3661): 4 warps beat 8 by 1.45x at 128k keys; ANGLES 3, 1 and 0 are within 2 %
# of each other, 32-key tiles 25 % slower.
GPU_CONFIG = dict(BLOCK_N=64, ANGLES=3, num_warps=4, num_stages=3)
# Per head dim where the H200 measured a better one (GPU_CONFIG for the others; issue 19,
# perf/runs/tune_decode_h200.json, perf/NOTES.md): at D=64, 128-key tiles take B=8 at
# 128k keys from 669 to 529 µs (8 warps, 256-key tiles or 2 stages lose). At D=128, 4 stages
# and 3 are within 1.5 %; 128-key tiles lose (1.3x at 4 warps). 3 or 4 programs per SM in the
# splits rule are no faster than 2 (3 is up to 1.3x slower: a second partial wave). An earlier
# benchmark sweep timed evict-first loads (EVICT, no change); 4 stages over the 9 (B, context)
# shapes of the grid (perf/runs/decode_round2_h200.json): D=128 from 3 % faster (B=8, 128k) to
# 7 % slower (B=1, 32k), D=64 up to 8 % slower; not adopted. With TMA loads (session 7, the
# grid's 18 bf16 shapes, perf/runs/decode_h19s7_call1_h200.json): 4 stages 1-7 % slower but at
# D=128 B=32 128k (3 % faster); ANGLES 1 within 2 % at D=128, 0.5-6 % slower at D=64;
# maxnreg=168 (the kernel holds 255 registers, 2 programs per SM) with 3 programs per SM in
# the splits rule: it spills, D=128 1.10-1.60x slower, D=64 2-13 %. None adopted.
HEAD_DIM_CONFIGS = {64: dict(BLOCK_N=128, ANGLES=3, num_warps=4, num_stages=3)}
PROGRAMS_PER_SM = 2
if configs.SETTINGS.decode_config:                 # REROPE_DECODE_CONFIG (rerope.configs)
    _n, _a, _w, _s, PROGRAMS_PER_SM = configs.SETTINGS.decode_config
    GPU_CONFIG = dict(BLOCK_N=_n, ANGLES=_a, num_warps=_w, num_stages=_s)
    HEAD_DIM_CONFIGS = {}
INTERPRETER_CONFIG = dict(BLOCK_N=16, ANGLES=GPU_CONFIG["ANGLES"])
# Paged caches: pages of 16 to 256 keys, a power of two (a page then holds whole key tiles, or
# a tile whole pages).
PAGE_SIZES = (16, 32, 64, 128, 256)
# Their block-table entries (:func:`page_loads`): one scalar load per page of a tile when a tile
# spans at most MAX_SCALAR_PAGES pages, else a gather per key (at 8 pages per tile, D=64 with
# 16-key pages, the gather measured 0.80-0.87x of contiguous, scalars 0.71-0.80x; loading the
# gather one tile ahead, 0.79-0.88x, was not kept: perf/runs/decode_round3_h200.json).
# PAGE_LOADS_RULE (0 or 1) forces one variant (measurements).
MAX_SCALAR_PAGES = 4
PAGE_LOADS_RULE = None
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64
# K and V tiles through TMA tensor descriptors (:func:`use_tma`): under ``REROPE_TMA=auto``
# (rerope.configs.TMA, the default) for contiguous fp16/bf16 caches on Hopper or newer at
# these head dims, where each split reads at least TMA_MIN_KEYS keys of the cache;
# ``REROPE_TMA=1`` forces it wherever the layout allows (the interpreter too), ``0`` never.
# H200, bf16, window 2048 (perf/runs/decode_h19s7_call1_h200.json, mean of two rounds, µs,
# pointer loads -> TMA): long chunks gain, D=128 B=32 at 32k / 128k 1050.5 -> 971.7 /
# 4165.9 -> 3832.2, B=8 at 32k / 128k 274.9 -> 263.2 / 1094.4 -> 986.2, B=1 at 128k (4032
# keys per split) 150.6 -> 146.2; D=64 B=32 520.9 -> 494.7 / 2144.8 -> 2024.5, B=8 151.5 ->
# 145.7 / 543.3 -> 508.1, B=1 at 128k 86.7 -> 86.5; chunks of 1024 keys or fewer lose (each
# program builds its descriptors after reading its row's length): B=1 at 4k / 32k, D=128
# 18.4 -> 19.9 / 54.3 -> 56.7, D=64 14.6 -> 16.2 / 36.0 -> 38.5; B=8 at 4k 53.1 -> 54.7,
# 35.1 -> 35.9. One split of 4096 keys (B=32 at 4k): within 0.6 %.
TMA_HEAD_DIMS = (64, 128)
TMA_MIN_KEYS = 2048

# The splits rule (see :func:`default_num_splits`).
MIN_KEYS_PER_SPLIT = 256  # never cut a row into chunks shorter than this (merge overhead)
MAX_SPLITS = 128
MERGE_SPLITS_BLOCK = 64   # partials the merge folds per step (16: 1-3 % slower at B=1, 33 splits)
MERGE_TILE = 8192         # at most this many partial elements per step (registers)
# Rows merged at once (see merge_blocks): by the merge kernel, one per program (its programs
# run side by side; the same bits and speed as before the fused merge), and by the split
# kernel's fused merge, where one program merges all rows of its tile (4 at once; one at a time
# the fused step was slower: B=1, D=128, 32k 63.0 against 54.7 µs, Nq=8 143.5 against 80.9;
# perf/runs/decode_h19s5_call1_h200.json).
MERGE_ROWS = 1
FUSED_MERGE_ROWS = 4

# The merge in the split kernel (see :func:`fused_merge`): one launch per step instead of two.
# Opt-in (False: two launches; None: the rule; True: always): its counters are per stream, so
# CUDA graphs captured on one stream must not replay at once on several streams.
FUSED_MERGE = configs.SETTINGS.fused_merge
# The merge counters (see :func:`merge_counters`): at least this many per buffer.
MIN_COUNTERS = 4096


# --- the split kernel -----------------------------------------------------------------------------


@triton.jit
def _scores(q_a, q_b, k_a, k_b, HALF: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``q · kᵀ`` as two ``D/2``-wide products (``tl.dot`` needs ``D/2 >= 16``; D=16 sums)."""
    if HALF >= 16:
        scores = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PRECISION)
        return tl.dot(q_b, tl.trans(k_b), scores, input_precision=DOT_PRECISION)
    else:
        return (tl.sum(q_a.to(tl.float32)[:, None, :] * k_a.to(tl.float32)[None, :, :], 2)
                + tl.sum(q_b.to(tl.float32)[:, None, :] * k_b.to(tl.float32)[None, :, :], 2))


@triton.jit
def _decode_pass(acc, l_i, m_i, q_a, q_b, K, V, sk_n, sk_d, sv_n, sv_d, Table, cos_r, sin_r,
                 positions, walk, n_keys, window, qk_scale, pages,
                 PRODUCT: tl.constexpr, MASKED: tl.constexpr, ROT_KEYS: tl.constexpr,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 ANGLES: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 EVICT: tl.constexpr, PAGE_LOADS: tl.constexpr, TMA: tl.constexpr,
                 dtype: tl.constexpr):
    """Fold the key tiles of ``walk`` (``(lo1, hi1, lo2, hi2)``) into the softmax state.

    ``q_a, q_b``: the halves of the queries, already rotated for this product (fp32).
    ``K, V`` point at row 0 of this (batch, KV head). With ``ROT_KEYS`` each key tile is turned
    by ``R(σ j)``, its angles from the table (``ANGLES``): 0, ``cos_r, sin_r`` (``BLOCK_N × D/2``,
    held in registers) give ``σ r θ`` for ``r < BLOCK_N`` and the table row of the tile's first
    key ``σ j0 θ``, combined by angle addition; 1, the same with ``cos_r, sin_r`` re-read every
    tile (cache hits: fewer registers); 2, one table row per key; 3 (the default), the keys
    turned by ``R(σ r)`` only and the queries by ``R(-σ j0)`` instead,
    ``q · R(σ j0) R(σ r) k = R(-σ j0) q · R(σ r) k``: ``BLOCK_M`` query rows per tile instead of
    a second rotation of ``BLOCK_N`` key rows. ``MASKED`` tiles keep only keys ``j < n_keys``,
    ``j <= i`` and on this product's side of the window; loads past ``n_keys``
    read nothing (a poisoned cache stays unread).

    ``PAGED``: ``K, V`` point at page 0 of this KV head and ``pages`` is ``(BlockTable row,
    its stride, sk_page, sv_page, num_blocks)``; key ``j`` lives in slot ``j % PAGE_SIZE`` of
    page ``BlockTable[j // PAGE_SIZE]`` (:func:`_key_rows`), the entries as :func:`_tile_pages`
    loads them (``PAGE_LOADS``, :func:`page_loads`): 0, a gather per key; 1, one scalar load
    per page of the tile.

    ``dtype``: the cache's element type (the keys are turned in fp32 and go back to it).
    ``TMA`` (contiguous caches only): ``K, V`` are tensor descriptors of this row's ``n_keys``
    keys (:func:`_kv_sources`), ``K``'s blocks ``BLOCK_N × D/2`` (the two halves are two
    loads), ``V``'s ``BLOCK_N × D``; rows at and past ``n_keys`` come back as zeros without
    being read, as the masked pointer loads do.
    """
    offs_n = tl.arange(0, BLOCK_N)
    halves = tl.arange(0, HALF)
    qd_a, qd_b = q_a.to(dtype), q_b.to(dtype)
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, BLOCK_N)
    for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):
        start = tl.multiple_of(_nth_tile(t, lo1, n1, lo2, BLOCK_N), BLOCK_N)
        cols = start + offs_n
        if TMA:         # the bulk tensor-copy engine; zeros past n_keys (no mask needed)
            k_a = K.load([start, 0])
            k_b = K.load([start, HALF])
            v = V.load([start, 0])
        else:
            if PAGED:
                page = _tile_pages(pages, start, n_keys, BLOCK_N, PAGE_SIZE, PAGE_LOADS == 1)
                k_rows, v_rows, paged_ok = _key_rows(pages, page, cols, sk_n, sv_n, BLOCK_N,
                                                     PAGE_SIZE)
            else:
                k_rows, v_rows = cols.to(tl.int64) * sk_n, cols.to(tl.int64) * sv_n
            k_ptrs = K + k_rows[:, None] + halves[None, :] * sk_d
            v_ptrs = V + v_rows[:, None] + tl.arange(0, 2 * HALF)[None, :] * sv_d
            if MASKED or PAGED:
                if MASKED and PAGED:
                    live = ((cols < n_keys) & paged_ok)[:, None]
                elif MASKED:
                    live = (cols < n_keys)[:, None]
                else:
                    live = paged_ok[:, None]
                k_a = tl.load(k_ptrs, mask=live, other=0.0, eviction_policy=EVICT)
                k_b = tl.load(k_ptrs + HALF * sk_d, mask=live, other=0.0,
                              eviction_policy=EVICT)
                v = tl.load(v_ptrs, mask=live, other=0.0, eviction_policy=EVICT)
            else:
                k_a = tl.load(k_ptrs, eviction_policy=EVICT)
                k_b = tl.load(k_ptrs + HALF * sk_d, eviction_policy=EVICT)
                v = tl.load(v_ptrs, eviction_policy=EVICT)
        if ROT_KEYS:
            if ANGLES == 2:      # one table row per key
                cos, sin = _table_rows(Table, cols, HALF)
            else:                # row j0 and the first BLOCK_N rows
                if ANGLES == 1:
                    cos_r, sin_r = _table_rows(Table, offs_n, HALF)
                row = Table + start.to(tl.int64) * (2 * HALF)
                cos_0 = tl.load(row + halves)[None, :]
                sin_0 = tl.load(row + HALF + halves)[None, :]
                if ANGLES == 3:  # the queries take the tile's turn R(σ j0), inverted
                    qt_a, qt_b = _unrotate(q_a, q_b, cos_0, sin_0)
                    qd_a, qd_b = qt_a.to(dtype), qt_b.to(dtype)
                    cos, sin = cos_r, sin_r
                else:            # angle addition: cos(σ (j0 + r) θ), sin(σ (j0 + r) θ)
                    cos = cos_r * cos_0 - sin_r * sin_0
                    sin = sin_r * cos_0 + cos_r * sin_0
            k_a, k_b = _rotate(k_a.to(tl.float32), k_b.to(tl.float32), cos, sin)
            k_a, k_b = k_a.to(dtype), k_b.to(dtype)
        scores = _scores(qd_a, qd_b, k_a, k_b, HALF, DOT_PRECISION)
        if MASKED:
            distance = positions[:, None] - cols[None, :]
            if PRODUCT == INSIDE:
                keep = (distance < window) & (distance >= 0)
            else:
                keep = distance >= window
            keep = keep & (cols[None, :] < n_keys)
            scores = tl.where(keep, scores, float("-inf"))
        if PAGED:       # a block-table entry out of range: NaN scores, the row comes out NaN
            scores = tl.where(paged_ok[None, :], scores, float("nan"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _tile_pages(pages, start, n_keys, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                SCALARS: tl.constexpr):
    """The block-table entries of the key tile from ``start`` (int64): one scalar when a page
    holds the whole tile (``PAGE_SIZE >= BLOCK_N``, both powers of two, the tile aligned), else
    one per key (``BLOCK_N``): a gather, or with ``SCALARS`` one scalar load per page of the
    tile. Entries at and past ``n_keys`` are not read (the table may be shorter than the tile)
    and come back 0.

    Why scalars: a K/V address that waits on a tensor load of the same iteration can make the
    pipeliner give that load a stage of its own, and K and V are then prefetched one tile
    ahead instead of ``num_stages - 1`` (the gather at D=128: 16- and 32-key pages at
    0.65-0.72x of the contiguous layout); scalar loads are not pipelined, so K and V keep
    their depth (0.84-0.90x and 0.95-0.97x), at one load per page.
    """
    table, st_page, sk_page, sv_page, num_blocks = pages
    if PAGE_SIZE >= BLOCK_N:
        return tl.load(table + (start // PAGE_SIZE) * st_page, mask=start < n_keys,
                       other=0).to(tl.int64)
    elif SCALARS:
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
    """Where the keys ``cols`` (one tile) of one row live in a paged cache, given the tile's
    block-table entries ``page`` (:func:`_tile_pages`).

    Returns the K and V row offsets (int64, from page 0 of the KV head) and whether each key's
    block-table entry is a page of the cache (``0 <= page < num_blocks``; the loads skip the
    others).
    """
    table, st_page, sk_page, sv_page, num_blocks = pages
    page = tl.full([BLOCK_N], 0, tl.int64) + page
    ok = (page >= 0) & (page < num_blocks)
    slot = cols % PAGE_SIZE
    return page * sk_page + slot * sk_slot, page * sv_page + slot * sv_slot, ok


@triton.jit
def _kv_sources(K, V, sk_n, sv_n, n_keys, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                TMA: tl.constexpr):
    """How :func:`_decode_pass` reads the keys and values of one row (``K, V`` at its slot 0):
    with ``TMA`` two tensor descriptors over its ``n_keys`` keys (rows past them read as zeros,
    unread), ``K``'s blocks half a head wide; otherwise the pointers themselves."""
    if TMA:
        return (tl.make_tensor_descriptor(K, shape=[n_keys, 2 * HALF], strides=[sk_n, 1],
                                          block_shape=[BLOCK_N, HALF]),
                tl.make_tensor_descriptor(V, shape=[n_keys, 2 * HALF], strides=[sv_n, 1],
                                          block_shape=[BLOCK_N, 2 * HALF]))
    else:
        return K, V


@triton.jit
def _query_halves(q_a, q_b, Table, Offset, positions, ROT_TABLE: tl.constexpr,
                  HALF: tl.constexpr):
    """The query halves (fp32) rotated by ``R(σ i + offset)`` for one product: the offset's
    ``[cos | sin]`` vector, turned by the table rows of the positions when ``σ != 0``."""
    freqs = tl.arange(0, HALF)
    cos = tl.load(Offset + freqs)[None, :]
    sin = tl.load(Offset + HALF + freqs)[None, :]
    if ROT_TABLE:
        cos_p, sin_p = _table_rows(Table, positions, HALF)
        cos, sin = cos_p * cos - sin_p * sin, sin_p * cos + cos_p * sin
    return _rotate(q_a, q_b, cos, sin)


@triton.jit
def _chunk_walks(n_keys, n_queries, window, split, num_splits, BLOCK_N: tl.constexpr):
    """The keys of one split and how they are walked: ``(lo, c1, c2, c3, hi)``.

    The row's ``n_keys`` keys are cut into ``num_splits`` tile-aligned chunks of equal length
    (the last shorter, spare ones empty); this split owns ``[lo, hi)``, walked as
    ``[lo, c1)`` outside the window for every query, one product, no mask |
    ``[c1, c2)`` the window's edge: both products, masked |
    ``[c2, c3)`` inside for every query and causal-visible to all, no mask |
    ``[c3, hi)`` the causal edge of the ``Nq`` queries (and the ragged last tile), masked.
    Queries sit at ``n_keys - n_queries …``; all operands stay non-negative before dividing.
    """
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, n_keys), lo)
    all_outside = n_keys - n_queries - window + 1   # keys below: outside for every query
    some_inside = tl.maximum(n_keys - window, 0)    # keys from here on: inside for every query
    all_visible = n_keys - n_queries + 1            # keys below: causal-visible to every query
    c1 = tl.minimum(tl.maximum(tl.maximum(all_outside, 0) // BLOCK_N * BLOCK_N, lo), hi)
    c2 = tl.minimum(tl.maximum(tl.cdiv(some_inside, BLOCK_N) * BLOCK_N, c1), hi)
    c3 = tl.minimum(tl.maximum(all_visible // BLOCK_N * BLOCK_N, c2), hi)
    return lo, c1, c2, c3, hi


@triton.jit
def _chunk_map_kernel(Out, n_keys, n_queries, window, num_splits, BLOCK_N: tl.constexpr):
    """One program per split: write :func:`_chunk_walks` (the book draws it, tests check it)."""
    split = tl.program_id(0)
    lo, c1, c2, c3, hi = _chunk_walks(n_keys, n_queries, window, split, num_splits, BLOCK_N)
    base = Out + split * 5
    tl.store(base, lo)
    tl.store(base + 1, c1)
    tl.store(base + 2, c2)
    tl.store(base + 3, c3)
    tl.store(base + 4, hi)


def chunk_map(n_keys, n_queries, window, num_splits, block_n):
    """``(num_splits, 5)`` int tensor of ``(lo, c1, c2, c3, hi)`` per split, computed by the
    kernel's own :func:`_chunk_walks` (see there for what the five cut points mean)."""
    device = "cpu" if INTERPRET else "cuda"
    out = torch.zeros(num_splits, 5, dtype=torch.int32, device=device)
    with launching():              # a direct launch: the interpreter's lock (rerope.runtime)
        _chunk_map_kernel[(num_splits,)](out, n_keys, n_queries, min(window, n_keys), num_splits,
                                         BLOCK_N=block_n)
    return out.cpu()


# ``n_max`` (the cache length) grows by one per generated token in a Hugging Face model's
# dynamic cache; Triton would otherwise compile a second variant the first time it is a
# multiple of 16, in the middle of generation.
@triton.jit(do_not_specialize=["n_max"])
def _decode_split_kernel(
    Q, K, V, SeqLens, BlockTable, Out, Lse, Final, Counters, TableIn, OffsetIn, TableOut,
    OffsetOut,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    so_s, so_b, so_h, so_n, so_d, sl_s, sl_b, sl_h, sl_n, st_b, st_p, num_blocks,
    n_kv_heads, group, n_queries, n_max, num_splits, window, qk_scale, logn_factor,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROT_KEYS_IN: tl.constexpr, ROT_KEYS_OUT: tl.constexpr, LOGN: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, ANGLES: tl.constexpr,
    PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 16, EVICT: tl.constexpr = "",
    PAGE_LOADS: tl.constexpr = 1, FUSED_MERGE: tl.constexpr = False,
    MERGE_ROWS: tl.constexpr = 1, SPLITS_BLOCK: tl.constexpr = 1, LSE_BLOCK: tl.constexpr = 1,
    TMA: tl.constexpr = False,
):
    """Grid ``(B · Hkv, num_splits, cdiv(group · Nq, BLOCK_M))``: one chunk of one row's keys
    for the ``BLOCK_M`` (head, query) rows of one KV-head group.

    Writes the chunk's normalised output to ``Out`` (a partial ``(S, B, Hq, Nq, D)`` buffer, or
    the final output when ``num_splits == 1``, then ``WRITE_LSE`` is off) and its log-sum-exp
    (log2 units, ``-inf`` for a chunk with no visible key) to ``Lse``. A row whose
    ``cache_seqlens`` entry is out of range (``< Nq`` or ``> Nmax``) gets NaN.

    ``FUSED_MERGE`` (with ``num_splits > 1``): the merge happens here, not in
    :func:`_decode_merge_kernel`. After writing its partial, each program counts itself in
    ``Counters[program_id(0), program_id(2)]`` (int32, ``(B · Hkv, cdiv(group · Nq,
    BLOCK_M))``, zero before the launch); the one that finds ``num_splits - 1`` there is the
    last of its rows' splits: it merges their partials into ``Final`` (``(B, Hq, Nq, D)``
    contiguous) with :func:`_merge_rows`, ``MERGE_ROWS`` rows and ``SPLITS_BLOCK`` partials
    per step, the merge kernel's arithmetic in the same order, and sets the
    counter back to zero for the next launch (a CUDA graph replays with no memset).

    ``PAGED``: ``K, V`` are ``(num_blocks, PAGE_SIZE, Hkv, D)`` pools (the ``sk_b, sk_n``
    strides step pages and slots) and ``BlockTable`` ``(B, max_blocks)`` (strides ``st_b,
    st_p``) maps a row's logical page ``j // PAGE_SIZE`` to its page; ``Nmax = max_blocks ·
    PAGE_SIZE``. A row with an entry outside ``[0, num_blocks)`` among its pages gets NaN.

    ``TMA`` (contiguous only, :func:`use_tma`): K and V tiles are read through tensor
    descriptors (:func:`_kv_sources`) instead of pointer loads.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    # the KV heads of one chunk side by side (they read the same rows of the angle table)
    batch = tl.program_id(0) // n_kv_heads
    kv_head = tl.program_id(0) % n_kv_heads
    split = tl.program_id(1)
    seq_len = tl.load(SeqLens + batch)
    bad_length = (seq_len < n_queries) | (seq_len > n_max)
    n_keys = tl.minimum(tl.maximum(seq_len, n_queries), n_max)

    # rows of the tile: (head of the group, query); query n sits at position L - Nq + n
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * n_queries
    head = kv_head * group + rows // n_queries
    query = rows % n_queries
    positions = n_keys - n_queries + query

    lo, c1, c2, c3, hi = _chunk_walks(n_keys, n_queries, window, split, num_splits, BLOCK_N)

    b64 = batch.to(tl.int64)
    K = K + kv_head.to(tl.int64) * sk_h
    V = V + kv_head.to(tl.int64) * sv_h
    if PAGED:    # pages: this row's block table; the keys' rows come from it tile by tile
        pages = (BlockTable + b64 * st_b, st_p, sk_b, sv_b, num_blocks)
    else:        # contiguous: this row's keys from slot 0
        K = K + b64 * sk_b
        V = V + b64 * sv_b
        pages = (BlockTable, st_p, sk_b, sv_b, num_blocks)
    kv_dtype = V.dtype.element_ty
    Ks, Vs = _kv_sources(K, V, sk_n, sv_n, n_keys, BLOCK_N, HALF, TMA)
    halves = tl.arange(0, HALF)
    q_ptrs = (Q + b64 * sq_b + head[:, None].to(tl.int64) * sq_h + query[:, None] * sq_n
              + halves[None, :] * sq_d)
    q_a = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_b = tl.load(q_ptrs + HALF * sq_d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if LOGN:
        scale = _logn_scale(positions, logn_factor)[:, None]
        q_a, q_b = q_a * scale, q_b * scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_r = tl.arange(0, BLOCK_N)

    # outside the window: the long loop, then the masked tiles around the window edge
    qo_a, qo_b = _query_halves(q_a, q_b, TableOut, OffsetOut, positions, ROT_KEYS_OUT,
                               HALF)
    cos_r = tl.zeros([BLOCK_N, HALF], tl.float32)      # placeholders unless ANGLES uses them
    sin_r = tl.zeros([BLOCK_N, HALF], tl.float32)
    if ROT_KEYS_OUT and (ANGLES == 0 or ANGLES == 3):
        cos_r, sin_r = _table_rows(TableOut, offs_r, HALF)
    acc, l_i, m_i = _decode_pass(acc, l_i, m_i, qo_a, qo_b, Ks, Vs, sk_n, sk_d, sv_n, sv_d,
                                 TableOut, cos_r, sin_r, positions, (lo, c1, c1, c1), n_keys,
                                 window, qk_scale, pages, OUTSIDE, False, ROT_KEYS_OUT, BLOCK_N,
                                 HALF, DOT_PRECISION, ANGLES, PAGED, PAGE_SIZE, EVICT,
                                 PAGE_LOADS, TMA, kv_dtype)
    acc, l_i, m_i = _decode_pass(acc, l_i, m_i, qo_a, qo_b, Ks, Vs, sk_n, sk_d, sv_n, sv_d,
                                 TableOut, cos_r, sin_r, positions, (c1, c2, c2, c2), n_keys,
                                 window, qk_scale, pages, OUTSIDE, True, ROT_KEYS_OUT, BLOCK_N,
                                 HALF, DOT_PRECISION, ANGLES, PAGED, PAGE_SIZE, EVICT,
                                 PAGE_LOADS, TMA, kv_dtype)
    # inside the window: the last `window` keys
    qi_a, qi_b = _query_halves(q_a, q_b, TableIn, OffsetIn, positions, ROT_KEYS_IN,
                               HALF)
    if ROT_KEYS_IN and (ANGLES == 0 or ANGLES == 3):
        cos_r, sin_r = _table_rows(TableIn, offs_r, HALF)
    acc, l_i, m_i = _decode_pass(acc, l_i, m_i, qi_a, qi_b, Ks, Vs, sk_n, sk_d, sv_n, sv_d,
                                 TableIn, cos_r, sin_r, positions, (c2, c3, c3, c3), n_keys,
                                 window, qk_scale, pages, INSIDE, False, ROT_KEYS_IN, BLOCK_N,
                                 HALF, DOT_PRECISION, ANGLES, PAGED, PAGE_SIZE, EVICT,
                                 PAGE_LOADS, TMA, kv_dtype)
    acc, l_i, m_i = _decode_pass(acc, l_i, m_i, qi_a, qi_b, Ks, Vs, sk_n, sk_d, sv_n, sv_d,
                                 TableIn, cos_r, sin_r, positions, (c1, c2, c3, hi), n_keys,
                                 window, qk_scale, pages, INSIDE, True, ROT_KEYS_IN, BLOCK_N,
                                 HALF, DOT_PRECISION, ANGLES, PAGED, PAGE_SIZE, EVICT,
                                 PAGE_LOADS, TMA, kv_dtype)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if bad_length:                      # out-of-range cache_seqlens: poison the row's output
        out = tl.full([BLOCK_M, HEAD_DIM], float("nan"), tl.float32)
        lse = tl.zeros([BLOCK_M], tl.float32)
    dims = tl.arange(0, HEAD_DIM)
    s64 = split.to(tl.int64)
    out_ptrs = (Out + s64 * so_s + b64 * so_b + head[:, None].to(tl.int64) * so_h
                + query[:, None] * so_n + dims[None, :] * so_d)
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        tl.store(Lse + s64 * sl_s + b64 * sl_b + head.to(tl.int64) * sl_h + query * sl_n, lse,
                 mask=row_ok)
    if FUSED_MERGE:
        # Every thread's stores come before the count (the barrier); the count releases them
        # to the GPU, and the last program's count acquires the other programs' partials.
        tl.debug_barrier()
        counter = Counters + tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:          # the last split of these rows: merge them
            tl.store(counter, 0)               # ready for the next launch
            rows_per_head = group * n_queries  # the rows of one KV head, contiguous in Final
            n_rows = tl.num_programs(0).to(tl.int64) * rows_per_head    # B · Hq · Nq
            first = (tl.program_id(0).to(tl.int64) * rows_per_head
                     + tl.program_id(2) * BLOCK_M)
            count = tl.minimum(rows_per_head - tl.program_id(2) * BLOCK_M, BLOCK_M)
            for r0 in range(0, count, MERGE_ROWS):
                _merge_rows(Out, Lse, Final, first + r0, count - r0, n_rows, num_splits,
                            HEAD_DIM, MERGE_ROWS, SPLITS_BLOCK, LSE_BLOCK)


# --- the merge kernel ----------------------------------------------------------------------------


@triton.jit
def _merge_rows(Part, PartLse, Out, first, count, n_rows, num_splits, HEAD_DIM: tl.constexpr,
                ROWS: tl.constexpr, SPLITS_BLOCK: tl.constexpr, LSE_BLOCK: tl.constexpr):
    """Merge the partials of rows ``first … first + min(count, ROWS) - 1``:
    ``out = Σ_s 2^(lse_s − m) o_s / Σ_s 2^(lse_s − m)``, ``m`` the row's largest ``lse_s``.

    ``Part`` ``(S, rows, D)`` fp32 and ``PartLse`` ``(S, rows)`` contiguous (``rows =
    n_rows``); ``Out`` ``(rows, D)`` contiguous. ``ROWS × SPLITS_BLOCK`` partials per step.
    When every split fits in one step (``num_splits <= SPLITS_BLOCK``) the log-sum-exps and the
    partials are loaded together, one round trip to memory; else a first pass finds ``m``
    (``LSE_BLOCK`` log-sum-exps per load, one load for up to ``LSE_BLOCK`` splits) and a
    second folds the partials. Chunks without a visible key have ``lse = −inf`` and weigh
    nothing. The partials may come from other programs of the same launch (the fused merge):
    the loads skip L1 (``.cg``). The merge kernel and the split kernel's fused merge both call
    this with the same constexprs and warps: the same arithmetic in the same order (the same
    bits in every CPU test and in every GPU comparison but one, a 1-ulp difference at one
    shape: perf/runs/decode_h19s5_call1_h200.json).
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
        part = tl.load(Part + ((splits[None, :, None] * n_rows + rows[:, None, None]) * HEAD_DIM
                               + dims[None, None, :]),
                       mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_max = tl.where(row_ok, tl.max(lse, 1), 0.0)
        weight = tl.math.exp2(lse - m_max[:, None])
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32) + tl.sum(weight[:, :, None] * part, 1)
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
            lse = tl.load(PartLse + (s0 + splits)[None, :] * n_rows + rows[:, None], mask=ok,
                          other=float("-inf"), cache_modifier=".cg")
            weight = tl.math.exp2(lse - m_max[:, None])
            part = tl.load(Part + (((s0 + splits)[None, :, None] * n_rows + rows[:, None, None])
                                   * HEAD_DIM + dims[None, None, :]),
                           mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            acc += tl.sum(weight[:, :, None] * part, 1)
            total += weight
    out = acc / tl.where(row_ok, tl.sum(total, 1), 1.0)[:, None]
    tl.store(Out + rows[:, None] * HEAD_DIM + dims[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _decode_merge_kernel(Part, PartLse, Out, n_rows, num_splits, HEAD_DIM: tl.constexpr,
                         ROWS: tl.constexpr, SPLITS_BLOCK: tl.constexpr,
                         LSE_BLOCK: tl.constexpr):
    """Grid ``(cdiv(B · Hq · Nq, ROWS),)``: :func:`_merge_rows` of ``ROWS`` rows each (the
    two-launch path: the split kernel without ``FUSED_MERGE``, then this)."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    _merge_rows(Part, PartLse, Out, first, n_rows - first, n_rows, num_splits, HEAD_DIM, ROWS,
                SPLITS_BLOCK, LSE_BLOCK)


# --- the launcher ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=CACHE_SIZE)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device):
    """Streaming multiprocessors of ``device`` (132 on an H200; 132 under the interpreter, so the
    splits rule gives the same numbers there)."""
    if INTERPRET or device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def launch_config(head_dim):
    """The split kernel's launch configuration for ``head_dim`` on a GPU (``BLOCK_N``,
    ``ANGLES``, ``num_warps``, ``num_stages``): ``HEAD_DIM_CONFIGS`` or ``GPU_CONFIG``."""
    return HEAD_DIM_CONFIGS.get(head_dim, GPU_CONFIG)


def use_tma(k_cache, v_cache, paged, keys_per_split):
    """Whether the split kernel reads K and V tiles through TMA tensor descriptors (``TMA``;
    ``k_cache, v_cache`` as the kernel sees them, ``keys_per_split`` the cache slots of one
    split, ``cdiv(Nmax, num_splits)``: shapes only). Never for a paged cache (a tile's keys
    are not one box of memory). ``rerope.configs.TMA``: ``"0"`` never; ``"1"`` wherever the
    layout allows (under the interpreter too: the tests run this path on CPU); ``"auto"``, on a
    GPU where :func:`rerope.configs.tma_pays` (Hopper or newer, 16-bit, ``D <= 128``), for
    head dims in ``TMA_HEAD_DIMS`` and splits of at least ``TMA_MIN_KEYS`` keys (each program
    builds two descriptors once it has read its row's length: on short chunks that latency
    costs more than the loads gain; the figures are at ``TMA_MIN_KEYS``). The layout: 16-byte
    aligned starts, unit stride along ``D``, 16-byte aligned key, head and batch strides
    (:func:`rerope.launch._tma_layout_ok`)."""
    if paged or configs.TMA == "0":
        return False
    d = k_cache.shape[-1]
    if configs.TMA != "1" and (INTERPRET or d not in TMA_HEAD_DIMS
                               or keys_per_split < TMA_MIN_KEYS or not configs.tma_pays(
                                   _capability(k_cache.device), k_cache.element_size(), d)):
        return False
    return _tma_layout_ok(k_cache) and _tma_layout_ok(v_cache)


def page_loads(block_n, page_size):
    """How the split kernel loads a paged cache's block-table entries (``PAGE_LOADS``, see
    :func:`_tile_pages`): ``PAGE_LOADS_RULE`` if set, else one scalar load per page (1) when a
    tile spans at most ``MAX_SCALAR_PAGES`` pages, a gather per key (0) beyond. A page that
    holds a whole tile takes one scalar load whatever the rule."""
    if PAGE_LOADS_RULE is not None:
        return PAGE_LOADS_RULE
    return 1 if block_n // page_size <= MAX_SCALAR_PAGES else 0


def merge_blocks(num_splits, head_dim, rows):
    """How the merge walks the partials (:func:`_merge_rows`) when it merges ``rows`` rows at
    once: ``(splits, lse)``, ``splits`` partials per row and step (a power of two, at most
    ``MERGE_SPLITS_BLOCK`` and ``MERGE_TILE`` partial elements per step: registers), and up to
    ``lse`` log-sum-exps per load of the first pass (``MAX_SPLITS``: one load). The merge takes
    one step when ``num_splits <= splits``."""
    splits = triton.next_power_of_2(num_splits)
    tile = max(1, MERGE_TILE // (rows * head_dim))
    return (min(splits, MERGE_SPLITS_BLOCK, triton.next_power_of_2(tile + 1) // 2),
            min(splits, triton.next_power_of_2(MAX_SPLITS)))


def fused_merge(num_splits, rows, head_dim):
    """Whether the split kernel merges the partials itself (one launch per step), for a
    program of ``rows`` (head, query) rows: never by default (``FUSED_MERGE`` False); with
    ``FUSED_MERGE`` True wherever there is something to merge; with ``None`` (the rule) where
    the merge is one step, ``rows <= FUSED_MERGE_ROWS`` and every split in one load
    (:func:`merge_blocks`). The environment variable ``REROPE_FUSED_MERGE`` sets it (``0``,
    ``rule``, ``1``).

    Why opt-in: the counters that say which program is last live per (device, stream)
    (:func:`merge_counters`), and a CUDA graph keeps the buffer of the stream it was captured
    on. Graphs captured on one stream and replayed at the same time on different streams (a
    serving engine overlapping two micro-batches) would count each other's programs and give
    wrong rows, with no error. Calls and graphs that run one after another, or on the streams
    they were made on, are safe: that is the case the rule was measured for, and its gain is
    small (below).

    The rule's reason: the last program of a row group merges alone, after everything else of its group, so
    its steps are a tail the launch waits for; the merge kernel spreads the rows over programs
    that run side by side. On the H200 (Hq=32, Hkv=8, bf16; perf/runs/decode_h19s5_call1_h200.json)
    one step (B=8: 4 splits; B=1 at 4k: 16) took 0-4 % off a step against two launches (B=1
    4k: D=64 14.9 -> 14.3 µs, D=128 18.7 -> 18.5; B=8 at 4k / 32k / 128k: D=64 35.0 -> 34.0,
    150.6 -> 147.5, 537.6 -> 524.5; D=128 52.7 -> 51.4, 274.2 -> 268.4, 1027.4 -> 1027.8);
    several steps (B=1 at 32k and 128k, 33 splits: three steps at D=128, two at D=64) were
    0.3-1.1 µs slower than two launches, and at Nq = 4 and 8 (B=1, 32k, D=128: 4 and 8 row
    groups of 4 in the tile, three steps each) 8.1 and 16.0 µs slower. Not measured: one
    step with several row groups at B=1; at B=8 with Nq=8 (eight groups, one step each) the
    fused merge was 5 % faster (351.8 -> 332.7 µs), a case the rule leaves to two launches.
    """
    if FUSED_MERGE is not None:
        return FUSED_MERGE and num_splits > 1
    if num_splits == 1 or rows > FUSED_MERGE_ROWS:
        return False
    return num_splits <= merge_blocks(num_splits, head_dim, FUSED_MERGE_ROWS)[0]


def _raw_stream(index):
    """The current stream's handle on CUDA device ``index`` (what Triton launches on)."""
    return torch.cuda.current_stream(index).cuda_stream


try:                   # the same without building a Stream object (Triton's own way)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:
    pass
_COUNTERS = {}         # (device, stream) -> int32 counters, all zero between launches
_RETIRED = []          # outgrown ones: a captured CUDA graph may still launch on them
_ALLOC_STREAMS = {}    # device -> the side stream new counters are zeroed on


def merge_counters(device, size):
    """The fused merge's counters for a launch on ``device``'s current stream: an int32 tensor
    of at least ``size`` zeros (``MIN_COUNTERS``), kept for good.

    The split kernel's last program of each row group sets its counter back to zero, so the
    buffer is zero again after every launch and needs no memset per step (nor in a CUDA
    graph). A launch that stops part-way would leave counts set and every later merge wrong:
    on a GPU that cannot happen to a process that goes on (a kernel runs whole, or its fault
    poisons the CUDA context: every later call fails), but the interpreter runs programs one
    by one in Python, where an exception or ``KeyboardInterrupt`` stops it between programs;
    under the interpreter :func:`_run` therefore zeroes the counters before each fused
    launch. Launches on one stream run one after another, so every call and every plan on a
    stream share its buffer; two streams get two buffers (concurrent calls never share one).
    New counters are zeroed on a side stream (the allocation then stays out of a CUDA-graph
    memory pool that the current stream may be allocating into, e.g. a compiled forward's
    warm-up) that the current stream waits for; inside a capture they are zeroed on the
    capturing stream, so that graph zeroes them on each replay (call once on the capture
    stream first to avoid it). A graph keeps the buffer of the stream it was captured on:
    replay graphs captured on one stream one at a time, not on several streams at once (as
    for graphs that share a memory pool).
    """
    key = (device, _raw_stream(device.index) if device.type == "cuda" else None)
    counters = _COUNTERS.get(key)
    if counters is not None and counters.numel() >= size:
        return counters
    if counters is not None:
        _RETIRED.append(counters)
    size = max(size, MIN_COUNTERS)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        counters = torch.zeros(size, dtype=torch.int32, device=device)
    else:
        stream = torch.cuda.current_stream(device)
        side = _ALLOC_STREAMS.get(device) or _ALLOC_STREAMS.setdefault(
            device, torch.cuda.Stream(device))
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            counters = torch.zeros(size, dtype=torch.int32, device=device)
        stream.wait_stream(side)
    _COUNTERS[key] = counters
    return counters


def block_m(group, n_queries):
    """Rows per program: the group's heads × queries, a power of two in [16, 64]."""
    return min(max(MIN_BLOCK_M, triton.next_power_of_2(group * n_queries)), MAX_BLOCK_M)


def default_num_splits(batch, kv_heads, group, n_queries, n_max, sms=132):
    """How many chunks to cut each row's keys into: as many as fit in one wave of resident
    programs (``PROGRAMS_PER_SM`` per SM; a partial second wave would leave SMs idle for its
    whole duration), but chunks of at least ``MIN_KEYS_PER_SPLIT`` keys, at most ``MAX_SPLITS``.

    From shapes only (``n_max``, never the data), so a CUDA graph replays it. Hq=32, Hkv=8,
    Nq=1 on 132 SMs: batch 1, 128k keys: 33 splits (264 programs); batch 1, 4k: 16;
    batch 8: 4; batch 33 and more: 1.
    """
    programs = batch * kv_heads * triton.cdiv(group * n_queries, block_m(group, n_queries))
    if programs == 0:                 # an empty batch (or no query head): nothing to spread
        return 1
    fits = (PROGRAMS_PER_SM * sms) // programs
    return max(1, min(fits, triton.cdiv(n_max, MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def _check_lengths_on_host(cache_seqlens, n_queries, n_max):
    """``Nq <= cache_seqlens[b] <= Nmax`` for every row (CPU tensors only: no sync needed)."""
    short = cache_seqlens < n_queries
    if bool(short.any()):
        row = int(short.nonzero()[0])
        raise ValueError(
            f"cache_seqlens[{row}] = {int(cache_seqlens[row])} is less than the number of "
            f"queries Nq = {n_queries}: the queries sit at the last Nq positions of the cache, "
            "so every row needs at least Nq cached keys")
    long = cache_seqlens > n_max
    if bool(long.any()):
        row = int(long.nonzero()[0])
        raise ValueError(f"cache_seqlens[{row}] = {int(cache_seqlens[row])} exceeds the cache "
                         f"size Nmax = {n_max}")


def _check_block_table_on_host(block_table, cache_seqlens, page_size, num_blocks):
    """Every entry a row's keys use (``j < cdiv(cache_seqlens[b], page_size)``) names a page of
    the cache (CPU tensors only)."""
    used = torch.arange(block_table.shape[1])[None, :] * page_size < cache_seqlens[:, None].long()
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, entry = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {entry}] = {int(block_table[row, entry])} is not a page of the "
            f"cache: k_cache and v_cache have num_blocks = {num_blocks} pages, and row {row} "
            f"uses entries 0 to {-(-int(cache_seqlens[row]) // page_size) - 1}")


def _check_paged_args(q, k_cache, v_cache, block_table, cache_seqlens):
    """The paged layout's tensors; returns ``(B, Hq, Hkv, Nq, Nmax, D)`` with ``Nmax`` the
    table's capacity ``max_blocks_per_seq · block_size``."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have rank 4 (B, Hq, Nq, D), got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"with a block_table, {name} must be a paged cache of rank 4 "
                             f"(num_blocks, block_size, Hkv, D), got shape {tuple(t.shape)}")
    check_alike({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache pages disagree: k_cache has shape "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} (both "
                         "(num_blocks, block_size, Hkv, D))")
    batch, hq, n_queries, d = q.shape
    num_blocks, page_size, hkv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(f"k_cache has head dim {d_k}, expected {d} like q")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"block_size {page_size} (k_cache.shape[1]) is not supported: pages "
                         f"of {', '.join(map(str, PAGE_SIZES))} keys")
    if num_blocks < 1:
        raise ValueError("k_cache and v_cache have no pages (num_blocks = 0)")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks_per_seq) with "
                         f"max_blocks_per_seq >= 1 (one row of page numbers per batch row), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on q's device ({q.device}), got "
                         f"{block_table.device}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required with a block_table (the number of valid "
                         "keys of each row): an int32 tensor of shape (B,)")
    if n_queries < 1:
        raise ValueError(f"q must have sequence length N >= 1, got {n_queries}")
    n_max = block_table.shape[1] * page_size
    if n_queries > n_max:
        raise ValueError(f"q has {n_queries} queries but the block table holds {n_max} keys")
    return batch, hq, hkv, n_queries, n_max, d


def _check_decode_args(q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky,
                       logn_len, rotated, num_splits, inv_freq=None, block_table=None,
                       group=None):
    if block_table is None:
        batch, hq, hkv, n_queries, n_max, d = check_qkv(
            {"q": q}, {"k_cache": k_cache, "v_cache": v_cache}, fewer_queries=True)
        keys = k_cache
    else:
        batch, hq, hkv, n_queries, n_max, d = _check_paged_args(q, k_cache, v_cache,
                                                                block_table, cache_seqlens)
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
        if not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError(f"cache_seqlens must be an int32 tensor of shape ({batch},) or None, "
                            f"got {type(cache_seqlens).__name__}")
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must have dtype torch.int32, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},) (one length per batch "
                             f"row), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on q's device ({q.device}), got "
                             f"{cache_seqlens.device}")
    check_logn_overflow(logn_len, n_max, q.dtype)
    return batch, hq, hkv, n_queries, n_max, d


def rerope_decode(q, k_cache, v_cache, window, cache_seqlens=None, sm_scale=None, base=10000.0,
                  leaky=None, logn_len=None, rotated=True, num_splits=None, inv_freq=None,
                  block_table=None, group=None):
    """(Leaky) ReRoPE or Self-Extend attention of a few new queries against a KV cache (forward
    only).

    The decode step of generation: each batch row's ``Nq`` newest tokens attend, causally, to the
    row's cached keys, whose last ``Nq`` entries are those tokens themselves (append the new
    ``k, v`` to the cache first, then count them in ``cache_seqlens``). Split-KV: the keys are
    cut into ``num_splits`` chunks folded in parallel and merged by log-sum-exp. No host
    synchronisation and no allocation that depends on data: the call can be captured in a CUDA
    graph (call it once before capturing: the first call compiles and builds the RoPE table).

    Grouped-query and multi-query attention: the cache may have fewer heads than ``q`` (``Hq``
    a multiple of ``Hkv``); query head ``h`` attends cache head ``h // (Hq / Hkv)``, by
    indexing: the cache is never repeated in memory.

    Row ``b`` holds ``L = cache_seqlens[b]`` keys (``L = Nmax`` without ``cache_seqlens``), at
    positions ``0 … L - 1``; its queries are the last ``Nq`` of them: query ``n`` sits at
    position ``i = L - Nq + n`` and attends keys ``j <= i``, the causal mask aligned to the
    bottom right corner of the row's score matrix. For ``Nq = 2``, ``L = 5`` (1 = attended,
    0 = masked)::

        1 1 1 1 0
        1 1 1 1 1

    Args:
        q: ``(B, Hq, Nq, D)``, the new queries, ``1 <= Nq <= 16`` (one token, or a few
            speculative ones), at positions ``L - Nq … L - 1`` of their row; fp16, bf16 or
            fp32, ``D`` in 16, 32, 64, 128, 256. RoPE-rotated at those positions if
            ``rotated``, raw otherwise.
        k_cache: ``(B, Hkv, Nmax, D)``, the key cache, ``q``'s dtype and device. Slot ``j``
            holds the key of position ``j`` (RoPE-rotated at ``j`` if ``rotated``). Any strides,
            e.g. a transposed view of a ``(B, Nmax, Hkv, D)`` buffer. Paged: see
            ``block_table``.
        v_cache: ``(B, Hkv, Nmax, D)``, the value cache, ``q``'s dtype and device (paged: as
            ``k_cache``).
        window: int ``>= 1``, ReRoPE's window ``w``: relative positions ``i - j < w`` use plain
            RoPE, the others are clamped to ``w`` (or grow as ``w + (i - j - w) / leaky``).
        cache_seqlens: ``None`` (every row uses the whole cache) or an int32 tensor ``(B,)`` on
            ``q``'s device: the number of valid slots ``L`` per row, between ``Nq`` and
            ``Nmax``. Slots at and beyond it are never read. Values out of range raise
            ``ValueError`` for CPU tensors; on a GPU they are not checked (that would need a
            host sync) and the rows concerned come back as NaN.
        sm_scale: float, the score scale; ``1 / sqrt(D)`` when ``None``. Between about
            1.2e-38 and 1.1e26 (``ValueError`` otherwise: the scaled fp32 scores must
            stay finite; :func:`rerope._validate.check_sm_scale`).
        base: float ``> 1``, the RoPE base (10000.0 for Llama 2).
        leaky: ``None`` for ReRoPE, or Leaky ReRoPE's factor ``κ > 1``.
        logn_len: ``None``, or a training length ``> 1``: queries are scaled by
            ``max(1, log(i + 1) / log(logn_len))`` at their position ``i``.
        rotated: bool; ``True`` (the default, the Llama/Hugging Face convention) if ``q`` and
            ``k_cache`` carry RoPE at their positions, ``False`` if they are raw.
        num_splits: ``None`` (chosen from the shapes, :func:`default_num_splits`) or an int
            ``>= 1``: chunks per row. More splits than key tiles is allowed (the spare ones
            are empty).
        inv_freq: ``None`` (the frequencies ``base ** (-2t / D)``), or RoPE's ``D / 2`` angular
            frequencies, a 1-D floating-point tensor ``(D / 2,)`` (any device) or a sequence of
            positive finite floats (a model's own, e.g. ``model.model.rotary_emb.inv_freq`` for
            ``llama3``, ``linear`` or YaRN RoPE); ``base`` must then stay at its default. As in
            :func:`rerope.rerope`: a tensor is read on the host on every call (for a GPU
            tensor a sync, which a CUDA graph capture refuses), a
            :class:`rerope.rope.Frequencies` never is.
        block_table: ``None`` (the contiguous layout above), or a paged cache as
            FlashAttention's ``flash_attn_with_kvcache`` keeps it: an int32 tensor
            ``(B, max_blocks_per_seq)`` on ``q``'s device, and then ``k_cache`` and ``v_cache``
            are page pools ``(num_blocks, block_size, Hkv, D)``, any strides, ``block_size``
            one of 16, 32, 64, 128, 256. Logical slot ``j`` of row ``b`` (the key of position
            ``j``, rotated at ``j`` if ``rotated``) is slot ``j % block_size`` of page
            ``block_table[b, j // block_size]``; the cache size is
            ``Nmax = max_blocks_per_seq * block_size``. ``cache_seqlens`` is then required.
            Entries for pages past a row's length are never read (they may hold anything). An
            entry the row does use that is not in ``[0, num_blocks)`` raises ``ValueError`` for
            CPU tensors; on a GPU (no host sync) its keys are not read and the row comes back
            as NaN.
        group: ``None``, or Self-Extend's group size ``G`` (an int ``>= 1`` dividing ``window``;
            not with ``leaky``), as in :func:`rerope.rerope`: beyond the window the relative
            position is ``⌊i/G⌋ - ⌊j/G⌋ + window - window/G``, on the model's own cache (the
            keys are turned from ``j`` to ``⌊j/G⌋`` in registers). Tiles split their angles as
            for ReRoPE when ``G`` divides ``BLOCK_N``; otherwise one table row per key
            (``ANGLES = 2``).

    Returns:
        ``(B, Hq, Nq, D)``, the attention output, in ``q``'s dtype and on its device (empty for
        an empty batch).

    Forward only: with grad mode on, inputs that require grad raise ``ValueError`` (use
    :func:`rerope.rerope`). CUDA tensors, or CPU tensors under Triton's CPU interpreter
    (:mod:`rerope.runtime`). Allocates the output and, when ``num_splits > 1``, the fp32
    partials ``(num_splits, B, Hq, Nq, D)`` and their log-sum-exps; the merge of the partials
    is a second launch, or, opted in (``REROPE_FUSED_MERGE``, :func:`fused_merge`), runs in
    the same launch, counted by int32 counters kept per device and stream
    (:func:`merge_counters`: CUDA graphs captured on one stream share that stream's, so replay
    those one at a time). Where K and V are read through TMA descriptors (:func:`use_tma`),
    Triton also asks for a small scratch buffer per launch (the descriptors, 128 bytes each,
    two per program), from torch's allocator unless the caller installed one
    (``triton.set_allocator``).

    Threads and non-finite inputs: as :func:`rerope.rerope` says.
    """
    if torch.compiler.is_compiling():          # an opaque op for the compiler (see _decode_op)
        inv_freq = as_frequencies(inv_freq)
        return _decode_op(q, k_cache, v_cache, cache_seqlens, window, sm_scale, base, leaky,
                          logn_len, rotated, num_splits,
                          None if inv_freq is None else list(inv_freq), block_table, group)
    _check_forward_only(q, k_cache, v_cache)
    plan = _plan(q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky, logn_len,
                 rotated, num_splits, as_frequencies(inv_freq), block_table, group)
    return _run(plan, q, k_cache, v_cache, cache_seqlens, block_table)


def _check_forward_only(q, k_cache, v_cache):
    """``rerope_decode`` has no backward: refuse inputs that want one rather than return an
    output silently cut from the graph."""
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if getattr(t, "requires_grad", False):
                raise ValueError(
                    f"{name} requires grad, but rerope_decode is forward-only (no backward): "
                    "use rerope.rerope for gradients, or call rerope_decode under "
                    "torch.no_grad() / torch.inference_mode()")


def _run(plan, q, k_cache, v_cache, cache_seqlens, block_table=None):
    """Launch a call's :class:`_Plan`: allocate the output (and partials), one launch (one
    split, or the merge fused into the split kernel) or two (split, merge)."""
    if q.numel() == 0:                             # an empty batch: nothing to attend
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cache_seqlens is None:
        cache_seqlens = plan.full_lengths
    elif cache_seqlens.device.type == "cpu":       # free to read here; on a GPU it would sync
        _check_lengths_on_host(cache_seqlens, plan.n_queries, plan.n_max)
        if block_table is not None:
            _check_block_table_on_host(block_table, cache_seqlens, plan.page_size,
                                       k_cache.shape[0])
    cache_seqlens = cache_seqlens.contiguous()     # the kernel reads it with unit stride
    dtype = q.dtype
    if plan.lift:                                  # bf16 under the interpreter: fp32 copies
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.num_splits == 1:
        part = lse = out
    else:
        part = torch.empty(plan.part_shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(plan.part_shape[:-1], dtype=torch.float32, device=q.device)
    table = cache_seqlens if block_table is None else block_table   # (never read if None)
    # the fused merge's counters (this stream's); otherwise never read
    counters = merge_counters(q.device, plan.n_counters) if plan.fused else out
    if INTERPRET and plan.fused:     # an interrupted interpreted launch leaves counts behind:
        with INTERPRETER_LOCK:       # zero them first, in one step with the launch (threads)
            counters.zero_()
            _launch(plan, q, k_cache, v_cache, cache_seqlens, table, part, lse, out, counters)
    else:
        _launch(plan, q, k_cache, v_cache, cache_seqlens, table, part, lse, out, counters)
    return out.to(dtype) if plan.lift else out


def _launch(plan, q, k_cache, v_cache, cache_seqlens, table, part, lse, out, counters):
    """The launches of :func:`_run`: the plan's kept ones, or (first call) its launchers."""
    launches = plan.launches
    if launches:           # the kept launches: the plan's arguments bound (Launcher.fixed)
        launches[0](q, k_cache, v_cache, cache_seqlens, table, part, lse, out, counters)
        if plan.num_splits > 1 and not plan.fused:
            launches[1](part, lse, out)
    else:
        plan.split(q, k_cache, v_cache, cache_seqlens, table, part, lse, out, counters,
                   *plan.split_args)
        if plan.num_splits > 1 and not plan.fused:
            plan.merge(part, lse, out, *plan.merge_args)
        if plan.split.bound or INTERPRET:          # keep them once bound (not in a capture)
            launches += [plan.split.fixed(*plan.split_args),
                         plan.merge.fixed(*plan.merge_args)]


# Under torch.compile the op is opaque: the compiler calls it as it is (its launches are
# captured whole by mode="reduce-overhead"'s CUDA graphs) instead of tracing into Triton's
# launcher. The output is a fresh contiguous tensor of q's shape, in q's dtype.
@torch.library.custom_op("rerope::rerope_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: Optional[torch.Tensor], window: int, sm_scale: Optional[float],
               base: float, leaky: Optional[float], logn_len: Optional[float], rotated: bool,
               num_splits: Optional[int], inv_freq: Optional[list[float]] = None,
               block_table: Optional[torch.Tensor] = None,
               group: Optional[int] = None) -> torch.Tensor:
    # inv_freq comes checked by rerope_decode: kept as it is (no per-call conversion)
    plan = _plan(q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky, logn_len,
                 rotated, num_splits, None if inv_freq is None else Frequencies(inv_freq),
                 block_table, group)
    return _run(plan, q, k_cache, v_cache, cache_seqlens, block_table)


@_decode_op.register_fake
def _(q, *args):
    return q.new_empty(q.shape)


@dataclass(frozen=True)
class _Plan:
    """Everything a call derives from its arguments' shapes and settings (not their data);
    ``launches``: the split and merge launches with the plan's arguments bound
    (:meth:`rerope.launch.Launcher.fixed`), kept by the first call whose launch bound.
    ``fused``: the split kernel merges (:func:`fused_merge`), with ``n_counters`` counters."""

    n_queries: int
    n_max: int
    num_splits: int
    fused: bool
    n_counters: int
    page_size: Optional[int]  # keys per page of a paged cache, None for a contiguous one
    full_lengths: Optional[torch.Tensor]    # the lengths of a call that gives none
    part_shape: tuple
    split: Launcher           # the split kernel, bound (rerope.launch)
    split_args: tuple         # its arguments after the six tensors: tables, strides, scalars
    merge: Launcher
    merge_args: tuple
    lift: bool                # bf16 under the interpreter: computed on fp32 copies
    launches: list = field(default_factory=list)


_PLANS = LRUCache()   # a growing KV cache makes a new signature every step: old ones age out


def _plan(q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky, logn_len, rotated,
          num_splits, inv_freq=None, block_table=None, group=None):
    """The call's :class:`_Plan`, checked and built once per distinct set of shapes, dtypes,
    devices and settings: a decode loop over a fixed-size cache pays the Python checks only on
    its first step (a growing cache, as in a Hugging Face model, once per step, not per layer)."""
    try:
        settings = (window, sm_scale, base, leaky, logn_len, rotated, num_splits, inv_freq,
                    group)
        key = (signature(q, k_cache, v_cache, cache_seqlens, block_table),
               type(cache_seqlens), type(block_table), settings, tuple(map(type, settings)),
               tuple(launch_config(q.shape[-1]).items()), PROGRAMS_PER_SM, PAGE_LOADS_RULE,
               MAX_SCALAR_PAGES, MERGE_SPLITS_BLOCK, MERGE_ROWS, FUSED_MERGE_ROWS, MERGE_TILE,
               FUSED_MERGE, _tma_setting())
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):    # not tensors, unhashable settings: checks will say
        key, plan = None, None
    if plan is None:
        plan = _make_plan(q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky,
                          logn_len, rotated, num_splits, inv_freq, block_table, group)
        if key is not None:
            _PLANS.put(key, plan)
    return plan


def _make_plan(q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky, logn_len,
               rotated, num_splits, inv_freq=None, block_table=None, group=None):
    batch, hq, hkv, n_queries, n_max, d = _check_decode_args(
        q, k_cache, v_cache, window, cache_seqlens, sm_scale, base, leaky, logn_len, rotated,
        num_splits, inv_freq, block_table, group)
    extend = group                         # Self-Extend's group size; below, group is GQA's
    paged = block_table is not None
    group = hq // hkv
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    window = min(int(window), n_max)       # every pair has i - j <= Nmax - 1
    device = q.device
    config = INTERPRETER_CONFIG if INTERPRET else launch_config(d)
    if extend is not None and config["BLOCK_N"] % extend:  # Self-Extend: ⌊(j0 + r)/G⌋ splits
        config = dict(config, ANGLES=2)                     # only where G divides the tile
    rows_per_program = block_m(group, n_queries)
    if num_splits is None:
        num_splits = default_num_splits(batch, hkv, group, n_queries, n_max, sm_count(device))
    rotation = rotation_tables(n_max, d, window, leaky, rotated, device, base, inv_freq, extend)
    # the strides the kernel will see (under the interpreter bf16 runs as an fp32 copy)
    prepared, _ = prepare_for_device(q, k_cache, v_cache)
    strides = [t.stride() for t in prepared]
    if paged:   # (page, slot, head, dim) -> the kernel's (row/page, head, slot, dim) order
        strides[1:] = [(s[0], s[2], s[1], s[3]) for s in strides[1:]]
    strides = tuple(s for t in strides for s in t)
    table_args = ((*block_table.stride(), k_cache.shape[0]) if paged else (0, 0, 0))
    compute_dtype = prepared[0].dtype
    n_rows = batch * hq * n_queries
    # the partials' strides: (S, B, Hq, Nq, D) fp32 and (S, B, Hq, Nq) contiguous; with one split
    # the kernel writes the output itself (contiguous, q's shape) and no log-sum-exp
    part_strides = _contiguous_strides((num_splits, batch, hq, n_queries, d))
    lse_strides = _contiguous_strides((num_splits, batch, hq, n_queries))
    if num_splits == 1:
        part_strides, lse_strides = (0, *_contiguous_strides(q.shape)), (0, 0, 0, 0)
    tma = use_tma(prepared[1], prepared[2], paged, triton.cdiv(n_max, num_splits))
    if tma and not INTERPRET:
        _ensure_scratch_allocator()         # the descriptors live in a global scratch buffer
    fused = fused_merge(num_splits, min(group * n_queries, rows_per_program), d)
    merge_rows = FUSED_MERGE_ROWS if fused else MERGE_ROWS
    splits_block, lse_block = merge_blocks(num_splits, d, merge_rows)
    program_blocks = triton.cdiv(group * n_queries, rows_per_program)
    split = Launcher(
        _decode_split_kernel, (batch * hkv, num_splits, program_blocks),
        HEAD_DIM=d, BLOCK_M=rows_per_program, ROT_KEYS_IN=rotation.flags["TURN_IN"],
        ROT_KEYS_OUT=rotation.flags["TURN_OUT"], LOGN=logn_len is not None, WRITE_LSE=num_splits > 1,
        DOT_PRECISION=dot_precision(compute_dtype), PAGED=paged,
        PAGE_SIZE=k_cache.shape[1] if paged else 16,
        PAGE_LOADS=page_loads(config["BLOCK_N"], k_cache.shape[1]) if paged else 1,
        **(dict(FUSED_MERGE=True, MERGE_ROWS=merge_rows, SPLITS_BLOCK=splits_block,
                LSE_BLOCK=lse_block) if fused else {}), TMA=tma, **config)
    # the merge kernel with the split kernel's warps: the same layouts as the fused merge
    merge = Launcher(_decode_merge_kernel, (triton.cdiv(n_rows, merge_rows),), HEAD_DIM=d,
                     ROWS=merge_rows, SPLITS_BLOCK=splits_block, LSE_BLOCK=lse_block,
                     **{k: v for k, v in config.items() if k == "num_warps"})
    return _Plan(
        n_queries=n_queries, n_max=n_max, num_splits=num_splits, fused=fused,
        n_counters=batch * hkv * program_blocks,
        page_size=k_cache.shape[1] if paged else None,
        # only where no lengths come: a plan built inside a compiled forward's CUDA-graph
        # warm-up must keep no tensor of its own (it would sit in the graph's memory pool)
        full_lengths=(torch.full((batch,), n_max, dtype=torch.int32, device=device)
                      if cache_seqlens is None else None),
        part_shape=(num_splits, batch, hq, n_queries, d),
        split=split,
        split_args=(*rotation.tables, *strides, *part_strides,
                    *lse_strides, *table_args, hkv, group, n_queries, n_max, num_splits, window,
                    scale * LOG2E, logn_factor(logn_len)),
        merge=merge, merge_args=(n_rows, num_splits),
        lift=compute_dtype != q.dtype)


def _tma_setting():
    return configs.TMA, TMA_HEAD_DIMS, TMA_MIN_KEYS


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
