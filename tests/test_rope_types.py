"""RoPE frequencies given as a vector (``inv_freq=``): every op against the float64 oracles.

A model's scaled RoPE (``linear``, Llama 3's ``llama3``, YaRN) changes only the ``D/2``
frequencies ``θ_t``; the ops take them as ``inv_freq`` next to ``base``. Checked here, on the
CPU interpreter at small sizes:

* ``rerope.rerope`` (forward and backward) and ``rerope.rerope_decode`` with a random vector
  of frequencies equal ``reference.rerope_from_relative_positions`` with the same vector
  (float64), raw and rotated inputs, ReRoPE and Leaky, GQA, ``Nq < Nk``;
* the two references agree with each other, ``apply_rope`` is the complex rotation by the
  given frequencies, and the default frequencies passed as a vector give the ``base`` result;
* a tensor, a list and :class:`rerope.rope.Frequencies` give the same result; a tensor is read
  on every call, so a change in place shows; other frequencies on the same shapes are not
  served from a stale cache;
* bad ``inv_freq`` raises a ``TypeError`` / ``ValueError`` naming it, in every op.
"""

import math

import pytest
import torch

import rerope
from rerope import reference, rope
from rerope._validate import as_frequencies
from rerope_testing import kernel_device, randn, results_problems, tolerance

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


# --- bad inv_freq --------------------------------------------------------------------------------

D = 16


def _call(op, inv_freq, base=10000.0):
    device = kernel_device()
    q, k, v = (torch.zeros(1, 2, 4, D, device=device) for _ in range(3))
    if op == "rerope":
        return rerope.rerope(q, k, v, 2, base=base, inv_freq=inv_freq)
    if op == "rerope_decode":
        return rerope.rerope_decode(q[:, :, -1:], k, v, 2, base=base, inv_freq=inv_freq)
    if op == "reference.rerope":
        return reference.rerope(q, k, v, 2, base=base, inv_freq=inv_freq)
    if op == "rerope_from_relative_positions":
        return reference.rerope_from_relative_positions(q, k, v, 2, base=base, inv_freq=inv_freq)
    if op == "rerope_inputs":
        return rope.rerope_inputs(q, k, 2, base=base, inv_freq=inv_freq)
    return rope.apply_rope(q, torch.arange(4), base=base, inv_freq=inv_freq)


OPS = ["rerope", "rerope_decode", "reference.rerope", "rerope_from_relative_positions",
       "rerope_inputs", "apply_rope"]
GOOD = [10000.0 ** (-2 * t / D) for t in range(D // 2)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("inv_freq, error, message", [
    (0.5, TypeError, "inv_freq must be a 1-D tensor or a sequence of floats"),
    ("0.5", TypeError, "inv_freq must be a 1-D tensor or a sequence of floats"),
    ([True] * (D // 2), TypeError, r"inv_freq\[0\] must be a real number"),
    (GOOD[:-1] + ["x"], TypeError, r"inv_freq\[7\] must be a real number"),
    (torch.ones(D // 2, dtype=torch.int64), TypeError, "floating-point tensor"),
    (torch.ones(2, D // 4), ValueError, "must be 1-D"),
    ([], ValueError, "inv_freq is empty"),
    (GOOD[:-1], ValueError, "inv_freq has 7 frequencies, but a head dim of 16 needs 8"),
    (GOOD + [1e-3], ValueError, "inv_freq has 9 frequencies"),
    (GOOD[:-1] + [0.0], ValueError, r"inv_freq\[7\] = 0.0: every frequency must be positive"),
    (GOOD[:-1] + [-1e-3], ValueError, r"inv_freq\[7\] = -0.001"),
    (GOOD[:-1] + [math.nan], ValueError, r"inv_freq\[7\] = nan"),
    (torch.tensor(GOOD[:-1] + [math.inf]), ValueError, r"inv_freq\[7\] = inf"),
], ids=["float", "str", "bools", "str-entry", "int-tensor", "2-D", "empty", "short", "long",
        "zero", "negative", "nan", "inf"])
def test_bad_inv_freq_raises(op, inv_freq, error, message):
    with pytest.raises(error, match=message):
        _call(op, inv_freq)


@pytest.mark.parametrize("op", OPS)
def test_inv_freq_with_a_base_is_refused(op):
    with pytest.raises(ValueError, match="pass either base or inv_freq, not both"):
        _call(op, GOOD, base=500.0)
    _call(op, GOOD)                   # the default base with inv_freq is fine
