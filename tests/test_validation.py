"""Bad inputs: each raises the right exception type, with a message that names the argument.

Checked for the public ops ``rerope.rerope_attention`` (five tensors) and ``rerope.rerope``
(raw ``q, k, v``), and for the references where they share the checks. No kernel runs here
except in the few "accepted" cases (tiny shapes).
"""

import math
import re
import warnings

import numpy as np
import pytest
import torch

import rerope
from rerope import reference, rope
from rerope._validate import SM_SCALE_MAX, SM_SCALE_MIN, check_logn_overflow
from rerope.rope import apply_rope
from rerope.runtime import INTERPRET
from rerope_testing import F16, F32, kernel_device, raw_leaves

DEVICE = "cpu" if INTERPRET else "cuda"


def five(batch=1, hq=2, hkv=1, n=8, d=16, dtype=torch.float32, device=DEVICE, **override):
    """Valid ``q1, q2, k1, k2, v``; ``override`` replaces some by name."""
    shapes = {"q1": (batch, hq, n, d), "q2": (batch, hq, n, d),
              "k1": (batch, hkv, n, d), "k2": (batch, hkv, n, d), "v": (batch, hkv, n, d)}
    tensors = {name: torch.zeros(shape, dtype=dtype, device=device)
               for name, shape in shapes.items()}
    tensors.update(override)
    return [tensors[name] for name in ("q1", "q2", "k1", "k2", "v")]


def raw(batch=1, hq=2, hkv=1, n=8, d=16, dtype=torch.float32, device=DEVICE, **override):
    tensors = {"q": torch.zeros(batch, hq, n, d, dtype=dtype, device=device),
               "k": torch.zeros(batch, hkv, n, d, dtype=dtype, device=device),
               "v": torch.zeros(batch, hkv, n, d, dtype=dtype, device=device)}
    tensors.update(override)
    return [tensors[name] for name in "qkv"]


def zeros(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(*shape, dtype=dtype, device=device)


OTHER_DEVICE = "cpu" if DEVICE == "cuda" else "meta"

# (id, inputs, error type, regex the message must match: the argument's name)
TENSOR_CASES = [
    ("rank3-q1", dict(q1=zeros(2, 8, 16)), ValueError, r"q1 must have rank 4"),
    ("rank5-v", dict(v=zeros(1, 1, 1, 8, 16)), ValueError, r"v must have rank 4"),
    ("batch-k1", dict(k1=zeros(2, 1, 8, 16)), ValueError, r"k1 has batch 2"),
    ("seqlen-k2", dict(k2=zeros(1, 1, 9, 16)), ValueError, r"k2 has sequence length 9"),
    ("headdim-v", dict(v=zeros(1, 1, 8, 32)), ValueError, r"v has head dim 32"),
    ("shape-q2", dict(q2=zeros(1, 2, 9, 16)), ValueError, r"q2 has shape"),
    ("kvheads-v", dict(v=zeros(1, 2, 8, 16)), ValueError, r"v has 2 heads.*like k1"),
    ("dtype-q2", dict(q2=zeros(1, 2, 8, 16, dtype=torch.float16)), TypeError,
     r"q2 has dtype torch.float16"),
    ("dtype-v", dict(v=zeros(1, 1, 8, 16, dtype=torch.bfloat16)), TypeError, r"v has dtype"),
    ("device-v", dict(v=zeros(1, 1, 8, 16, device=OTHER_DEVICE)), ValueError,
     rf"v is on {OTHER_DEVICE}"),
    ("nontensor-q1", dict(q1=np.zeros((1, 2, 8, 16), dtype=np.float32)), TypeError,
     r"q1 must be a torch.Tensor"),
    ("nontensor-k2", dict(k2=[[0.0]]), TypeError, r"k2 must be a torch.Tensor"),
]


@pytest.mark.parametrize("op", [rerope.rerope_attention, reference.rerope_attention],
                         ids=["kernel", "reference"])
@pytest.mark.parametrize("override, error, message", [c[1:] for c in TENSOR_CASES],
                         ids=[c[0] for c in TENSOR_CASES])
def test_bad_tensors(op, override, error, message):
    with pytest.raises(error, match=message):
        op(*five(**override), 4)


@pytest.mark.parametrize("hq, hkv", [(3, 2), (4, 3), (1, 2)])
def test_heads_not_a_multiple(hq, hkv):
    for op in (rerope.rerope_attention, reference.rerope_attention):
        with pytest.raises(ValueError, match=rf"query heads \({hq}\).*key/value heads \({hkv}\)"):
            op(*five(hq=hq, hkv=hkv), 4)
    with pytest.raises(ValueError, match=r"heads"):
        rerope.rerope(*raw(hq=hq, hkv=hkv), 4)


def test_empty_sequence():
    with pytest.raises(ValueError, match=r"q1 must have sequence length"):
        rerope.rerope_attention(*five(n=0), 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool,
                                   torch.complex64], ids=str)
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match=rf"q1 has unsupported dtype {dtype}"):
        rerope.rerope_attention(*five(dtype=dtype), 4)
    with pytest.raises(TypeError, match=r"unsupported dtype"):
        rerope.rerope(*raw(dtype=dtype), 4)


def test_reference_accepts_float64_but_not_ints():
    reference.rerope_attention(*five(dtype=torch.float64, device="cpu"), 4)
    with pytest.raises(TypeError, match=r"q1 has unsupported dtype torch.int32"):
        reference.rerope_attention(*five(dtype=torch.int32, device="cpu"), 4)


@pytest.mark.parametrize("d", [8, 48, 96, 512])
def test_unsupported_head_dim(d):
    with pytest.raises(ValueError, match=rf"head dim D={d} is not supported"):
        rerope.rerope_attention(*five(d=d), 4)
    with pytest.raises(ValueError, match=rf"head dim D={d}"):
        rerope.rerope(*raw(d=d), 4)


def test_odd_head_dim_for_rope():
    with pytest.raises(ValueError, match=r"head dim"):       # the kernels' head-dim check first
        rerope.rerope(*raw(d=15), 4)
    with pytest.raises(ValueError, match=r"q must have an even head dim"):
        reference.rerope(*raw(d=15, device="cpu"), 4)


def test_inputs_on_the_wrong_device_for_the_mode():
    """All inputs on one device, but not the one the kernels run on."""
    wrong = "meta" if INTERPRET else "cpu"
    with pytest.raises(ValueError, match=rf"inputs are on {wrong}"):
        rerope.rerope_attention(*five(device=wrong), 4)


@pytest.mark.parametrize("window, error, message", [
    (0, ValueError, r"window must be >= 1, got 0"),
    (-3, ValueError, r"window must be >= 1, got -3"),
    (2.0, TypeError, r"window must be an int"),
    (2.5, TypeError, r"window must be an int"),
    (True, TypeError, r"window must be an int"),
    (False, TypeError, r"window must be an int"),
    ("4", TypeError, r"window must be an int"),
    (None, TypeError, r"window must be an int"),
    (torch.tensor(4), TypeError, r"window must be an int"),
])
def test_bad_window(window, error, message):
    for call in (lambda: rerope.rerope_attention(*five(), window),
                 lambda: reference.rerope_attention(*five(device="cpu"), window),
                 lambda: rerope.rerope(*raw(), window)):
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("causal", [1, 0, "yes", None, np.bool_(True)], ids=repr)
def test_causal_must_be_bool(causal):
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        rerope.rerope_attention(*five(), 4, causal=causal)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        rerope.rerope(*raw(), 4, causal=causal)


@pytest.mark.parametrize("sm_scale, error", [
    (0.0, ValueError), (-0.5, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    ("0.1", TypeError), (True, TypeError), (torch.tensor(0.1), TypeError),
    # outside the range where sm_scale·log2(e) is a normal fp32 number (issue 9, item 3)
    (1e-46, ValueError), (1e-39, ValueError), (1e39, ValueError), (10 ** 400, ValueError),
], ids=repr)
def test_bad_sm_scale(sm_scale, error):
    with pytest.raises(error, match=r"sm_scale must be"):
        rerope.rerope_attention(*five(), 4, sm_scale=sm_scale)
    with pytest.raises(error, match=r"sm_scale must be"):
        rerope.rerope(*raw(), 4, sm_scale=sm_scale)


@pytest.mark.parametrize("leaky, error", [
    (1.0, ValueError), (1, ValueError), (0.5, ValueError), (-2.0, ValueError),
    (float("inf"), ValueError), (float("nan"), ValueError), ("16", TypeError), (True, TypeError),
], ids=repr)
def test_bad_leaky(leaky, error):
    with pytest.raises(error, match=r"leaky must be"):
        rerope.rerope(*raw(), 4, leaky=leaky)
    with pytest.raises(error, match=r"leaky must be"):
        reference.rerope(*raw(device="cpu"), 4, leaky=leaky)


@pytest.mark.parametrize("logn_len, error", [
    (1, ValueError), (0, ValueError), (-4096, ValueError), (1.0, ValueError),
    ("4096", TypeError), (True, TypeError),
], ids=repr)
def test_bad_logn_len(logn_len, error):
    with pytest.raises(error, match=r"logn_len must be"):
        rerope.rerope(*raw(), 4, logn_len=logn_len)


@pytest.mark.parametrize("base, error", [
    (1.0, ValueError), (0.5, ValueError), (-10000.0, ValueError), (float("inf"), ValueError),
    ("10000", TypeError), (True, TypeError), (None, TypeError),
], ids=repr)
def test_bad_base(base, error):
    with pytest.raises(error, match=r"base must be"):
        rerope.rerope(*raw(), 4, base=base)
    with pytest.raises(error, match=r"base must be"):
        reference.rerope(*raw(device="cpu"), 4, base=base)


def test_raw_op_names_its_arguments():
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor"):
        rerope.rerope(*raw(v="not a tensor"), 4)
    with pytest.raises(ValueError, match=r"k must have rank 4"):
        rerope.rerope(*raw(k=zeros(1, 8, 16)), 4)
    with pytest.raises(TypeError, match=r"k has dtype torch.float16"):
        rerope.rerope(*raw(k=zeros(1, 1, 8, 16, dtype=torch.float16)), 4)


def _plain_rope_attention(q, k, v, sm_scale):
    """Causal softmax attention of RoPE-rotated ``q, k`` (float64, GQA by repeating heads):
    what any window ``>= N`` must give."""
    positions = torch.arange(q.shape[2], dtype=torch.float64)
    q, k = apply_rope(q.double(), positions), apply_rope(k.double(), positions)
    return _causal_attention(q, k, v, sm_scale)


def _causal_attention(q, k, v, sm_scale):
    repeat = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(repeat, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * sm_scale
    n = q.shape[2]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("window", [np.int64(3), 3, 10 ** 9, 10 ** 400])
def test_accepted_edge_values(window):
    """Integer-like windows (numpy ints too), windows far beyond N (beyond any float too),
    sm_scale as an int: the float64 reference's answer, and for a window ``>= N`` plain RoPE
    attention (the five-tensor op: plain attention of ``q1, k1``)."""
    gen = torch.Generator().manual_seed(3)
    rand = [torch.randn(1, h, 5, 16, generator=gen, dtype=torch.float64)
            for h in (2, 2, 1, 1, 1)]
    q1, q2, k1, k2, v = (t.float().to(DEVICE) for t in rand)
    huge = window >= 5
    out = rerope.rerope_attention(q1, q2, k1, k2, v, window, sm_scale=1)
    want = (_causal_attention(*rand[0:3:2], rand[4], 1.0) if huge
            else reference.rerope_attention(*rand, int(window), sm_scale=1))
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-5)
    q, k = q1, k1
    out = rerope.rerope(q, k, v, window, sm_scale=1)
    want = (_plain_rope_attention(rand[0], rand[2], rand[4], 1.0) if huge
            else reference.rerope(rand[0], rand[2], rand[4], int(window), sm_scale=1))
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_references_take_sm_scales_the_kernels_refuse():
    """The float64 references compute any finite positive scale (tests/test_reference.py
    checks the values); the kernels' fp32 range does not apply to them."""
    for sm_scale in (1e-46, 1e39):
        out = reference.rerope_attention(*five(dtype=torch.float64, device="cpu"), 4,
                                         sm_scale=sm_scale)
        assert torch.isfinite(out).all()


# --- rerope.rerope's q, k, v; sm_scale, base and logn_len bounds; group ----------------------


@pytest.mark.parametrize("bad, error, match", [
    (dict(q_len=9, k_len=8), ValueError, "Nq <= Nk"),
    (dict(rotated=1), TypeError, "rotated"),
    (dict(d=24), ValueError, "head dim"),
    (dict(dtype=torch.float64), TypeError, "q has unsupported dtype"),
    (dict(window=0), ValueError, "window"),
])
def test_bad_input(bad, error, match):
    d, dtype = bad.pop("d", 16), bad.pop("dtype", F32)
    q_len, k_len = bad.pop("q_len", 8), bad.pop("k_len", 8)
    q = torch.randn(1, 1, q_len, d, dtype=dtype)
    k, v = (torch.randn(1, 1, k_len, d, dtype=dtype) for _ in range(2))
    with pytest.raises(error, match=match):
        rerope.rerope(q, k, v, bad.pop("window", 4), **bad)


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


@pytest.mark.parametrize("group, kw, error, match", [
    (True, {}, TypeError, "group must be an int"), (2.0, {}, TypeError, "group must be an int"),
    (0, {}, ValueError, "group must be >= 1"), (-2, {}, ValueError, "group must be >= 1"),
    (3, {}, ValueError, "group must divide window"),
    (2, {"leaky": 4.0}, ValueError, "group .* and leaky"),
    (2, {"causal": False}, ValueError, "group .* needs causal=True"),
])
def test_bad_group_raises(group, kw, error, match):
    device = kernel_device()
    q, k, v = (torch.zeros(1, 1, 20, 32, device=device) for _ in range(3))
    with pytest.raises(error, match=match):
        rerope.rerope(q, k, v, 8, group=group, **kw)
    with pytest.raises(error, match=match):
        reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), 8,
                                                 group=group, **kw)
    if "causal" not in kw:
        with pytest.raises(error, match=match):
            rerope.rerope_decode(q[:, :, :1], k, v, 8, group=group, **kw)


# --- RoPE frequencies given as a vector (inv_freq=): bad ones, in every op -------------------


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
