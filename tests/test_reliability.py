"""One regression test (or a few) per item of project issue 9, "no silent wrong answer, no crash
on valid input": each item's reproducer, now refused with a clear error or computed right.

Every result is judged against the float64 references (``rerope.reference``) with the
tolerance table of ``tests/conftest.py``. Shapes are tiny: the kernels run through Triton's
interpreter on CPU.
"""

import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import rerope
from rerope import configs, reference
from rerope._validate import SM_SCALE_MAX, SM_SCALE_MIN, check_logn_overflow
from rerope.rope import relative_positions, rerope_inputs
from rerope_testing import (close_problems, error_stats, kernel_device, randn, results_problems,
                            tolerance)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw_leaves(gen, b, hq, hkv, n, d, dtype, n_queries=None):
    """Random ``q, k, v`` leaves on the kernels' device; ``q`` has ``n_queries`` rows."""
    device = kernel_device()
    shapes = [(b, hq, n_queries or n, d), (b, hkv, n, d), (b, hkv, n, d)]
    return [randn(gen, *shape, dtype=dtype, device=device).requires_grad_() for shape in shapes]


def five_from(raw, window, **rope_args):
    """The caller's five tensors (leaves) for ``rerope.rerope_attention``, from ``q, k, v``."""
    q, k, v = (t.detach() for t in raw)
    return [t.detach().clone().requires_grad_()
            for t in (*rerope_inputs(q, k, window, **rope_args), v)]


def oracle(raw, window, dout=None, **kwargs):
    """The relative-position oracle in float64 on copies of ``q, k, v``: ``out`` and, with
    ``dout``, ``dq, dk, dv``."""
    leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in raw]
    out = reference.rerope_from_relative_positions(*leaves, window, **kwargs)
    if dout is None:
        return {"out": out.detach()}
    out.backward(dout.to("cpu", torch.float64))
    return {"out": out.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), leaves)}}


def rerope_results(raw, window, dout, **kwargs):
    """``rerope.rerope`` forward and backward: ``out, dq, dk, dv``."""
    for t in raw:
        t.grad = None
    out = rerope.rerope(*raw, window, **kwargs)
    out.backward(dout)
    return {"out": out.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), raw)}}


# --- 1. double backward: a clear error, or right ----------------------------------------------

# What torch says when a backward is differentiated again but cannot be: ``once_differentiable``
# ("trying to differentiate twice a function that was marked with @once_differentiable"), or a
# custom op with no double-backward formula ("Trying to backward through rerope.rerope_bwd…
# but no autograd formula was registered"). NOT "does not require grad": that is the silent
# failure (first-order gradients detached from the graph, second order taken as zero).
CLEAR_DOUBLE_BACKWARD_ERROR = re.compile(
    r"once_differentiable|differentiate twice|double backward|second.order|higher.order|"
    r"not (?:implemented|supported)|no autograd formula", re.IGNORECASE)


def _double_backward(op, leaves, weights, dout):
    """``d/d(leaves) Σ weights · d(out·dout)/d(leaves)``: a gradient penalty's gradient."""
    out = op(*leaves)
    try:   # a backward may refuse create_graph=True at once, or only when differentiated
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        if not all(g.requires_grad for g in grads):
            return "detached", None
        penalty = sum((g * w).sum() for g, w in zip(grads, weights))
        # .backward() as a training loop does: it runs every node of the graph, so an error
        # node (once_differentiable's DelayedError) fires; autograd.grad(penalty, leaves) would
        # skip one that does not lead to the leaves and silently return zeros
        penalty.backward()
    except RuntimeError as error:
        return "error", error
    return "value", [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


@pytest.mark.parametrize("op_name", ["rerope", "rerope_attention"])
def test_double_backward_raises_clearly_or_is_right(op_name, gen):
    """Item 1. A gradient penalty (``create_graph=True``) through the op either raises torch's
    clear error or gives the second-order gradients of the float64 reference."""
    window, causal = 3, False
    raw = raw_leaves(gen, 1, 2, 1, 12, 16, F32)
    if op_name == "rerope":
        leaves = raw

        def op(q, k, v):
            return rerope.rerope(q, k, v, window, causal=causal, leaky=4.0)

        def ref_op(q, k, v):
            return reference.rerope_from_relative_positions(q, k, v, window, causal=causal,
                                                            leaky=4.0)
    else:
        leaves = five_from(raw, window)

        def op(*five):
            return rerope.rerope_attention(*five, window, causal=causal)

        def ref_op(*five):
            return reference.rerope_attention(*five, window, causal=causal)
    dout = randn(gen, *raw[0].shape, dtype=F32, device=raw[0].device)
    weights = [randn(gen, *t.shape, dtype=F32, device=t.device) for t in leaves]
    outcome, result = _double_backward(op, leaves, weights, dout)
    assert outcome != "detached", (
        "first-order gradients with create_graph=True came back detached (requires_grad=False): "
        "a gradient penalty added to a loss would silently get a zero second-order gradient. "
        "Note: @once_differentiable alone does this when the upstream gradient does not require "
        "grad (the usual case); attach its DelayedError whenever grad mode is on in backward, "
        "raise there, or make the backward differentiable")
    if outcome == "error":
        assert CLEAR_DOUBLE_BACKWARD_ERROR.search(str(result)), f"unclear error: {result}"
        return
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    _, want = _double_backward(ref_op, ref_leaves, [w.double().cpu() for w in weights],
                               dout.double().cpu())
    names = [f"d2_{i}" for i in range(len(leaves))]
    problems = results_problems(dict(zip(names, result)), dict(zip(names, want)), tolerance(F32))
    assert not problems, "second-order gradients wrong:\n" + "\n".join(problems)


# --- 2. rows whose scores all lie below -1e30 --------------------------------------------------


@pytest.mark.parametrize("op_name", ["rerope", "rerope_attention"])
def test_row_with_very_negative_scores_is_finite(op_name, gen):
    """Item 2. ``q[0,0,0,0] = 1e16, k[0,0,0,0] = -1e16``, causal: row 0 sees key 0 only, with a
    score of -1e32·sm_scale = -2.5e31, below the kernels' running-max start (-1e30). A softmax
    over one key is that key's value: row 0 must be ``v[0]``, not 0/0 = NaN.

    The other rows' dimensions 0 and d/2 (the pair RoPE turns key 0's dimension 0 into) are
    zero, so only row 0 meets an extreme score. A row whose largest score is near +1e15 is
    beyond what fp32 can differentiate: the backward recomputes scores in another summation
    order, ~1e-7 relative and so ~1e8 absolute away from the forward's, and ``exp2`` of that
    overflows."""
    n, d, window = 8, 16, 4
    raw = raw_leaves(gen, 1, 1, 1, n, d, F32)
    with torch.no_grad():
        raw[0][0, 0, 1:, [0, d // 2]] = 0.0
        raw[0][0, 0, 0, 0] = 1e16
        raw[1][0, 0, 0, 0] = -1e16
    dout = randn(gen, 1, 1, n, d, dtype=F32, device=raw[0].device)
    if op_name == "rerope":
        out = rerope.rerope(*raw, window)
        grads = torch.autograd.grad(out, raw, dout)
    else:
        five = five_from(raw, window)
        out = rerope.rerope_attention(*five, window)
        grads = torch.autograd.grad(out, five, dout)
    want = oracle(raw, window)["out"]
    assert torch.isfinite(want).all()
    assert not close_problems("out row 0", out[:, :, :1], want[:, :, :1], tolerance(F32))
    assert torch.isfinite(out).all(), "rows after row 0 must stay finite too"
    assert all(torch.isfinite(g).all() for g in grads), "backward: non-finite gradients"


# --- 3. sm_scale so small that sm_scale·log2(e) underflows fp32 ---------------------------------


@pytest.mark.parametrize("sm_scale", [1e-46, 1e-40, 1e-39, 1e27, 1e38, 1e39, 1e300])
def test_sm_scale_outside_the_fp32_range_is_refused(sm_scale):
    """Item 3. Below ~1.2e-38 ``sm_scale·log2(e)`` is subnormal or zero in fp32 (flushed to zero
    on GPUs: every score NaN); above ~1e26 scaled fp32 scores of fp16-range entries can be inf
    (project issue "Reliability III", item 5: 1e38 gave NaN rows). The kernels refuse such
    scales, naming ``sm_scale`` and the bounds."""
    device = kernel_device()
    q, k, v = (torch.zeros(1, 1, 4, 16, device=device) for _ in range(3))
    message = re.escape(f"sm_scale must be between {SM_SCALE_MIN:.4g} and {SM_SCALE_MAX:.4g}")
    with pytest.raises(ValueError, match=message):
        rerope.rerope(q, k, v, 2, sm_scale=sm_scale)
    with pytest.raises(ValueError, match=message):
        rerope.rerope_attention(q, q, k, k, v, 2, sm_scale=sm_scale)


def test_sm_scale_at_the_bounds_is_computed(gen):
    """Item 3. The smallest accepted scale gives near-uniform attention, finite and right."""
    assert SM_SCALE_MIN * math.log2(math.e) >= torch.finfo(F32).tiny
    assert SM_SCALE_MAX * math.log2(math.e) <= torch.finfo(F32).max
    raw = raw_leaves(gen, 1, 1, 1, 10, 16, F32)
    out = rerope.rerope(*raw, 3, sm_scale=SM_SCALE_MIN)
    want = oracle(raw, 3, sm_scale=SM_SCALE_MIN)["out"]
    assert not close_problems("out", out, want, tolerance(F32))


@pytest.mark.parametrize("sm_scale", [1e-46, 1e-300])
def test_references_compute_tiny_sm_scale(sm_scale, gen):
    """Item 3. The float64 references compute what the kernels refuse: with all scores ~0 the
    causal softmax is uniform, so row ``i`` is the mean of ``v[0..i]``."""
    q, k, v = (randn(gen, 1, 2, 6, 16) for _ in range(3))
    uniform = v.cumsum(2) / torch.arange(1, 7, dtype=v.dtype)[:, None]
    for out in (reference.rerope_from_relative_positions(q, k, v, 2, sm_scale=sm_scale),
                reference.rerope(q, k, v, 2, sm_scale=sm_scale)):
        assert torch.allclose(out, uniform, rtol=0, atol=1e-12)


# --- 4. row offsets past 2**31 elements --------------------------------------------------------

# Run in a subprocess: with 32-bit offsets the kernels read far outside the tensors and the
# process dies (SIGSEGV under the interpreter). The inputs are views into one 4 GiB fp16 buffer
# that is never filled: only the rows the views cover are written, so the operating system maps
# a few pages (resident memory stays ~300 MB). On a GPU the same 4 GiB are really allocated.
_BIG_OFFSETS_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import rerope
    from rerope import reference
    sys.path.insert(0, "tests")
    from conftest import kernel_device, results_problems, tolerance

    op_name, device = sys.argv[1], kernel_device()
    d, span = 16, 2 ** 31 + 4096                        # elements in the buffer
    buffer = torch.empty(span, dtype=torch.float16, device=device)
    gen = torch.Generator().manual_seed(0)

    def view(shape, stride, offset):
        # a strided view into the buffer, filled with random numbers (only its rows are touched)
        t = buffer.as_strided(shape, stride, offset)
        t.copy_(torch.randn(shape, generator=gen).to(t.dtype))
        return t

    layouts = {
        # rows 2**30 + 64 elements apart: the last row of each tensor starts past 2**31
        "rows": lambda i: view((1, 1, 3, d), (3 * d, d, 2 ** 30 + 64, 1), i * d),
        # batches 2**31 + 64 elements apart (B·H offsets, not only row offsets); 6 rows, as
        # with 2 the fp16 gradients are small differences of larger terms (rounding shows)
        "batch": lambda i: view((2, 1, 6, d), (2 ** 31 + 64, 6 * d, d, 1), i * 6 * d),
    }
    for name, make in layouts.items():
        q, k, v, dout = (make(i) for i in range(4))
        # the views themselves are the leaves: the kernels get the huge strides
        if op_name == "rerope":
            inputs = [q, k, v]
            call = lambda *t: rerope.rerope(*t, 2, causal=False)
            ref_call = lambda *t: reference.rerope_from_relative_positions(*t, 2, causal=False)
        else:   # q1 = q2 = q, k1 = k2 = k: five strided views
            inputs = [q, q, k, k, v]
            call = lambda *t: rerope.rerope_attention(*t, 2, causal=False)
            ref_call = lambda *t: reference.rerope_attention(*t, 2, causal=False)
        leaves = [t.detach().requires_grad_() for t in inputs]
        assert max(t.stride(0) * (t.shape[0] - 1) + t.stride(2) * (t.shape[2] - 1)
                   for t in leaves) > 2 ** 31
        out = call(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
        ref = [t.detach().double().cpu().requires_grad_() for t in inputs]
        want = ref_call(*ref)
        want_grads = torch.autograd.grad(want, ref, dout.double().cpu())
        got = {"out": out, **{f"d{i}": g for i, g in enumerate(grads)}}
        expected = {"out": want, **{f"d{i}": g for i, g in enumerate(want_grads)}}
        problems = results_problems(got, expected, tolerance(torch.float16))
        assert not problems, name + ": " + "; ".join(problems)
        print(name, "ok")
""")


@pytest.mark.parametrize("op_name", ["rerope_attention", "rerope"])
def test_row_offsets_past_2_31_elements(op_name):
    """Item 4. Views whose rows (or batches) lie more than 2**31 elements apart: ``row ·
    stride`` must be computed in 64 bits, else the kernels read elsewhere (or crash)."""
    run = subprocess.run([sys.executable, "-c", _BIG_OFFSETS_SCRIPT, op_name], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [os.path.join(ROOT, "kernels"), ROOT])})
    assert run.returncode == 0, (
        f"exit status {run.returncode}"
        f"{' (SIGSEGV: 32-bit offsets?)' if run.returncode == -11 else ''}"
        f"\nstdout:\n{run.stdout}\nstderr:\n{run.stderr[-3000:]}")
    assert run.stdout.split() == ["rows", "ok", "batch", "ok"]


# --- 5. TMA with N = 1 and a row stride TMA cannot take ----------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 16, 1), (2, 2, 16, 1)], ids=["B1H1", "B2H2"])
def test_tma_with_one_row_and_an_unaligned_row_stride(shape, gen):
    """Item 5. ``randn(1, 1, 16, 1).permute(0, 1, 3, 2)`` is ``(1, 1, 1, 16)`` with row stride 1
    (2 bytes) and reports ``is_contiguous()``. Under ``REROPE_TMA=1`` the kernels must still
    read it right (plain loads, or a descriptor that does not use the size-1 dim's stride)."""
    with rerope.using_config(tma="on"):
        _check_one_row_permuted(shape, gen)


def _check_one_row_permuted(shape, gen):
    device = kernel_device()

    def permuted():
        base = randn(gen, *shape, dtype=F16, device=device)
        t = base.permute(0, 1, 3, 2).detach().requires_grad_()
        assert t.is_contiguous() and t.stride(2) == 1 and t.shape[2] == 1
        return t

    raw = [permuted() for _ in range(3)]
    dout = randn(gen, *raw[0].shape, dtype=F16, device=device)
    want = oracle(raw, 4, dout)
    got = rerope_results(raw, 4, dout)
    problems = results_problems(got, want, tolerance(F16))
    assert not problems, "rerope.rerope:\n" + "\n".join(problems)
    q, k, v = raw
    five = [q, q, k, k, v]          # N = 1: R(0) is the identity, and the one pair is inside
    out = rerope.rerope_attention(*five, 4)
    assert not close_problems("out", out, want["out"], tolerance(F16)), "rerope_attention"


# --- 6. huge windows ---------------------------------------------------------------------------


@pytest.mark.parametrize("leaky", [None, 4.0])
def test_huge_window_is_plain_rope(leaky, gen):
    """Item 6. ``window=10**400`` (no float can hold it) is the same as ``window = Nk``: every
    pair has ``|i - j| <= Nk - 1``. No ``OverflowError`` anywhere."""
    huge, n = 10 ** 400, 9
    raw = raw_leaves(gen, 1, 2, 1, n, 16, F32)
    q, k, v = (t.detach() for t in raw)
    assert torch.equal(relative_positions(n, huge, leaky=leaky), relative_positions(n, n))
    small = rerope_inputs(q, k, n, leaky=leaky)
    for got, want in zip(rerope_inputs(q, k, huge, leaky=leaky), small):
        assert torch.equal(got, want)
    for causal in (True, False):
        want = oracle(raw, n, leaky=leaky, causal=causal)["out"]
        for out in (reference.rerope_from_relative_positions(q, k, v, huge, causal=causal,
                                                             leaky=leaky),
                    reference.rerope(q, k, v, huge, causal=causal, leaky=leaky),
                    rerope.rerope(q, k, v, huge, causal=causal, leaky=leaky),
                    rerope.rerope_attention(*small, v, huge, causal=causal)):
            assert not close_problems("out", out, want, tolerance(F32))


def test_huge_window_with_fewer_queries(gen):
    """Item 6, ``Nq < Nk``: the huge window is clamped at ``Nk`` (not ``Nq``)."""
    raw = raw_leaves(gen, 1, 1, 1, 12, 16, F32, n_queries=5)
    want = oracle(raw, 12, causal=False)["out"]
    out = rerope.rerope(*raw, 10 ** 400, causal=False)
    assert not close_problems("out", out, want, tolerance(F32))


# --- 7. torch.compile --------------------------------------------------------------------------


@pytest.mark.parametrize("op_name, backend", [("rerope", "inductor"),
                                              ("rerope_attention", "aot_eager")])
def test_torch_compile_fullgraph(op_name, backend, gen):
    """Item 7. ``torch.compile(fullgraph=True)`` of a function calling the op (no graph break
    allowed), forward and backward: the same results and gradients as eager, and as the oracle.
    Inductor for ``rerope.rerope`` (what users get); ``aot_eager`` (tracing and fake tensors,
    no code generation: cheaper) for ``rerope.rerope_attention``."""
    import torch._dynamo

    window = 5
    raw = raw_leaves(gen, 1, 2, 1, 20, 16, F32)
    dout = randn(gen, *raw[0].shape, dtype=F32, device=raw[0].device)
    if op_name == "rerope":
        leaves = raw

        def fn(q, k, v):
            return rerope.rerope(q, k, v, window, leaky=8.0)
    else:
        leaves = five_from(raw, window)

        def fn(*five):
            return rerope.rerope_attention(*five, window)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    results = {}
    for name, f in (("eager", fn), ("compiled", compiled)):
        for t in leaves:
            t.grad = None
        out = f(*leaves)
        out.backward(dout)
        results[name] = {"out": out.detach(), **{f"d{i}": t.grad for i, t in enumerate(leaves)}}
    torch._dynamo.reset()
    problems = results_problems(results["compiled"], results["eager"], tolerance(F32))
    assert not problems, "compiled != eager:\n" + "\n".join(problems)
    if op_name == "rerope":
        want = oracle(raw, window, dout, leaky=8.0)
        got = dict(zip(want, results["compiled"].values()))
        problems = results_problems(got, want, tolerance(F32))
        assert not problems, "compiled != oracle:\n" + "\n".join(problems)


# --- 8. clear messages: the caller's argument names, TypeError for types ---------------------

# rerope.rerope validates q, k, v itself; reference.rerope validates the same way (so these
# messages are checked on the float64 oracle's path too).
RAW_OPS = [pytest.param(rerope.rerope, id="kernel"),
           pytest.param(reference.rerope, id="reference")]
INTERNAL_NAME = re.compile(r"\b[qk][12]\b")


def _zeros(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype, device=kernel_device())


def _message(op, *args, error, **kwargs):
    with pytest.raises(error) as info:
        op(*args, **kwargs)
    message = str(info.value)
    assert not INTERNAL_NAME.search(message), f"names an internal tensor: {message}"
    return message


@pytest.mark.parametrize("op", RAW_OPS)
def test_messages_name_the_callers_tensors(op):
    """Item 8. Errors about ``q, k, v`` name ``q``, ``k`` or ``v``, never ``q1 … k2``."""
    q, k, v = _zeros(1, 2, 8, 16), _zeros(1, 1, 8, 16), _zeros(1, 1, 8, 16)
    if op is rerope.rerope:   # float64 is the references' dtype, not the kernels'
        message = _message(op, q.double(), k.double(), v.double(), 4, error=TypeError)
        assert re.search(r"\bq has unsupported dtype torch.float64", message), message
    message = _message(op, q, k, v.half(), 4, error=TypeError)
    assert re.search(r"\bv has dtype torch.float16 but q has torch.float32", message), message
    message = _message(op, q, k, _zeros(1, 1, 9, 16), 4, error=ValueError)
    assert re.search(r"\bv has sequence length 9, expected 8 like k\b", message), message
    message = _message(op, q, k, _zeros(1, 2, 8, 16), 4, error=ValueError)
    assert re.search(r"\bv has 2 heads, expected 1 like k\b", message), message
    message = _message(op, q, k, _zeros(1, 1, 8, 32), 4, error=ValueError)
    assert re.search(r"\bv has head dim 32, expected 16 like q\b", message), message
    message = _message(op, q, k, "v", 4, error=TypeError)
    assert re.search(r"\bv must be a torch.Tensor", message), message
    message = _message(op, q, _zeros(1, 1, 4, 16), _zeros(1, 1, 4, 16), 4, error=ValueError)
    assert re.search(r"\bq has 8 queries but k has 4 keys", message), message


@pytest.mark.parametrize("op", RAW_OPS)
@pytest.mark.parametrize("base, error", [
    ("10000", TypeError), (None, TypeError), (True, TypeError), (torch.tensor(1e4), TypeError),
    (1.0, ValueError), (0.5, ValueError), (-1e4, ValueError), (float("inf"), ValueError),
    (float("nan"), ValueError), (10 ** 400, ValueError),
], ids=repr)
def test_base_type_and_value_errors(op, base, error):
    """Item 8. A wrongly typed ``base`` is a ``TypeError``, a wrong value a ``ValueError``."""
    q, k, v = _zeros(1, 1, 4, 16), _zeros(1, 1, 4, 16), _zeros(1, 1, 4, 16)
    message = _message(op, q, k, v, 2, base=base, error=error)
    assert message.startswith("base must be"), message


@pytest.mark.parametrize("op", RAW_OPS)
def test_logn_len_that_overflows_fp16_is_refused(op):
    """Item 8. ``logn_len=1.0001`` scales queries at position 1023 by log(1024)/log(1.0001) ≈
    6.9e4, beyond fp16's 65504: refused, naming ``logn_len`` and ``q``."""
    q, k, v = (_zeros(1, 1, 1024, 16, dtype=F16) for _ in range(3))
    message = _message(op, q, k, v, 8, logn_len=1.0001, error=ValueError)
    assert re.search(r"logn_len=1\.0001 scales the queries q by up to 6\.93e\+04", message)
    assert "float16" in message


@pytest.mark.parametrize("op", RAW_OPS)
def test_logn_len_near_overflow_warns(op, gen):
    """Item 8. ``logn_len=1.0002`` at N = 16: scale log(16)/log(1.0002) ≈ 1.4e4; fp16 query
    entries above ~4.7 overflow: a ``RuntimeWarning`` naming ``logn_len`` and ``q``, then the
    result (here finite: the entries are smaller)."""
    raw = [t.detach() / 4 for t in raw_leaves(gen, 1, 1, 1, 16, 16, F16)]
    with pytest.warns(RuntimeWarning, match=r"logn_len=1\.0002 scales the queries q by up to "
                                            r"1\.39e\+04.*entries of q above 4\.7"):
        out = op(*raw, 4, logn_len=1.0002)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_logn_len_near_one_is_fine_in_wide_dtypes(dtype, gen):
    """Item 8. fp32/bf16 hold any such scale (1.4e4 here): no warning, a finite result, and in
    fp32 the oracle's (bf16 rounds scores of ~1e4 by ~1e2: another key may win the argmax)."""
    raw = raw_leaves(gen, 1, 1, 1, 16, 16, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = rerope.rerope(*raw, 4, logn_len=1.0002)
    assert torch.isfinite(out).all()
    if dtype == F32:
        want = oracle(raw, 4, logn_len=1.0002)["out"]
        assert not close_problems("out", out, want, tolerance(dtype))


def test_check_logn_overflow_semantics():
    """Item 8. The helper the ops call: the largest scale ``max(1, log(Nk)/log(logn_len))``;
    ``ValueError`` beyond ``finfo(dtype).max``; ``RuntimeWarning`` beyond ``finfo.max / 16``."""
    assert check_logn_overflow(None, 4096, F16) == 1.0
    assert check_logn_overflow(4096, 100, F16) == 1.0                      # below L: no scaling
    assert check_logn_overflow(2, 4096, F16) == pytest.approx(12.0)        # log2(4096)
    assert check_logn_overflow(1.0001, 4096, F32) == pytest.approx(
        math.log(4096) / math.log(1.0001))
    with pytest.raises(ValueError, match=r"logn_len=1\.0001 .*queries k "):
        check_logn_overflow(1.0001, 4096, F16, name="k")
    with pytest.warns(RuntimeWarning, match=r"logn_len=1\.001 "):
        check_logn_overflow(1.001, 4096, F16)                              # 8.3e3 · 16 > 65504
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert check_logn_overflow(1.01, 4096, F16) < 65504 / 16           # 836: quiet
        check_logn_overflow(1.0 + 1e-15, 2 ** 40, F32)                     # 2.5e16: fits fp32


# --- 9. future keys in the non-causal case (documented in rerope.rerope and chapter 1) -------


@pytest.mark.parametrize("leaky", [None, 3.0])
def test_future_keys_positions(leaky, gen):
    """Item 9. Non-causal ReRoPE gives a key ``d >= w`` tokens *ahead* the position ``+w``, the
    same as the far past; Leaky ReRoPE gives it ``w + (-d - w) / κ``, which is 0 at ``d = w(κ-1)``
    (``κ = 2``: the key at ``i + w``) and negative beyond. The kernels do the same."""
    n, window, i = 24, 4, 3
    rel = relative_positions(n, window, leaky=leaky)
    for dist in range(window, n - i):
        want = window if leaky is None else window + (-dist - window) / leaky
        assert rel[i, i + dist].item() == pytest.approx(want)
    if leaky is None:
        assert rel[i, i + window].item() == rel[n - 1, 0].item() == window   # future = far past
    else:
        assert rel[i, i + int(window * (leaky - 1))].item() == pytest.approx(0.0)
    raw = raw_leaves(gen, 1, 1, 1, n, 16, F32)
    out = rerope.rerope(*raw, window, causal=False, leaky=leaky)
    assert not close_problems("out", out, oracle(raw, window, causal=False, leaky=leaky)["out"],
                              tolerance(F32))


# --- keep it so: the rounding of the five tensors under sharp softmaxes ------------------------

# With the five-tensor preprocessing (q1 = R(i) q … rounded to the input dtype BEFORE the
# kernel), gradients under a sharp softmax are off by much more than the kernel's own error:
# the rounded q1·k1 and q2·k2 no longer belong to one (q, k). Measured 2026-12-01 on CPU
# (interpreter), B=1 H=1 D=256, seed 0, max|err| / max|ref| of the worst of dq, dk against the
# float64 oracle on the same rounded q, k, v:
#
#   path                               dtype  default scale  sm_scale 1  sm_scale 2  sm_scale 4
#   five tensors (rerope_inputs +      bf16   4.8e-3         2.0e-2      9.7e-2      1.25e-1
#     rerope_attention)                fp16   7.0e-4         4.5e-3      1.2e-2      6.9e-3
#   rerope.rerope, fused rotation     bf16   3.1e-3         2.9e-3      3.5e-3      2.8e-3
#                                      fp16   4.4e-4         4.3e-3      1.2e-2      6.9e-3
#
# (N=64 window 16 for the default scale and 2, 4; N=32 window 8 for 1.) The kernel alone on the
# rounded five tensors, against the five-tensor float64 reference, stays within 3.5e-3 (bf16)
# and 3.2e-3 (fp16). So the fused rotation removes the five tensors' rounding where the rotated
# tiles stay in fp32 (bf16 here: the interpreter computes bf16 in fp32), but NOT for fp16, whose
# rotated tiles are rounded to fp16 again for tl.dot: the same rounding, in registers. On a GPU
# expect bf16 to behave like fp16 here (its rotated tiles are rounded to bf16 for tl.dot too).
# The test below keeps the fused path no worse than the five-tensor path at sm_scale 4, and
# within the tolerance table at the default scale; `pytest -s` prints the ROUNDING numbers.


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_rounding_of_rotated_operands_under_sharp_softmax(dtype, gen):
    """D=256. Default scale: ``rerope.rerope`` within the tolerance table. ``sm_scale=4`` (a
    very sharp softmax): its worst gradient error at most 1.5x that of the five-tensor path
    (rounded ``q1 … k2``), both measured against the float64 oracle (numbers above)."""
    n, d, window = 32, 256, 8
    raw = raw_leaves(gen, 1, 1, 1, n, d, dtype)
    dout = randn(gen, 1, 1, n, d, dtype=dtype, device=raw[0].device)
    problems = results_problems(rerope_results(raw, window, dout), oracle(raw, window, dout),
                                tolerance(dtype))
    assert not problems, "default sm_scale, D=256:\n" + "\n".join(problems)

    sm_scale, names = 4.0, ("dq", "dk", "dv")
    want = oracle(raw, window, dout, sm_scale=sm_scale)
    got = rerope_results(raw, window, dout, sm_scale=sm_scale)
    fused = max(error_stats(got[name], want[name])["scaled"] for name in names)
    five = five_from(raw, window)
    grads = torch.autograd.grad(rerope.rerope_attention(*five, window, sm_scale=sm_scale),
                                five, dout)
    # chain the five gradients back to q, k, v through the (float64) preprocessing
    leaves = [t.detach().double().cpu().requires_grad_() for t in raw]
    rebuilt = (*rerope_inputs(leaves[0], leaves[1], window), leaves[2])
    chained = torch.autograd.grad(rebuilt, leaves, [g.double().cpu() for g in grads])
    five_path = max(error_stats(g, want[name])["scaled"] for g, name in zip(chained, names))
    print(f"ROUNDING {dtype} sm_scale={sm_scale}: rerope.rerope {fused:.3g}, "
          f"five-tensor path {five_path:.3g}")
    assert fused <= 1.5 * five_path, (
        f"fused rotation worse than rounding the five tensors: {fused:.3g} > 1.5 · "
        f"{five_path:.3g}")


# --- issue 24: an empty batch, and decode asked for gradients ----------------------------------


@pytest.mark.parametrize("batch, heads", [(0, 2), (2, 0)], ids=["B0", "Hq0"])
def test_empty_batch_gives_an_empty_output(batch, heads, gen):
    """``B = 0`` (or no query head) used to raise ZeroDivisionError in ``rerope_decode`` and in
    ``rerope.rerope``'s short no-grad calls (the splits rule divided by the program count).
    Every op returns an empty output; the training ops empty gradients."""
    device = kernel_device()
    q = randn(gen, batch, heads, 5, 16, dtype=F32, device=device)
    k, v = (randn(gen, batch, 1, 5, 16, dtype=F32, device=device) for _ in range(2))
    with torch.no_grad():
        for rotated in (False, True):
            outs = [rerope.rerope_decode(q[:, :, -1:], k, v, 3, rotated=rotated),
                    rerope.rerope_decode(q[:, :, -2:], k, v, 3, rotated=rotated, num_splits=4,
                                         cache_seqlens=torch.full((batch,), 5, dtype=torch.int32)),
                    rerope.rerope(q, k, v, 3, rotated=rotated)]
            for out, n in zip(outs, (1, 2, 5)):
                assert out.shape == (batch, heads, n, 16) and out.dtype == q.dtype
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for op in (lambda q, k, v: rerope.rerope(q, k, v, 3, rotated=True),
               lambda q, k, v: rerope.rerope_attention(q, q, k, k, v, 3)):
        out = op(*leaves)
        assert out.shape == q.shape
        grads = torch.autograd.grad(out.sum(), leaves)
        assert [g.shape for g in grads] == [t.shape for t in leaves]


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
def test_decode_refuses_inputs_that_want_gradients(name, gen):
    """``rerope_decode`` has no backward: with grad mode on, an input that requires grad used to
    give an output cut from the graph (no error, no gradient). Now: a clear error naming the
    input; under ``torch.no_grad()`` the same call runs."""
    device = kernel_device()
    tensors = {"q": randn(gen, 1, 2, 1, 16, dtype=F32, device=device),
               "k_cache": randn(gen, 1, 1, 9, 16, dtype=F32, device=device),
               "v_cache": randn(gen, 1, 1, 9, 16, dtype=F32, device=device)}
    tensors[name].requires_grad_()
    with pytest.raises(ValueError, match=f"{name} requires grad, but rerope_decode is "
                                         "forward-only.*use rerope.rerope for gradients"):
        rerope.rerope_decode(tensors["q"], tensors["k_cache"], tensors["v_cache"], 4)
    with torch.no_grad():
        out = rerope.rerope_decode(tensors["q"], tensors["k_cache"], tensors["v_cache"], 4)
    want = reference.rerope_from_relative_positions(
        *(t.detach().double() for t in tensors.values()), 4, rotated=True)
    assert not results_problems({"out": out}, {"out": want}, tolerance(F32))
    # rerope.rerope with grad mode on takes the differentiable path and gives gradients
    out = rerope.rerope(tensors["q"], tensors["k_cache"], tensors["v_cache"], 4, rotated=True)
    assert out.requires_grad
    out.sum().backward()
    assert tensors[name].grad is not None
