"""Checkers for the book's Triton exercises, and the palette of its tile figures.

Every exercise of chapters 3 to 11 that asks for Triton code is checked here (and a few plain
Python ones, so that the tests can feed them wrong answers), in the style of Triton-Puzzles: the
reader writes a ``@triton.jit`` function or kernel, a checker runs it (through the CPU
interpreter on a machine with no GPU, compiled on a GPU) on small shapes, compares it with the
package's own kernel or reference, and returns a one-line verdict that says *where* the answer is
wrong: which key tile, which rows, which quantity. ``"correct"`` means it passed. Every tensor a
reader's kernel touches lies inside guard regions (:func:`_guarded`), so a missing mask is a
verdict, never a crash.

The harness kernels below are small on purpose: they are the book's own code, shown with
:func:`rerope.source`, and they use only the stable building blocks of the package
(:func:`rerope.online_softmax._softmax_step`, :func:`rerope.regions._schedule`, the references),
never the internals of :mod:`rerope.forward` or :mod:`rerope.backward`.

Inputs are fp16 on both machines (the interpreter computes fp16 ``tl.dot`` correctly; bf16 it
does not), so a checker's verdict reads the same on a CPU and on a GPU.

=================================  =======  ============================================================
checker                            chapter  what the reader writes
=================================  =======  ============================================================
:func:`check_softcap_step`               3  a soft-capped ``_softmax_step``, safe for ``m = -inf``
:func:`check_causal_mask`                3  the causal mask and the loop end of the plain kernel
:func:`check_masked_pass`                4  one masked pass (band / diagonal) of the ReRoPE forward
:func:`check_band_pass`                  4  the band run of the teaching forward (both products)
:func:`check_window_bounds`              4  the cut points of an asymmetric window (plain Python)
:func:`check_delta_kernel`               5  the δ kernel, ``rowsum(dO ∘ O)``
:func:`check_delta_varlen_kernel`        5  the δ kernel for packed sequences of different lengths
:func:`check_ds_routing`                 5  the routing of ``dS`` to ``dQ1`` / ``dQ2``
:func:`check_band_tiles`                 6  how many tiles need both products (plain Python)
:func:`check_rope_kernel`                6  a RoPE rotation kernel (the five-tensor interface's cost)
:func:`check_turn_tile`                  7  a tile's halves turned by ``R(speed·p ± offset)`` in registers
:func:`check_turn_back_tile`             7  the transpose, for gradients (``dq = Rᵀ dq_rot``)
:func:`check_tile_angles`                7  a key tile's angles from one table row (Self-Extend too)
:func:`check_merge_kernel`               8  the split-KV merge of partial outputs by their LSEs
:func:`check_merge_lse_kernel`           8  the merge that also writes the merged LSE (mergeable again)
:func:`check_chunk_bounds`               8  the keys ``[lo, hi)`` of one split's chunk
:func:`check_split_free_batch`           8  the first batch at which the split rule stops splitting
:func:`check_program_order`              9  which head and query block a program of the grid does
:func:`check_positions_kernel`          10  positions from a left-padded mask, as ``generate`` gives
:func:`check_logn_kernel`               11  the log-n query scale, ``max(1, log(i + 1) / log(L))``
:func:`check_ntk_base`                  11  the RoPE base that slows one chosen frequency by α
=================================  =======  ============================================================
"""

import contextlib
import io
import warnings

import numpy as np
import torch
import triton
import triton.language as tl

from . import reference
from .online_softmax import LOG2E, _softmax_step, plain_attention
from .regions import (INSIDE, INSIDE_CLEAN, INSIDE_MASKED, OUTSIDE, OUTSIDE_CLEAN,
                      OUTSIDE_MASKED, _mark, _schedule, _window_bounds, tile_map)
from .rope import apply_rope
from .runtime import INTERPRET, kernels_decorated
from .teach.three_regions import INSIDE as _INSIDE_RUN, OUTSIDE as _OUTSIDE_RUN
from .teach.three_regions import _region_pass

# This module's own kernels are decorated in the package's mode (interpreted where rerope chose
# the interpreter, see rerope.runtime): the window opens here and closes at the end of the module.
_DECORATING = kernels_decorated()
_DECORATING.__enter__()

# One palette for the tile classes, in every figure of chapters 4, 5 and 6.
TILE_COLOURS = {
    "skipped": "#eeeeee",        # fully masked: never visited
    "outside": "#4c72b0",        # q2·k2 only, no mask (blue)
    "inside": "#55a868",         # q1·k1 only, no mask (green)
    "band": "#c44e52",           # both products, each masked to its side of the window (red)
    "edge_inside": "#dd8452",    # masked q1·k1 only: the causal diagonal, the ragged end (orange)
    "edge_outside": "#8172b3",   # masked q2·k2 only (purple)
}

CORRECT = "correct"


@contextlib.contextmanager
def _quiet():
    """Silence numpy's warnings while a reader's kernel runs under the interpreter: a wrong
    answer may divide 0 by 0, and the verdict, not a RuntimeWarning, should say so."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def assert_rejected(checker, wrong_answers):
    """The test of a checker: each of ``wrong_answers`` (``{what the slip is: answer}``) must be
    rejected with a message.

    Works for the checkers here (they return the verdict) and for the notebooks' own
    ``check_exercise_N`` (they print it). A wrong answer that the checker calls correct, that
    gets no message, or on which the checker itself raises is an ``AssertionError`` naming it.
    Prints nothing, so that a notebook cell calling it has no output to compare.
    """
    problems = []
    for what, answer in wrong_answers.items():
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), _quiet():
                returned = checker(answer)
        except Exception as error:                    # a checker must not crash on an answer
            problems.append(f"{what!r}: the checker raised {type(error).__name__}: {error}")
            continue
        verdict = (returned if isinstance(returned, str) else printed.getvalue()).strip()
        if not verdict or verdict.startswith(CORRECT) or verdict.startswith("not solved yet"):
            problems.append(f"{what!r}: verdict {verdict!r}")
    assert not problems, "wrong answers the checker does not reject:\n" + "\n".join(problems)


def _device():
    return "cpu" if INTERPRET else "cuda"


def _randn(gen, *shape, scale=1.0):
    """fp16 normal samples drawn on the CPU from ``gen``, moved to the kernels' device."""
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).half().to(_device())


def _spans(indices):
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0–2, 5, 7–8"``: a short list of rows for a message."""
    indices = sorted(int(i) for i in indices)
    parts, start = [], None
    for a, b in zip(indices, indices[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}–{a}")
            start = None
    return ", ".join(parts[:6]) + (", …" if len(parts) > 6 else "")


def _bad_rows(got, want, atol, rtol=0.0):
    """Indices along dim -2 (rows) where ``got`` and ``want`` differ (NaN counts as a difference)."""
    got, want = got.double().cpu(), want.double().cpu()
    bad = ~((got - want).abs() <= atol + rtol * want.abs())
    while bad.dim() > 1:
        bad = bad.any(-1)
    return bad.nonzero().flatten().tolist()


# --- guard regions: a reader's kernel must not write (or read) past its tensors -----------------
#
# Under the interpreter a store past the end of a tensor lands in whatever the heap holds there:
# the process aborts later (``free(): invalid pointer``), in Jupyter the kernel dies, often after
# the checker has printed its verdict. So every tensor a reader's kernel touches lives in the
# middle of a larger buffer: poison on each side, as long as the tensor (``GUARD`` elements at
# least). Stores past the end hit
# the poison (checked after the launch and reported), loads past the end read it (NaN, or a
# sentinel for integers) and show up as wrong rows.

GUARD = 4096           # elements each side at least (and at least the tensor's own size): more
                       # than a missing mask (a ragged block) or a wrong stride can reach
_INT_POISON = -7       # an int tensor's "never written"
_SENTINEL = -12288.0   # the guard of an output: finite and exact in fp16/fp32/int32, so that a
                       # stray store of NaN (a load past the end) shows up as well


def _poison(dtype):
    return float("nan") if dtype.is_floating_point else _INT_POISON


def _guarded(values, name, guard_value=None):
    """``values`` copied into the middle of a buffer with ``max(GUARD, values.numel())``
    poisoned elements on each side (``guard_value``; default NaN, or -7 for integers, so that loads past the end give wrong
    rows); returns ``(view, guard)``: ``view`` (same shape, contiguous) goes to the kernel,
    ``guard`` to :func:`_guard_verdict` after the launch."""
    guard_value = _poison(values.dtype) if guard_value is None else guard_value
    flat = values.contiguous().reshape(-1)
    guard = max(GUARD, flat.numel())
    buffer = torch.full((flat.numel() + 2 * guard,), guard_value, dtype=values.dtype,
                        device=values.device)
    view = buffer[guard:guard + flat.numel()].view(values.shape)
    view.copy_(values)
    return view, (name, buffer, guard_value, guard)


def _guarded_empty(shape, dtype, device, name):
    """An output: NaN (-7 for integers) inside, :data:`_SENTINEL` in the guard regions."""
    return _guarded(torch.full(shape, _poison(dtype), dtype=dtype, device=device), name,
                    _SENTINEL)


def _guard_verdict(*guards):
    """``None`` if no guard region changed, else a message naming the tensor, the side and how
    far the writes reached."""
    for name, buffer, guard_value, guard in guards:
        inner = buffer.numel() - 2 * guard
        for side, region in (("before its first", buffer[:guard].flip(0)),
                             ("past its last", buffer[guard + inner:])):
            region = region.cpu().double()
            same = (region.isnan() if guard_value != guard_value else region == guard_value)
            changed = (~same).nonzero().flatten()
            if changed.numel():
                return (f"your kernel wrote {changed.numel()} element(s) {side} element of "
                        f"{name} (up to {int(changed.max()) + 1} away): a store without the "
                        "right mask writes the ragged block's lanes outside the tensor (caught "
                        "here in a guard region; unguarded, the interpreter corrupts memory and "
                        "the process dies, a GPU overwrites a neighbour's data or faults)")
    return None


# --- chapter 3: the online-softmax step ----------------------------------------------------------

@triton.jit
def _step_trace_kernel(Q, K, V, TraceM, TraceL, TraceAcc, n_ctx, qk_scale, softcap,
                       m_start, shift, STEP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Attention of one head that records the online-softmax state after every key tile.

    ``STEP`` is a ``@triton.jit`` function with the signature of ``_softmax_step`` plus
    a ``softcap`` argument before ``DOT_PRECISION``. Row ``i`` sees the keys ``j >=
    shift · i`` (``shift = 0``: all of them), so with ``shift > 0`` the later rows meet
    fully masked tiles first. The state starts at ``m = m_start``, ``l = 0``, ``acc =
    0``; after key tile ``t`` the rows' ``m``, ``l`` (``(n_tiles, N)``) and ``acc``
    (``(n_tiles, N, D)``) are stored.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < n_ctx
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None],
                other=0.0)
    m_i = tl.zeros([BLOCK_M], tl.float32) + m_start
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for t in range(0, tl.cdiv(n_ctx, BLOCK_N)):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_ctx
        kv_ptrs = cols[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K + kv_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + kv_ptrs, mask=col_ok[:, None], other=0.0)
        visible = col_ok[None, :] & (cols[None, :] >= shift * rows[:, None])
        scores = tl.where(visible, tl.dot(q, tl.trans(k)), float("-inf"))
        acc, l_i, m_i = STEP(acc, l_i, m_i, scores, v, qk_scale, softcap, "tf32")
        tl.store(TraceM + t * n_ctx + rows, m_i, mask=row_ok)
        tl.store(TraceL + t * n_ctx + rows, l_i, mask=row_ok)
        tl.store(TraceAcc + (t * n_ctx + rows[:, None]) * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])


@triton.jit
def _tanh(x):
    """``tanh`` from ``exp2`` (exact to fp32 rounding; some Triton versions lack a tanh)."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))          # exp(-2|x|), in (0, 1]
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _softcap_step(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    """What :func:`check_softcap_step` compares with: the online-softmax step on soft-capped
    scores ``softcap · tanh(s / softcap)``, ``s = scores · qk_scale`` (log2 units), masked
    entries kept at ``-inf``, safe for ``m = -inf``."""
    s = scores * qk_scale
    s = tl.where(scores == float("-inf"), float("-inf"), softcap * _tanh(s / softcap))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _plain_step(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION: tl.constexpr):
    """The package's ``_softmax_step`` in the trace kernel's signature (``softcap`` unused)."""
    return _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)


def _step_trace(step, q, k, v, block_m, block_n, m_start, shift, softcap=1.0):
    n, d = q.shape
    n_tiles = triton.cdiv(n, block_n)
    trace_m = torch.full((n_tiles, n), float("nan"), device=q.device)
    trace_l = torch.full_like(trace_m, float("nan"))
    trace_acc = torch.full((n_tiles, n, d), float("nan"), device=q.device)
    with _quiet():
        _step_trace_kernel[(triton.cdiv(n, block_m),)](
            q, k, v, trace_m, trace_l, trace_acc, n, d ** -0.5 * LOG2E, softcap, m_start, shift,
            STEP=step, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    return trace_m.cpu(), trace_l.cpu(), trace_acc.cpu()


def _compare_traces(mine, want, n, block_n, shift, case, cap_hint=False):
    """The first tile after which ``mine`` and ``want`` (``(m, l, acc)`` traces) differ, as a
    verdict; ``None`` if they agree."""
    for t in range(want[0].shape[0]):
        keys = f"{case}, after key tile {t} (keys {t * block_n}–{min((t + 1) * block_n, n) - 1})"
        nan_rows = (mine[0][t].isnan() | mine[1][t].isnan()
                    | mine[2][t].isnan().any(-1)).nonzero().flatten().tolist()
        if nan_rows:
            return (f"{keys}: NaN in rows {_spans(nan_rows)}. A row whose scores so far are "
                    "all -inf has m = -inf, and exp2(-inf - (-inf)) is NaN: a fully masked "
                    "tile must leave its state unchanged")
        seen = torch.arange(n) * shift <= min((t + 1) * block_n, n) - 1
        if cap_hint:
            early = (~seen & (mine[1][t] != 0)).nonzero().flatten().tolist()
            if early:
                return (f"{keys}: rows {_spans(early)} have seen no key yet but l > 0: their "
                        "masked scores count. A masked entry is -inf, and softcap · tanh(-inf) = "
                        "-softcap is finite: keep -inf where the score was -inf")
        for name, got, expected in zip(("m", "l", "acc"), mine, want):
            got, expected = got[t].clone(), expected[t].clone()
            if name == "m":                         # unseen rows: -inf (yours) vs -1e30
                got[~seen], expected[~seen] = 0.0, 0.0
            scale = expected.abs().max().item()
            rows = _bad_rows(got, expected, atol=1e-3 * scale, rtol=1e-3)
            if rows:
                r = rows[0]
                detail = (f"row {r}: got {got[r].item():.4g}, expected {expected[r].item():.4g}"
                          if name != "acc" else f"row {r}: largest error "
                          f"{(got[r] - expected[r]).abs().max().item():.3g}")
                hint = {"m": " (m is in log2 units: the row max of the "
                             + ("capped " if cap_hint else "") + "scores · qk_scale)",
                        "l": " (l is the sum of 2^(s − m), rescaled by α; 0 until a row sees a "
                             "key)",
                        "acc": " (acc is rescaled by α, then gets P·V)"}[name]
                if cap_hint and name == "l" and bool((got[rows] > expected[rows]).all()):
                    hint += (". Too large: do masked entries count? softcap · tanh(-inf) = "
                             "-softcap is finite: keep -inf where the score was -inf (here the "
                             "ragged tile's keys past N are masked)")
                return (f"wrong in the case {keys}: {name} differs in rows {_spans(rows)}; "
                        f"{detail}{hint}")
    return None


def _step_inputs():
    gen = torch.Generator().manual_seed(3)
    n, d, block_m, block_n = 40, 16, 16, 16          # ragged: the last key tile is part empty
    q = _randn(gen, n, d, scale=2.0)                 # sharp scores: the running max moves
    k, v = _randn(gen, n, d), _randn(gen, n, d)
    k[33] = 4.0 * q[5]                               # row 5's largest score arrives late
    return q, k, v, block_m, block_n


def check_softcap_step(step):
    """Chapter 3: ``step(acc, l_i, m_i, scores, v, qk_scale, softcap, DOT_PRECISION)`` must be
    the online-softmax step on soft-capped scores (as Gemma 2 caps its logits): with
    ``s = scores · qk_scale`` (log2 units) it folds in ``softcap · tanh(s / softcap)``, leaves
    masked entries (``-inf``) at ``-inf``, and is safe for ``m = -inf``.

    Same kernel and inputs as the plain step's check (every key visible with a late row maximum;
    row ``i`` seeing keys ``j >= i`` only), at ``softcap`` 3 and 30 (log2 units; the scores reach
    about 10), both starting from ``m = -inf``, compared tile by tile with :func:`_softcap_step`.
    Reports the first tile, quantity and rows that differ, and names the two classic slips: NaN
    from ``-inf − (-inf)``, and masked entries capped to a finite ``-softcap``.
    """
    q, k, v, block_m, block_n = _step_inputs()
    for softcap in (3.0, 30.0):
        for shift in (0, 1):
            case = (f"softcap {softcap:g}, "
                    + ("every key visible" if shift == 0 else "row i sees keys j >= i"))
            mine = _step_trace(step, q, k, v, block_m, block_n, float("-inf"), shift, softcap)
            want = _step_trace(_softcap_step, q, k, v, block_m, block_n, float("-inf"), shift,
                               softcap)
            verdict = _compare_traces(mine, want, q.shape[0], block_n, shift, case,
                                      cap_hint=True)
            if verdict:
                return verdict
    return CORRECT


# --- chapter 3: the causal mask of the plain kernel ---------------------------------------------

@triton.jit
def _plain_exercise_kernel(Q, K, V, Out, Visits, n_ctx, qk_scale,
                           MASK: tl.constexpr, KEY_END: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """The plain kernel of chapter 3 with its two causal pieces supplied by the caller.

    ``KEY_END(start_m, BLOCK_M, n_ctx)`` is where the key loop stops, ``MASK(scores,
    rows, cols, n_ctx)`` returns the score tile with every entry that must not count set
    to ``-inf``. One head, contiguous ``(N, D)``; ``Visits[program]`` counts the key
    tiles the program walked.
    """
    start_m = tl.program_id(0) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :],
                mask=rows[:, None] < n_ctx, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    visits = tl.program_id(0) * 0          # an int32 counter
    for start_n in range(0, KEY_END(start_m, BLOCK_M, n_ctx), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_ptrs = cols[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K + kv_ptrs, mask=cols[:, None] < n_ctx, other=0.0)
        v = tl.load(V + kv_ptrs, mask=cols[:, None] < n_ctx, other=0.0)
        scores = MASK(tl.dot(q, tl.trans(k)), rows, cols, n_ctx)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, "tf32")
        visits += 1
    tl.store(Out + rows[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None],
             mask=rows[:, None] < n_ctx)
    tl.store(Visits + tl.program_id(0), visits)


# The causal mask's likely slips: which keys j row i sees (its block: rows start to
# end - 1).
_CAUSAL_SLIPS = (
    ("the causal mask is missing: row i attends to keys after it (mask cols > rows)",
     lambda i, j, start, end: j >= 0),
    ("the causal mask is missing in the diagonal tile: the loop ends at the block's "
     "last row, but within that tile row i still sees keys after it (mask cols > rows)",
     lambda i, j, start, end: j < end),
    ("off by one at the diagonal: row i must see itself, keys 0 … i (cols <= rows)",
     lambda i, j, start, end: j < i),
    ("off by one at the diagonal: row i also sees key i + 1 (keep cols <= rows)",
     lambda i, j, start, end: (j <= i + 1) & (j < end)),
    ("the key loop stops before the block's diagonal tile: it must run to "
     "min(start_m + BLOCK_M, n_ctx)", lambda i, j, start, end: (j <= i) & (j < start)),
)


def _causal_slip(out, q, k, v, block_m):
    """The hint for a wrong causal output: the slip of :data:`_CAUSAL_SLIPS` whose
    attention (float64) it reproduces, else the rule."""
    n, d = q.shape
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    scores = (q.double() @ k.double().T) * d ** -0.5
    for hint, sees in _CAUSAL_SLIPS:
        start = i // block_m * block_m
        allowed = sees(i, j, start, start + block_m)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        slip = probs @ v.double()
        if torch.allclose(out.double(), slip, atol=2e-3, rtol=2e-3, equal_nan=True):
            return hint
    return "causal: row i attends to the keys 0 … i, and to none past N − 1"


def check_causal_mask(mask, key_end):
    """Chapter 3: causal plain attention from the reader's ``mask`` and ``key_end``.

    Compares with the package's ``plain_attention(causal=True)`` row by row, and the number of key
    tiles each program walks with the fewest that suffice (a loop that runs into tiles above the
    diagonal is correct but wasteful: reported as such).
    """
    gen = torch.Generator().manual_seed(4)
    for n, block_m, block_n in ((40, 16, 16), (40, 32, 16), (48, 16, 32)):
        d = 16
        q, k, v = (_randn(gen, n, d) for _ in range(3))
        out = torch.full((n, d), float("nan"), dtype=torch.float32, device=q.device)
        n_programs = triton.cdiv(n, block_m)
        visits = torch.zeros(n_programs, dtype=torch.int32, device=q.device)
        with _quiet():
            _plain_exercise_kernel[(n_programs,)](
                q, k, v, out, visits, n, d ** -0.5 * LOG2E, MASK=mask, KEY_END=key_end,
                BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
        want = plain_attention(q[None, None], k[None, None], v[None, None], causal=True,
                               block_m=block_m, block_n=block_n)[0, 0]
        shape = f"N={n}, {block_m}-row query blocks, {block_n}-key tiles"
        rows = _bad_rows(out, want, atol=2e-3, rtol=2e-3)
        if rows:
            return (f"{shape}: output rows {_spans(rows)} differ from plain_attention"
                    f"(causal=True); " + _causal_slip(out, q, k, v, block_m))
        fewest = [triton.cdiv(min((p + 1) * block_m, n), block_n) for p in range(n_programs)]
        for p, (walked, need) in enumerate(zip(visits.cpu().tolist(), fewest)):
            if walked != need:
                return (f"{shape}: right output, but program {p} (rows {p * block_m}–"
                        f"{min((p + 1) * block_m, n) - 1}) walks {walked} key tiles where "
                        f"{need} suffice: the tiles above the diagonal are fully masked")
    return CORRECT


# --- chapter 4: one masked pass of the ReRoPE forward -------------------------------------------

@triton.jit
def _clean_pass(acc, l_i, m_i, q, K, V, lo, hi, qk_scale, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """An unmasked pass over the key tiles ``[lo, hi)``: no window, causal or length mask."""
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :])
        v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :])
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, tl.dot(q, tl.trans(k)), v, qk_scale, "tf32")
    return acc, l_i, m_i


@triton.jit
def _reference_masked_pass(acc, l_i, m_i, q, K, V, rows, lo, hi, n_ctx, window, qk_scale,
                           PRODUCT: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """What :func:`check_masked_pass` compares with, to tell band tiles from edge tiles: the
    forward's mask, written out here (valid, causal, this product's side of the window)."""
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < n_ctx,
                    other=0.0)
        v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < n_ctx,
                    other=0.0)
        distance = rows[:, None] - cols[None, :]
        keep = (distance < window) & (distance > -window)
        if PRODUCT == OUTSIDE:
            keep = ~keep
        keep = keep & (cols[None, :] < n_ctx)
        if CAUSAL:
            keep = keep & (distance >= 0)
        scores = tl.where(keep, tl.dot(q, tl.trans(k)), float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, "tf32")
    return acc, l_i, m_i


@triton.jit
def _rerope_exercise_fwd_kernel(Q1, Q2, K1, K2, V, Out, n_ctx, window, qk_scale,
                                MASKED_PASS: tl.constexpr, BAND_PASS: tl.constexpr,
                                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A teaching ReRoPE forward: one head, contiguous ``(N, D)`` tensors, the six passes of
    :func:`rerope.regions._schedule`. The unmasked passes are :func:`_clean_pass`; the masked
    ones call ``BAND_PASS`` on the band walk and ``MASKED_PASS`` on the two edge walks, each
    once per tile range ``[lo, hi)`` of the walk."""
    start_m = tl.program_id(0) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start_m, BLOCK_M, BLOCK_N, n_ctx, window, CAUSAL, True)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)   # finite: a row may meet only masked entries
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    q_ptrs = rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(Q2 + q_ptrs, mask=rows[:, None] < n_ctx, other=0.0)       # the q2·k2 phase
    lo1, hi1, lo2, hi2 = outside_clean
    acc, l_i, m_i = _clean_pass(acc, l_i, m_i, q, K2, V, lo1, hi1, qk_scale, BLOCK_N, HEAD_DIM)
    acc, l_i, m_i = _clean_pass(acc, l_i, m_i, q, K2, V, lo2, hi2, qk_scale, BLOCK_N, HEAD_DIM)
    lo1, hi1, lo2, hi2 = band
    acc, l_i, m_i = BAND_PASS(acc, l_i, m_i, q, K2, V, rows, lo1, hi1, n_ctx, window,
                              qk_scale, OUTSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    acc, l_i, m_i = BAND_PASS(acc, l_i, m_i, q, K2, V, rows, lo2, hi2, n_ctx, window,
                              qk_scale, OUTSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    lo1, hi1, lo2, hi2 = edge_outside
    acc, l_i, m_i = MASKED_PASS(acc, l_i, m_i, q, K2, V, rows, lo1, hi1, n_ctx, window,
                                qk_scale, OUTSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    acc, l_i, m_i = MASKED_PASS(acc, l_i, m_i, q, K2, V, rows, lo2, hi2, n_ctx, window,
                                qk_scale, OUTSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    q = tl.load(Q1 + q_ptrs, mask=rows[:, None] < n_ctx, other=0.0)       # the q1·k1 phase
    lo1, hi1, lo2, hi2 = inside_clean
    acc, l_i, m_i = _clean_pass(acc, l_i, m_i, q, K1, V, lo1, hi1, qk_scale, BLOCK_N, HEAD_DIM)
    lo1, hi1, lo2, hi2 = band
    acc, l_i, m_i = BAND_PASS(acc, l_i, m_i, q, K1, V, rows, lo1, hi1, n_ctx, window,
                              qk_scale, INSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    acc, l_i, m_i = BAND_PASS(acc, l_i, m_i, q, K1, V, rows, lo2, hi2, n_ctx, window,
                              qk_scale, INSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    lo1, hi1, lo2, hi2 = edge_inside
    acc, l_i, m_i = MASKED_PASS(acc, l_i, m_i, q, K1, V, rows, lo1, hi1, n_ctx, window,
                                qk_scale, INSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    acc, l_i, m_i = MASKED_PASS(acc, l_i, m_i, q, K1, V, rows, lo2, hi2, n_ctx, window,
                                qk_scale, INSIDE, CAUSAL, BLOCK_N, HEAD_DIM)
    tl.store(Out + q_ptrs, acc / l_i[:, None], mask=rows[:, None] < n_ctx)


def _exercise_forward(masked_pass, band_pass, five, window, causal, block_m, block_n, n=None):
    """The teaching forward on ``five`` (its first ``n`` rows: the rest is padding)."""
    n = five[0].shape[0] if n is None else n
    d = five[0].shape[1]
    out = torch.full((n, d), float("nan"), dtype=torch.float32, device=five[0].device)
    with _quiet():
        _rerope_exercise_fwd_kernel[(triton.cdiv(n, block_m),)](
            *five, out, n, window, d ** -0.5 * LOG2E, MASKED_PASS=masked_pass,
            BAND_PASS=band_pass, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    return out


@triton.jit
def _walk_map_kernel(Map, n_tiles, n_ctx, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr):
    """Per query block, the key tiles of its masked walks: +1 band, +2 diagonal/end (q1·k1),
    +4 diagonal/end (q2·k2), from the kernels' own :func:`rerope.regions._schedule`."""
    row = Map + tl.program_id(0) * n_tiles
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        tl.program_id(0) * BLOCK_M, BLOCK_M, BLOCK_N, n_ctx, window, CAUSAL, True)
    _mark(row, band, 1, BLOCK_N)
    _mark(row, edge_inside, 2, BLOCK_N)
    _mark(row, edge_outside, 4, BLOCK_N)


def _walk_tiles(n, window, block_m, block_n, causal):
    """``{program: {"band": [tile, …], "diagonal/end": [tile, …]}}``: the masked walks of each
    query block of the teaching forward, by :func:`_walk_map_kernel` (tile = key tile index)."""
    n_rows, n_tiles = triton.cdiv(n, block_m), triton.cdiv(n, block_n)
    flags = torch.zeros(n_rows, n_tiles, dtype=torch.int32, device=_device())
    _walk_map_kernel[(n_rows,)](flags, n_tiles, n, window, BLOCK_M=block_m, BLOCK_N=block_n,
                                CAUSAL=causal)
    return {p: {"band": [c for c, f in enumerate(row) if f & 1],
                "diagonal/end": [c for c, f in enumerate(row) if f & 6]}
            for p, row in enumerate(flags.cpu().tolist())}


def _tile_keys(tiles, block_n):
    return ", ".join(f"[{c * block_n}, {(c + 1) * block_n})" for c in tiles) or "none"


def _masked_tiles(n, window, block_m, block_n, causal, program):
    """The key tiles one program visits with a masked pass, by walk, from the kernels' schedule."""
    walks = _walk_tiles(n, window, block_m, block_n, causal)[program]
    return (f"band tiles {_tile_keys(walks['band'], block_n)}; diagonal/end tiles "
            f"{_tile_keys(walks['diagonal/end'], block_n)}")


def check_masked_pass(masked_pass):
    """Chapter 4: ``masked_pass`` as the masked passes of a ReRoPE forward.

    Runs :func:`_rerope_exercise_fwd_kernel` with the reader's pass on the band and edge walks,
    compares with the float64 naive reference (:func:`rerope.reference.rerope_attention`) on the
    same fp16 inputs, and, if rows are wrong, runs again with the reader's pass on the band only
    and on the edges only, to say which kind of tile it gets wrong.
    """
    gen = torch.Generator().manual_seed(5)
    cases = [(40, 13, True, 16, 16),      # the window cuts through tiles, ragged end
             (40, 13, False, 16, 16),     # non-causal: bands on both sides of the diagonal
             (48, 20, True, 32, 16),      # query blocks taller than key tiles
             (40, 1, True, 16, 16)]       # only i = j is inside
    for n, window, causal, block_m, block_n in cases:
        d = 16
        plain = [_randn(gen, n, d) for _ in range(5)]
        # K and V sit in NaN-padded buffers: a load past n_ctx reads NaN, not whatever follows
        five = [_guarded(t, name)[0] for t, name in zip(plain, ("Q1", "Q2", "K1", "K2", "V"))]
        want = reference.rerope_attention(*(t.double()[None, None] for t in plain), window,
                                          causal=causal)[0, 0]
        got = _exercise_forward(masked_pass, masked_pass, five, window, causal, block_m, block_n)
        rows = _bad_rows(got, want, atol=5e-3, rtol=5e-3)
        if not rows:
            continue
        shape = (f"N={n}, w={window}, {'causal' if causal else 'non-causal'}, "
                 f"{block_m}x{block_n} tiles")
        program = rows[0] // block_m
        block_rows = f"rows {program * block_m}–{min((program + 1) * block_m, n) - 1}"
        mine = [r for r in rows if r // block_m == program]
        walks = _walk_tiles(n, window, block_m, block_n, causal)[program]
        zero_padded = [torch.cat([t, torch.zeros(block_n, d, dtype=t.dtype, device=t.device)])
                       for t in plain]
        if not _bad_rows(_exercise_forward(masked_pass, masked_pass, zero_padded, window, causal,
                                           block_m, block_n, n), want, atol=5e-3, rtol=5e-3):
            last = (n - 1) // block_n
            return (f"{shape}: rows {_spans(rows)} are wrong, and right when the rows of K and V "
                    f"past N = {n} are zeros instead of NaN: your pass reads keys past n_ctx. "
                    f"Program {program} ({block_rows}) walks the ragged tile "
                    f"[{last * block_n}, {(last + 1) * block_n}); load K and V with "
                    "mask=cols[:, None] < n_ctx, other=0.0")
        band_only = _exercise_forward(_reference_masked_pass, masked_pass, five, window, causal,
                                      block_m, block_n)
        edges_only = _exercise_forward(masked_pass, _reference_masked_pass, five, window, causal,
                                       block_m, block_n)
        wrong_on = [name for name, out in (("band", band_only), ("diagonal/end", edges_only))
                    if set(_bad_rows(out, want, atol=5e-3, rtol=5e-3)) & set(mine)]
        visited = "; ".join(f"{name} tiles {_tile_keys(walks[name], block_n)}"
                            for name in (wrong_on or ("band", "diagonal/end")))
        return (f"{shape}: rows {_spans(rows)} are wrong. Program {program} ({block_rows}) "
                + (f"goes wrong on its {' and '.join(wrong_on)} walk"
                   f"{'s' if len(wrong_on) > 1 else ''}: {visited}" if wrong_on else
                   f"is right with your pass on either walk alone, wrong with both: {visited}"))
    return CORRECT


@triton.jit
def _band_exercise_kernel(Q1, Q2, K1, K2, V, Out, n_ctx, window, qk_scale,
                          BAND_PASS: tl.constexpr, SLIP: tl.constexpr,
                          CAUSAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    """Chapter 4's teaching forward (:mod:`rerope.teach.three_regions`, one head,
    contiguous ``(N, D)``) with ``BAND_PASS`` on its two band runs, or with the known
    slip number ``SLIP`` of :func:`_band_slip` when it is not 0."""
    start_m = tl.program_id(0) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = rows[:, None] * HEAD_DIM + dims[None, :]
    q1 = tl.load(Q1 + q_ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    q2 = tl.load(Q2 + q_ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    end = tl.minimum(start_m + BLOCK_M, n_ctx) if CAUSAL else n_ctx
    below_end, inside_start, inside_end, above_start = _window_bounds(
        start_m, BLOCK_M, BLOCK_N, window)
    cut1, cut2 = tl.minimum(below_end, end), tl.minimum(inside_start, end)
    cut3, cut4 = tl.minimum(inside_end, end), tl.minimum(above_start, end)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, 0, cut1,
                                 n_ctx, window, qk_scale, _OUTSIDE_RUN, CAUSAL, BLOCK_N,
                                 HEAD_DIM, "tf32")
    if SLIP == 0:
        acc, l_i, m_i = BAND_PASS(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut1, cut2,
                                  n_ctx, window, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM)
    else:
        acc, l_i, m_i = _band_slip(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut1, cut2,
                                   n_ctx, window, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM,
                                   SLIP)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut2, cut3,
                                 n_ctx, window, qk_scale, _INSIDE_RUN, CAUSAL, BLOCK_N,
                                 HEAD_DIM, "tf32")
    if SLIP == 0:
        acc, l_i, m_i = BAND_PASS(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut3, cut4,
                                  n_ctx, window, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM)
    else:
        acc, l_i, m_i = _band_slip(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut3, cut4,
                                   n_ctx, window, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM,
                                   SLIP)
    acc, l_i, m_i = _region_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, cut4, end,
                                 n_ctx, window, qk_scale, _OUTSIDE_RUN, CAUSAL, BLOCK_N,
                                 HEAD_DIM, "tf32")
    tl.store(Out + q_ptrs, acc / l_i[:, None], mask=rows[:, None] < n_ctx)


@triton.jit
def _band_slip(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx, window, qk_scale,
               CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               SLIP: tl.constexpr):
    """The band pass with slip number ``SLIP`` of :data:`_BAND_SLIPS` (1, 2, …): what a
    reader's wrong answer is compared with, to name its slip."""
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        ptrs = cols[:, None] * HEAD_DIM + dims[None, :]
        ok = cols[:, None] < n_ctx
        if SLIP == 9:
            k1, k2, v = tl.load(K1 + ptrs), tl.load(K2 + ptrs), tl.load(V + ptrs)
        else:
            k1 = tl.load(K1 + ptrs, mask=ok, other=0.0)
            k2 = tl.load(K2 + ptrs, mask=ok, other=0.0)
            v = tl.load(V + ptrs, mask=ok, other=0.0)
        gap = rows[:, None] - cols[None, :]
        inside = (gap < window) & (gap > -window)
        if SLIP == 3:
            inside = (gap <= window) & (gap >= -window)
        if SLIP == 6:
            inside = gap < window
        near, far = tl.dot(q1, tl.trans(k1)), tl.dot(q2, tl.trans(k2))
        scores = tl.where(inside, near, far)
        if SLIP == 2:
            scores = tl.where(inside, far, near)
        if SLIP == 4:
            scores = near
        if SLIP == 5:
            scores = far
        keep = cols[None, :] < n_ctx
        if SLIP == 8:
            keep = cols[None, :] >= 0
        if CAUSAL and SLIP != 7:
            keep = keep & (gap >= 0)
        scores = tl.where(keep, scores, float("-inf"))
        if SLIP != 1:
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, "tf32")
    return acc, l_i, m_i


# The band pass's likely slips, numbered from 1 in this order -> the hint naming it.
_BAND_SLIPS = {
    "skipped":
        "your pass leaves the band tiles out (acc, l_i, m_i come back unchanged): fold "
        "every tile of [lo, hi) into the online softmax",
    "swapped":
        "the two products are swapped: inside the window (|i − j| < w) the score is "
        "q1·k1, outside it q2·k2",
    "|i - j| <= w":
        "off by one at the window's edge: you count |i − j| = w as inside. Inside "
        "means |i − j| < w: i − j = w − 1 is the last pair inside, i − j = w the first "
        "outside",
    "q1·k1 only":
        "every entry took q1·k1: the window mask is missing. Compute both products and "
        "keep q1·k1 where |i − j| < w, q2·k2 elsewhere",
    "q2·k2 only":
        "every entry took q2·k2: the window mask is missing. Compute both products and "
        "keep q1·k1 where |i − j| < w, q2·k2 elsewhere",
    "one side":
        "your window has one side: without the causal mask a row also sees keys after "
        "it, where i − j < 0; inside means −w < i − j < w",
    "no causal mask":
        "the causal mask is missing: a band tile can hold the diagonal (when w is "
        "narrower than a tile), so keys j > i must get −inf",
    "no end mask":
        "keys past the end of the sequence got weight: a load's other=0.0 makes their "
        "score 0, not −inf; mask the scores of cols >= n_ctx",
    "no load mask":
        "your pass reads K or V past the end of the sequence (the buffers hold NaN "
        "there): load with mask=cols[:, None] < n_ctx, other=0.0",
}


def _band_forward(band_pass, five, window, causal, block_m, block_n, slip=0):
    n, d = five[0].shape
    out = torch.full((n, d), float("nan"), dtype=torch.float32, device=five[0].device)
    with _quiet():
        _band_exercise_kernel[(triton.cdiv(n, block_m),)](
            *five, out, n, window, d ** -0.5 * LOG2E, BAND_PASS=band_pass, SLIP=slip,
            CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    return out


def _band_tiles(n, window, block_m, block_n, causal, program):
    """The key tiles of one program's two band runs in the teaching forward, by
    :func:`rerope.regions._window_bounds`'s rules (in Python)."""
    start = program * block_m
    end = min(start + block_m, n) if causal else n
    below_end = max(start - window + 1, 0) // block_n * block_n
    inside_start = -(-max(start + block_m - window, 0) // block_n) * block_n
    inside_end = max(max(start + window, 0) // block_n * block_n, inside_start)
    above_start = -(-max(start + block_m - 1 + window, 0) // block_n) * block_n
    runs = [(min(below_end, end), min(inside_start, end)),
            (min(inside_end, end), min(above_start, end))]
    return [t // block_n for lo, hi in runs for t in range(lo, hi, block_n)]


def check_band_pass(band_pass):
    """Chapter 4: ``band_pass(acc, l_i, m_i, q1, q2, K1, K2, V, rows, lo, hi, n_ctx,
    window, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM)``: the teaching forward's band run.

    For each key tile of ``[lo, hi)``: both products, each entry keeping its own
    (``q1·k1`` where ``|i − j| < w``), the causal and end-of-sequence masks, one
    ``_softmax_step``. Runs :func:`_band_exercise_kernel` with it (the other runs are
    :mod:`rerope.teach.three_regions`'), compares with the float64 naive reference on
    the same fp16 inputs (K and V in NaN-padded buffers). A wrong answer is compared
    with the known slips of :data:`_BAND_SLIPS`: the verdict names the one it
    reproduces, else the wrong rows and their program's band tiles.
    """
    gen = torch.Generator().manual_seed(5)
    cases = [(40, 13, True, 16, 16),      # the window cuts through tiles, ragged end
             (40, 5, True, 16, 16),       # w below a tile: the diagonal in the band
             (40, 13, False, 16, 16),     # non-causal: two bands, one holds the end
             (48, 20, True, 32, 16),      # query blocks taller than key tiles
             (64, 16, True, 16, 16)]      # the window on a tile edge: i - j = w - 1, w
    for n, window, causal, block_m, block_n in cases:
        d = 16
        plain = [_randn(gen, n, d) for _ in range(5)]
        names = ("Q1", "Q2", "K1", "K2", "V")
        five = [_guarded(t, name)[0] for t, name in zip(plain, names)]
        want = reference.rerope_attention(*(t.double()[None, None] for t in plain),
                                          window, causal=causal)[0, 0]
        got = _band_forward(band_pass, five, window, causal, block_m, block_n)
        rows = _bad_rows(got, want, atol=5e-3, rtol=5e-3)
        if not rows:
            continue
        shape = (f"N={n}, w={window}, {'causal' if causal else 'non-causal'}, "
                 f"{block_m}x{block_n} tiles")
        for number, (slip, hint) in enumerate(_BAND_SLIPS.items(), 1):
            same = _band_forward(band_pass, five, window, causal, block_m, block_n,
                                 number)
            if torch.allclose(got, same, atol=1e-3, rtol=1e-3, equal_nan=True):
                return f"{shape}: rows {_spans(rows)} are wrong; {hint}"
        program = rows[0] // block_m
        block_rows = f"rows {program * block_m}–{min((program + 1) * block_m, n) - 1}"
        band = _band_tiles(n, window, block_m, block_n, causal, program)
        return (f"{shape}: rows {_spans(rows)} are wrong. Program {program} "
                f"({block_rows}) walks the band tiles {_tile_keys(band, block_n)}: "
                "each entry must take q1·k1 where |i − j| < w and q2·k2 elsewhere, with the "
                "causal and end-of-sequence masks")
    return CORRECT


def check_window_bounds(window_bounds):
    """Chapter 4: cut points of an *asymmetric* window, checked against brute force.

    ``window_bounds(start, self_block, other_block, before, after)`` must return
    ``(below_end, inside_start, inside_end, above_start)`` for a window where pair ``(i, j)`` is
    inside iff ``-after < i - j < before``. Each tile of keys ``[t, t + other_block)`` against
    the query rows ``[start, start + self_block)`` is classified by the bounds and by looking at
    all its pairs; the first disagreement is reported. With ``before == after == w`` this is
    :func:`rerope.regions._window_bounds`.
    """
    for before, after, self_block, other_block in ((13, 13, 16, 16), (17, 5, 32, 16),
                                                   (5, 17, 16, 32), (1, 1, 16, 16),
                                                   (40, 9, 64, 16), (3, 30, 16, 16)):
        n = 192
        for start in range(0, n, self_block):
            bounds = window_bounds(start, self_block, other_block, before, after)
            if bounds is None:
                return "not solved yet: my_window_bounds returned None"
            below_end, inside_start, inside_end, above_start = (int(b) for b in bounds)
            if any(b % other_block for b in (below_end, inside_start, inside_end, above_start)):
                return (f"start {start}: bounds {tuple(bounds)} are not all multiples of "
                        f"{other_block}")
            i = torch.arange(start, start + self_block)[:, None]
            for t in range(0, n, other_block):
                distance = i - torch.arange(t, t + other_block)[None, :]
                inside = (distance < before) & (distance > -after)
                truth = "inside" if inside.all() else "outside" if not inside.any() else "band"
                said = ("outside" if t + other_block <= below_end or t >= above_start else
                        "inside" if inside_start <= t < inside_end else "band")
                # "band" for a tile that is all one kind is safe (masked), only slower;
                # the checker asks for the tightest cut points, like the kernels'.
                if said != truth:
                    return (f"before={before}, after={after}, query rows [{start}, "
                            f"{start + self_block}), keys [{t}, {t + other_block}): your bounds "
                            f"{tuple(int(b) for b in bounds)} make it {said!r}; its pairs make "
                            f"it {truth!r} (i - j from {int(distance.min())} to "
                            f"{int(distance.max())}); "
                            + _bounds_slip(tuple(int(b) for b in bounds), start, self_block,
                                           other_block, before, after))
    return CORRECT


def _tight_bounds(start, self_block, other_block, before, after, swap=False):
    """The cut points of the window ``-after < i - j < before`` (``swap=True``: the ends
    of runs rounded up and their starts down, the wrong way round)."""
    def down(x):
        return max(x, 0) // other_block * other_block

    def up(x):
        return -(-max(x, 0) // other_block) * other_block

    floor, ceil = (up, down) if swap else (down, up)

    inside_start = ceil(start + self_block - before)
    return (floor(start - before + 1), inside_start,
            max(floor(start + after), inside_start), ceil(start + self_block - 1 + after))


def _bounds_slip(bounds, start, self_block, other_block, before, after):
    """The likely slip behind wrong cut points, by the bounds it reproduces."""
    names = ("below_end", "inside_start", "inside_end", "above_start")
    right = _tight_bounds(start, self_block, other_block, before, after)
    wrong = [name for name, a, b in zip(names, bounds, right) if a != b]
    for b, a, hint in ((before + 1, after, "i - j = before counted inside"),
                       (before, after + 1, "i - j = -after counted inside"),
                       (before - 1, after, "i - j = before - 1 counted outside"),
                       (before, after - 1, "i - j = -(after - 1) counted outside")):
        if bounds == _tight_bounds(start, self_block, other_block, b, a):
            return (f"off by one at the window's edge ({hint}): inside means "
                    "-after < i - j < before, both strict")
    if bounds == _tight_bounds(start, self_block, other_block, before, before):
        return "your bounds ignore `after`: the window is asymmetric"
    if bounds == _tight_bounds(start, self_block, other_block, before, after, swap=True):
        return ("rounded the wrong way: a run's end must be rounded down onto the tile "
                "grid (below_end, inside_end) and its start up (inside_start, above_start)")
    return (f"{', '.join(wrong)} differ(s) from the tightest cut points {right}: round "
            "the ends of runs down and their starts up")


# --- chapter 5: δ and the routing of dS ---------------------------------------------------------

def check_delta_kernel(delta_kernel):
    """Chapter 5: ``delta_kernel(Out, DO, Delta, n_ctx, BLOCK_M, HEAD_DIM)`` must store
    ``Delta[bh, i] = Σ_d O[bh, i, d] · dO[bh, i, d]`` in fp32.

    Launched with grid ``(cdiv(N, BLOCK_M), B·H)`` on contiguous fp16 ``(B·H, N, D)`` tensors;
    ``Delta`` (``(B·H, N)`` fp32) starts as NaN, so rows never written show up. Compared with the
    formula in float64, per (head, row).
    """
    gen = torch.Generator().manual_seed(6)
    for bh, n, d, block_m in ((3, 40, 32, 16), (2, 64, 16, 32), (1, 7, 64, 16)):
        (o, o_guard), (do, do_guard) = (_guarded(_randn(gen, bh, n, d), name)
                                        for name in ("Out", "DO"))
        delta, delta_guard = _guarded_empty((bh, n), torch.float32, o.device, "Delta")
        with _quiet():
            delta_kernel[(triton.cdiv(n, block_m), bh)](o, do, delta, n, BLOCK_M=block_m,
                                                         HEAD_DIM=d)
        shape = f"B·H={bh}, N={n}, D={d}, BLOCK_M={block_m}"
        spilled = _guard_verdict(delta_guard, o_guard, do_guard)
        if spilled:
            return f"{shape}: {spilled}"
        want = (o.double() * do.double()).sum(-1)
        got = delta.double().cpu()
        for head in range(bh):
            never = got[head].isnan().nonzero().flatten().tolist()
            if never:
                return (f"B·H={bh}, N={n}, D={d}, BLOCK_M={block_m}: head {head}, rows "
                        f"{_spans(never)} were never written (program "
                        f"({never[0] // block_m}, {head}) owns row {never[0]})")
            rows = _bad_rows(got[head][:, None], want[head][:, None].cpu(), atol=1e-3, rtol=1e-3)
            if rows:
                r = rows[0]
                return (f"B·H={bh}, N={n}, D={d}, BLOCK_M={block_m}: head {head}, rows "
                        f"{_spans(rows)} are wrong; row {r}: got {got[head, r].item():.4g}, "
                        f"expected {want[head, r].item():.4g}")
    return CORRECT


def check_delta_varlen_kernel(delta_kernel):
    """Chapter 5: ``delta_kernel(Out, DO, Delta, CuSeqlens, BLOCK_M, HEAD_DIM)``, the δ kernel
    for **packed** sequences of different lengths (as FlashAttention's ``varlen`` functions take
    them): ``Out`` and ``DO`` contiguous fp16 ``(total, D)``, the sequences one after another,
    sequence ``b`` at rows ``CuSeqlens[b] … CuSeqlens[b + 1] - 1`` (int32 ``(B + 1,)``, starting
    at 0); ``Delta`` fp32 ``(total,)`` gets ``rowsum(O ∘ dO)``. Grid ``(cdiv(longest,
    BLOCK_M), B)``: ``tl.program_id(1)`` is the sequence, ``tl.program_id(0)`` a block of its
    rows.

    Every tensor sits in a guarded buffer (a store past the end is reported, not a crash);
    ``Delta`` starts as NaN. Then each sequence's programs run alone (grid ``(…, 1)`` on that
    sequence's two offsets): a program that writes rows of another sequence — a store masked
    by the total length instead of the sequence's end — is named.
    """
    gen = torch.Generator().manual_seed(6)
    # the first case ends on a block boundary: a store without the sequence's mask spills into
    # the next sequence only, which then overwrites it: only the runs one sequence at a time see it
    for lengths, d, block_m in (([16, 5, 32], 32, 16), ([5, 40, 17], 32, 16),
                                ([64, 1, 33], 16, 32), ([7], 64, 16)):
        total = sum(lengths)
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        shape = f"lengths {lengths}, D={d}, BLOCK_M={block_m}"
        grid = (triton.cdiv(max(lengths), block_m), len(lengths))
        (o, o_guard), (do, do_guard) = (_guarded(_randn(gen, total, d), name)
                                        for name in ("Out", "DO"))
        cu, cu_guard = _guarded(torch.tensor(offsets, dtype=torch.int32, device=o.device),
                                "CuSeqlens")
        delta, delta_guard = _guarded_empty((total,), torch.float32, o.device, "Delta")
        with _quiet():
            delta_kernel[grid](o, do, delta, cu, BLOCK_M=block_m, HEAD_DIM=d)
        spilled = _guard_verdict(delta_guard, o_guard, do_guard, cu_guard)
        if spilled:
            return f"{shape}: {spilled}"
        for b in range(len(lengths)):                   # one sequence's programs at a time
            alone, alone_guard = _guarded_empty((total,), torch.float32, o.device, "Delta")
            with _quiet():
                delta_kernel[(grid[0], 1)](o, do, alone, cu[b:], BLOCK_M=block_m, HEAD_DIM=d)
            spilled = _guard_verdict(alone_guard)
            if spilled:
                return f"{shape}, sequence {b}'s programs alone: {spilled}"
            written = (~alone.cpu().isnan()).nonzero().flatten().tolist()
            foreign = [r for r in written if not offsets[b] <= r < offsets[b + 1]]
            if foreign:
                owners = sorted({next(c for c in range(len(lengths)) if r < offsets[c + 1])
                                 for r in foreign})
                return (f"{shape}: the programs of sequence {b} (rows {offsets[b]}–"
                        f"{offsets[b + 1] - 1}) also wrote packed rows {_spans(foreign)}, which "
                        f"belong to sequence(s) {', '.join(map(str, owners))}: programs (·, b) "
                        "own the packed rows CuSeqlens[b] … CuSeqlens[b + 1] − 1 only (offset by "
                        "the start, mask with the end)")
        want = (o.double() * do.double()).sum(-1).cpu()
        got = delta.double().cpu()
        for b, length in enumerate(lengths):
            rows = slice(offsets[b], offsets[b + 1])
            never = got[rows].isnan().nonzero().flatten().tolist()
            if never:
                return (f"{shape}: sequence {b} (rows {offsets[b]}–{offsets[b + 1] - 1} of the "
                        f"packed tensor), its rows {_spans(never)} were never written (program "
                        f"({never[0] // block_m}, {b}) owns its row {never[0]})")
            bad = _bad_rows(got[rows][:, None], want[rows][:, None], atol=1e-3, rtol=1e-3)
            if bad:
                r = bad[0]
                return (f"{shape}: sequence {b}, its rows {_spans(bad)} are wrong; its row {r} "
                        f"(packed row {offsets[b] + r}): got {got[offsets[b] + r].item():.4g}, "
                        f"expected {want[offsets[b] + r].item():.4g}")
    return CORRECT


@triton.jit
def _dq_exercise_kernel(Q1, Q2, K1, K2, V, DO, Lse, Delta, DQ1, DQ2, n_ctx, window,
                        qk_scale, sm_scale, ROUTE: tl.constexpr, CAUSAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    """dQ1 and dQ2 of one head, one program per query block, every key tile visited
    once with both products (no regions: the routing is what is being checked).

    ``ROUTE(ds, rows, cols, window)`` returns ``(ds_inside, ds_outside)``: the parts of
    the ``dS`` tile that flow into ``dQ1 = τ·dS_in·K1`` and ``dQ2 = τ·dS_out·K2``.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < n_ctx
    ptrs = rows[:, None] * HEAD_DIM + dims[None, :]
    q1 = tl.load(Q1 + ptrs, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(Q2 + ptrs, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + rows, mask=row_ok, other=0.0)
    delta = tl.load(Delta + rows, mask=row_ok, other=0.0)
    dq1 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq2 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, n_ctx, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols[:, None] < n_ctx
        kp = cols[:, None] * HEAD_DIM + dims[None, :]
        k1 = tl.load(K1 + kp, mask=col_ok, other=0.0)
        k2 = tl.load(K2 + kp, mask=col_ok, other=0.0)
        v = tl.load(V + kp, mask=col_ok, other=0.0)
        distance = rows[:, None] - cols[None, :]
        in_window = (distance < window) & (distance > -window)
        near, far = tl.dot(q1, tl.trans(k1)), tl.dot(q2, tl.trans(k2))
        scores = tl.where(in_window, near, far)
        valid = (cols[None, :] < n_ctx) & row_ok[:, None]
        if CAUSAL:
            valid = valid & (distance >= 0)
        p = tl.where(valid, tl.math.exp2(scores * qk_scale - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        ds_inside, ds_outside = ROUTE(ds, rows, cols, window)
        dq1 = tl.dot(ds_inside.to(k1.dtype), k1, dq1)
        dq2 = tl.dot(ds_outside.to(k2.dtype), k2, dq2)
    tl.store(DQ1 + ptrs, dq1 * sm_scale, mask=row_ok[:, None])
    tl.store(DQ2 + ptrs, dq2 * sm_scale, mask=row_ok[:, None])


# The routing's likely slips, each as a route, and the hint that names it.
@triton.jit
def _route_all_inside(ds, rows, cols, window):
    return ds, ds * 0.0


@triton.jit
def _route_all_outside(ds, rows, cols, window):
    return ds * 0.0, ds


@triton.jit
def _route_both(ds, rows, cols, window):
    return ds, ds


@triton.jit
def _route_swapped(ds, rows, cols, window):
    distance = rows[:, None] - cols[None, :]
    inside = (distance < window) & (distance > -window)
    return tl.where(inside, 0.0, ds), tl.where(inside, ds, 0.0)


@triton.jit
def _route_edge_inside(ds, rows, cols, window):
    distance = rows[:, None] - cols[None, :]
    inside = (distance <= window) & (distance >= -window)
    return tl.where(inside, ds, 0.0), tl.where(inside, 0.0, ds)


@triton.jit
def _route_one_side(ds, rows, cols, window):
    distance = rows[:, None] - cols[None, :]
    inside = distance < window
    return tl.where(inside, ds, 0.0), tl.where(inside, 0.0, ds)


_ROUTE_SLIPS = (
    (_route_all_inside,
     "all of dS went to dQ1 (and none to dQ2): split it by the window, dS ∘ W to dQ1 "
     "and dS ∘ ¬W to dQ2"),
    (_route_all_outside,
     "all of dS went to dQ2 (and none to dQ1): split it by the window, dS ∘ W to dQ1 "
     "and dS ∘ ¬W to dQ2"),
    (_route_both,
     "both gradients got the whole dS: the window mask is missing; each entry belongs "
     "to the one product its score came from"),
    (_route_swapped,
     "the two parts are swapped: dS where |i − j| < w comes from q1·k1 and goes to "
     "dQ1, the rest to dQ2"),
    (_route_edge_inside,
     "off by one at the window's edge: you route |i − j| = w to dQ1; inside means |i − "
     "j| < w, exactly as in the forward's scores"),
    (_route_one_side,
     "your window has one side: without the causal mask keys after the query have i − "
     "j < 0; inside means −w < i − j < w"),
)


def _run_dq_exercise(route, five, dout, lse, delta, window, causal, block_m, block_n):
    n, d = five[0].shape
    dq1 = torch.full((n, d), float("nan"), dtype=torch.float32, device=five[0].device)
    dq2 = torch.full_like(dq1, float("nan"))
    with _quiet():
        _dq_exercise_kernel[(triton.cdiv(n, block_m),)](
            *five, dout, lse, delta, dq1, dq2, n, window, d ** -0.5 * LOG2E, d ** -0.5,
            ROUTE=route, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    return dq1, dq2


def check_ds_routing(route):
    """Chapter 5: ``route(ds, rows, cols, window) -> (ds_inside, ds_outside)``.

    Runs :func:`_dq_exercise_kernel` with it and compares ``dQ1``, ``dQ2`` with autograd
    through the float64 reference on the same fp16 inputs. A wrong answer is compared
    with the likely slips (:data:`_ROUTE_SLIPS`): the verdict names the one it
    reproduces, else the gradient, the rows, and the key tiles of their program.
    """
    gen = torch.Generator().manual_seed(7)
    for n, window, causal, block_m, block_n in ((40, 13, True, 16, 16),
                                                (40, 9, False, 16, 16),
                                                (48, 20, True, 32, 16)):
        d = 16
        five = [_randn(gen, n, d) for _ in range(5)]
        dout = _randn(gen, n, d)
        leaves = [t.double()[None, None].requires_grad_() for t in five]
        out = reference.rerope_attention(*leaves, window, causal=causal)
        want_dq1, want_dq2 = torch.autograd.grad(out, leaves[:2],
                                                 dout.double()[None, None])
        # the forward's saved statistics in the kernels' units: lse in log2,
        # δ = rowsum(dO ∘ O)
        idx = torch.arange(n, device=five[0].device)
        s = torch.where((idx[:, None] - idx[None, :]).abs() < window,
                        five[0].double() @ five[2].double().T,
                        five[1].double() @ five[3].double().T) * d ** -0.5
        if causal:
            s = s.masked_fill(idx[None, :] > idx[:, None], float("-inf"))
        lse = (torch.logsumexp(s, -1) * LOG2E).float()
        delta = (dout.double() * out.detach()[0, 0]).sum(-1).float()
        stats = (five, dout, lse, delta, window, causal, block_m, block_n)
        dq1, dq2 = _run_dq_exercise(route, *stats)
        shape = (f"N={n}, w={window}, {'causal' if causal else 'non-causal'}, "
                 f"{block_m}x{block_n} tiles")
        for name, got, want in (("dQ1", dq1, want_dq1[0, 0]),
                                ("dQ2", dq2, want_dq2[0, 0])):
            scale = want.abs().max().item()
            rows = _bad_rows(got, want, atol=1e-2 * scale, rtol=1e-2)
            if not rows:
                continue
            for slip, hint in _ROUTE_SLIPS:
                same1, same2 = _run_dq_exercise(slip, *stats)
                close = [torch.allclose(a, b, atol=1e-3 * scale, rtol=1e-3,
                                        equal_nan=True)
                         for a, b in ((dq1, same1), (dq2, same2))]
                if all(close):
                    return f"{shape}: {name} is wrong in rows {_spans(rows)}; {hint}"
            program = rows[0] // block_m
            return (f"{shape}: {name} is wrong in rows {_spans(rows)}. "
                    f"Program {program} visits "
                    + _masked_tiles(n, window, block_m, block_n, causal, program)
                    + f"; {name} must get dS where |i − j| "
                    + ("< w" if name == "dQ1" else ">= w") + " and nothing else")
    return CORRECT


# --- chapter 6: counting band tiles ---------------------------------------------------------------

# (N, w, block_m, block_n, causal): windows that are multiples of both block sizes, and windows
# smaller than both (a thin band along the diagonal, where "half the non-causal count" is wrong)
_BAND_CASES = ((256, 64, 32, 16, True), (256, 32, 32, 16, False), (512, 96, 32, 32, False),
               (384, 64, 64, 32, True), (256, 8, 32, 16, True), (256, 8, 16, 16, True),
               (256, 1, 32, 16, True), (256, 8, 32, 16, False), (256, 256, 32, 16, True))


def schedule_band_tiles(n_ctx, window, block_m, block_n, causal):
    """How many tiles the kernels' own schedule (:func:`rerope.regions.tile_map`) visits with
    both products."""
    flags = tile_map(n_ctx, window, block_m, block_n, causal=causal)
    both = (((flags & (INSIDE_CLEAN | INSIDE_MASKED)) != 0)
            & ((flags & (OUTSIDE_CLEAN | OUTSIDE_MASKED)) != 0))
    return int(both.sum())


def check_band_tiles(band_tiles):
    """Chapter 6: ``band_tiles(n_ctx, window, block_m, block_n, causal)`` must count the tiles
    that hold valid pairs on both sides of the window, as the kernels' schedule visits them.

    Cases: windows that are multiples of both block sizes, causal and not, and windows smaller
    than a tile (the diagonal's own tiles are then band tiles too), w = 1 and w >= N. Reports the
    first case that differs, with the count of the closest wrong rule when it is one of them.
    """
    for n_ctx, window, block_m, block_n, causal in _BAND_CASES:
        want = schedule_band_tiles(n_ctx, window, block_m, block_n, causal)
        got = band_tiles(n_ctx, window, block_m, block_n, causal)
        if got is None:
            return "not solved yet: band_tiles returned None"
        if got != want:
            hint = ""
            if causal and got == schedule_band_tiles(n_ctx, window, block_m, block_n, False) // 2:
                hint = (": that is half the non-causal count, but with a window narrower than a "
                        "tile the diagonal's tiles hold pairs on both sides too, and they are not "
                        "mirrored")
            return (f"N={n_ctx}, w={window}, {block_m}x{block_n} tiles, "
                    f"{'causal' if causal else 'non-causal'}: got {got}, the schedule has {want}"
                    + hint)
    return CORRECT


# --- chapter 6: a RoPE kernel -------------------------------------------------------------------

def rope_tables(n, head_dim, base=10000.0, device=None):
    """``cos``, ``sin`` of the angles ``p θ_t`` for positions ``p < n``: fp32 ``(n, D/2)``."""
    from .rope import rope_frequencies

    angles = torch.arange(n, dtype=torch.float64)[:, None] * rope_frequencies(head_dim, base)[None]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def check_rope_kernel(rope_kernel):
    """Chapter 6: ``rope_kernel(X, Cos, Sin, Out, n_ctx, BLOCK_N, HEAD_DIM)`` must write
    ``R(p) x`` for every row ``p`` of every head.

    ``X`` and ``Out`` are contiguous ``(B·H, N, D)``, ``Cos``/``Sin`` are :func:`rope_tables`;
    the grid is ``(cdiv(N, BLOCK_N), B·H)``. ``Out`` starts as NaN. Compared with
    :func:`rerope.rope.apply_rope`; reports the head, the positions and the half of the vector.
    """
    gen = torch.Generator().manual_seed(8)
    for bh, n, d, block_n, dtype in ((2, 40, 32, 16, torch.float16), (3, 70, 64, 32, torch.float32),
                                     (1, 5, 16, 16, torch.float16)):
        x, x_guard = _guarded(_randn(gen, bh, n, d).to(dtype), "X")
        (cos, cos_guard), (sin, sin_guard) = (_guarded(t, name) for t, name in zip(
            rope_tables(n, d, device=x.device), ("Cos", "Sin")))
        out, out_guard = _guarded_empty(x.shape, dtype, x.device, "Out")
        with _quiet():
            rope_kernel[(triton.cdiv(n, block_n), bh)](x, cos, sin, out, n, BLOCK_N=block_n,
                                                       HEAD_DIM=d)
        spilled = _guard_verdict(out_guard, x_guard, cos_guard, sin_guard)
        if spilled:
            return f"B·H={bh}, N={n}, D={d}, {str(dtype)[6:]}, BLOCK_N={block_n}: {spilled}"
        want = apply_rope(x.double(), torch.arange(n, dtype=torch.float64, device=x.device))
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        for head in range(bh):
            for half, cols in (("first", slice(0, d // 2)), ("second", slice(d // 2, d))):
                rows = _bad_rows(out[head, :, cols], want[head, :, cols], atol=tol, rtol=tol)
                if rows:
                    never = out[head, rows[0], cols].isnan().any().item()
                    return (f"B·H={bh}, N={n}, D={d}, {str(dtype)[6:]}, BLOCK_N={block_n}: head "
                            f"{head}, positions {_spans(rows)}, the {half} half (coordinates "
                            f"{cols.start}–{cols.stop - 1}) "
                            + ("was never written" if never else "is wrong"))
    return CORRECT


# --- chapter 7: turning a tile in registers -----------------------------------------------------

@triton.jit
def _turn_tile_kernel(X, Out, Table, Offset, n_rows, offset_sign, TURN: tl.constexpr,
                      BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows of a contiguous ``(N, D)`` tensor passed through the reader's ``TURN``,
    half by half.

    Row ``p`` of ``Table`` is ``[cos | sin]`` of ``speed · p · θ``, ``Offset`` is
    ``[cos | sin]`` of ``offset · θ`` and its sines are multiplied by ``offset_sign``
    (±1). ``TURN(x_a, x_b, cos_p, sin_p, cos_o, sin_o)`` gets the fp32 halves
    ``(BLOCK, D/2)`` of the rows, the table entries of their positions ``(BLOCK, D/2)``
    and the offset's ``(1, D/2)``, and returns the two halves it turned, stored in fp32.
    """
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    freqs = tl.arange(0, HEAD_DIM // 2)[None, :]
    ok = rows[:, None] < n_rows
    first = rows[:, None] * HEAD_DIM + freqs
    x_a = tl.load(X + first, mask=ok, other=0.0).to(tl.float32)
    x_b = tl.load(X + first + HEAD_DIM // 2, mask=ok, other=0.0).to(tl.float32)
    table = Table + rows[:, None] * HEAD_DIM + freqs  # the table has rows past n_rows
    cos_p, sin_p = tl.load(table), tl.load(table + HEAD_DIM // 2)
    cos_o = tl.load(Offset + freqs)
    sin_o = tl.load(Offset + HEAD_DIM // 2 + freqs) * offset_sign
    out_a, out_b = TURN(x_a, x_b, cos_p, sin_p, cos_o, sin_o)
    tl.store(Out + first, out_a, mask=ok)
    tl.store(Out + first + HEAD_DIM // 2, out_b, mask=ok)


# (what the case is, speed, offset, sign of the offset, N, D, BLOCK): the turns the kernels make
_TURN_CASES = (
    ("queries and keys inside the window, raw inputs: R(p)", 1.0, 0.0, 1, 40, 32, 16),
    ("queries outside the window, ReRoPE, raw inputs: R(w)", 0.0, 13.0, 1, 40, 32, 16),
    ("queries outside the window, ReRoPE, rotated inputs: R(w - i)", -1.0, 13.0, 1, 70, 16, 32),
    ("resident keys of dK/dV, Leaky (κ = 4), rotated inputs: R((1/κ - 1) j - w (κ - 1)/κ)",
     -0.75, 9.75, -1, 40, 32, 16),
    ("queries outside the window, Leaky (κ = 4), raw inputs, long context: R(i/κ + w (κ - 1)/κ)",
     0.25, 1536.0, 1, 3000, 64, 64),
)


def _turn_hint(got, x, speed, offset, sign, back):
    """The likely slip behind a wrong turn, from what the answer equals instead
    (``None`` if it matches none of them). ``got``, ``x``: float64 ``(N, D)``."""
    n, d = x.shape
    p = torch.arange(n, dtype=torch.float64)
    way = -1.0 if back else 1.0              # the turn asked for: R(way · (σp ± o))

    def turned(angle):
        return apply_rope(x, way * angle)

    right = turned(speed * p + sign * offset)
    swapped = torch.cat((right[:, d // 2:], right[:, : d // 2]), -1)
    plus, minus = ("−", "+") if back else ("+", "−")
    # the offset's slips first: at speed 0 they look like others
    candidates = [
        (turned(speed * p),
         "the offset β was left out: combine the table row's cos_p, sin_p with "
         "cos_o, sin_o by angle addition"),
        (turned(speed * p - sign * offset),
         "the offset was subtracted, α − β instead of α + β: cos(α + β) = "
         "cos α cos β − sin α sin β and sin(α + β) = sin α cos β + cos α sin β"),
        (apply_rope(x, -way * (speed * p + sign * offset)),
         "turned the wrong way, by the transpose: the signs of the sin terms are "
         "swapped (R(α) x = [a cos − b sin, b cos + a sin], R(α)ᵀ x = "
         "[a cos + b sin, b cos − a sin])"),
        (x, "nothing was turned: the halves came back as they went in"),
        (turned(sign * offset + 0.0 * p) if offset else None,
         "only the offset β: the table row's angle α is missing (cos_p, sin_p unused)"),
        (swapped, "the two halves come back swapped: return (first half, second half)"),
        (torch.cat((right[:, : d // 2], x[:, d // 2:]), -1),
         f"the second half came back unturned: it is b cos {plus} a sin"),
        (torch.cat((x[:, : d // 2], right[:, d // 2:]), -1),
         f"the first half came back unturned: it is a cos {minus} b sin"),
    ]
    hints = [hint for want, hint in candidates
             if want is not None and ((got - want).abs() <= 1e-4).all()]
    return "; or ".join(hints) if hints else None


def _check_turn(turn, back):
    from .rotary import rope_table, rotation_offset

    gen = torch.Generator().manual_seed(9)
    for what, speed, offset, sign, n, d, block in _TURN_CASES:
        x = _randn(gen, n, d)
        table = rope_table(n, d, 10000.0, speed, x.device)
        shift = rotation_offset(d, 10000.0, offset, x.device)
        out = torch.full((n, d), float("nan"), dtype=torch.float32, device=x.device)
        with _quiet():
            _turn_tile_kernel[(triton.cdiv(n, block),)](
                x, out, table, shift, n, float(sign), TURN=turn, BLOCK=block,
                HEAD_DIM=d)
        # in units of θ_t
        angle = speed * torch.arange(n, dtype=torch.float64) + sign * offset
        want = apply_rope(x.double().cpu(), -angle if back else angle)
        got = out.double().cpu()
        bad = ~((got - want).abs() <= 1e-4)                # NaN (never written) counts
        if not bad.any():
            continue
        shift_text = f"{'+' if sign > 0 else '-'}{offset:g}"
        case = (f"{what} (speed {speed:g}, offset {shift_text}; N={n}, D={d}, "
                f"BLOCK={block}): ")
        if got.isnan().all().item():
            return case + "nothing was written"
        halves = [name for name, cols in (("first", slice(0, d // 2)),
                                         ("second", slice(d // 2, d)))
                  if bad[:, cols].any()]
        by_freq = bad[:, : d // 2] | bad[:, d // 2:]            # (N, D/2): pair t
        where = "both halves" if len(halves) > 1 else f"the {halves[0]} half"
        hint = _turn_hint(got, x.double().cpu(), speed, offset, sign, back)
        positions = _spans(by_freq.any(1).nonzero().flatten().tolist())
        freqs = _spans(by_freq.any(0).nonzero().flatten().tolist())
        return (case + f"wrong at positions {positions}, frequencies t = {freqs}, "
                f"in {where}" + (f". Likely: {hint}" if hint else ""))
    return CORRECT


def check_turn_tile(turn):
    """Chapter 7: ``turn(x_a, x_b, cos_p, sin_p, cos_o, sin_o)`` must return the halves of
    ``R(α + β) x``, where ``cos_p, sin_p`` are ``cos α, sin α`` of a table row (``α = speed · p ·
    θ_t``) and ``cos_o, sin_o`` those of the offset ``β = ± offset · θ_t``.

    Runs :func:`_turn_tile_kernel` with it on fp16 rows, for the turns the kernels make (the
    products of :func:`rerope.rotary.rotation_plan`, and the dK/dV kernel's keys with the offset
    subtracted), and compares with :func:`rerope.rope.apply_rope` in float64 at the angles
    ``speed · p ± offset``; reports the case, the positions and the frequencies that are wrong.
    """
    return _check_turn(turn, back=False)


def check_turn_back_tile(turn_back):
    """Chapter 7: ``turn_back`` (the arguments of :func:`check_turn_tile`) must return the halves
    of ``R(α + β)ᵀ g = R(-α - β) g``: a gradient with respect to a turned operand, brought back to
    the unturned one. Same cases and report as :func:`check_turn_tile`."""
    return _check_turn(turn_back, back=True)


# --- chapter 7: a key tile's angles from one table row (Self-Extend's grouped positions) -------

@triton.jit
def _tile_angles_kernel(Table, Out, TILE_ANGLES: tl.constexpr, BLOCK: tl.constexpr,
                        HALF: tl.constexpr):
    """One program per key tile: ``TILE_ANGLES(Table, start, BLOCK, HALF)`` gives the ``(BLOCK,
    HALF)`` fp32 ``cos, sin`` of the angles of keys ``start … start + BLOCK - 1`` (``start =
    program · BLOCK``), stored to rows ``start …`` of ``Out`` (``[cos | sin]``, like the table)."""
    start = tl.program_id(0) * BLOCK
    cos, sin = TILE_ANGLES(Table, start, BLOCK, HALF)
    rows = (start + tl.arange(0, BLOCK))[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    tl.store(Out + rows, cos)
    tl.store(Out + rows + HALF, sin)


# (what the table is, speed, group, N keys, D, BLOCK): the key turns of the decode kernel
_TILE_ANGLE_CASES = (
    ("ReRoPE outside the window, rotated cache: a(p) = -p", -1.0, None, 64, 32, 16),
    ("Leaky (κ = 4) outside, rotated cache: a(p) = (1/κ - 1) p", -0.75, None, 64, 32, 16),
    ("Self-Extend (G = 4) outside, raw cache: a(p) = ⌊p/G⌋", 0.0, 4, 64, 32, 16),
    ("Self-Extend (G = 8) outside, rotated cache: a(p) = ⌊p/G⌋ - p", -1.0, 8, 96, 32, 16),
    ("Self-Extend (G = 16 = BLOCK) outside, rotated cache, long context", -1.0, 16, 2048, 64, 16),
)


def check_tile_angles(tile_angles):
    """Chapter 7: ``tile_angles(Table, start, BLOCK, HALF)`` (``@triton.jit``) must return the
    ``cos, sin`` ``(BLOCK, HALF)`` of the angles ``a(start + r)``, ``r < BLOCK``, of a key tile,
    reading only the table's first ``BLOCK`` rows and its row ``start`` (angle addition:
    ``a(start + r) = a(start) + a(r)``, true for a speed and for Self-Extend's ``⌊p/G⌋`` when
    ``G`` divides ``start``).

    Runs :func:`_tile_angles_kernel` on tables of :func:`rerope.rotary.rope_table` (speeds and
    groups of the decode kernel's key turns) whose other rows are NaN, so an answer that reads a
    row per key, or a wrong one, shows; compares with the table's own rows in float64. Reports
    the case, the tiles, keys and frequencies that are wrong.
    """
    from .rotary import rope_table

    for what, speed, group, n, d, block in _TILE_ANGLE_CASES:
        half = d // 2
        table = rope_table(n, d, 10000.0, speed, _device(), group=group)[:n]
        readable = torch.full_like(table, float("nan"))   # rows 0 … BLOCK-1 and tile starts
        readable[:block] = table[:block]
        readable[::block] = table[::block]
        table_view, table_guard = _guarded(readable, "Table")
        out, out_guard = _guarded_empty((n, d), torch.float32, table.device, "Out")
        try:
            with _quiet():
                _tile_angles_kernel[(n // block,)](table_view, out, TILE_ANGLES=tile_angles,
                                                   BLOCK=block, HALF=half)
        except Exception as error:            # a reader's kernel that does not compile or run
            text = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            hint = (" (under the interpreter a function passed to a kernel cannot call Triton's "
                    "library functions that are themselves written in Triton, such as tl.zeros: "
                    "build the values from loads and arithmetic)"
                    if "outside of the scope of a kernel" in text else "")
            return (f"{what}: your function raised {type(error).__name__}: {text}{hint} (it "
                    f"must return (cos, sin), each of shape (BLOCK, HALF) = ({block}, {half}), "
                    "fp32)")
        spilled = _guard_verdict(out_guard, table_guard)
        if spilled:
            return f"{what}: {spilled}"
        got, want = out.double().cpu(), table.double().cpu()
        bad = ~((got - want).abs() <= 1e-5)           # NaN (a row read per key) counts
        if bad.any():
            keys = bad.any(1).nonzero().flatten()
            read_nan = got[keys].isnan().any().item()
            tiles = sorted({int(j) // block for j in keys})
            by_freq = bad[:, :half] | bad[:, half:]
            hint = (" (NaN: your function read table rows other than the first BLOCK and the "
                    "tile's first; use the angle addition formulas)" if read_nan else "")
            return (f"{what} (N={n}, D={d}, BLOCK={block}): wrong on tiles {_spans(tiles)}, keys "
                    f"{_spans(keys.tolist())}, frequencies t = "
                    f"{_spans(by_freq.any(0).nonzero().flatten().tolist())}{hint}")
    return CORRECT


# --- chapter 9: the production kernel's grid order ------------------------------------------


@triton.jit
def _program_order_kernel(Heads, Blocks, PROGRAM: tl.constexpr, HEADS_FIRST: tl.constexpr,
                          CAUSAL: tl.constexpr):
    """Writes, at each program's place in launch order (first grid axis fastest), the
    ``(batch · head, query block)`` that the reader's ``PROGRAM`` gives it."""
    slot = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    bh, block = PROGRAM(HEADS_FIRST, CAUSAL)
    tl.store(Heads + slot, bh)
    tl.store(Blocks + slot, block)


def reference_program_order(n_heads, n_blocks, heads_first, causal):
    """``(heads, blocks)``: int tensors in launch order, what the production forward's programs
    work on: grid ``(B·H, blocks)`` with ``heads_first``, else ``(blocks, B·H)``; with ``causal``
    the query blocks are taken last first (the last block has the most keys)."""
    slots = torch.arange(n_heads * n_blocks)
    if heads_first:
        heads, blocks = slots % n_heads, slots // n_heads
    else:
        heads, blocks = slots // n_blocks, slots % n_blocks
    return heads, (n_blocks - 1 - blocks) if causal else blocks


def check_program_order(program):
    """Chapter 9: ``program(HEADS_FIRST: tl.constexpr, CAUSAL: tl.constexpr)``, a
    ``@triton.jit`` function, must return ``(bh, block)`` for the program that calls it: the
    ``batch · head`` index and the query block of :func:`reference_program_order` (grid
    ``(B·H, blocks)`` with ``HEADS_FIRST``, else ``(blocks, B·H)``; heaviest block first when
    ``CAUSAL``).

    Cases: both grid orders, causal or not, 3 heads × 5 blocks (so that a swapped axis shows).
    """
    n_heads, n_blocks = 3, 5
    for heads_first in (True, False):
        for causal in (True, False):
            what = f"HEADS_FIRST={heads_first}, CAUSAL={causal}"
            grid = (n_heads, n_blocks) if heads_first else (n_blocks, n_heads)
            heads = torch.full((n_heads * n_blocks,), -99, dtype=torch.int32, device=_device())
            blocks = torch.full_like(heads, -99)
            with _quiet():
                _program_order_kernel[grid](heads, blocks, PROGRAM=program,
                                            HEADS_FIRST=heads_first, CAUSAL=causal)
            got_h, got_b = heads.cpu().long(), blocks.cpu().long()
            want_h, want_b = reference_program_order(n_heads, n_blocks, heads_first, causal)
            if torch.equal(got_h, want_h) and torch.equal(got_b, want_b):
                continue
            head_axis, block_axis = (0, 1) if heads_first else (1, 0)
            wrong = ((got_h != want_h) | (got_b != want_b)).nonzero().flatten().tolist()
            first = wrong[0]
            where = (f"{what}, grid {grid}: the program launched {first}th does (bh, block) = "
                     f"({got_h[first].item()}, {got_b[first].item()}), want "
                     f"({want_h[first].item()}, {want_b[first].item()})")
            if torch.equal(got_h, want_h):
                if torch.equal(got_b, n_blocks - 1 - want_b):
                    hint = ("the query blocks run in the wrong direction: only with CAUSAL "
                            "does the last block (the most keys) start first, as "
                            "n_blocks - 1 - block")
                elif torch.equal((got_b - want_b).abs(), torch.ones_like(want_b)):
                    hint = ("off by one in the reversed block: the last block is "
                            "n_blocks - 1 - block")
                else:
                    hint = (f"the block is read from the wrong axis or counted with the wrong "
                            f"tl.num_programs: the blocks are axis {block_axis} of this grid")
            elif got_h.max() >= n_heads or got_b.max() >= n_blocks or got_b.min() < 0:
                hint = (f"the axes are swapped: with HEADS_FIRST={heads_first} the head is "
                        f"tl.program_id({head_axis}) and the block tl.program_id({block_axis})")
            else:
                hint = "some (bh, block) pairs are done twice and others never"
            return f"{where}: {hint}"
    return CORRECT


# --- chapter 11: the log-n query scale -----------------------------------------------------------


def check_logn_kernel(logn_kernel):
    """Chapter 11: ``logn_kernel(Q, Out, n_q, n_k, logn_factor, BLOCK: tl.constexpr, HEAD_DIM:
    tl.constexpr)`` must write ``Out = Q · max(1, log2(i + 1) · logn_factor)`` row by row, one
    program per ``BLOCK`` rows of a contiguous ``(n_q, HEAD_DIM)`` slice, where row ``r`` is the
    query at position ``i = n_k - n_q + r`` and ``logn_factor = 1 / log2(train_len)``.

    Compared with :func:`rerope.rope.logn_scale` (float64) for a whole sequence, a chunk at the
    end of a longer one, and a ragged last block; reports the case and the wrong rows.
    """
    from .rope import logn_scale

    gen = torch.Generator().manual_seed(10)
    for what, n_q, n_k, train_len, block in (("a whole sequence", 100, 100, 16, 32),
                                             ("the last 37 queries of 300", 37, 300, 64, 16),
                                             ("training length 256, 4096 positions", 50, 4096,
                                              256, 64)):
        q, q_guard = _guarded(_randn(gen, n_q, 32), "Q")
        out, out_guard = _guarded_empty((n_q, 32), torch.float32, q.device, "Out")
        with _quiet():
            logn_kernel[(triton.cdiv(n_q, block),)](q, out, n_q, n_k, 1.0 / np.log2(train_len),
                                                    BLOCK=block, HEAD_DIM=32)
        spilled = _guard_verdict(out_guard, q_guard)
        if spilled:
            return f"{what} (n_q={n_q}, n_k={n_k}, BLOCK={block}): {spilled}"
        want = q.double().cpu() * logn_scale(n_k, train_len)[n_k - n_q:, None]
        bad = _bad_rows(out, want, atol=1e-3, rtol=1e-3)
        if bad:
            return (f"{what} (n_q={n_q}, n_k={n_k}, train_len={train_len}, BLOCK={block}): "
                    f"rows {_spans(bad)} wrong (row r is position n_k - n_q + r)")
    return CORRECT


# --- chapter 10: positions from a padding mask ----------------------------------------------------


def reference_positions(mask):
    """What transformers' ``generate`` computes from a 2D padding mask ``(B, N)`` (0/1):
    ``cumsum(mask) - 1`` along each row, 0 where ``mask`` is 0."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 0)


def check_positions_kernel(positions_kernel):
    """Chapter 10: ``positions_kernel(Mask, Positions, n, BLOCK: tl.constexpr)``, one program per
    batch row of a contiguous int32 ``(B, n)`` mask, ``n <= BLOCK``, must write the int32
    positions of :func:`reference_positions`.

    Cases: left padding of different lengths, a row with no padding, a row of padding only,
    right padding, and a ragged ``n < BLOCK``.
    """
    device = "cpu" if INTERPRET else "cuda"
    cases = (("left padding", [[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]], 8),
             ("a row without padding", [[1] * 8, [0] * 5 + [1] * 3], 8),
             ("a row of padding only", [[0] * 8, [0, 0, 1, 1, 1, 1, 1, 1]], 8),
             ("right padding (a single forward)", [[1, 1, 1, 1, 1, 0, 0, 0]], 8),
             ("n = 13, BLOCK = 16", [[0] * 4 + [1] * 9, [1] * 13], 16))
    for what, rows, block in cases:
        mask, mask_guard = _guarded(torch.tensor(rows, dtype=torch.int32, device=device), "Mask")
        n = mask.shape[1]
        out, out_guard = _guarded_empty(mask.shape, torch.int32, device, "Positions")
        with _quiet():
            positions_kernel[(mask.shape[0],)](mask, out, n, BLOCK=block)
        spilled = _guard_verdict(out_guard, mask_guard)
        if spilled:
            return f"{what}: {spilled}"
        want = reference_positions(mask.cpu())
        got = out.cpu().long()
        for row in range(mask.shape[0]):
            bad = (got[row] != want[row]).nonzero().flatten().tolist()
            if bad:
                return (f"{what} (mask row {rows[row]}): slots {_spans(bad)} wrong, got "
                        f"{got[row, bad[:4]].tolist()}, want {want[row, bad[:4]].tolist()}")
    return CORRECT



# --- chapter 8: merging split-KV partials ---------------------------------------------------------


def _merge_reference(part, lse):
    """What the merge must give: ``Σ_s 2^(lse_s − M) part_s / Σ_s 2^(lse_s − M)`` per row."""
    weights = torch.exp2(lse.double() - lse.double().amax(0, keepdim=True))   # (S, rows)
    weights = torch.nan_to_num(weights, nan=0.0)                              # empty splits
    return (weights[..., None] * part.double()).sum(0) / weights.sum(0)[:, None]


def _merge_cases(rows=12, d=32):
    """The merge checkers' cases: ``(what, n_splits, SPLITS, part, lse)``, fp32 on the CPU —
    one split; three splits of which one is empty (``lse = -inf``, zero partials); eight splits
    whose log-sum-exps lie up to 300 apart."""
    gen = torch.Generator().manual_seed(8)
    for what, n_splits, splits, spread, empty in (("one split", 1, 1, 0.0, None),
                                                  ("three splits, the last one empty", 3, 4,
                                                   4.0, 2),
                                                  ("eight splits, log-sum-exps 300 apart", 8, 8,
                                                   300.0, None)):
        part = torch.randn(n_splits, rows, d, generator=gen, dtype=torch.float64).float()
        lse = (spread * torch.rand(n_splits, rows, generator=gen, dtype=torch.float64)).float()
        if empty is not None:
            lse[empty] = float("-inf")
            part[empty] = 0.0
        yield what, n_splits, splits, part, lse


def _merge_hint(out, part, lse, splits):
    """The likely slip behind a wrong merge, from what ``out`` equals instead (``None``
    if nothing fits). ``part`` ``(S, rows, D)`` and ``lse`` ``(S, rows)`` as the kernel
    got them, on the CPU; ``splits``: the kernel's ``SPLITS`` (lanes past ``S`` are
    padding)."""
    n_splits, rows, d = part.shape
    part, lse, got = part.double(), lse.double(), out.double().cpu()
    m = lse.amax(0, keepdim=True)
    weight = torch.exp2(lse - m).nan_to_num(nan=0.0)

    def weighted(w, p=part):
        return (w[..., None] * p).sum(0) / w.sum(0)[:, None]

    # the split axis read as the inner one: split s of row r at r · S + s
    inner_part = part.reshape(-1).view(rows, n_splits, d).transpose(0, 1)
    inner_lse = lse.reshape(-1).view(rows, n_splits).T
    inner_w = torch.exp2(inner_lse - inner_lse.amax(0, keepdim=True))
    padding = torch.cat((weight, torch.exp2(-m).expand(splits - n_splits, rows)))
    padded = torch.cat((part, part.new_zeros(splits - n_splits, rows, d)))
    candidates = [
        (part.mean(0), "the partials were averaged: each must be weighed by "
                       "2^(lse_s − M), its share of the row's softmax mass"),
        ((weight[..., None] * part).sum(0),
         "the weighted sum was not divided by Σ_s 2^(lse_s − M)"),
        (weighted(torch.exp(lse - m).nan_to_num(nan=0.0)),
         "exp instead of exp2: the log-sum-exps are in log2 units"),
        (weighted(inner_w.nan_to_num(nan=0.0), inner_part),
         "a wrong stride: Part and Lse were read as (rows, n_splits, …); the split "
         "axis is the outer one, split s of row r is at s · rows + r"),
        (weighted(padding, padded),
         "the padding lanes (splits ≥ n_splits) were loaded as lse = 0, not −inf: "
         "each adds 2^(0 − M) to the denominator"),
    ]
    for want, hint in candidates:
        close = (got - want).abs() <= 1e-4 + 1e-4 * want.abs()
        if want.shape == got.shape and (close | (got.isnan() & want.isnan())).all():
            return hint
    if torch.isfinite(got).all():
        return None
    if (lse.amax(0) > 120).any():
        return ("NaN or inf: 2^lse overflows fp32 from lse ≈ 128; subtract the row's "
                "largest lse first, M = max_s lse_s, and weigh by 2^(lse_s − M)")
    if splits > n_splits:
        return ("NaN or inf: the lanes past n_splits read beyond Part and Lse; mask "
                "the loads with splits < n_splits (other=-inf for Lse, 0 for Part)")
    if got.isnan().all():
        return "NaN in every row: nothing stored into Out, or 0 / 0"
    return ("NaN or inf: an empty split (lse = −inf) must weigh 2^(−inf − M) = 0; "
            "take M over the splits that exist")


def check_merge_kernel(merge_kernel):
    """Chapter 8: ``merge_kernel(Part, Lse, Out, n_splits, HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr)``, one program per output row, must combine the ``n_splits``
    partial outputs of split-KV decoding — ``Part`` a contiguous fp32 ``(n_splits, rows,
    HEAD_DIM)``, each already normalised within its split, ``Lse`` fp32 ``(n_splits,
    rows)``, the splits' log-sum-exps in log2 units, ``-inf`` for a split that saw no
    key — into ``Out`` fp32 ``(rows, HEAD_DIM)``. ``SPLITS`` is a power of two
    ``>= n_splits``.

    Cases: one split, three splits of which one is empty, eight splits whose
    log-sum-exps lie up to 300 apart (a merge that exponentiates without subtracting the
    maximum overflows fp32). Reports the case and the wrong rows, and the likely slip
    where the wrong output matches one: the partials averaged, the division forgotten,
    ``exp`` for ``exp2``, the split axis read as the inner one, padding lanes loaded as
    0, an overflow.
    """
    rows, d = 12, 32
    for what, n_splits, splits, part, lse in _merge_cases(rows, d):
        (part, part_guard), (lse, lse_guard) = (
            _guarded(t.to(_device()), name)
            for t, name in ((part, "Part"), (lse, "Lse")))
        out, out_guard = _guarded_empty((rows, d), torch.float32, part.device, "Out")
        with _quiet():
            merge_kernel[(rows,)](part, lse, out, n_splits, HEAD_DIM=d, SPLITS=splits)
        spilled = _guard_verdict(out_guard, part_guard, lse_guard)
        case = f"{what} (n_splits={n_splits}, SPLITS={splits})"
        if spilled:
            return f"{case}: {spilled}"
        bad = _bad_rows(out, _merge_reference(part.cpu(), lse.cpu()), atol=1e-4,
                        rtol=1e-4)
        if bad:
            hint = _merge_hint(out, part.cpu(), lse.cpu(), splits)
            return (f"{case}: rows {_spans(bad)} wrong"
                    + (f". Likely: {hint}" if hint else ""))
    return CORRECT


def check_merge_lse_kernel(merge_kernel):
    """Chapter 8: ``merge_kernel(Part, Lse, Out, LseOut, n_splits, HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr)``: the merge of :func:`check_merge_kernel` that also writes each row's
    **merged** log-sum-exp into ``LseOut`` (fp32 ``(rows,)``, log2 units), so that merged states
    can be merged again (a tree of merges; a prefix shared by several requests, merged once).

    The merged log-sum-exp is ``M + log2 Σ_s 2^(lse_s − M)``, ``M`` the row's largest. Same cases
    as :func:`check_merge_kernel`; every tensor in a guarded buffer. Then the result is merged
    once more: the rows split in two groups of splits, each merged by your kernel, the two
    results merged by your kernel, which must give the one-step merge.
    """
    rows, d = 12, 32
    for what, n_splits, splits, part, lse in _merge_cases(rows, d):

        def run(part, lse, n_splits, splits):
            (part_d, part_guard), (lse_d, lse_guard) = (
                _guarded(t.contiguous().to(_device()), name)
                for t, name in ((part, "Part"), (lse, "Lse")))
            out, out_guard = _guarded_empty((rows, d), torch.float32, part_d.device, "Out")
            lse_out, lse_out_guard = _guarded_empty((rows,), torch.float32, part_d.device,
                                                    "LseOut")
            with _quiet():
                merge_kernel[(rows,)](part_d, lse_d, out, lse_out, n_splits, HEAD_DIM=d,
                                      SPLITS=splits)
            return out.cpu(), lse_out.cpu(), _guard_verdict(out_guard, lse_out_guard, part_guard,
                                                            lse_guard)

        case = f"{what} (n_splits={n_splits}, SPLITS={splits})"
        out, lse_out, spilled = run(part, lse, n_splits, splits)
        if spilled:
            return f"{case}: {spilled}"
        bad = _bad_rows(out, _merge_reference(part, lse), atol=1e-4, rtol=1e-4)
        if bad:
            return f"{case}: Out, rows {_spans(bad)} wrong"
        m = lse.double().amax(0)
        want_lse = m + torch.log2(torch.exp2(lse.double() - m).nan_to_num(nan=0.0).sum(0))
        bad = _bad_rows(lse_out[:, None], want_lse[:, None], atol=1e-4, rtol=1e-5)
        if bad:
            r = bad[0]
            never = lse_out[bad].isnan().all().item()
            return (f"{case}: LseOut, rows {_spans(bad)} "
                    + ("never written" if never else
                       f"wrong; row {r}: got {lse_out[r].item():.6g}, expected "
                       f"{want_lse[r].item():.6g} (log2 units: M + log2 Σ 2^(lse − M))"))
        if n_splits >= 2:                                       # merge the merges
            cut = n_splits // 2
            first = run(part[:cut], lse[:cut], cut, triton.next_power_of_2(cut))
            second = run(part[cut:], lse[cut:], n_splits - cut,
                         triton.next_power_of_2(n_splits - cut))
            again, _, spilled = run(torch.stack([first[0], second[0]]),
                                    torch.stack([first[1], second[1]]), 2, 2)
            bad = _bad_rows(again, out, atol=1e-4, rtol=1e-4)
            if spilled or bad:
                return (f"{case}: splits 0–{cut - 1} and {cut}–{n_splits - 1} merged apart, "
                        f"then merged with their LseOut: rows {_spans(bad)} differ from the "
                        "one-step merge" if bad else f"{case}: {spilled}")
    return CORRECT


# --- chapter 8: a split's chunk of the cache ------------------------------------------

@triton.jit
def _chunk_bounds_kernel(Bounds, n_keys, num_splits, CHUNK_BOUNDS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """One program per split: the reader's ``(lo, hi)`` at ``Bounds[2s]``,
    ``Bounds[2s + 1]``."""
    split = tl.program_id(0)
    lo, hi = CHUNK_BOUNDS(n_keys, split, num_splits, BLOCK_N)
    tl.store(Bounds + 2 * split, lo)
    tl.store(Bounds + 2 * split + 1, hi)


# (n_keys, num_splits, BLOCK_N): uneven and even cuts, spare splits, one split
_CHUNK_CASES = ((1000, 7, 16), (64, 4, 16), (100, 8, 16), (5, 3, 16), (17, 1, 16),
                (4100, 33, 64))


def _chunk_verdict(bounds, n_keys, block):
    """What is wrong with the chunks ``bounds`` (``(S, 2)`` ints), or ``None``."""
    spans = [(lo, hi) for lo, hi in bounds.tolist()]
    cover = torch.zeros(n_keys + 1, dtype=torch.long)
    for lo, hi in spans:
        cover[max(lo, 0):max(min(hi, n_keys), max(lo, 0))] += 1
    starts = {lo for lo, hi in spans if hi > lo}
    ends = {hi for lo, hi in spans if hi > lo}
    twice = (cover[:n_keys] > 1).nonzero().flatten().tolist()
    missed = (cover[:n_keys] == 0).nonzero().flatten().tolist()
    past = [(s, hi) for s, (lo, hi) in enumerate(spans) if hi > n_keys]
    if past:
        s, hi = past[0]
        return (f"split {s} ends at hi = {hi}, past the cache's {n_keys} keys: clamp "
                "hi to n_keys (the kernel's masks stop at hi)")
    if twice:
        why = (": each chunk also takes the next one's first key — off by one: "
               "[lo, hi) already stops before hi, so hi = lo + chunk, "
               "not lo + chunk + 1"
               if set(twice) <= starts else "")
        return f"keys {_spans(twice)} belong to two splits{why}"
    if missed:
        if set(missed) <= ends:
            why = (" — off by one: hi = lo + chunk − 1 drops each chunk's last key; "
                   "[lo, hi) already excludes hi")
        elif missed[-1] == n_keys - 1:
            why = (": the chunks stop short of the cache's end; round the chunk length "
                   "up (cdiv), so that num_splits chunks cover n_keys")
        else:
            why = ""
        return f"keys {_spans(missed)} belong to no split{why}"
    unaligned = [(s, lo) for s, (lo, hi) in enumerate(spans) if hi > lo and lo % block]
    if unaligned:
        s, lo = unaligned[0]
        return (f"split {s} starts at key {lo}, not a multiple of BLOCK_N = {block}: "
                "round the chunk length up to whole tiles, so that no tile straddles "
                "two splits")
    lengths = [hi - lo for lo, hi in spans if hi > lo]
    if len(set(lengths[:-1])) > 1 or (len(lengths) > 1 and lengths[-1] > lengths[0]):
        return (f"chunk lengths {lengths}: cut equal chunks, the last one shorter, so "
                "that every program has the same work")
    return None


def check_chunk_bounds(chunk_bounds):
    """Chapter 8: ``chunk_bounds(n_keys, split, num_splits, BLOCK_N: tl.constexpr)``, a
    ``@triton.jit`` function, must return ``(lo, hi)``, the keys ``[lo, hi)`` of chunk
    ``split``: equal chunks of whole tiles (``BLOCK_N`` keys), the last one shorter,
    spare splits past the end empty (``hi <= lo``), together every key
    ``0 … n_keys − 1`` exactly once.

    Runs it once per split for several cache lengths and split counts and says which
    keys two splits share or none covers, and the likely slip: an ``hi`` one too far or
    one too short, a chunk length rounded down, a chunk that is not whole tiles, an
    ``hi`` past the cache's end.
    """
    for n_keys, num_splits, block in _CHUNK_CASES:
        bounds, guard = _guarded_empty((num_splits, 2), torch.int32, _device(),
                                       "Bounds")
        with _quiet():
            _chunk_bounds_kernel[(num_splits,)](
                bounds, n_keys, num_splits, CHUNK_BOUNDS=chunk_bounds, BLOCK_N=block)
        case = f"n_keys={n_keys}, num_splits={num_splits}, BLOCK_N={block}"
        spilled = _guard_verdict(guard)
        if spilled:
            return f"{case}: {spilled}"
        got = bounds.cpu().long()
        if (got == _INT_POISON).all():
            return f"{case}: nothing was stored (return (lo, hi))"
        verdict = _chunk_verdict(got, n_keys, block)
        if verdict:
            return f"{case}: {verdict}"
    return CORRECT


def _paged_case(gen, batch, block_size, max_blocks, spare):
    """A random paged cache: ``(block_table, cache_seqlens, keys, pool)`` where ``keys[b]`` is
    row ``b``'s logical ``(L_b, 2)`` keys (its row number and position, so a wrong slot shows
    what it picked) and ``pool`` the ``(num_blocks · block_size, 2)`` flat pool they were
    scattered into, in random non-monotone pages; unused entries point at spare pages."""
    lengths = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=gen)
    lengths[0] = max_blocks * block_size                         # one full row
    used = [-(-int(n) // block_size) for n in lengths]
    blocks = sum(used) + spare
    order = torch.randperm(blocks, generator=gen)
    pool = torch.full((blocks * block_size, 2), -1, dtype=torch.int64)
    table = torch.empty(batch, max_blocks, dtype=torch.int32)
    taken, keys = 0, []
    for b in range(batch):
        for j in range(max_blocks):
            table[b, j] = int(order[taken] if j < used[b] else order[-1 - j % spare])
            taken += j < used[b]
        n = int(lengths[b])
        positions = torch.arange(n)
        keys.append(torch.stack([torch.full_like(positions, b), positions], 1))
        flat = table[b, positions // block_size].long() * block_size + positions % block_size
        pool[flat] = keys[-1]
    return table, lengths.to(torch.int32), keys, pool


def check_page_slots(page_slots):
    """Chapter 8: ``page_slots(block_table, cache_seqlens, block_size)`` must return, for each
    batch row ``b``, a 1-D int64 tensor of ``cache_seqlens[b]`` entries: entry ``j`` is where key
    ``j`` of the row lives in the pool ``k_cache.flatten(0, 1)`` (``(num_blocks · block_size,
    Hkv, D)``), i.e. slot ``j % block_size`` of page ``block_table[b, j // block_size]``.
    Checked on random non-monotone tables for block sizes 16 to 256 (entries past a row's
    length point at spare pages); says which row and key are wrong and what was read there."""
    gen = torch.Generator().manual_seed(8)
    for batch, block_size, max_blocks, spare in ((3, 16, 5, 3), (2, 64, 3, 2), (4, 256, 2, 3),
                                                 (1, 32, 1, 1)):
        table, lengths, keys, pool = _paged_case(gen, batch, block_size, max_blocks, spare)
        case = f"B={batch}, block_size={block_size}, lengths {lengths.tolist()}"
        try:
            got = page_slots(table.clone(), lengths.clone(), block_size)
        except Exception as error:                      # the reader's code raised: say so
            return f"{case}: my_page_slots raised {type(error).__name__}: {error}"
        if got is None:
            return "not solved yet: my_page_slots returned None"
        if isinstance(got, torch.Tensor) or not isinstance(got, (list, tuple)):
            return (f"{case}: expected a list of {batch} tensors (one per row; rows have "
                    f"different lengths), got {type(got).__name__}")
        if len(got) != batch:
            return f"{case}: expected {batch} tensors, one per batch row, got {len(got)}"
        for b, slots in enumerate(got):
            n = int(lengths[b])
            if not isinstance(slots, torch.Tensor):
                return f"{case}: row {b} is a {type(slots).__name__}, expected a tensor"
            if slots.dtype != torch.int64:
                return f"{case}: row {b} has dtype {slots.dtype}, expected torch.int64 (indices)"
            if tuple(slots.shape) != (n,):
                return (f"{case}: row {b} has shape {tuple(slots.shape)}, expected ({n},): one "
                        f"slot per valid key (cache_seqlens[{b}] = {n})")
            if bool(((slots < 0) | (slots >= pool.shape[0])).any()):
                j = int(((slots < 0) | (slots >= pool.shape[0])).nonzero()[0])
                return (f"{case}: row {b}, key {j}: slot {int(slots[j])} is outside the pool "
                        f"(0 to {pool.shape[0] - 1})")
            read = pool[slots]
            wrong = (read != keys[b]).any(1)
            if bool(wrong.any()):
                j = int(wrong.nonzero()[0])
                found = read[j].tolist()
                what = ("a slot no row uses" if found[0] < 0 else
                        f"key {found[1]} of row {found[0]}")
                return (f"{case}: row {b}, key {j}: slot {int(slots[j])} holds {what}; key {j} "
                        f"is in page block_table[{b}, {j // block_size}] = "
                        f"{int(table[b, j // block_size])}, slot {j % block_size}")
    return CORRECT


def check_split_free_batch(split_free_batch):
    """Chapter 8: ``split_free_batch(kv_heads, n_keys, sms)``: the smallest batch for which
    :func:`rerope.decode.default_num_splits` (group 4, one query per row) cuts no row's keys,
    i.e. picks 1 split. Compared with a search over the rule itself, for many shapes."""
    from . import decode

    for kv_heads in (1, 4, 8, 12):
        for n_keys in (1, 255, 256, 257, 4096, 131072):
            for sms in (80, 132):
                want = next(b for b in range(1, 10 ** 5)
                            if decode.default_num_splits(b, kv_heads, 4, 1, n_keys, sms) == 1)
                got = split_free_batch(kv_heads, n_keys, sms)
                if got is None:
                    return "not solved yet: my_split_free_batch returned None"
                if got != want:
                    splits = decode.default_num_splits(max(int(got), 1), kv_heads, 4, 1, n_keys,
                                                       sms)
                    return (f"Hkv={kv_heads}, {n_keys} keys, {sms} SMs: got batch {got}, where "
                            f"the rule picks {splits} split(s); the first batch with 1 is {want}")
    return CORRECT


def check_ntk_base(ntk_base):
    """Chapter 11: ``ntk_base(base, head_dim, alpha, pair)`` must return the RoPE base for which
    frequency ``pair`` (``θ_pair = b^(-2·pair/D)``, ``0 < pair < D/2``) turns ``alpha`` times
    slower (pair 0, ``θ_0 = 1``, stays whatever the base). ``pair = D/2 - 1`` is NTK-aware
    scaling. Reports the case and how much slower that pair and the slowest one turn."""
    from .rope import rope_frequencies

    for head_dim, alpha, pair in ((64, 16.0, 31), (64, 16.0, 8), (128, 4.0, 40), (16, 2.5, 3),
                                  (32, 8.0, 1)):
        got = ntk_base(10000.0, head_dim, alpha, pair)
        if got is None:
            return "not solved yet: my_ntk_base returned None"
        old, new = rope_frequencies(head_dim, 10000.0), rope_frequencies(head_dim, float(got))
        case = f"D={head_dim}, α={alpha:g}, pair {pair}"
        slowed = float(old[pair] / new[pair])
        if abs(slowed - alpha) > 1e-6 * alpha:
            return (f"{case}: pair {pair} turns {slowed:.4f} times slower, not {alpha:g}"
                    + ("" if pair == head_dim // 2 - 1 else f" (the slowest, pair "
                       f"{head_dim // 2 - 1}: {float(old[-1] / new[-1]):.4f} times)"))
    return CORRECT


_DECORATING.__exit__(None, None, None)   # the window opened at the top (rerope.runtime)
