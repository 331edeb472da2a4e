"""The two references agree, and the kernel agrees with the independent one.

:func:`rerope.reference.rerope` builds the five tensors and runs the naive two-matrix method;
:func:`rerope.reference.rerope_from_relative_positions` never builds them: each score comes
straight from ReRoPE's relative position. Equal in float64 means the five-tensor form (and so
everything the kernel is fed) is right; the kernel is then checked against the second oracle too.
"""

import pytest
import torch
import torch.nn.functional as F

import rerope
from rerope_testing import describe, kernel_device, randn, results_problems, tolerance
from rerope import reference, rope

F64 = torch.float64

# (causal, hq, hkv, window, leaky, logn_len)
SETTINGS = [
    (True, 1, 1, 5, None, None),
    (False, 1, 1, 5, None, None),
    (True, 4, 2, 1, None, None),
    (False, 4, 1, 9, None, None),
    (True, 2, 2, 30, None, None),            # window >= N
    (True, 2, 1, 6, 4.0, None),
    (False, 2, 2, 6, 16.0, None),
    (True, 2, 2, 6, None, 8),
    (False, 4, 2, 3, 2.0, 4),
    (True, 1, 1, 1, 16.0, 2),
]


def ids(setting):
    causal, hq, hkv, window, leaky, logn_len = setting
    return (f"{'causal' if causal else 'full'}-H{hq}kv{hkv}-w{window}"
            f"{f'-leaky{leaky:g}' if leaky else ''}{f'-logn{logn_len}' if logn_len else ''}")


def raw_inputs(gen, batch, hq, hkv, n, d, dtype=F64, device="cpu"):
    return [randn(gen, batch, h, n, d, dtype=dtype, device=device).requires_grad_()
            for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("setting", SETTINGS, ids=ids)
def test_five_tensor_reference_equals_relative_position_oracle(setting, gen):
    causal, hq, hkv, window, leaky, logn_len = setting
    q, k, v = raw_inputs(gen, 2, hq, hkv, 23, 16)
    kwargs = dict(causal=causal, leaky=leaky, logn_len=logn_len)
    five = reference.rerope(q, k, v, window, **kwargs)
    oracle_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oracle = reference.rerope_from_relative_positions(*oracle_inputs, window, **kwargs)
    assert five.dtype == oracle.dtype == F64
    assert torch.allclose(five, oracle, rtol=1e-10, atol=1e-12)
    dout = torch.randn(five.shape, generator=gen, dtype=F64)
    five.backward(dout)
    oracle.backward(dout)
    for name, a, b in zip("qkv", (q, k, v), oracle_inputs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-11), name


def test_explicit_sm_scale_and_base(gen):
    q, k, v = raw_inputs(gen, 1, 2, 2, 19, 32)
    kwargs = dict(sm_scale=0.7, base=500.0)
    assert torch.allclose(reference.rerope(q, k, v, 4, **kwargs),
                          reference.rerope_from_relative_positions(q, k, v, 4, **kwargs),
                          rtol=1e-10, atol=1e-12)
    # and the scale really is used: 0.7 differs from the default 1/sqrt(32)
    assert not torch.allclose(reference.rerope(q, k, v, 4, base=500.0),
                              reference.rerope(q, k, v, 4, **kwargs))


@pytest.mark.parametrize("causal", [True, False])
def test_window_at_least_n_is_plain_rope_attention(causal, gen):
    """Against torch's own attention: with ``w >= N`` ReRoPE is ordinary RoPE attention."""
    n = 21
    q, k, v = raw_inputs(gen, 2, 4, 2, n, 16)
    q1, k1 = rope.apply_rope(q, torch.arange(n)), rope.apply_rope(k, torch.arange(n))
    want = F.scaled_dot_product_attention(q1, k1.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          is_causal=causal)
    for window in (n, 10 * n):
        assert torch.allclose(reference.rerope(q, k, v, window, causal=causal), want, atol=1e-12)
        oracle = reference.rerope_from_relative_positions(q, k, v, window, causal=causal)
        assert torch.allclose(oracle, want, atol=1e-12)


def test_rerope_attention_selects_by_distance(gen):
    """The five-tensor reference uses q1·k1 exactly where |i - j| < w: built by hand here."""
    n, d, window = 9, 16, 3
    q1, q2, k1, k2, v = (torch.randn(1, 1, n, d, generator=gen, dtype=F64) for _ in range(5))
    scores = torch.empty(n, n, dtype=F64)
    for i in range(n):
        for j in range(n):
            pair = (q1, k1) if abs(i - j) < window else (q2, k2)
            scores[i, j] = pair[0][0, 0, i] @ pair[1][0, 0, j] / d ** 0.5
    for causal in (True, False):
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        s = scores.masked_fill(future, float("-inf")) if causal else scores
        want = torch.softmax(s, -1) @ v[0, 0]
        got = reference.rerope_attention(q1, q2, k1, k2, v, window, causal=causal)
        assert torch.allclose(got[0, 0], want, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_keeps_dtype_and_softmax_precision(dtype, gen):
    q, k, v = raw_inputs(gen, 1, 2, 1, 17, 16, dtype=dtype)
    out = reference.rerope(q, k, v, 4)
    assert out.dtype == dtype
    want = reference.rerope(q.double(), k.double(), v.double(), 4)
    assert (out.double() - want).abs().max() < 20 * torch.finfo(dtype).eps
    oracle = reference.rerope_from_relative_positions(q, k, v, 4)
    assert oracle.dtype == dtype


# --- the kernel against the independent oracle ------------------------------------------------


@pytest.mark.parametrize("setting", [
    (True, 1, 1, 5, None, None),
    (False, 2, 1, 9, None, None),
    (True, 2, 1, 6, 4.0, None),
    (False, 2, 2, 3, 2.0, 4),
], ids=ids)
def test_kernel_matches_relative_position_oracle(setting, gen):
    """``rerope.rerope`` (fp32, the fused kernel) against the float64 relative-position oracle:
    output and the gradients of raw ``q, k, v``."""
    causal, hq, hkv, window, leaky, logn_len = setting
    q, k, v = raw_inputs(gen, 1, hq, hkv, 45, 32, dtype=torch.float32, device=kernel_device())
    kwargs = dict(causal=causal, leaky=leaky, logn_len=logn_len)
    out = rerope.rerope(q, k, v, window, **kwargs)
    dout = randn(gen, *out.shape, device=out.device)
    out.backward(dout.float())
    oracle_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference.rerope_from_relative_positions(*oracle_inputs, window, **kwargs)
    want.backward(dout)
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    want = {"out": want, **{name: t.grad for name, t in zip(("dq", "dk", "dv"), oracle_inputs)}}
    problems = results_problems(got, want, tolerance(torch.float32))
    assert not problems, describe(gen, setting=ids(setting)) + "\n" + "\n".join(problems)
