"""RoPE, ReRoPE and Leaky ReRoPE helpers of :mod:`rerope.rope` (pure torch, float64)."""

import math

import pytest
import torch

from rerope import rope

F64 = torch.float64


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def rotate_complex(x, positions, base=10000.0):
    """An independent RoPE: halves ``[a, b]`` as complex ``a + ib``, times ``exp(i p θ_t)``."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=F64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    z = z * torch.polar(torch.ones_like(theta), positions.to(F64)[:, None] * theta)
    return torch.cat((z.real, z.imag), dim=-1)


def test_rotate_half_maps_halves():
    x = torch.arange(6, dtype=F64)                     # a = [0, 1, 2], b = [3, 4, 5]
    assert rope.rotate_half(x).tolist() == [-3, -4, -5, 0, 1, 2]
    assert torch.equal(rope.rotate_half(rope.rotate_half(x)), -x)


def test_frequencies():
    theta = rope.rope_frequencies(8, base=100.0)
    assert theta.dtype == F64 and theta.shape == (4,)
    assert torch.allclose(theta, torch.tensor([100.0 ** (-2 * t / 8) for t in range(4)], dtype=F64))


@pytest.mark.parametrize("d", [2, 16, 64, 128])
def test_apply_rope_is_the_complex_rotation(d, gen):
    x = randn(gen, 2, 3, 11, d)
    positions = torch.arange(11, dtype=F64) * 7.5 - 20       # negative and fractional too
    assert torch.allclose(rope.apply_rope(x, positions), rotate_complex(x, positions),
                          rtol=1e-12, atol=1e-12)
    assert torch.allclose(rope.apply_rope(x, positions, base=500.0),
                          rotate_complex(x, positions, base=500.0), rtol=1e-12, atol=1e-12)


def test_rotation_preserves_norms(gen):
    x = randn(gen, 1, 2, 50, 64)
    positions = torch.rand(50, generator=gen, dtype=F64) * 1e4
    rotated = rope.apply_rope(x, positions)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-12)


def test_position_zero_is_identity_and_rotations_compose(gen):
    x = randn(gen, 1, 1, 5, 32)
    assert torch.allclose(rope.apply_rope(x, torch.zeros(5, dtype=F64)), x, atol=0, rtol=0)
    p, s = torch.tensor([3.0, 10.0, 0.5, 99.0, 7.0], dtype=F64), torch.arange(5, dtype=F64) * 4
    assert torch.allclose(rope.apply_rope(rope.apply_rope(x, p), s), rope.apply_rope(x, p + s),
                          atol=1e-12)
    # R(-p) undoes R(p): a cache of rotated keys is as good as raw keys
    assert torch.allclose(rope.apply_rope(rope.apply_rope(x, p), -p), x, atol=1e-12)


def test_score_depends_only_on_relative_position(gen):
    d = 32
    q, k = randn(gen, d), randn(gen, d)

    def score(p, s):
        return (rope.apply_rope(q[None], torch.tensor([p], dtype=F64))
                @ rope.apply_rope(k[None], torch.tensor([s], dtype=F64)).T).item()

    for offset in (0, 1, 5, 100, -3):
        scores = [score(p, p - offset) for p in (offset + 0.0, 17.0, 1000.0, 4096.0 + offset)]
        assert max(scores) - min(scores) < 1e-9 * max(1.0, abs(scores[0])), (offset, scores)
    # …and the relative position matters
    assert abs(score(10, 0) - score(10, 1)) > 1e-3


def test_score_formula_per_frequency(gen):
    """The notes' formula: Σ_t (a c + b d) cos(r θ_t) + (a d − b c) sin(r θ_t)."""
    d, r = 16, 37.0
    q, k = randn(gen, d), randn(gen, d)
    a, b, c, e = q[: d // 2], q[d // 2:], k[: d // 2], k[d // 2:]
    theta = rope.rope_frequencies(d)
    formula = ((a * c + b * e) * torch.cos(r * theta)
               + (a * e - b * c) * torch.sin(r * theta)).sum()
    direct = rope.apply_rope(q[None], torch.tensor([r], dtype=F64)) @ k
    assert torch.allclose(direct, formula, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_is_rounded_once(dtype, gen):
    x = randn(gen, 1, 1, 20, 64)
    positions = torch.arange(20, dtype=F64) * 300
    got = rope.apply_rope(x.to(dtype), positions)
    assert got.dtype == dtype
    want = rope.apply_rope(x.to(dtype).to(F64), positions)
    # one rounding to dtype (half an ulp), on top of the float32 arithmetic
    eps, compute_eps = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    bound = eps / 2 * want.abs() + 4 * compute_eps * x.abs().max()
    assert ((got.to(F64) - want).abs() <= bound).all()


def test_logn_scale():
    scale = rope.logn_scale(20, 4)
    assert scale.dtype == F64 and scale.shape == (20,)
    assert torch.equal(scale[:4], torch.ones(4, dtype=F64))          # log(i+1) <= log(4)
    assert scale[15].item() == pytest.approx(2.0)                     # log(16) / log(4)
    assert scale[19].item() == pytest.approx(math.log(20) / math.log(4))
    assert torch.equal(rope.logn_scale(100, 4096), torch.ones(100, dtype=F64))


# --- the five tensors ----------------------------------------------------------------------


def positions(n):
    return torch.arange(n, dtype=F64)


@pytest.mark.parametrize("window", [1, 7, 1000, 10 ** 400])
def test_rerope_inputs(window, gen):
    q, k = randn(gen, 2, 4, 30, 32), randn(gen, 2, 2, 30, 32)
    q1, q2, k1, k2 = rope.rerope_inputs(q, k, window)
    assert torch.allclose(q1, rope.apply_rope(q, positions(30)), atol=0, rtol=0)
    assert torch.allclose(k1, rope.apply_rope(k, positions(30)), atol=0, rtol=0)
    # a window >= N (every |i - j| <= 29) is taken as N: q2 is never read then
    at = float(min(window, 30))
    assert torch.allclose(q2, rotate_complex(q, torch.full((30,), at)), atol=1e-12)
    assert torch.equal(k2, k)                                        # keys unrotated outside


@pytest.mark.parametrize("leaky", [2.0, 16.0])
def test_leaky_rerope_inputs(leaky, gen):
    window, n = 5, 30
    q, k = randn(gen, 1, 2, n, 16), randn(gen, 1, 2, n, 16)
    q1, q2, k1, k2 = rope.rerope_inputs(q, k, window, leaky=leaky)
    assert torch.allclose(q1, rotate_complex(q, positions(n)), atol=1e-12)
    assert torch.allclose(k2, rotate_complex(k, positions(n) / leaky), atol=1e-12)
    assert torch.allclose(q2, rotate_complex(q, (positions(n) + window * (leaky - 1)) / leaky),
                          atol=1e-12)


def test_logn_inputs_scale_queries_before_rotation(gen):
    n, train_len = 40, 8
    q, k = randn(gen, 1, 1, n, 16), randn(gen, 1, 1, n, 16)
    q1, q2, k1, k2 = rope.rerope_inputs(q, k, 6, logn_len=train_len)
    scaled = q * rope.logn_scale(n, train_len)[:, None]
    assert torch.allclose(q1, rotate_complex(scaled, positions(n)), atol=1e-12)
    assert torch.allclose(q2, rotate_complex(scaled, torch.full((n,), 6.0)), atol=1e-12)
    assert torch.equal(k1, rope.apply_rope(k, positions(n))) and torch.equal(k2, k)


@pytest.mark.parametrize("leaky", [None, 4.0])
def test_rerope_inputs_gradients_match_the_complex_rotation(leaky, gen):
    # d(loss)/dq and d(loss)/dk through rerope_inputs against float64 autograd of the
    # independent construction (log-n scale, then the complex rotation at each position)
    n, window, train_len = 9, 3, 2
    q, k = randn(gen, 1, 2, n, 16), randn(gen, 1, 1, n, 16)
    weights = [randn(gen, *t.shape) for t in (q, q, k, k)]   # a loss that sees every entry

    def loss(parts):
        return sum((w * part).sum() for w, part in zip(weights, parts))

    def by_hand(q, k):
        scaled = q * rope.logn_scale(n, train_len)[:, None]
        if leaky is None:
            far_q, far_k = torch.full((n,), float(window)), torch.zeros(n)
        else:
            far_q, far_k = (positions(n) + window * (leaky - 1)) / leaky, positions(n) / leaky
        return (rotate_complex(scaled, positions(n)), rotate_complex(scaled, far_q),
                rotate_complex(k, positions(n)), rotate_complex(k, far_k))

    grads = {}
    for name, build in (("rope", lambda q, k: rope.rerope_inputs(
            q, k, window, leaky=leaky, logn_len=train_len)), ("by hand", by_hand)):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        grads[name] = torch.autograd.grad(loss(build(*leaves)), leaves)
    for got, want in zip(grads["rope"], grads["by hand"]):
        assert got.dtype == F64 and got.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --- relative positions ---------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 4, 9])
def test_relative_positions_at_the_window_boundary(window):
    n = 20
    rel = rope.relative_positions(n, window)
    i = 15
    assert rel[i, i].item() == 0
    assert rel[i, i - (window - 1)].item() == window - 1              # last pair inside
    assert rel[i, i - window].item() == window                        # first pair outside
    assert rel[i, 0].item() == window                                 # clamped at w
    assert rel[2, 2 + window - 1].item() == -(window - 1)             # inside, key ahead
    assert rel[2, 2 + window].item() == window                        # outside, key ahead
    assert rel[0, n - 1].item() == window                  # q2·k2: position w, both directions


@pytest.mark.parametrize("leaky", [2.0, 16.0])
def test_leaky_relative_positions(leaky):
    window, n = 4, 40
    rel = rope.relative_positions(n, window, leaky=leaky)
    i = 30
    assert rel[i, i - (window - 1)].item() == window - 1
    assert rel[i, i - window].item() == window                       # continuous at the boundary
    assert rel[i, i - window - int(leaky)].item() == pytest.approx(window + 1)   # slope 1/leaky
    assert rel[i, 0].item() == pytest.approx(window + (i - window) / leaky)
    # keys ahead (non-causal): what q2 · k2 of the five-tensor form gives
    assert rel[0, 20].item() == pytest.approx(window + (-20 - window) / leaky)


def test_relative_positions_window_at_least_n_is_plain_rope():
    idx = torch.arange(12, dtype=F64)
    plain = idx[:, None] - idx[None, :]
    assert torch.equal(rope.relative_positions(12, 12), plain)
    assert torch.equal(rope.relative_positions(12, 500, leaky=3.0), plain)
    assert torch.equal(rope.relative_positions(12, 10 ** 400), plain)   # no float holds it
    assert torch.equal(rope.relative_positions(4, 10 ** 400, n_keys=12), plain[8:])


@pytest.mark.parametrize("leaky", [None, 8.0])
def test_five_tensor_scores_are_relative_position_scores(leaky, gen):
    """Selecting ``q1·k1`` inside the window and ``q2·k2`` outside gives, for every pair, the
    RoPE score at ReRoPE's relative position (``relative_positions``)."""
    n, d, window = 24, 16, 5
    q, k = randn(gen, 1, 1, n, d), randn(gen, 1, 1, n, d)
    q1, q2, k1, k2 = rope.rerope_inputs(q, k, window, leaky=leaky)
    idx = torch.arange(n)
    inside = (idx[:, None] - idx[None, :]).abs() < window
    five = torch.where(inside, q1[0, 0] @ k1[0, 0].T, q2[0, 0] @ k2[0, 0].T)
    rel = rope.relative_positions(n, window, leaky=leaky)
    direct = torch.empty(n, n, dtype=F64)
    for i in range(n):
        # rotate q_i by each pair's relative position, score against the raw keys
        direct[i] = (rotate_complex(q[0, 0, i].expand(n, d), rel[i]) * k[0, 0]).sum(-1)
    assert torch.allclose(five, direct, atol=1e-10)
