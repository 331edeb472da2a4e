"""RoPE, ReRoPE and Leaky ReRoPE helpers of :mod:`rerope.rope` (pure torch, float64).

Also RoPE frequencies given as a vector (``inv_freq=``, a model's scaled RoPE: ``linear``,
``llama3``, YaRN) through every op against the float64 oracles (the kernels in Triton's
interpreter on CPU), and Self-Extend's relative positions against the paper's definition.
"""

import math

import pytest
import torch

import rerope
from rerope import reference, rope
from rerope._validate import as_frequencies
from rerope_testing import kernel_device, randn, results_problems, tolerance

F64 = torch.float64


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


# --- RoPE frequencies given as a vector (inv_freq=), through every op ------------------------


F32, F64 = torch.float32, torch.float64


def scaled_frequencies(gen, head_dim):
    """A frequency vector unlike any base's: ``θ_t`` of base 10⁴, each scaled by a random factor
    in [0.1, 1] (as ``llama3`` / YaRN / ``linear`` scale them), float64."""
    factors = 0.1 + 0.9 * torch.rand(head_dim // 2, generator=gen, dtype=F64)
    return rope.rope_frequencies(head_dim) * factors


def leaves(gen, b, hq, hkv, n_q, n_k, d, dtype=F32):
    device = kernel_device()
    return [randn(gen, *shape, dtype=dtype, device=device).requires_grad_()
            for shape in ((b, hq, n_q, d), (b, hkv, n_k, d), (b, hkv, n_k, d))]


def oracle(raw, window, **kwargs):
    """float64 relative-position oracle: ``out`` and ``dq, dk, dv`` for ``dout``."""
    *tensors, dout = raw
    copies = [t.detach().to("cpu", F64).requires_grad_() for t in tensors]
    out = reference.rerope_from_relative_positions(*copies, window, **kwargs)
    out.backward(dout.to("cpu", F64))
    return {"out": out.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), copies)}}


CASES = [  # (batch, Hq, Hkv, Nq, Nk, D, window, leaky, rotated)
    (1, 2, 1, 19, 19, 32, 5, None, True),
    (2, 2, 2, 17, 17, 16, 1, 3.0, False),
    (1, 4, 2, 7, 23, 32, 6, None, False),       # Nq < Nk (a prefill chunk), GQA
    (1, 2, 1, 13, 13, 64, 13, 4.0, True),       # window = N: plain RoPE
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_rerope_with_inv_freq_matches_the_oracle(case, gen):
    b, hq, hkv, n_q, n_k, d, window, leaky, rotated = case
    freqs = scaled_frequencies(gen, d)
    q, k, v = leaves(gen, b, hq, hkv, n_q, n_k, d)
    dout = randn(gen, b, hq, n_q, d, dtype=F32, device=q.device)
    out = rerope.rerope(q, k, v, window, leaky=leaky, rotated=rotated, inv_freq=freqs)
    out.backward(dout)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    want = oracle((q, k, v, dout), window, leaky=leaky, rotated=rotated, inv_freq=freqs)
    assert not results_problems(got, want, tolerance(F32))
    default = reference.rerope_from_relative_positions(
        *(t.detach().double() for t in (q, k, v)), window, leaky=leaky, rotated=rotated)
    if window < n_k:      # the frequencies matter: the base's give another result
        assert (default - want["out"]).abs().max() > 1e-2


@pytest.mark.parametrize("n_q, n_k, window, leaky, rotated", [
    (1, 37, 6, None, True), (3, 40, 9, 2.0, True), (2, 33, 4, None, False)])
def test_decode_with_inv_freq_matches_the_oracle(n_q, n_k, window, leaky, rotated, gen):
    d = 32
    freqs = scaled_frequencies(gen, d)
    q, k, v = (t.detach() for t in leaves(gen, 2, 4, 2, n_q, n_k, d))
    want = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), window,
                                                    leaky=leaky, rotated=rotated, inv_freq=freqs)
    for num_splits in (None, 3):
        out = rerope.rerope_decode(q, k, v, window, leaky=leaky, rotated=rotated,
                                   inv_freq=freqs, num_splits=num_splits)
        assert not results_problems({"out": out}, {"out": want}, tolerance(F32))
    with torch.no_grad():          # rerope.rerope routes short no-grad calls to decoding
        routed = rerope.rerope(q, k, v, window, leaky=leaky, rotated=rotated, inv_freq=freqs)
    assert not results_problems({"out": routed}, {"out": want}, tolerance(F32))


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("leaky", [None, 3.0])
def test_the_two_references_agree_with_inv_freq(rotated, leaky, gen):
    d, window = 16, 4
    freqs = scaled_frequencies(gen, d)
    q, k, v = (randn(gen, 1, 2, n, d) for n in (9, 12, 12))
    five = reference.rerope(q, k, v, window, leaky=leaky, rotated=rotated, inv_freq=freqs)
    direct = reference.rerope_from_relative_positions(q, k, v, window, leaky=leaky,
                                                      rotated=rotated, inv_freq=freqs)
    assert torch.allclose(five, direct, rtol=1e-10, atol=1e-12)


def test_apply_rope_rotates_by_the_given_frequencies(gen):
    d = 16
    freqs = scaled_frequencies(gen, d)
    x = randn(gen, 2, 3, 11, d)
    positions = torch.arange(11, dtype=F64) * 3.5 - 7
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    z = z * torch.polar(torch.ones_like(freqs), positions[:, None] * freqs)
    expected = torch.cat((z.real, z.imag), dim=-1)
    assert torch.allclose(rope.apply_rope(x, positions, inv_freq=freqs), expected,
                          rtol=1e-12, atol=1e-12)
    assert torch.equal(rope.frequencies(d, inv_freq=freqs), freqs)
    assert torch.equal(rope.frequencies(d, base=500.0), rope.rope_frequencies(d, 500.0))


def test_default_frequencies_as_a_vector_give_the_base_result(gen):
    """``inv_freq = base ** (-2t/D)`` is ``base``: the kernels build the same tables."""
    d, window = 32, 5
    q, k, v = (t.detach() for t in leaves(gen, 1, 2, 1, 15, 15, d))
    theta = rope.rope_frequencies(d, 500.0)
    for rotated in (False, True):
        by_base = rerope.rerope(q, k, v, window, base=500.0, rotated=rotated)
        by_vector = rerope.rerope(q, k, v, window, inv_freq=theta, rotated=rotated)
        assert torch.equal(by_base, by_vector)
        with torch.no_grad():
            assert torch.equal(rerope.rerope_decode(q[:, :, -1:], k, v, window, base=500.0,
                                                    rotated=rotated),
                               rerope.rerope_decode(q[:, :, -1:], k, v, window,
                                                    inv_freq=theta.tolist(), rotated=rotated))


def test_tensor_list_and_frequencies_agree_and_caches_follow_the_values(gen):
    d, window = 16, 3
    q, k, v = (t.detach() for t in leaves(gen, 1, 2, 1, 12, 12, d))
    freqs = scaled_frequencies(gen, d).to(F32)
    forms = [freqs, freqs.tolist(), tuple(freqs.tolist()), rope.Frequencies.of(freqs)]
    outs = [rerope.rerope(q, k, v, window, rotated=True, inv_freq=f) for f in forms]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # a tensor is read on every call: an in-place change shows in the next one
    first = as_frequencies(freqs)
    assert as_frequencies(freqs) == first
    freqs.mul_(0.5)
    halved = as_frequencies(freqs)
    assert halved is not first and halved == tuple(x * 0.5 for x in first)
    # the same shapes with other frequencies: no stale table, operands or decode plan
    for f in (first, halved):
        want = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(),
                                                        window, rotated=True, inv_freq=f)
        got = rerope.rerope(q, k, v, window, rotated=True, inv_freq=f)
        assert not results_problems({"out": got}, {"out": want}, tolerance(F32))
        with torch.no_grad():
            step = rerope.rerope_decode(q[:, :, -1:], k, v, window, inv_freq=f)
        assert not results_problems({"out": step}, {"out": want[:, :, -1:]}, tolerance(F32))


# --- Self-Extend positions -------------------------------------------------------------------


def self_extend_position(i, j, window, group):
    """The paper's relative position of query ``i`` and key ``j <= i``, one pair at a time."""
    if i - j < window:
        return i - j
    return (i // group + window - window // group) - j // group


@pytest.mark.parametrize("n_q, n_k, window, group", [
    (20, 20, 6, 3), (20, 20, 4, 4), (5, 23, 8, 2), (20, 20, 6, 1), (9, 9, 12, 4)])
def test_relative_positions_are_the_papers(n_q, n_k, window, group):
    rel = rope.relative_positions(n_q, window, n_keys=n_k, group=group)
    for r in range(n_q):
        i = n_k - n_q + r
        for j in range(i + 1):
            assert rel[r, j] == self_extend_position(i, j, window, group), (i, j)
    first = n_k - n_q
    for i in range(max(first, window), n_k):            # the window edge: w - 1 inside, w not
        assert rel[i - first, i - window + 1] == window - 1
        assert rel[i - first, i - window] == window


def test_group_rule_reaches_the_length_read():
    """``rope.self_extend_group``: G = 1 up to the training length, then the smallest power of
    two (dividing w) whose reach (T - w)·G + w covers L; capped where w runs out of powers."""
    g = rope.self_extend_group
    assert [g(8192, 2048, n) for n in (100, 8192, 8193, 16384, 32768, 65536)] == [1, 1, 2, 4, 8, 16]
    assert [g(256, 64, 256 * f) for f in (1, 2, 4, 8, 16)] == [1, 4, 8, 16, 32]
    for n in (8193, 20000, 65536):
        group = g(8192, 1024, n)
        assert (8192 - 1024) * group + 1024 >= n > (8192 - 1024) * (group // 2) + 1024
    assert g(100, 12, 10**6) == 4                      # 12 = 4·3: no larger power divides it
    with pytest.raises(ValueError, match="window must be below train_len"):
        g(1024, 1024, 4096)
    with pytest.raises(ValueError, match="length must be >= 1"):
        g(1024, 256, 0)
    with pytest.raises(TypeError, match="window must be an int"):
        g(1024, 256.0, 4096)
