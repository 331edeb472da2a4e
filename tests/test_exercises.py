"""The checkers of the book's Triton exercises (kernels/exercises.py), through the interpreter.

Each checker must accept a right answer, and for a wrong one say where it is wrong (the tile, the
rows, the quantity), which is the point of a Triton-Puzzles-style exercise. The right answers
here are written independently of the notebooks' hidden solutions (nbval checks those).
"""

import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import exercises
from kernels.regions import OUTSIDE

pytestmark = pytest.mark.skipif(not kernels.runtime.INTERPRET, reason="CPU interpreter only")


# --- chapter 3 ----------------------------------------------------------------------------------

@triton.jit
def step_right(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(scores * qk_scale, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing seen yet: any finite value
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores * qk_scale - m_ref[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_unsafe(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(scores * qk_scale, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_unchanged(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION: tl.constexpr):
    return acc, l_i, m_i


@triton.jit
def step_no_rescale(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(scores * qk_scale, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    return acc + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_natural_exp(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(scores * qk_scale, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores * qk_scale - m_new[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


def test_softmax_step():
    assert exercises.check_softmax_step(step_right) == "correct"
    verdict = exercises.check_softmax_step(step_unchanged)
    assert verdict.startswith("wrong in the case every key visible, after key tile 0 (keys 0–15): "
                              "m differs in rows 0–39; row 0: got -inf"), verdict
    verdict = exercises.check_softmax_step(step_no_rescale)
    assert "acc differs" in verdict and "key tile 0" not in verdict, verdict
    assert "l differs" in exercises.check_softmax_step(step_natural_exp)
    verdict = exercises.check_softmax_step(step_unsafe)
    assert verdict.startswith("row i sees keys j >= i, after key tile 0 (keys 0–15): NaN in rows "
                              "16–39") or "NaN in rows 16–39" in verdict, verdict


@triton.jit
def mask_right(scores, rows, cols, n_ctx):
    keep = (cols[None, :] < n_ctx) & (cols[None, :] <= rows[:, None])
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def mask_off_by_one(scores, rows, cols, n_ctx):
    keep = (cols[None, :] < n_ctx) & (cols[None, :] < rows[:, None])
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def mask_none(scores, rows, cols, n_ctx):
    return tl.where(cols[None, :] < n_ctx, scores, float("-inf"))


@triton.jit
def end_right(start_m, BLOCK_M: tl.constexpr, n_ctx):
    return tl.minimum(start_m + BLOCK_M, n_ctx)


@triton.jit
def end_everything(start_m, BLOCK_M: tl.constexpr, n_ctx):
    return n_ctx


def test_causal_mask():
    assert exercises.check_causal_mask(mask_right, end_right) == "correct"
    assert "rows 0–38 differ" in exercises.check_causal_mask(mask_none, end_everything)
    # a row that may not see itself: row 0 has nothing left (NaN), every row is off
    assert "differ from plain_attention" in exercises.check_causal_mask(mask_off_by_one, end_right)
    verdict = exercises.check_causal_mask(mask_right, end_everything)
    assert "right output, but program 0 (rows 0–15) walks 3 key tiles where 1 suffice" in verdict


# --- chapter 4 ----------------------------------------------------------------------------------

@triton.jit
def pass_right(acc, l_i, m_i, q, K, V, rows, lo, hi, n_ctx, window, qk_scale,
               PRODUCT: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < n_ctx,
                    other=0.0)
        v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < n_ctx,
                    other=0.0)
        gap = rows[:, None] - cols[None, :]
        keep = (gap < window) & (-gap < window)
        if PRODUCT == OUTSIDE:
            keep = ~keep
        keep = keep & (cols[None, :] < n_ctx)
        if CAUSAL:
            keep = keep & (gap >= 0)
        scores = tl.where(keep, tl.dot(q, tl.trans(k)), float("-inf"))
        acc, l_i, m_i = kernels.online_softmax._softmax_step(acc, l_i, m_i, scores, v, qk_scale,
                                                             "tf32")
    return acc, l_i, m_i


@triton.jit
def pass_no_window_side(acc, l_i, m_i, q, K, V, rows, lo, hi, n_ctx, window, qk_scale,
                        PRODUCT: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    # forgets the window: both products count every pair of a band tile
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < n_ctx,
                    other=0.0)
        v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < n_ctx,
                    other=0.0)
        keep = (cols[None, :] < n_ctx) & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, tl.dot(q, tl.trans(k)), float("-inf"))
        acc, l_i, m_i = kernels.online_softmax._softmax_step(acc, l_i, m_i, scores, v, qk_scale,
                                                             "tf32")
    return acc, l_i, m_i


def test_masked_pass():
    assert exercises.check_masked_pass(pass_right) == "correct"
    verdict = exercises.check_masked_pass(pass_no_window_side)
    assert verdict.startswith("N=40, w=13, causal, 16x16 tiles: rows"), verdict
    assert "wrong on the band and diagonal/end walks" in verdict and "band tiles [" in verdict


def window_bounds_right(start, self_block, other_block, before, after):
    def floor(x):
        return max(x, 0) // other_block * other_block

    def ceil(x):
        return -(-max(x, 0) // other_block) * other_block
    inside_start = ceil(start + self_block - before)
    return (floor(start - before + 1), inside_start, max(floor(start + after), inside_start),
            ceil(start + self_block - 1 + after))


def test_window_bounds():
    assert exercises.check_window_bounds(window_bounds_right) == "correct"

    def symmetric(start, self_block, other_block, before, after):   # ignores `after`
        return window_bounds_right(start, self_block, other_block, before, before)
    assert "before=40, after=9" in exercises.check_window_bounds(symmetric)
    assert "not solved yet" in exercises.check_window_bounds(lambda *args: None)


# --- chapter 5 ----------------------------------------------------------------------------------

@triton.jit
def delta_right(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    base = tl.program_id(1) * n_ctx
    ptrs = (base + rows[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    tl.store(Delta + base + rows, tl.sum(o * do, 1), mask=rows < n_ctx)


@triton.jit
def delta_first_head_only(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ptrs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    tl.store(Delta + rows, tl.sum(o * do, 1), mask=rows < n_ctx)


def test_delta_kernel():
    assert exercises.check_delta_kernel(delta_right) == "correct"
    verdict = exercises.check_delta_kernel(delta_first_head_only)
    assert "head 1, rows 0–39 were never written (program (0, 1) owns row 0)" in verdict


@triton.jit
def route_right(ds, rows, cols, window):
    gap = rows[:, None] - cols[None, :]
    inside = (gap < window) & (gap > -window)
    return tl.where(inside, ds, 0.0), tl.where(inside, 0.0, ds)


@triton.jit
def route_swapped(ds, rows, cols, window):
    gap = rows[:, None] - cols[None, :]
    inside = (gap < window) & (gap > -window)
    return tl.where(inside, 0.0, ds), tl.where(inside, ds, 0.0)


def test_ds_routing():
    assert exercises.check_ds_routing(route_right) == "correct"
    verdict = exercises.check_ds_routing(route_swapped)
    assert verdict.startswith("N=40, w=13, causal, 16x16 tiles: dQ1 is wrong in rows"), verdict


# --- chapter 6 ----------------------------------------------------------------------------------

@triton.jit
def rope_right(X, Cos, Sin, Out, n_ctx, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, HEAD_DIM // 2)
    ok = rows[:, None] < n_ctx
    x_ptrs = X + (tl.program_id(1) * n_ctx + rows[:, None]) * HEAD_DIM + half[None, :]
    o_ptrs = Out + (tl.program_id(1) * n_ctx + rows[:, None]) * HEAD_DIM + half[None, :]
    cos = tl.load(Cos + rows[:, None] * (HEAD_DIM // 2) + half[None, :], mask=ok)
    sin = tl.load(Sin + rows[:, None] * (HEAD_DIM // 2) + half[None, :], mask=ok)
    a = tl.load(x_ptrs, mask=ok).to(tl.float32)
    b = tl.load(x_ptrs + HEAD_DIM // 2, mask=ok).to(tl.float32)
    tl.store(o_ptrs, (a * cos - b * sin).to(Out.dtype.element_ty), mask=ok)
    tl.store(o_ptrs + HEAD_DIM // 2, (b * cos + a * sin).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def rope_sign_flipped(X, Cos, Sin, Out, n_ctx, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, HEAD_DIM // 2)
    ok = rows[:, None] < n_ctx
    x_ptrs = X + (tl.program_id(1) * n_ctx + rows[:, None]) * HEAD_DIM + half[None, :]
    o_ptrs = Out + (tl.program_id(1) * n_ctx + rows[:, None]) * HEAD_DIM + half[None, :]
    cos = tl.load(Cos + rows[:, None] * (HEAD_DIM // 2) + half[None, :], mask=ok)
    sin = tl.load(Sin + rows[:, None] * (HEAD_DIM // 2) + half[None, :], mask=ok)
    a = tl.load(x_ptrs, mask=ok).to(tl.float32)
    b = tl.load(x_ptrs + HEAD_DIM // 2, mask=ok).to(tl.float32)
    tl.store(o_ptrs, (a * cos + b * sin).to(Out.dtype.element_ty), mask=ok)      # R(-p)
    tl.store(o_ptrs + HEAD_DIM // 2, (b * cos - a * sin).to(Out.dtype.element_ty), mask=ok)


def test_rope_kernel():
    assert exercises.check_rope_kernel(rope_right) == "correct"
    verdict = exercises.check_rope_kernel(rope_sign_flipped)
    assert verdict.startswith("B·H=2, N=40, D=32, float16, BLOCK_N=16: head 0, positions 1–39, "
                              "the first half"), verdict



# --- chapter 7 ----------------------------------------------------------------------------------

@triton.jit
def turn_right(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    cos = cos_p * cos_o - sin_p * sin_o
    sin = sin_p * cos_o + cos_p * sin_o
    return x_a * cos - x_b * sin, x_b * cos + x_a * sin


@triton.jit
def turn_back_right(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    cos = cos_p * cos_o - sin_p * sin_o
    sin = sin_p * cos_o + cos_p * sin_o
    return x_a * cos + x_b * sin, x_b * cos - x_a * sin


@triton.jit
def turn_ignoring_offset(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    return x_a * cos_p - x_b * sin_p, x_b * cos_p + x_a * sin_p


@triton.jit
def turn_by_difference(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    cos = cos_p * cos_o + sin_p * sin_o          # cos(α − β): the offset's sign flipped
    sin = sin_p * cos_o - cos_p * sin_o
    return x_a * cos - x_b * sin, x_b * cos + x_a * sin


@triton.jit
def turn_first_half_only(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    cos = cos_p * cos_o - sin_p * sin_o
    sin = sin_p * cos_o + cos_p * sin_o
    return x_a * cos - x_b * sin, x_b


def test_turn_tile():
    assert exercises.check_turn_tile(turn_right) == "correct"
    verdict = exercises.check_turn_tile(turn_ignoring_offset)
    assert verdict.startswith("queries outside the window, ReRoPE, raw inputs: R(w) (speed 0, "
                              "offset +13; N=40, D=32, BLOCK=16): wrong at positions 0–39, "
                              "frequencies t = 0–15, in both halves"), verdict
    assert "ReRoPE, raw inputs: R(w)" in exercises.check_turn_tile(turn_by_difference)
    verdict = exercises.check_turn_tile(turn_first_half_only)
    assert verdict.endswith("wrong at positions 1–39, frequencies t = 0–15, in the second half")
    # the forward turn is not its own transpose: position 0 is the only row it gets right
    assert "R(p) (speed 1, offset +0; N=40, D=32, BLOCK=16): wrong at positions 1–39" in (
        exercises.check_turn_back_tile(turn_right))


def test_turn_back_tile():
    assert exercises.check_turn_back_tile(turn_back_right) == "correct"
    assert exercises.check_turn_tile(turn_back_right) != "correct"

def test_spans():
    assert exercises._spans([0, 1, 2, 5, 7, 8]) == "0–2, 5, 7–8"
    assert exercises._spans([3]) == "3"


def test_palette_names_every_tile_class():
    assert set(exercises.TILE_COLOURS) == {"skipped", "outside", "inside", "band", "edge_inside",
                                           "edge_outside"}
