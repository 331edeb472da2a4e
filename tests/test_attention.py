"""The fused kernel against the naive float64 reference: forward and all five gradients.

Runs on whatever :mod:`rerope.runtime` picked; on the CPU machines that is Triton's
interpreter with 16 × 16 tiles, so short sequences (N = 40 … 130) already cross every kind of
tile: outside, inside, band, the causal diagonal and the ragged end. Shapes stay tiny except
where a case is about them (the interpreter is slow: about a second per case).

Every kernel call runs with ``torch.empty`` poisoned (NaN), and every comparison also requires
finite values, so memory the kernel forgets to write fails the test.
"""

from dataclasses import asdict

import pytest
import torch

import rerope
from rerope_testing import (CASES, F16, F32, GRAD_NAMES, TOLERANCES, Case,
                            check_kernel_against_reference, close_problems, describe,
                            kernel_results, make_inputs, randn, raw_inputs, reference_results,
                            results_problems, tolerance, where_kernels_run,
                            window_contrast_inputs)


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_matches_reference(case, gen):
    tensors, dout = make_inputs(gen, case.batch, case.hq, case.hkv, case.n, case.d, case.dtype,
                                layout=case.layout)
    check_kernel_against_reference(tensors, dout, case.window, case.causal, case.sm_scale,
                                   context=describe(gen, **asdict(case)))


# Both ways of reading tiles: tensor descriptors (TMA on Hopper) and pointer loads. Under the
# interpreter the default is pointers; tma="on" (REROPE_TMA=1) forces descriptors wherever
# the layout allows, and the interpreter then runs the descriptor code path.
TMA_CASES = [Case(77, 15, dtype=F16), Case(77, 30, causal=False), Case(1, 1),
             Case(24, 12, hq=4, hkv=1, d=64, dtype=F16),
             Case(24, 7, batch=2, hq=2, hkv=2, causal=False, dtype=F16),
             Case(40, 10, hq=2, hkv=2, layout="transposed", dtype=F16)]


@pytest.mark.parametrize("case", TMA_CASES, ids=Case.id)
@pytest.mark.parametrize("mode", ["off", "on"], ids=["pointers", "descriptors"])
def test_both_load_paths(case, mode, gen):
    from rerope import attention

    tensors, dout = make_inputs(gen, case.batch, case.hq, case.hkv, case.n, case.d, case.dtype,
                                layout=case.layout)
    assert attention._use_tma(mode, *tensors, dout) == (mode == "on"), (
        "the path under test is not taken")
    with rerope.using_config(tma=mode):
        check_kernel_against_reference(tensors, dout, case.window, case.causal, case.sm_scale,
                                       context=describe(gen, tma=mode, **asdict(case)))


def test_descriptor_layout_rules():
    """TMA needs unit column stride, 16-byte aligned row/head strides and a 16-byte aligned start;
    anything else falls back to pointer loads (sizes-1 dimensions' strides do not matter)."""
    from rerope.launch import _tma_layout_ok

    base = torch.zeros(2, 3, 40, 32, dtype=F16)
    assert _tma_layout_ok(base)
    assert _tma_layout_ok(base.transpose(1, 2).contiguous().transpose(1, 2))   # (B, N, H, D)
    assert not _tma_layout_ok(base[..., ::2])                    # column stride 2
    assert not _tma_layout_ok(torch.zeros(1, 1, 40, 36, dtype=F16)[..., :32])  # 72-byte rows
    assert not _tma_layout_ok(torch.zeros(2 * 3 * 40 * 32 + 1, dtype=F16)[1:].view(2, 3, 40, 32))
    assert _tma_layout_ok(torch.zeros(1, 1, 5, 16, dtype=F32).as_strided((1, 1, 5, 16),
                                                                         (7, 3, 16, 1)))


# --- the window boundary, made loud ---------------------------------------------------------


@pytest.mark.parametrize("strong, window, causal, dtype", [
    ("outside", 1, True, F32), ("outside", 16, True, F16), ("outside", 17, False, F32),
    ("outside", 31, True, F16), ("inside", 2, True, F32), ("inside", 17, False, F16),
], ids=str)
def test_window_boundary(strong, window, causal, dtype, gen):
    """``q2·k2`` and ``q1·k1`` far apart: putting ``i - j = w`` or ``w - 1`` on the wrong side
    moves most of a row's attention weight (errors of order 1, see the test below)."""
    tensors, dout = window_contrast_inputs(gen, 1, 1, 1, 40, 32, dtype, strong)
    check_kernel_against_reference(tensors, dout, window, causal,
                                    context=describe(gen, strong=strong, window=window,
                                                     causal=causal))


@pytest.mark.parametrize("dtype", [F32, F16, torch.bfloat16], ids=str)
def test_tolerances_catch_wrong_region(dtype, gen):
    """The tolerance table is tight enough: the kernel's result, held against the reference
    with the window off by one either way, fails (the output); held against the reference with
    ``q1``/``k1`` swapped with ``q2``/``k2``, fails for the output and every gradient."""
    window, causal = 17, True
    tensors, dout = window_contrast_inputs(gen, 1, 1, 1, 50, 32, dtype, "outside")
    got = kernel_results(tensors, dout, window, causal)
    tol = tolerance(dtype)

    def failures(want):
        return {name: bool(results_problems(got, want, tol, names=[name]))
                for name in ("out",) + GRAD_NAMES}

    right = reference_results(tensors, dout, window, causal)
    assert not results_problems(got, right, tol), results_problems(got, right, tol)
    for wrong_window in (window - 1, window + 1):
        flagged = failures(reference_results(tensors, dout, wrong_window, causal))
        assert flagged["out"], f"window {wrong_window} passes as {window}: {flagged}"
    q1, q2, k1, k2, v = tensors
    swapped = reference_results([q2, q1, k2, k1, v], dout, window, causal)
    # gradients of the swapped problem, named after the tensors they belong to
    swapped = {"out": swapped["out"], "dq1": swapped["dq2"], "dq2": swapped["dq1"],
               "dk1": swapped["dk2"], "dk2": swapped["dk1"], "dv": swapped["dv"]}
    flagged = failures(swapped)
    assert all(flagged.values()), f"q1/q2 swap not caught everywhere: {flagged}"


# --- memory: poison, strides, dtypes ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_poisoned_strided_views(dtype, gen):
    """Inputs (and dO) are strided views into NaN-filled buffers (every other element along D,
    offset rows and heads); outputs are allocated poisoned. The kernel must read only its own
    elements and write every output element."""
    tensors, dout = make_inputs(gen, 2, 2, 1, 40, 32, dtype, layout="poisoned")
    assert all(torch.isnan(t._base).any() for t in tensors)
    check_kernel_against_reference(tensors, dout, 9, True, context=describe(gen))


@pytest.mark.parametrize("n, window", [(15, 3), (16, 1), (16, 16), (33, 3), (33, 16)])
def test_small_sequences(n, window, gen):
    """Lengths at a tile edge (1, 2 and 17 are in the main grid), forward and backward."""
    causal = bool(n % 2)
    tensors, dout = make_inputs(gen, 1, 2, 1, n, 16, F32)
    check_kernel_against_reference(tensors, dout, window, causal,
                                   context=describe(gen, n=n, window=window, causal=causal))


def test_bfloat16(gen):
    """bf16 in, bf16 out (outputs and gradients); under the interpreter it is computed in fp32,
    on a GPU in bf16: only rough agreement is asked (the bf16 row of the table)."""
    tensors, dout = make_inputs(gen, 1, 2, 1, 40, 32, torch.bfloat16)
    got = kernel_results(tensors, dout, 9, True)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}, {n: t.dtype for n, t in got.items()}
    want = reference_results(tensors, dout, 9, True)
    problems = results_problems(got, want, tolerance(torch.bfloat16))
    assert not problems, describe(gen) + "\n" + "\n".join(problems)


def test_forward_only_under_no_grad(gen):
    tensors, _ = make_inputs(gen, 1, 2, 2, 40, 32, F32)
    with torch.no_grad():
        out = rerope.rerope_attention(*tensors, 10)
    assert not out.requires_grad
    want = reference_results(tensors, torch.zeros_like(out), 10)["out"]
    assert not close_problems("out", out, want, tolerance(F32))


# --- the raw-input op: rerope(q, k, v, window, leaky=, logn_len=) --------------------------------


@pytest.mark.parametrize("dtype, causal, hq, hkv, leaky, logn_len", [
    (F32, True, 2, 1, 4.0, None),
    (F16, False, 1, 1, 16.0, None),
    (F16, True, 2, 2, None, 8),
    (F32, False, 2, 1, 16.0, 16),
])
def test_rerope_raw_inputs(dtype, causal, hq, hkv, leaky, logn_len, gen):
    """``rerope.rerope`` (RoPE built in torch, then the kernel) against ``reference.rerope`` in
    float64 on the same raw inputs: output and ``dq, dk, dv``."""
    from rerope import reference

    n, d, window = 50, 32, 13
    raw = raw_inputs(gen, 1, hq, hkv, n, d, dtype)
    dout = randn(gen, 1, hq, n, d, dtype=dtype, device=raw[0].device)
    out = rerope.rerope(*raw, window, causal=causal, leaky=leaky, logn_len=logn_len)
    out.backward(dout)
    ref_raw = [t.detach().double().requires_grad_() for t in raw]
    want = reference.rerope(*ref_raw, window, causal=causal, leaky=leaky, logn_len=logn_len)
    want.backward(dout.double())
    got = {"out": out, **{name: t.grad for name, t in zip(("dq", "dk", "dv"), raw)}}
    want = {"out": want, **{name: t.grad for name, t in zip(("dq", "dk", "dv"), ref_raw)}}
    problems = results_problems(got, want, tolerance(dtype))
    assert not problems, describe(gen, leaky=leaky, logn_len=logn_len) + "\n" + "\n".join(problems)


def test_tolerance_table_is_complete():
    for dtype in (F32, F16, torch.bfloat16):
        assert ("interpreter", dtype) in TOLERANCES and ("gpu", dtype) in TOLERANCES
    assert where_kernels_run() in ("interpreter", "gpu")


@pytest.mark.parametrize("window", [2 ** 31 - 1, 2 ** 31 - 20], ids=["int32_max", "int32_max-19"])
def test_window_near_int32_max(window, gen):
    """A huge window (e.g. ``torch.iinfo(torch.int32).max`` for "no window") is plain RoPE."""
    tensors, dout = make_inputs(gen, 1, 1, 1, 20, 16, F32)
    check_kernel_against_reference(tensors, dout, window, True, context=describe(gen))


@pytest.mark.parametrize("fused", [False, True], ids=["five_tensors", "raw_qk"])
def test_grid_orders_agree(fused, gen):
    """Heads first or blocks first (``attention.heads_first``: the grid's axis order) runs the
    same programs, so forward and gradients are bit-identical; and right (float64 reference).
    GQA, batch 2, causal, an odd N whose last query block is ragged."""
    from rerope import attention, reference

    n, d, window = 35, 32, 13
    if fused:
        raw = raw_inputs(gen, 2, 2, 1, n, d, F32)
        dout = randn(gen, 2, 2, n, d, dtype=F32, device=raw[0].device)
    else:
        raw, dout = make_inputs(gen, 2, 2, 1, n, d, F32)

    def run(max_keys):
        with rerope.using_config(heads_first_max_keys=max_keys):
            assert attention.heads_first(n) == (max_keys >= n)
            leaves = [t.detach().clone().requires_grad_() for t in raw]
            out = (rerope.rerope(*leaves, window) if fused
                   else rerope.rerope_attention(*leaves, window))
            out.backward(dout)
        return [out.detach(), *(t.grad for t in leaves)]

    heads, blocks = run(n), run(0)
    # past CUDA's 65535 on the grid's second axis, heads go first at any length
    assert attention.heads_first(1 << 20, attention.GRID_Y_MAX + 1)
    assert not attention.heads_first(1 << 20, attention.GRID_Y_MAX)
    for got, want in zip(blocks, heads):
        assert torch.equal(got, want), "the two grid orders give different bits"
    ref = [t.detach().double().requires_grad_() for t in raw]
    want = (reference.rerope(*ref, window) if fused
            else reference.rerope_attention(*ref, window))
    want.backward(dout.double())
    names = ("out", "dq", "dk", "dv") if fused else ("out", *GRAD_NAMES)
    problems = results_problems(dict(zip(names, heads)),
                                dict(zip(names, [want, *(t.grad for t in ref)])),
                                tolerance(F32))
    assert not problems, describe(gen, fused=fused) + "\n" + "\n".join(problems)
