"""The checkers of the book's Triton exercises (kernels/rerope/exercises.py), through the interpreter.

Each checker must accept a right answer, and for a wrong one say where it is wrong (the tile, the
rows, the quantity), which is the point of a Triton-Puzzles-style exercise. The right answers
here are written independently of the notebooks' hidden solutions (nbval checks those).
"""

import pytest
import torch
import triton
import triton.language as tl

import rerope
from rerope import exercises
from rerope.regions import OUTSIDE

pytestmark = pytest.mark.skipif(not rerope.runtime.INTERPRET, reason="CPU interpreter only")


# --- chapter 3 ----------------------------------------------------------------------------------

@triton.jit
def cap(s, softcap):
    return softcap * exercises._tanh(s / softcap)


@triton.jit
def step_right(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    s = tl.where(scores == float("-inf"), float("-inf"), cap(scores * qk_scale, softcap))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing seen yet: any finite value
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_uncapped(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    # the package's step: right but for the cap
    m_new = tl.maximum(m_i, tl.max(scores * qk_scale, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores * qk_scale - m_ref[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_caps_the_mask(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    s = cap(scores * qk_scale, softcap)                     # -inf becomes -softcap
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_unsafe(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    s = tl.where(scores == float("-inf"), float("-inf"), cap(scores * qk_scale, softcap))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_cap_before_scale(acc, l_i, m_i, scores, v, qk_scale, softcap,
                          DOT_PRECISION: tl.constexpr):
    s = tl.where(scores == float("-inf"), float("-inf"), cap(scores, softcap) * qk_scale)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def step_unchanged(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    return acc, l_i, m_i


@triton.jit
def step_no_rescale(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    s = tl.where(scores == float("-inf"), float("-inf"), cap(scores * qk_scale, softcap))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return acc + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


def test_softcap_step():
    assert exercises.check_softcap_step(step_right) == "correct"
    assert exercises.check_softcap_step(exercises._softcap_step) == "correct"
    verdict = exercises.check_softcap_step(step_unchanged)
    assert verdict.startswith("wrong in the case softcap 3, every key visible, after key tile 0 "
                              "(keys 0–15): m differs in rows 0–39; row 0: got -inf"), verdict
    verdict = exercises.check_softcap_step(step_uncapped)
    assert verdict.startswith("wrong in the case softcap 3, every key visible, after key tile 0 "
                              "(keys 0–15): m differs"), verdict
    verdict = exercises.check_softcap_step(step_caps_the_mask)
    assert "Too large: do masked entries count?" in verdict and "keep -inf" in verdict, verdict
    verdict = exercises.check_softcap_step(step_unsafe)
    assert verdict.startswith("softcap 3, row i sees keys j >= i, after key tile 0 (keys 0–15): "
                              "NaN in rows 16–39"), verdict
    assert exercises.check_softcap_step(step_cap_before_scale) != "correct"
    verdict = exercises.check_softcap_step(step_no_rescale)
    assert "acc differs" in verdict and "key tile 0" not in verdict, verdict


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


@triton.jit
def mask_one_ahead(scores, rows, cols, n_ctx):
    keep = (cols[None, :] < n_ctx) & (cols[None, :] <= rows[:, None] + 1)
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def end_before_diagonal(start_m, BLOCK_M: tl.constexpr, n_ctx):
    return start_m


def test_causal_mask():
    assert exercises.check_causal_mask(mask_right, end_right) == "correct"
    verdict = exercises.check_causal_mask(mask_none, end_everything)
    assert "rows 0–38 differ" in verdict and "the causal mask is missing" in verdict
    # a row that may not see itself: row 0 has nothing left (NaN), every row is off
    verdict = exercises.check_causal_mask(mask_off_by_one, end_right)
    assert "row i must see itself" in verdict, verdict
    verdict = exercises.check_causal_mask(mask_none, end_right)
    assert "the causal mask is missing in the diagonal tile" in verdict, verdict
    verdict = exercises.check_causal_mask(mask_one_ahead, end_right)
    assert "row i also sees key i + 1" in verdict, verdict
    verdict = exercises.check_causal_mask(mask_right, end_before_diagonal)
    assert "stops before the block's diagonal tile" in verdict, verdict
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
        acc, l_i, m_i = rerope.online_softmax._softmax_step(acc, l_i, m_i, scores, v, qk_scale,
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
        acc, l_i, m_i = rerope.online_softmax._softmax_step(acc, l_i, m_i, scores, v, qk_scale,
                                                            "tf32")
    return acc, l_i, m_i


@triton.jit
def pass_no_load_mask(acc, l_i, m_i, q, K, V, rows, lo, hi, n_ctx, window, qk_scale,
                      PRODUCT: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
    # the right masks on the scores, but K and V loaded past n_ctx
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :])
        v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :])
        gap = rows[:, None] - cols[None, :]
        keep = (gap < window) & (-gap < window)
        if PRODUCT == OUTSIDE:
            keep = ~keep
        keep = keep & (cols[None, :] < n_ctx)
        if CAUSAL:
            keep = keep & (gap >= 0)
        scores = tl.where(keep, tl.dot(q, tl.trans(k)), float("-inf"))
        acc, l_i, m_i = rerope.online_softmax._softmax_step(acc, l_i, m_i, scores, v, qk_scale,
                                                            "tf32")
    return acc, l_i, m_i


@triton.jit
def pass_skipped(acc, l_i, m_i, q, K, V, rows, lo, hi, n_ctx, window, qk_scale,
                 PRODUCT: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    return acc, l_i, m_i


def walk_keys(n, window, block_m, block_n, causal, program, walk):
    tiles = exercises._walk_tiles(n, window, block_m, block_n, causal)[program][walk]
    return exercises._tile_keys(tiles, block_n)


def test_walk_tiles_match_the_tile_map():
    """The masked walks the diagnosis names are those the kernels' schedule makes."""
    from rerope.regions import INSIDE_MASKED, OUTSIDE_MASKED
    for n, window, causal, block_m, block_n in ((40, 13, True, 16, 16), (48, 20, True, 32, 16),
                                                (40, 13, False, 16, 16)):
        flags = exercises.tile_map(n, window, block_m, block_n, causal=causal)
        for program, walks in exercises._walk_tiles(n, window, block_m, block_n, causal).items():
            masked = {c for c, f in enumerate(flags[program].tolist())
                      if f & (INSIDE_MASKED | OUTSIDE_MASKED)}
            assert set(walks["band"]) | set(walks["diagonal/end"]) == masked


def verdict_names_only_visited_walks(verdict, n, window, block_m, block_n, causal):
    """Each walk the verdict blames is one its program makes, with exactly that walk's tiles."""
    program = int(verdict.split("Program ")[1].split()[0])
    blamed = verdict.split("goes wrong on its ")[1]
    for walk in ("band", "diagonal/end"):
        if f"{walk} tiles" in blamed:
            keys = walk_keys(n, window, block_m, block_n, causal, program, walk)
            assert keys != "none" and f"{walk} tiles {keys}" in blamed, (walk, verdict)
    return True


def test_masked_pass():
    assert exercises.check_masked_pass(pass_right) == "correct"
    verdict = exercises.check_masked_pass(pass_no_window_side)
    assert verdict.startswith("N=40, w=13, causal, 16x16 tiles: rows"), verdict
    assert verdict_names_only_visited_walks(verdict, 40, 13, 16, 16, True)
    # a pass without load masks: blamed on the read past n_ctx, in a walk the program makes
    verdict = exercises.check_masked_pass(pass_no_load_mask)
    assert "your pass reads keys past n_ctx" in verdict and "mask=cols[:, None] < n_ctx" in verdict
    program = int(verdict.split("Program ")[1].split()[0])
    ragged = verdict.split("the ragged tile ")[1].split(";")[0]
    walks = exercises._walk_tiles(40, 13, 16, 16, True)[program]
    assert ragged in exercises._tile_keys(walks["band"] + walks["diagonal/end"], 16), verdict
    # the starter: every walk the verdict names is one the program makes
    verdict = exercises.check_masked_pass(pass_skipped)
    assert verdict.startswith("N=40, w=13, causal, 16x16 tiles: rows 0–39 are wrong. Program 0 "
                              "(rows 0–15) goes wrong on its diagonal/end walk: diagonal/end "
                              "tiles [0, 16)"), verdict
    assert verdict_names_only_visited_walks(verdict, 40, 13, 16, 16, True)


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
    verdict = exercises.check_window_bounds(symmetric)
    assert "before=40, after=9" in verdict and "ignore `after`" in verdict, verdict
    assert "not solved yet" in exercises.check_window_bounds(lambda *args: None)

    def edge_inside(start, self_block, other_block, before, after):  # |i - j| = w inside
        return window_bounds_right(start, self_block, other_block, before + 1, after + 1)
    verdict = exercises.check_window_bounds(edge_inside)
    assert "off by one at the window's edge" in verdict, verdict

    def rounded_outward(start, self_block, other_block, before, after):  # floor <-> ceil
        def floor(x):
            return -(-max(x, 0) // other_block) * other_block

        def ceil(x):
            return max(x, 0) // other_block * other_block
        inside_start = ceil(start + self_block - before)
        return (floor(start - before + 1), inside_start,
                max(floor(start + after), inside_start),
                ceil(start + self_block - 1 + after))
    verdict = exercises.check_window_bounds(rounded_outward)
    assert "rounded the wrong way" in verdict, verdict


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


@triton.jit
def delta_no_store_mask(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    base = tl.program_id(1) * n_ctx
    ptrs = (base + rows[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    tl.store(Delta + base + rows, tl.sum(o * do, 1))             # the ragged block spills


@triton.jit
def delta_no_masks(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    base = tl.program_id(1) * n_ctx
    ptrs = (base + rows[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs).to(tl.float32)
    do = tl.load(DO + ptrs).to(tl.float32)
    tl.store(Delta + base + rows, tl.sum(o * do, 1))


@triton.jit
def delta_in_fp16(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    base = tl.program_id(1) * n_ctx
    ptrs = (base + rows[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    do = tl.load(DO + ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    tl.store(Delta + base + rows, tl.sum(o * do, 1).to(tl.float16), mask=rows < n_ctx)


@triton.jit
def delta_row_stride(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    base = tl.program_id(1) * n_ctx
    ptrs = (base + rows[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    tl.store(Delta + (base + rows) * HEAD_DIM, tl.sum(o * do, 1), mask=rows < n_ctx)  # Out's stride


def test_delta_kernel():
    assert exercises.check_delta_kernel(delta_right) == "correct"
    verdict = exercises.check_delta_kernel(delta_first_head_only)
    assert "head 1, rows 0–39 were never written (program (0, 1) owns row 0)" in verdict
    # no store mask: caught in the guard region after Delta, not a heap corruption
    for wrong in (delta_no_store_mask, delta_no_masks):
        verdict = exercises.check_delta_kernel(wrong)
        assert verdict.startswith("B·H=3, N=40, D=32, BLOCK_M=16: your kernel wrote 8 "
                                  "element(s) past its last element of Delta"), verdict
    assert exercises.check_delta_kernel(delta_in_fp16) != "correct"
    # Out's row stride used for Delta: writes thousands of elements past Delta, still caught
    verdict = exercises.check_delta_kernel(delta_row_stride)
    assert "past its last element of Delta" in verdict, verdict


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


@triton.jit
def route_edge_inside(ds, rows, cols, window):
    gap = rows[:, None] - cols[None, :]
    inside = (gap <= window) & (gap >= -window)
    return tl.where(inside, ds, 0.0), tl.where(inside, 0.0, ds)


@triton.jit
def route_unmasked(ds, rows, cols, window):
    return ds, ds


@triton.jit
def route_causal_side_only(ds, rows, cols, window):
    gap = rows[:, None] - cols[None, :]
    return tl.where(gap < window, ds, 0.0), tl.where(gap < window, 0.0, ds)


@triton.jit
def route_halved(ds, rows, cols, window):       # no named slip
    gap = rows[:, None] - cols[None, :]
    inside = (gap < window) & (gap > -window)
    return tl.where(inside, ds, 0.0) * 0.5, tl.where(inside, 0.0, ds)


def test_ds_routing():
    assert exercises.check_ds_routing(route_right) == "correct"
    for route, hint in ((route_swapped, "the two parts are swapped"),
                        (route_edge_inside, "off by one at the window's edge"),
                        (route_unmasked, "the window mask is missing"),
                        (route_causal_side_only, "your window has one side")):
        verdict = exercises.check_ds_routing(route)
        assert "is wrong in rows" in verdict and hint in verdict, (hint, verdict)
    verdict = exercises.check_ds_routing(route_halved)
    assert verdict.startswith("N=40, w=13, causal, 16x16 tiles: dQ1 is wrong in rows")
    assert "Program 0 visits band tiles" in verdict, verdict


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


@triton.jit
def rope_no_store_mask(X, Cos, Sin, Out, n_ctx, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, HEAD_DIM // 2)
    ok = rows[:, None] < n_ctx
    x_ptrs = X + (tl.program_id(1) * n_ctx + rows[:, None]) * HEAD_DIM + half[None, :]
    o_ptrs = Out + (tl.program_id(1) * n_ctx + rows[:, None]) * HEAD_DIM + half[None, :]
    cos = tl.load(Cos + rows[:, None] * (HEAD_DIM // 2) + half[None, :], mask=ok)
    sin = tl.load(Sin + rows[:, None] * (HEAD_DIM // 2) + half[None, :], mask=ok)
    a = tl.load(x_ptrs, mask=ok).to(tl.float32)
    b = tl.load(x_ptrs + HEAD_DIM // 2, mask=ok).to(tl.float32)
    tl.store(o_ptrs, (a * cos - b * sin).to(Out.dtype.element_ty))
    tl.store(o_ptrs + HEAD_DIM // 2, (b * cos + a * sin).to(Out.dtype.element_ty))


def test_rope_kernel():
    assert exercises.check_rope_kernel(rope_right) == "correct"
    verdict = exercises.check_rope_kernel(rope_no_store_mask)
    assert verdict.startswith("B·H=2, N=40, D=32, float16, BLOCK_N=16: your kernel wrote") and (
        "past its last element of Out" in verdict), verdict
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
    assert "Likely: the offset β was left out" in verdict, verdict
    verdict = exercises.check_turn_tile(turn_by_difference)
    assert "ReRoPE, raw inputs: R(w)" in verdict
    assert "Likely: the offset was subtracted, α − β instead of α + β" in verdict, (
        verdict)
    verdict = exercises.check_turn_tile(turn_first_half_only)
    assert verdict.endswith(
        "wrong at positions 1–39, frequencies t = 0–15, in the second half. Likely: "
        "the second half came back unturned: it is b cos + a sin"), verdict
    # the forward turn is not its own transpose: position 0 is the only row it gets right
    assert "R(p) (speed 1, offset +0; N=40, D=32, BLOCK=16): wrong at positions 1–39" in (
        exercises.check_turn_back_tile(turn_right))


@triton.jit
def turn_swapped_halves(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    cos = cos_p * cos_o - sin_p * sin_o
    sin = sin_p * cos_o + cos_p * sin_o
    return x_b * cos + x_a * sin, x_a * cos - x_b * sin


@triton.jit
def turn_nothing(x_a, x_b, cos_p, sin_p, cos_o, sin_o):
    return x_a, x_b


def test_turn_back_tile():
    assert exercises.check_turn_back_tile(turn_back_right) == "correct"
    verdict = exercises.check_turn_tile(turn_back_right)
    assert "Likely: turned the wrong way, by the transpose" in verdict, verdict
    verdict = exercises.check_turn_back_tile(turn_right)
    assert "Likely: turned the wrong way, by the transpose" in verdict, verdict


def test_turn_hints_name_the_slip():
    verdict = exercises.check_turn_tile(turn_swapped_halves)
    assert verdict.endswith(
        "Likely: the two halves come back swapped: return (first half, second half)"), (
        verdict)
    verdict = exercises.check_turn_tile(turn_nothing)
    assert verdict.endswith(
        "Likely: nothing was turned: the halves came back as they went in"), verdict

def test_spans():
    assert exercises._spans([0, 1, 2, 5, 7, 8]) == "0–2, 5, 7–8"
    assert exercises._spans([3]) == "3"


def test_palette_names_every_tile_class():
    assert set(exercises.TILE_COLOURS) == {"skipped", "outside", "inside", "band", "edge_inside",
                                           "edge_outside"}


# --- chapter 6: band tiles (plain Python) ---------------------------------------------------------

def band_tiles_brute(n_ctx, window, block_m, block_n, causal):
    count = 0
    for q_start in range(0, n_ctx, block_m):
        i = torch.arange(q_start, min(q_start + block_m, n_ctx))[:, None]
        for k_start in range(0, n_ctx, block_n):
            j = torch.arange(k_start, min(k_start + block_n, n_ctx))[None, :]
            valid = (j <= i) if causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
            near = (i - j).abs() < window
            count += bool((valid & near).any()) and bool((valid & ~near).any())
    return count


def test_band_cases_agree_with_brute_force():
    """The checker's shapes are those where the schedule's count is the brute-force count."""
    for case in exercises._BAND_CASES:
        assert exercises.schedule_band_tiles(*case) == band_tiles_brute(*case), case


def test_band_tiles():
    assert exercises.check_band_tiles(band_tiles_brute) == "correct"
    assert "not solved yet" in exercises.check_band_tiles(lambda *args: None)

    def half_of_non_causal(n_ctx, window, block_m, block_n, causal):
        both = band_tiles_brute(n_ctx, window, block_m, block_n, False)
        return both // 2 if causal else both
    verdict = exercises.check_band_tiles(half_of_non_causal)
    assert verdict.startswith("N=256, w=8, 32x16 tiles, causal: got 15, the schedule has 23: "
                              "that is half the non-causal count"), verdict

    def whole_rows_of_tiles(n_ctx, window, block_m, block_n, causal):   # every straddled tile
        return band_tiles_brute(n_ctx, window, block_m, block_n, False)
    assert "causal: got" in exercises.check_band_tiles(whole_rows_of_tiles)

    def closed_or_open(n_ctx, window, block_m, block_n, causal):        # |i - j| <= w
        return band_tiles_brute(n_ctx, window + 1, block_m, block_n, causal)
    assert exercises.check_band_tiles(closed_or_open).startswith("N=256, w=1, 32x16 tiles")


# --- chapter 8: the split-KV merge ----------------------------------------------------------------

@triton.jit
def merge_right(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    lse = tl.load(Lse + splits * n_rows + row, mask=ok, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / tl.sum(w, 0))


@triton.jit
def merge_without_max(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    w = tl.math.exp2(tl.load(Lse + splits * n_rows + row, mask=ok, other=float("-inf")))
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / tl.sum(w, 0))


@triton.jit
def merge_unmasked_loads(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(Lse + splits * n_rows + row)                    # reads SPLITS > n_splits rows
    w = tl.math.exp2(lse - tl.max(lse, 0))
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :])
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / tl.sum(w, 0))


@triton.jit
def merge_plain_mean(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(part, 0) / n_splits)


@triton.jit
def merge_unnormalised(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr,
                       SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    lse = tl.load(Lse + splits * n_rows + row, mask=ok, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0))    # no / Σ w


@triton.jit
def merge_split_axis_inner(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr,
                           SPLITS: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    # the wrong stride: the split axis read as the inner one
    lse = tl.load(Lse + row * n_splits + splits, mask=ok, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))
    part = tl.load(Part + (row * n_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / tl.sum(w, 0))


@triton.jit
def merge_natural_exp(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr,
                      SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    lse = tl.load(Lse + splits * n_rows + row, mask=ok, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))                          # log2 units read as e
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / tl.sum(w, 0))


@triton.jit
def merge_padding_zero(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr,
                       SPLITS: tl.constexpr):
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    lse = tl.load(Lse + splits * n_rows + row, mask=ok, other=0.0)    # not -inf
    w = tl.math.exp2(lse - tl.max(lse, 0))
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / tl.sum(w, 0))


def test_merge_kernel():
    from rerope.teach import split_decode

    assert exercises.check_merge_kernel(merge_right) == "correct"
    assert exercises.check_merge_kernel(split_decode.merge_kernel) == "correct"
    assert "Likely: NaN or inf: 2^lse overflows fp32" in (
        exercises.check_merge_kernel(merge_without_max))
    assert exercises.check_merge_kernel(merge_unmasked_loads).startswith(
        "three splits, the last one empty (n_splits=3, SPLITS=4): rows 0–11 wrong. "
        "Likely: NaN or inf: the lanes past n_splits read beyond Part and Lse")
    expected = {
        merge_plain_mean: "the partials were averaged",
        merge_unnormalised: "the weighted sum was not divided by Σ_s 2^(lse_s − M)",
        merge_split_axis_inner: "a wrong stride: Part and Lse were read as (rows, "
                                "n_splits",
        merge_natural_exp: "exp instead of exp2",
        merge_padding_zero: "the padding lanes (splits ≥ n_splits) were loaded as "
                            "lse = 0",
    }
    for answer, hint in expected.items():
        verdict = exercises.check_merge_kernel(answer)
        assert verdict.startswith("three splits, the last one empty") and (
            f"Likely: {hint}" in verdict), verdict


# --- chapter 8: a split's chunk of the cache ------------------------------------------

@triton.jit
def chunk_right(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    per_split = (n_keys + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return split * chunk, tl.minimum(split * chunk + chunk, n_keys)


@triton.jit
def chunk_one_too_far(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    return split * chunk, tl.minimum(split * chunk + chunk + 1, n_keys)


@triton.jit
def chunk_one_too_short(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    return split * chunk, tl.minimum(split * chunk + chunk - 1, n_keys)


@triton.jit
def chunk_rounded_down(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    chunk = n_keys // num_splits // BLOCK_N * BLOCK_N
    return split * chunk, tl.minimum(split * chunk + chunk, n_keys)


@triton.jit
def chunk_unclamped(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    return split * chunk, split * chunk + chunk


@triton.jit
def chunk_not_tiles(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    chunk = tl.cdiv(n_keys, num_splits)
    return split * chunk, tl.minimum(split * chunk + chunk, n_keys)


def test_chunk_bounds():
    from rerope.teach import split_decode

    assert exercises.check_chunk_bounds(chunk_right) == "correct"
    assert exercises.check_chunk_bounds(split_decode._chunk_bounds) == "correct"
    expected = {
        chunk_one_too_far: "belong to two splits: each chunk also takes the next one's "
                           "first key — off by one",
        chunk_one_too_short: "belong to no split — off by one: hi = lo + chunk − 1",
        chunk_rounded_down: "keys 896–999 belong to no split: the chunks stop short",
        chunk_unclamped: "split 6 ends at hi = 1008, past the cache's 1000 keys",
        chunk_not_tiles: "split 1 starts at key 143, not a multiple of BLOCK_N = 16",
    }
    for answer, hint in expected.items():
        verdict = exercises.check_chunk_bounds(answer)
        assert verdict.startswith("n_keys=1000, num_splits=7, BLOCK_N=16: "), verdict
        assert hint in verdict, verdict


# --- chapter 9: the production kernel's grid order --------------------------------------------

@triton.jit
def program_right(HEADS_FIRST: tl.constexpr, CAUSAL: tl.constexpr):
    if HEADS_FIRST:
        bh, block, n_blocks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    else:
        bh, block, n_blocks = tl.program_id(1), tl.program_id(0), tl.num_programs(0)
    if CAUSAL:
        block = n_blocks - 1 - block
    return bh, block


@triton.jit
def program_blocks_first_always(HEADS_FIRST: tl.constexpr, CAUSAL: tl.constexpr):
    block = tl.program_id(0)
    if CAUSAL:
        block = tl.num_programs(0) - 1 - block
    return tl.program_id(1), block


@triton.jit
def program_light_first(HEADS_FIRST: tl.constexpr, CAUSAL: tl.constexpr):
    if HEADS_FIRST:
        return tl.program_id(0), tl.program_id(1)
    else:
        return tl.program_id(1), tl.program_id(0)


@triton.jit
def program_off_by_one(HEADS_FIRST: tl.constexpr, CAUSAL: tl.constexpr):
    if HEADS_FIRST:
        bh, block, n_blocks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    else:
        bh, block, n_blocks = tl.program_id(1), tl.program_id(0), tl.num_programs(0)
    if CAUSAL:
        block = n_blocks - block
    return bh, block


@triton.jit
def program_wrong_count(HEADS_FIRST: tl.constexpr, CAUSAL: tl.constexpr):
    # counts the blocks on the head axis
    if HEADS_FIRST:
        bh, block, n_blocks = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    else:
        bh, block, n_blocks = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    if CAUSAL:
        block = n_blocks - 1 - block
    return bh, block


def test_program_order():
    assert exercises.check_program_order(program_right) == "correct"
    verdict = exercises.check_program_order(program_blocks_first_always)
    assert verdict.startswith("HEADS_FIRST=True, CAUSAL=True, grid (3, 5)"), verdict
    assert verdict.endswith("the head is tl.program_id(0) and the block tl.program_id(1)")
    assert exercises.check_program_order(program_light_first).endswith(
        "only with CAUSAL does the last block (the most keys) start first, as "
        "n_blocks - 1 - block")
    assert exercises.check_program_order(program_off_by_one).endswith(
        "off by one in the reversed block: the last block is n_blocks - 1 - block")
    assert "counted with the wrong tl.num_programs" in exercises.check_program_order(
        program_wrong_count)
    exercises.assert_rejected(exercises.check_program_order, {
        "blocks first whatever HEADS_FIRST": program_blocks_first_always,
        "light blocks first": program_light_first, "off by one": program_off_by_one,
        "the wrong axis counted": program_wrong_count})


# --- chapter 10: positions from a padding mask ----------------------------------------------------

@triton.jit
def positions_right(Mask, Positions, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slots = tl.arange(0, BLOCK)
    live = slots < n
    mask = tl.load(Mask + row * n + slots, mask=live, other=0)
    tl.store(Positions + row * n + slots, tl.where(mask != 0, tl.cumsum(mask, 0) - 1, 0),
             mask=live)


@triton.jit
def positions_no_store_mask(Mask, Positions, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slots = tl.arange(0, BLOCK)
    mask = tl.load(Mask + row * n + slots, mask=slots < n, other=0)
    tl.store(Positions + row * n + slots, tl.where(mask != 0, tl.cumsum(mask, 0) - 1, 0))


@triton.jit
def positions_arange(Mask, Positions, n, BLOCK: tl.constexpr):     # ignores the padding
    row = tl.program_id(0)
    slots = tl.arange(0, BLOCK)
    tl.store(Positions + row * n + slots, slots, mask=slots < n)


@triton.jit
def positions_padding_minus_one(Mask, Positions, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slots = tl.arange(0, BLOCK)
    live = slots < n
    mask = tl.load(Mask + row * n + slots, mask=live, other=0)
    tl.store(Positions + row * n + slots, tl.cumsum(mask, 0) - 1, mask=live)


def test_positions_kernel():
    assert exercises.check_positions_kernel(positions_right) == "correct"
    # printed "correct", then aborted with a corrupted heap before the guard regions
    verdict = exercises.check_positions_kernel(positions_no_store_mask)
    assert verdict.startswith("n = 13, BLOCK = 16: your kernel wrote 3 element(s) past its last "
                              "element of Positions"), verdict
    assert exercises.check_positions_kernel(positions_arange).startswith(
        "left padding (mask row [0, 0, 0, 1, 1, 1, 1, 1]): slots 1–7 wrong, got [1, 2, 3, 4]")
    assert "slots 0–2 wrong, got [-1, -1, -1], want [0, 0, 0]" in (
        exercises.check_positions_kernel(positions_padding_minus_one))


# --- chapter 11: the log-n scale ------------------------------------------------------------------

@triton.jit
def logn_right(Q, Out, n_q, n_k, logn_factor, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < n_q
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(1.0, tl.log2((n_k - n_q + rows + 1).to(tl.float32)) * logn_factor)
    tl.store(Out + rows[:, None] * HEAD_DIM + dims[None, :], q * scale[:, None], mask=ok)


@triton.jit
def logn_no_store_mask(Q, Out, n_q, n_k, logn_factor, BLOCK: tl.constexpr,
                       HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < n_q
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(1.0, tl.log2((n_k - n_q + rows + 1).to(tl.float32)) * logn_factor)
    tl.store(Out + rows[:, None] * HEAD_DIM + dims[None, :], q * scale[:, None])


@triton.jit
def logn_chunk_positions(Q, Out, n_q, n_k, logn_factor, BLOCK: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)       # forgets the chunk's offset
    dims = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < n_q
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(1.0, tl.log2((rows + 1).to(tl.float32)) * logn_factor)
    tl.store(Out + rows[:, None] * HEAD_DIM + dims[None, :], q * scale[:, None], mask=ok)


def test_logn_kernel():
    assert exercises.check_logn_kernel(logn_right) == "correct"
    assert "past its last element of Out" in exercises.check_logn_kernel(logn_no_store_mask)
    assert exercises.check_logn_kernel(logn_chunk_positions).startswith(
        "the last 37 queries of 300")


# --- chapter 4: the band walk with both products --------------------------------------------------

@triton.jit
def band_right(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
               CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        ptrs = cols[:, None] * HEAD_DIM + dims[None, :]
        ok = cols[:, None] < n_ctx
        k1 = tl.load(K1 + ptrs, mask=ok, other=0.0)
        k2 = tl.load(K2 + ptrs, mask=ok, other=0.0)
        v = tl.load(V + ptrs, mask=ok, other=0.0)
        gap = rows[:, None] - cols[None, :]
        scores = tl.where((gap < window) & (gap > -window), tl.dot(q1, tl.trans(k1)),
                          tl.dot(q2, tl.trans(k2)))
        keep = cols[None, :] < n_ctx
        if CAUSAL:
            keep = keep & (gap >= 0)
        acc, l_i, m_i = rerope.online_softmax._softmax_step(
            acc, l_i, m_i, tl.where(keep, scores, float("-inf")), v, qk_scale, "tf32")
    return acc, l_i, m_i


@triton.jit
def band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
              CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              SLIP: tl.constexpr):
    """band_right with one slip: 1 one product everywhere, 2 |i - j| <= w, 3 one side of
    the window only, 4 no causal mask, 5 no load masks, 6 the products swapped, 7 no
    end-of-sequence mask on the scores."""
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        ptrs = cols[:, None] * HEAD_DIM + dims[None, :]
        ok = cols[:, None] < n_ctx
        if SLIP == 5:
            k1 = tl.load(K1 + ptrs)
            k2 = tl.load(K2 + ptrs)
            v = tl.load(V + ptrs)
        else:
            k1 = tl.load(K1 + ptrs, mask=ok, other=0.0)
            k2 = tl.load(K2 + ptrs, mask=ok, other=0.0)
            v = tl.load(V + ptrs, mask=ok, other=0.0)
        gap = rows[:, None] - cols[None, :]
        inside = (gap < window) & (gap > -window)
        if SLIP == 2:
            inside = (gap <= window) & (gap >= -window)
        if SLIP == 3:
            inside = gap < window
        near = tl.dot(q1, tl.trans(k1))
        if SLIP == 1:
            near = tl.dot(q2, tl.trans(k2))
        if SLIP == 6:
            scores = tl.where(inside, tl.dot(q2, tl.trans(k2)), near)
        else:
            scores = tl.where(inside, near, tl.dot(q2, tl.trans(k2)))
        keep = cols[None, :] < n_ctx
        if SLIP == 7:
            keep = cols[None, :] > -1
        if CAUSAL and SLIP != 4:
            keep = keep & (gap >= 0)
        acc, l_i, m_i = rerope.online_softmax._softmax_step(
            acc, l_i, m_i, tl.where(keep, scores, float("-inf")), v, qk_scale, "tf32")
    return acc, l_i, m_i


@triton.jit
def band_slip_1(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 1)


@triton.jit
def band_slip_2(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 2)


@triton.jit
def band_slip_3(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 3)


@triton.jit
def band_slip_4(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 4)


@triton.jit
def band_slip_5(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 5)


@triton.jit
def band_slip_6(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 6)


@triton.jit
def band_slip_7(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return band_core(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                     qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, 7)


BAND_SLIPS = {i: globals()[f"band_slip_{i}"] for i in range(1, 8)}


@pytest.mark.parametrize("slip, hint", [
    (1, "every entry took q2·k2: the window mask is missing"),
    (2, "off by one at the window's edge: you count |i − j| = w as inside"),
    (3, "your window has one side"),
    (4, "the causal mask is missing"),
    (5, "your pass reads K or V past the end of the sequence"),
    (6, "the two products are swapped"),
    (7, "keys past the end of the sequence got weight"),
])
def test_band_pass_names_the_slip(slip, hint):
    verdict = exercises.check_band_pass(BAND_SLIPS[slip])
    assert "are wrong; " + hint in verdict, (slip, verdict)


@triton.jit
def band_skipped(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
                 CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    return acc, l_i, m_i


@triton.jit
def band_no_rescale(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                    qk_scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    # a slip the checker has no name for: the scores are not scaled
    return band_right(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window,
                      qk_scale * 2.0, CAUSAL, BLOCK_N, HEAD_DIM)


def test_band_pass():
    assert exercises.check_band_pass(band_right) == "correct"
    assert "leaves the band tiles out" in exercises.check_band_pass(band_skipped)
    verdict = exercises.check_band_pass(band_no_rescale)     # no named slip: where it is
    assert "walks the band tiles [" in verdict and "none" not in verdict, verdict


# --- chapter 5: δ for packed sequences ------------------------------------------------------------

@triton.jit
def varlen_core(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                SLIP: tl.constexpr):
    """The right varlen δ kernel, or one slip: 1 no store mask, 2 the local row index masked with
    the packed end,
    3 rows counted from 0 instead of the sequence's start, 4 the fp16 product."""
    seq = tl.program_id(1)
    start = tl.load(CuSeqlens + seq)
    end = tl.load(CuSeqlens + seq + 1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if SLIP == 3:
        packed = rows
    else:
        packed = start + rows
    ok = packed < end
    if SLIP == 2:
        ok = rows < end                    # the sequence's row index against a packed offset
    ptrs = packed[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=ok[:, None], other=0.0)
    do = tl.load(DO + ptrs, mask=ok[:, None], other=0.0)
    if SLIP == 4:
        delta = tl.sum(o * do, 1).to(tl.float16).to(tl.float32)
    else:
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if SLIP == 1:
        tl.store(Delta + packed, delta)
    else:
        tl.store(Delta + packed, delta, mask=ok)


@triton.jit
def varlen_0(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    varlen_core(Out, DO, Delta, CuSeqlens, BLOCK_M, HEAD_DIM, 0)


@triton.jit
def varlen_1(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    varlen_core(Out, DO, Delta, CuSeqlens, BLOCK_M, HEAD_DIM, 1)


@triton.jit
def varlen_2(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    varlen_core(Out, DO, Delta, CuSeqlens, BLOCK_M, HEAD_DIM, 2)


@triton.jit
def varlen_3(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    varlen_core(Out, DO, Delta, CuSeqlens, BLOCK_M, HEAD_DIM, 3)


@triton.jit
def varlen_4(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    varlen_core(Out, DO, Delta, CuSeqlens, BLOCK_M, HEAD_DIM, 4)


def test_delta_varlen_kernel():
    assert exercises.check_delta_varlen_kernel(varlen_0) == "correct"
    # no store mask: inside the packed tensor, caught when one sequence's programs run alone
    verdict = exercises.check_delta_varlen_kernel(varlen_1)
    assert verdict.startswith("lengths [16, 5, 32], D=32, BLOCK_M=16: the programs of sequence 0 "
                              "(rows 0–15) also wrote packed rows 16–31, which belong to "
                              "sequence(s) 1, 2"), verdict
    verdict = exercises.check_delta_varlen_kernel(varlen_2)
    assert "past its last element of Delta" in verdict or "also wrote packed rows" in verdict, (
        verdict)
    verdict = exercises.check_delta_varlen_kernel(varlen_3)
    assert verdict.startswith("lengths [16, 5, 32], D=32, BLOCK_M=16: the programs of sequence 1 "
                              "(rows 16–20) also wrote packed rows 0–15"), verdict
    assert "are wrong" in exercises.check_delta_varlen_kernel(varlen_4)
    verdict = exercises.check_delta_varlen_kernel(varlen_nothing)
    assert verdict.startswith("lengths [16, 5, 32], D=32, BLOCK_M=16: sequence 0 (rows 0–15 of the "
                              "packed tensor), its rows 0–15 were never written"), verdict


@triton.jit
def varlen_nothing(Out, DO, Delta, CuSeqlens, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    pass


# --- chapter 8: the merge that writes its LSE, the split-free batch -------------------------------

@triton.jit
def merge_lse_core(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                   SLIP: tl.constexpr):
    """Right, or: 1 LseOut = the max only, 2 natural log, 3 LseOut never written,
    4 the log of the sum without M added back."""
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < n_splits
    lse = tl.load(Lse + splits * n_rows + row, mask=ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - m)
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    tl.store(Out + row * HEAD_DIM + dims, tl.sum(w[:, None] * part, 0) / total)
    if SLIP == 0:
        tl.store(LseOut + row, m + tl.math.log2(total))
    if SLIP == 1:
        tl.store(LseOut + row, m)
    if SLIP == 2:
        tl.store(LseOut + row, m + tl.log(total))
    if SLIP == 4:
        tl.store(LseOut + row, tl.math.log2(total))


@triton.jit
def merge_lse_0(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    merge_lse_core(Part, Lse, Out, LseOut, n_splits, HEAD_DIM, SPLITS, 0)


@triton.jit
def merge_lse_1(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    merge_lse_core(Part, Lse, Out, LseOut, n_splits, HEAD_DIM, SPLITS, 1)


@triton.jit
def merge_lse_2(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    merge_lse_core(Part, Lse, Out, LseOut, n_splits, HEAD_DIM, SPLITS, 2)


@triton.jit
def merge_lse_3(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    merge_lse_core(Part, Lse, Out, LseOut, n_splits, HEAD_DIM, SPLITS, 3)


@triton.jit
def merge_lse_4(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    merge_lse_core(Part, Lse, Out, LseOut, n_splits, HEAD_DIM, SPLITS, 4)


def test_merge_lse_kernel():
    assert exercises.check_merge_lse_kernel(merge_lse_0) == "correct"
    verdict = exercises.check_merge_lse_kernel(merge_lse_1)
    assert verdict.startswith("three splits, the last one empty (n_splits=3, SPLITS=4): LseOut, "
                              "rows 0–11 wrong"), verdict
    assert "LseOut, rows" in exercises.check_merge_lse_kernel(merge_lse_2)
    assert exercises.check_merge_lse_kernel(merge_lse_3).endswith("never written")
    assert "LseOut, rows" in exercises.check_merge_lse_kernel(merge_lse_4)


def test_split_free_batch():
    from rerope import decode

    def right(kv_heads, n_keys, sms):
        if -(-n_keys // decode.MIN_KEYS_PER_SPLIT) <= 1:
            return 1
        return decode.PROGRAMS_PER_SM * sms // (2 * kv_heads) + 1
    assert exercises.check_split_free_batch(right) == "correct"
    assert "not solved yet" in exercises.check_split_free_batch(lambda *args: None)

    def one_wave(kv_heads, n_keys, sms):          # "a wave's worth of programs": off by a factor
        return decode.PROGRAMS_PER_SM * sms // kv_heads + 1
    assert "the first batch with 1 is" in exercises.check_split_free_batch(one_wave)

    def no_plus_one(kv_heads, n_keys, sms):
        return right(kv_heads, n_keys, sms) - (n_keys > decode.MIN_KEYS_PER_SPLIT)
    verdict = exercises.check_split_free_batch(no_plus_one)
    assert "where the rule picks 2 split(s)" in verdict, verdict

    def ignores_short_caches(kv_heads, n_keys, sms):
        return decode.PROGRAMS_PER_SM * sms // (2 * kv_heads) + 1
    assert exercises.check_split_free_batch(ignores_short_caches).startswith("Hkv=1, 1 keys")


# --- chapter 11: NTK-aware scaling for a chosen frequency ----------------------------------------

def test_ntk_base():
    assert exercises.check_ntk_base(lambda b, d, a, t: b * a ** (d / (2 * t))) == "correct"
    assert "not solved yet" in exercises.check_ntk_base(lambda *args: None)
    # the slowest frequency's formula (the page's): right only for pair D/2 - 1
    verdict = exercises.check_ntk_base(lambda b, d, a, t: b * a ** (d / (d - 2)))
    assert verdict.startswith("D=64, α=16, pair 8: pair 8 turns"), verdict
    assert "pair 0" not in exercises.check_ntk_base(lambda b, d, a, t: b * a)
    assert "turns 0.0" in exercises.check_ntk_base(lambda b, d, a, t: b / a ** (d / (2 * t)))


def test_assert_rejected():
    exercises.assert_rejected(exercises.check_split_free_batch, {"one": lambda *args: 1})
    with pytest.raises(AssertionError, match="'right': verdict 'correct'"):
        exercises.assert_rejected(exercises.check_ntk_base,
                                  {"right": lambda b, d, a, t: b * a ** (d / (2 * t))})
    with pytest.raises(AssertionError, match="the checker raised TypeError"):
        exercises.assert_rejected(exercises.check_ntk_base, {"wrong arity": lambda b: b})


# --- the tile-angles and page-address checkers -----------------------------------------------


@triton.jit
def _angles_split(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    freqs = tl.arange(0, HALF)[None, :]
    first = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + freqs
    cos_r, sin_r = tl.load(Table + first), tl.load(Table + first + HALF)
    cos_0 = tl.load(Table + start * (2 * HALF) + freqs)
    sin_0 = tl.load(Table + start * (2 * HALF) + HALF + freqs)
    return cos_r * cos_0 - sin_r * sin_0, sin_r * cos_0 + cos_r * sin_0


@triton.jit
def _angles_row_per_key(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = (start + tl.arange(0, BLOCK))[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(Table + rows), tl.load(Table + rows + HALF)


@triton.jit
def _angles_first_tile_only(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(Table + rows), tl.load(Table + rows + HALF)


@triton.jit
def _angles_too_wide(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    return tl.load(Table + rows), tl.load(Table + rows)


@triton.jit
def _angles_one_value(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(Table + rows)


@triton.jit
def _angles_raises(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    return undefined_name(Table)  # noqa: F821


def test_tile_angles_checker_accepts_the_split_and_rejects_slips():
    from rerope import exercises

    assert exercises.check_tile_angles(_angles_split) == "correct"
    verdict = exercises.check_tile_angles(_angles_row_per_key)
    assert "read table rows other than" in verdict and "tiles 1–3" in verdict, verdict
    assert "wrong on tiles 1–3, keys 16–63" in exercises.check_tile_angles(_angles_first_tile_only)
    for answer in (_angles_too_wide, _angles_one_value, _angles_raises):
        verdict = exercises.check_tile_angles(answer)
        assert "your function raised" in verdict and "(BLOCK, HALF)" in verdict, verdict


def test_page_address_checker():
    def right(block_table, cache_seqlens, block_size):
        return [block_table[b, torch.arange(n) // block_size].long() * block_size
                + torch.arange(n) % block_size for b, n in enumerate(cache_seqlens.tolist())]

    assert exercises.check_page_slots(right) == exercises.CORRECT

    def page_only(block_table, cache_seqlens, block_size):          # forgets the slot
        return [block_table[b, torch.arange(n) // block_size].long() * block_size
                for b, n in enumerate(cache_seqlens.tolist())]

    def logical(block_table, cache_seqlens, block_size):             # ignores the table
        return [torch.arange(n) for n in cache_seqlens.tolist()]

    def swapped(block_table, cache_seqlens, block_size):             # j % and // swapped
        return [block_table[b, torch.arange(n) % block_size].long() * block_size
                + torch.arange(n) // block_size for b, n in enumerate(cache_seqlens.tolist())]

    def full_rows(block_table, cache_seqlens, block_size):           # every table entry
        width = block_table.shape[1] * block_size
        return [block_table[b, torch.arange(width) // block_size].long() * block_size
                + torch.arange(width) % block_size for b in range(block_table.shape[0])]

    def floats(block_table, cache_seqlens, block_size):
        return [s.double() for s in right(block_table, cache_seqlens, block_size)]

    def crashes(block_table, cache_seqlens, block_size):
        return block_table[99]

    exercises.assert_rejected(exercises.check_page_slots, {
        "page only": page_only, "logical slots": logical, "swapped": swapped,
        "whole table": full_rows, "floats": floats, "raises": crashes,
        "one tensor": lambda t, n, s: torch.cat(right(t, n, s))})
