"""Three regions: which tiles need which product. Chapter 4 of the book.

A program owns a block of rows on one axis (query rows ``[start, start + SELF_BLOCK)``
in the forward and dQ kernels, key rows in the dK/dV kernel) and walks the other axis in
tiles of ``OTHER_BLOCK``. ReRoPE's rule depends only on ``|i - j|``, so each tile is

* **outside** — every pair has ``|i - j| >= window``: only ``q2 · k2`` is needed;
* **inside**  — every pair has ``|i - j| < window``: only ``q1 · k1`` is needed;
* **band**    — a mix: both products, each masked to its side of the window.

Along the other axis the tiles come in five contiguous runs:
``outside | band | inside | band | outside``. :func:`_window_bounds` computes the four
cut points once per program, so each run is a plain ``for`` loop with a compile-time
product and no branch.

Masks are a separate matter: the causal diagonal and the ragged end of the sequence.
:func:`_masking_spans` cuts the other axis into a masked head, an unmasked middle and a
masked tail; only the middle gets the mask-free loops. :func:`_schedule` turns both into
the walks of the six passes every kernel makes: one product per pass, band and edge
tiles visited once per product that can occur there, with every mask applied.

These are ``@triton.jit`` helpers shared by the forward and both backward kernels; the
small ``_tile_map_kernel`` runs the very same arithmetic so the book can draw it and the
tests can check it against brute force (:func:`tile_problems`).
"""

import torch
import triton
import triton.language as tl

OUTSIDE: tl.constexpr = tl.constexpr(0)   # a pass computing q2 · k2
INSIDE: tl.constexpr = tl.constexpr(2)    # a pass computing q1 · k1


@triton.jit
def _window_bounds(start, SELF_BLOCK: tl.constexpr, OTHER_BLOCK: tl.constexpr, window):
    """Cut points of ``outside | band | inside | band | outside`` along the other axis.

    Returns ``(below_end, inside_start, inside_end, above_start)``, multiples of
    ``OTHER_BLOCK`` in non-decreasing order. A tile ``[t, t + OTHER_BLOCK)`` is entirely
    outside the window if ``t + OTHER_BLOCK <= below_end`` or ``t >= above_start`` and
    entirely inside if ``inside_start <= t < inside_end``. Operands are kept
    non-negative before dividing (integer division rounds negatives differently on the
    GPU and in the interpreter; ``start`` is negative in the dK/dV view of chunked
    prefill, see :func:`_masking_spans`).
    """
    # every pair below: t + OTHER_BLOCK - 1 <= start - window
    below_end = tl.maximum(start - window + 1, 0) // OTHER_BLOCK * OTHER_BLOCK
    # every pair inside: t >= start + SELF_BLOCK - window
    #                and t + OTHER_BLOCK <= start + window
    inside_start = tl.cdiv(tl.maximum(start + SELF_BLOCK - window, 0),
                           OTHER_BLOCK) * OTHER_BLOCK
    inside_end = tl.maximum(tl.maximum(start + window, 0) // OTHER_BLOCK * OTHER_BLOCK,
                            inside_start)
    # every pair above: t >= start + SELF_BLOCK - 1 + window
    above_start = tl.cdiv(tl.maximum(start + SELF_BLOCK - 1 + window, 0),
                          OTHER_BLOCK) * OTHER_BLOCK
    return below_end, inside_start, inside_end, above_start


@triton.jit
def _masking_spans(start, SELF_BLOCK: tl.constexpr, OTHER_BLOCK: tl.constexpr, n_ctx,
                   CAUSAL: tl.constexpr, SELF_IS_QUERY: tl.constexpr):
    """Where the other axis needs masks: ``(head_lo, head_hi, mid_lo, mid_hi, tail_lo,
    tail_hi)``.

    Tiles in the head ``[head_lo, head_hi)`` and tail ``[tail_lo, tail_hi)`` need masks
    (the causal diagonal, the end of the sequence); tiles in ``[mid_lo, mid_hi)`` need
    none; the rest are fully masked and skipped.

    Query-owned programs (forward, dQ): keys ``j <= i`` survive, so the unmasked keys
    come first and the diagonal is the tail; the head is empty. Key-owned programs
    (dK/dV): queries ``i >= j`` survive, so the diagonal is the head, and the tail is
    the ragged last query tile. Positions are measured so that the other axis starts at
    0: ``start`` may be negative (keys before the first query, in chunked prefill) and
        is kept non-negative before dividing.
    """
    full_tiles_end = n_ctx // OTHER_BLOCK * OTHER_BLOCK
    if SELF_IS_QUERY:
        head_lo = 0
        mid_lo = 0
        if CAUSAL:
            mid_hi = tl.minimum((start + 1) // OTHER_BLOCK * OTHER_BLOCK,
                                full_tiles_end)
            tail_hi = tl.minimum(start + SELF_BLOCK, n_ctx)
        else:
            mid_hi = full_tiles_end
            tail_hi = n_ctx
    else:
        if CAUSAL:
            head_lo = tl.maximum(start, 0) // OTHER_BLOCK * OTHER_BLOCK
            mid_lo = tl.cdiv(tl.maximum(start + SELF_BLOCK - 1, 0),
                             OTHER_BLOCK) * OTHER_BLOCK
        else:
            head_lo = 0
            mid_lo = 0
        mid_hi = tl.maximum(mid_lo, full_tiles_end)
        tail_hi = n_ctx
    head_hi = tl.minimum(mid_lo, tail_hi)
    return head_lo, head_hi, mid_lo, mid_hi, mid_hi, tail_hi


@triton.jit
def _clip(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _middle_runs(bounds, mid_lo, mid_hi):
    """Cut ``[mid_lo, mid_hi)`` into ``outside | band | inside | band | outside``.

    ``bounds`` is what :func:`_window_bounds` returned. Returns the inner cut points
    ``(c1, c2, c3, c4)``: the runs are ``[mid_lo, c1)``, ``[c1, c2)``, ``[c2, c3)``,
    ``[c3, c4)``, ``[c4, mid_hi)``.
    """
    below_end, inside_start, inside_end, above_start = bounds
    return (_clip(below_end, mid_lo, mid_hi), _clip(inside_start, mid_lo, mid_hi),
            _clip(inside_end, mid_lo, mid_hi), _clip(above_start, mid_lo, mid_hi))


@triton.jit
def _edge_split(lo, hi, bounds):
    """For a masked span ``[lo, hi)``: ``(in_lo, in_hi, out_lo, out_hi)``, the tiles
    that may hold pairs inside the window and those that may hold pairs outside it (a
    tile can be in both)."""
    below_end, inside_start, inside_end, above_start = bounds
    in_lo = tl.maximum(lo, below_end)
    in_hi = tl.maximum(tl.minimum(hi, above_start), in_lo)
    has_outside = (lo < inside_start) | (hi > inside_end)
    out_hi = tl.where(has_outside, hi, lo)
    return in_lo, in_hi, lo, out_hi


@triton.jit
def _tile_count(lo, hi, BLOCK: tl.constexpr):
    return tl.cdiv(tl.maximum(hi - lo, 0), BLOCK)


@triton.jit
def _nth_tile(t, lo1, n1, lo2, BLOCK: tl.constexpr):
    """Start of tile ``t`` of a walk over ``n1`` tiles from ``lo1``, then on from
    ``lo2``."""
    return tl.where(t < n1, lo1 + t * BLOCK, lo2 + (t - n1) * BLOCK)


@triton.jit
def _schedule(start, SELF_BLOCK: tl.constexpr, OTHER_BLOCK: tl.constexpr, n_ctx, window,
              CAUSAL: tl.constexpr, SELF_IS_QUERY: tl.constexpr):
    """Every walk a kernel makes along the other axis, as ``(lo1, hi1, lo2, hi2)`` tile
    ranges.

    Returns ``(outside_clean, inside_clean, band, edge_inside, edge_outside)``. Each
    kernel runs six passes over them: ``q2·k2`` unmasked over ``outside_clean``,
    ``q1·k1`` unmasked over ``inside_clean``, both products masked (window mask) over
    ``band``, then ``q1·k1`` and ``q2·k2`` with every mask over ``edge_inside`` /
    ``edge_outside``. Band tiles are visited twice, once per product: a thin band costs
    one extra ``P·V``-sized product per tile, and in exchange every loop computes a
    single score tile, which keeps register pressure at plain attention's level.
    """
    head_lo, head_hi, mid_lo, mid_hi, tail_lo, tail_hi = _masking_spans(
        start, SELF_BLOCK, OTHER_BLOCK, n_ctx, CAUSAL, SELF_IS_QUERY)
    bounds = _window_bounds(start, SELF_BLOCK, OTHER_BLOCK, window)
    c1, c2, c3, c4 = _middle_runs(bounds, mid_lo, mid_hi)
    h_in_lo, h_in_hi, h_out_lo, h_out_hi = _edge_split(head_lo, head_hi, bounds)
    t_in_lo, t_in_hi, t_out_lo, t_out_hi = _edge_split(tail_lo, tail_hi, bounds)
    return ((mid_lo, c1, c4, mid_hi), (c2, c3, c3, c3), (c1, c2, c3, c4),
            (h_in_lo, h_in_hi, t_in_lo, t_in_hi),
            (h_out_lo, h_out_hi, t_out_lo, t_out_hi))


# --- drawing the schedule (for the book and the tests) --------------------------------

# Bit flags: which passes visited a tile.
OUTSIDE_CLEAN, INSIDE_CLEAN, INSIDE_MASKED, OUTSIDE_MASKED = 1, 2, 4, 8


@triton.jit
def _mark(Row, walk, flag, OTHER_BLOCK: tl.constexpr):
    lo1, hi1, lo2, hi2 = walk
    n1 = _tile_count(lo1, hi1, OTHER_BLOCK)
    for t in range(0, n1 + _tile_count(lo2, hi2, OTHER_BLOCK)):
        tile = _nth_tile(t, lo1, n1, lo2, OTHER_BLOCK) // OTHER_BLOCK
        tl.store(Row + tile, tl.load(Row + tile) + flag)


@triton.jit
def _tile_map_kernel(Map, n_tiles, n_ctx, window, SELF_BLOCK: tl.constexpr,
                     OTHER_BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                     SELF_IS_QUERY: tl.constexpr):
    row = Map + tl.program_id(0) * n_tiles
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        tl.program_id(0) * SELF_BLOCK, SELF_BLOCK, OTHER_BLOCK, n_ctx, window, CAUSAL,
        SELF_IS_QUERY)
    _mark(row, outside_clean, 1, OTHER_BLOCK)
    _mark(row, inside_clean, 2, OTHER_BLOCK)
    _mark(row, band, 4, OTHER_BLOCK)
    _mark(row, band, 8, OTHER_BLOCK)
    _mark(row, edge_inside, 4, OTHER_BLOCK)
    _mark(row, edge_outside, 8, OTHER_BLOCK)


def tile_map(n_ctx, window, block_self, block_other, causal=True, self_is_query=True):
    """Which passes visit each tile, by the kernels' own :func:`_schedule`: an int
    matrix.

    One row per program (query block; key block if ``self_is_query=False``, the dK/dV
    view), one column per tile of the other axis; each entry is a sum of the flags
    ``OUTSIDE_CLEAN``, ``INSIDE_CLEAN``, ``INSIDE_MASKED``, ``OUTSIDE_MASKED`` (0:
    skipped).
    """
    from .runtime import INTERPRET

    device = "cpu" if INTERPRET else "cuda"
    n_rows, n_tiles = triton.cdiv(n_ctx, block_self), triton.cdiv(n_ctx, block_other)
    flags = torch.zeros(n_rows, n_tiles, dtype=torch.int32, device=device)
    _tile_map_kernel[(n_rows,)](flags, n_tiles, n_ctx, window, SELF_BLOCK=block_self,
                                OTHER_BLOCK=block_other, CAUSAL=causal,
                                SELF_IS_QUERY=self_is_query)
    return flags.cpu()


def tile_problems(flags, n_ctx, window, block_self, block_other, causal=True,
                  self_is_query=True):
    """Check a :func:`tile_map` against brute force; returns a list of problems (empty:
    correct).

    Per tile, from its index ranges: every valid pair inside the window must be seen by
    exactly one ``q1·k1`` pass and every valid pair outside by exactly one ``q2·k2``
    pass; an unmasked pass may only visit a tile whose pairs are all valid and all of
    its kind.
    """
    problems = []
    for r in range(flags.shape[0]):
        own = torch.arange(r * block_self, min((r + 1) * block_self, n_ctx))
        for c in range(flags.shape[1]):
            # may run past the end
            other = torch.arange(c * block_other, (c + 1) * block_other)
            q_idx, k_idx = (own, other) if self_is_query else (other, own)
            valid = (q_idx[:, None] < n_ctx) & (k_idx[None, :] < n_ctx)
            if causal:
                valid &= k_idx[None, :] <= q_idx[:, None]
            inside = (q_idx[:, None] - k_idx[None, :]).abs() < window
            f = int(flags[r, c])
            for kind, pairs, clean, masked in (
                    ("inside", inside, INSIDE_CLEAN, INSIDE_MASKED),
                    ("outside", ~inside, OUTSIDE_CLEAN, OUTSIDE_MASKED)):
                visits = bool(f & clean) + bool(f & masked)
                if (valid & pairs).any() and visits != 1:
                    problems.append(f"tile ({r}, {c}): {kind} pairs seen {visits} "
                                    "times")
                if f & clean and not (valid & pairs).all():
                    problems.append(f"tile ({r}, {c}): unmasked {kind} pass on a tile "
                                    "that needs masks")
    return problems
