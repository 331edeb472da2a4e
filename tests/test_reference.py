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


# --- what the references compute; Self-Extend against the paper's two-attention form ---------


@pytest.mark.parametrize("sm_scale", [1e-46, 1e-300])
def test_references_compute_tiny_sm_scale(sm_scale, gen):
    """Item 3. The float64 references compute what the kernels refuse: with all scores ~0 the
    causal softmax is uniform, so row ``i`` is the mean of ``v[0..i]``."""
    q, k, v = (randn(gen, 1, 2, 6, 16) for _ in range(3))
    uniform = v.cumsum(2) / torch.arange(1, 7, dtype=v.dtype)[:, None]
    for out in (reference.rerope_from_relative_positions(q, k, v, 2, sm_scale=sm_scale),
                reference.rerope(q, k, v, 2, sm_scale=sm_scale)):
        assert torch.allclose(out, uniform, rtol=0, atol=1e-12)


def _rope64(x, positions, base=10000.0):
    """RoPE in float64 written out (halves convention), for the independent construction."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * theta[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def two_attention_self_extend(q, k, v, window, group):
    """The authors' form: neighbour attention with RoPE at ``i, j``, grouped attention with RoPE
    at ``⌊i/G⌋ + w - w/G`` and ``⌊j/G⌋``, scores merged by the window mask, causal softmax."""
    n_q, n_k, d = q.shape[2], k.shape[2], q.shape[-1]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    qpos = torch.arange(n_k - n_q, n_k)
    kpos = torch.arange(n_k)
    near = _rope64(q, qpos) @ _rope64(k, kpos).transpose(-1, -2)
    far = (_rope64(q, qpos // group + window - window // group)
           @ _rope64(k, kpos // group).transpose(-1, -2))
    dist = qpos[:, None] - kpos[None, :]
    scores = torch.where(dist < window, near, far) * d ** -0.5
    scores = scores.masked_fill(dist < 0, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("n_q, n_k, window, group, hq, hkv", [
    (24, 24, 6, 3, 2, 1), (7, 30, 8, 4, 2, 2), (24, 24, 30, 2, 1, 1)])
def test_oracles_match_the_two_attention_form(n_q, n_k, window, group, hq, hkv, gen):
    q = randn(gen, 2, hq, n_q, 16)
    k, v = randn(gen, 2, hkv, n_k, 16), randn(gen, 2, hkv, n_k, 16)
    want = two_attention_self_extend(q, k, v, window, group)
    for oracle in (reference.rerope, reference.rerope_from_relative_positions):
        got = oracle(q, k, v, window, group=group)
        assert (got - want).abs().max() < 1e-12, oracle.__name__
    # rotated inputs: rotated back first, the same result
    qpos = torch.arange(n_k - n_q, n_k, dtype=torch.float64)
    kpos = torch.arange(n_k, dtype=torch.float64)
    got = reference.rerope_from_relative_positions(
        rope.apply_rope(q, qpos), rope.apply_rope(k, kpos), v, window, group=group, rotated=True)
    assert (got - want).abs().max() < 1e-12


def test_group_one_and_long_windows_are_plain_rope(gen):
    q, k, v = (randn(gen, 1, 2, 20, 16) for _ in range(3))
    plain = reference.rerope_from_relative_positions(q, k, v, 20)      # w >= N: RoPE
    for window, group in ((4, 1), (7, 1), (24, 8), (40, 4)):
        got = reference.rerope_from_relative_positions(q, k, v, window, group=group)
        assert (got - plain).abs().max() < 1e-12, (window, group)
    # and a real group with a short window is not RoPE
    grouped = reference.rerope_from_relative_positions(q, k, v, 4, group=2)
    assert (grouped - plain).abs().max() > 1e-3
