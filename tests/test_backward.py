"""``rerope.backward`` through ``rerope.rerope``: the fused backward on pre-turned operands or
turning tiles in registers, against the float64 relative-position oracle and each other.

The grid is ``rerope.rerope``'s (``FUSED_CASES`` of ``tests/conftest.py``); outputs are allocated
poisoned (NaN). ``-m gpu``: both paths at the benchmark's shape.
"""

import contextlib
from dataclasses import asdict

import pytest
import torch

import rerope
from rerope import reference
from rerope_testing import (BF16, C, F16, FUSED_CASES, NAMES, FusedCase, describe, error_stats,
                            fused_inputs, fused_results, fused_settings, log_errors,
                            oracle_results, results_problems, tolerance, true_float32)


@pytest.fixture
def backward_path(monkeypatch):
    """``force(path, **config)``: make the fused backward pre-turn its operands
    (``"preturned"``) or turn tiles in registers (``"in_registers"``) whatever the size, for
    the rest of the test (``rerope.using_config``, with ``config``'s further changes); returns
    the calls of ``turn_operands`` seen since, to prove which path ran (the plans are emptied,
    so the next call is a plan's first, which turns through ``turn_operands``)."""
    from rerope import attention

    calls = []
    real = attention.turn_operands
    monkeypatch.setattr(attention, "turn_operands",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))

    with contextlib.ExitStack() as stack:
        def force(path, **config):
            changes = dict(preturn_bwd_min_keys=0 if path == "preturned" else 1 << 62,
                           preturn_bwd_max_bytes=1 << 62)
            stack.enter_context(rerope.using_config(**{**changes, **config}))
            attention.PLANS.clear()     # a plan's later calls turn through its kept turn
            calls.clear()
            return calls

        yield force


@pytest.mark.parametrize("case", FUSED_CASES, ids=FusedCase.id)
def test_preturned_backward_matches_oracle(case, gen, backward_path):
    """The grid of ``test_matches_oracle`` with the backward on pre-turned operands."""
    calls = backward_path("preturned")
    leaves, dout = fused_inputs(gen, case)
    got = fused_results(leaves, dout, case.window, **fused_settings(case))
    # rotated inputs at Nk <= w: only the outside product would change an operand, and it has
    # no tile, so there is nothing to pre-turn (attention._has_outside)
    nothing = case.rotated and case.logn_len is None and case.n_k <= case.window
    assert len(calls) == (0 if nothing else 2), "the backward did not pre-turn q and k"
    want = oracle_results(leaves, dout, case.window, **fused_settings(case))
    assert {t.dtype for t in got.values()} == {case.dtype}
    log_errors(case.dtype, {n: error_stats(got[n], want[n]) for n in NAMES})
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, preturn=True, **asdict(case)) + "\n" + "\n".join(problems)


BOTH_PATHS_CASES = [
    C(50, window=14), C(50, window=14, rotated=True, dtype=F16), C(50, window=9, leaky=4.0),
    C(33, 70, 9, leaky=3.0, logn_len=8.0, rotated=True), C(7, 100, 13, dtype=F16),
    C(24, 40, 7, batch=2, hq=4, hkv=2, dtype=F16, layout="transposed", rotated=True),
    C(40, window=9, dtype=BF16, logn_len=5.0),
]


@pytest.mark.parametrize("case", BOTH_PATHS_CASES, ids=FusedCase.id)
def test_both_backward_paths_agree(case, gen, backward_path):
    """Pre-turned and in registers, the same gradients within the dtype's tolerance (scaled by
    the largest gradient; the two differ in roundings only: the dK/dV kernel in registers moves
    each product's query offset onto its keys, the pre-turned one reads the forward's operands)."""
    leaves, dout = fused_inputs(gen, case)
    got = {}
    for path in ("in_registers", "preturned"):
        calls = backward_path(path)
        got[path] = fused_results(leaves, dout, case.window, **fused_settings(case))
        assert bool(calls) == (path == "preturned"), f"the {path} path did not run"
    assert torch.equal(got["in_registers"]["out"], got["preturned"]["out"])   # one forward
    problems = results_problems(got["preturned"], got["in_registers"], tolerance(case.dtype),
                                names=list(NAMES[1:]))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
@pytest.mark.parametrize("extra", [{}, {"leaky": 4.0, "logn_len": 8.0}],
                         ids=["rerope", "leaky-logn"])
def test_preturned_dq_is_bit_identical_at_d16(rotated, extra, gen, backward_path):
    """Where the arithmetic is the same, so are the bits: at D = 16 (halves joined, one dot in
    both paths) the dQ kernel turns exactly the tiles the pre-turn writes, so ``dq`` is equal to
    the last bit; ``dk, dv`` agree within tolerance (the dK/dV kernel in registers turns keys by
    ``R(speed·j − offset)``)."""
    case = C(40, window=7, d=16, rotated=rotated, dtype=F16, hq=2, hkv=1, **extra)
    leaves, dout = fused_inputs(gen, case)
    got = {}
    for path in ("in_registers", "preturned"):
        backward_path(path)
        got[path] = fused_results(leaves, dout, case.window, **fused_settings(case))
    assert torch.equal(got["in_registers"]["dq"], got["preturned"]["dq"])
    problems = results_problems(got["preturned"], got["in_registers"], tolerance(case.dtype),
                                names=["dk", "dv"])
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def test_backward_falls_back_to_registers_when_memory_is_tight(gen, backward_path):
    """Long enough to pre-turn, but over the byte limit: the in-register path runs, and is right."""
    calls = backward_path("preturned", preturn_bwd_max_bytes=0)
    case = C(40, window=9, rotated=True)
    leaves, dout = fused_inputs(gen, case)
    got = fused_results(leaves, dout, case.window, **fused_settings(case))
    assert not calls, "pre-turned although over the byte limit"
    want = oracle_results(leaves, dout, case.window, **fused_settings(case))
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_both_backward_paths_at_full_size(dtype, d, rotated):
    """The benchmark's shape (B=1, H=32, N=8192, W=2048, causal): both backward paths on one
    forward, against each other and against a float32 reference on two heads."""
    from rerope import attention

    n, w, scale = 8192, 2048, d ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(d + rotated)
    q, k, v, dout = (torch.randn(1, 32, n, d, device="cuda", dtype=dtype, generator=gen)
                     for _ in range(4))
    ops = attention._rotations(n, d, 10000.0, w, None, None, rotated, q.device)
    out, lse = attention.rerope_forward(q, q, k, k, v, w, True, scale, ops)
    grads = {p: dict(zip(NAMES[1:], attention.rerope_backward(
        dout, q, q, k, k, v, out, lse, w, True, scale, ops, preturn=p))) for p in (False, True)}
    tol = tolerance(dtype, "gpu")
    problems = results_problems(grads[True], grads[False], tol)
    leaves = [t[:, :2].float().requires_grad_() for t in (q, k, v)]
    with true_float32():
        ref = torch.autograd.grad(reference.rerope(*leaves, w, rotated=rotated), leaves,
                                  dout[:, :2].float())
    want = dict(zip(NAMES[1:], ref))
    for p in (False, True):
        problems += results_problems({n_: g[:, :2] for n_, g in grads[p].items()}, want, tol)
    assert not problems, "\n".join(problems)
