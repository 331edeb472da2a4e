"""Property-based fuzz test of both public ops against the float64 relative-position oracle.

Hypothesis draws a case: tiny shapes, grouped-query ratios, ``Nq <= Nk`` (``rerope.rerope``),
windows (1, ``w >= Nk``, ``Nk - 1``, around the interpreter's 16-wide tiles), causal or not,
``sm_scale``, Leaky ReRoPE, log-n scaling, ``rotated`` inputs, dtypes, RoPE frequencies given
as a tensor (``inv_freq``), and a memory layout per tensor (contiguous, transposed, sliced out
of a NaN buffer, stride-0 broadcast, last dim not unit-stride). A ``changed`` case first calls
``rerope.rerope`` on the same tensor objects, then changes ``q, k, v`` and ``inv_freq`` in
place through ``.data`` (which bumps no version counter): no cache may answer for the old
values. Explicit examples add the probes of project issue "Reliability III" (``inv_freq``
tripled through ``.data``; ``sm_scale=1e38``, which must raise). Each case runs the op forward and backward under NaN-poisoned ``torch.empty``
and compares ``out, dq, dk, dv`` with
:func:`rerope.reference.rerope_from_relative_positions` (float64, each score straight from its
relative position, never the five tensors) on the same rounded inputs, with the tolerance table
of ``tests/conftest.py``.

Both ops are judged by the same oracle on the raw ``q, k, v``: ``rerope.rerope`` directly,
``rerope.rerope_attention`` after the caller's own five-tensor preprocessing
(:func:`rerope.rope.rerope_inputs`, here in float64 and rounded once to the input dtype, so
its backward adds no roundings of its own), its inputs laid out like ``q, k, v``.

Gradients: for ``rerope.rerope``, those of the tensors the op was given, element by element
(for a stride-0 input, the gradient of each repeat, before autograd adds them up in the input
dtype: summing fp16 terms that cancel is autograd's rounding, not the kernel's); for
``rerope.rerope_attention``, those of ``q, k, v`` through the preprocessing.

Profiles (``REROPE_FUZZ_PROFILE``): ``ci`` (default) draws a fixed set of examples
(``derandomize=True``, no example database), sized so that this file runs in well under two
minutes on two cores under the interpreter; ``long`` draws many more, randomly, for a local
hunt (``REROPE_FUZZ_PROFILE=long pytest tests/test_fuzz.py``; ``REROPE_FUZZ_EXAMPLES`` sets
how many, default 300 per test). Hypothesis prints the failing case and shrinks it.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

import rerope
from rerope import reference
from rerope._validate import SM_SCALE_MAX
from rerope.rope import rerope_inputs, rope_frequencies
from rerope_testing import kernel_device, poisoned_empty, results_problems, tolerance

settings.register_profile(
    "ci", max_examples=9, derandomize=True,
    database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=int(os.environ.get("REROPE_FUZZ_EXAMPLES", 300)), deadline=None,
    database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile(os.environ.get("REROPE_FUZZ_PROFILE", "ci"))

LAYOUTS = ("contiguous", "transposed", "sliced", "broadcast", "lastdim")
# bf16 runs in fp32 under the interpreter (only its input/output rounding shows); it is drawn
# less often there for that reason, and because the same rounding is covered by fp16.
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.float16, torch.bfloat16])


@st.composite
def cases(draw, op):
    """One random case for ``op`` (``"rerope"`` or ``"rerope_attention"``)."""
    batch = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    if batch * hkv * group > 4:            # the interpreter's cost grows with B·Hq
        group = 1
    n_keys = draw(st.integers(1, 40))
    if op == "rerope":   # queries at the last Nq positions; Nq = Nk half of the time
        n_queries = draw(st.one_of(st.just(n_keys), st.integers(1, n_keys)))
    else:                # the five-tensor form takes Nq = Nk
        n_queries = n_keys
    window = draw(st.one_of(
        st.just(1), st.integers(1, n_keys + 2),
        st.sampled_from([n_keys, max(1, n_keys - 1), n_keys + 1, 15, 16, 17, 10 ** 9])))
    return dict(
        op=op, batch=batch, hq=hkv * group, hkv=hkv, n_queries=n_queries, n_keys=n_keys,
        d=draw(st.sampled_from([16, 16, 32, 64])), dtype=draw(DTYPES), window=window,
        causal=draw(st.booleans()),
        sm_scale=draw(st.one_of(st.none(), st.floats(0.02, 0.5))),
        base=draw(st.sampled_from([10000.0, 500000.0, 10.0])),
        leaky=draw(st.one_of(st.none(), st.floats(1.5, 32.0))),
        logn_len=draw(st.one_of(st.none(), st.integers(2, 48))),
        rotated=draw(st.booleans()),
        layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(4)],    # q, k, v, dout
        seed=draw(st.integers(0, 2 ** 32 - 1)),
        # drawn last, so the earlier draws (and the ci profile's examples) stay as they were
        inv_freq=draw(st.sampled_from([None, None, "scaled"])),
        changed=draw(st.booleans()),
    )


def _broadcast_dim(shape, allow_seq):
    """The dim a stride-0 layout repeats along: heads, else batch, else (raw op) the sequence."""
    for dim in (1, 0) + ((2,) if allow_seq else ()):
        if shape[dim] > 1:
            return dim
    return None


def lay_out(values, layout, allow_seq=True):
    """A leaf holding ``values`` (``(B, H, N, D)``, already in the test dtype) and the tensor the
    op is given, laid out as ``layout``; returns ``(leaf, given)``.

    ``broadcast``: the leaf is one slice along a dim and ``given`` its stride-0 ``expand``, so
    gradients of all the repeats add up in the leaf (in the kernel's result and the oracle's).
    """
    b, h, n, d = values.shape
    if layout == "broadcast":
        dim = _broadcast_dim(values.shape, allow_seq)
        if dim is None:
            layout = "contiguous"
        else:
            leaf = values.narrow(dim, 0, 1).clone().requires_grad_()
            return leaf, leaf.expand(values.shape)
    if layout == "contiguous":
        leaf = values.clone()
    elif layout == "transposed":     # a (B, N, H, D) tensor seen as (B, H, N, D)
        leaf = values.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "lastdim":        # a (B, H, D, N) tensor: stride(-1) = N, not 1
        leaf = values.transpose(2, 3).contiguous().transpose(2, 3)
    elif layout == "sliced":         # every other element along D, offset rows, NaN around
        buffer = torch.full((b, h + 1, n + 3, 2 * d + 1), float("nan"), dtype=values.dtype,
                            device=values.device)
        leaf = buffer[:, 1:, 2:2 + n, 1::2][..., :d]
        leaf.copy_(values)
    else:
        raise ValueError(layout)
    leaf.requires_grad_()
    return leaf, leaf


def relay(x, layout):
    """``x`` (the caller's five-tensor preprocessing output) handed on in ``layout``,
    differentiably. ``broadcast`` along heads or batch: the values repeat there already."""
    if layout == "broadcast":
        dim = _broadcast_dim(x.shape, allow_seq=False)
        return x if dim is None else x.narrow(dim, 0, 1).expand(x.shape)
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "lastdim":
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if layout == "sliced":
        b, h, n, d = x.shape
        buffer = torch.full((b, h + 1, n + 3, 2 * d + 1), float("nan"), dtype=x.dtype,
                            device=x.device)
        view = buffer[:, 1:, 2:2 + n, 1::2][..., :d]
        view.copy_(x)                    # autograd records the copy: gradients reach x
        return view
    return x


def run_case(case):
    """Kernel and oracle on one case; returns ``(got, want)`` dicts of out, dq, dk, dv."""
    dtype, device = case["dtype"], kernel_device()
    gen = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, nq, nk, d = (case[key]
                             for key in ("batch", "hq", "hkv", "n_queries", "n_keys", "d"))
    shapes = [(b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, hq, nq, d)]
    values = [torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
              for shape in shapes]
    allow_seq = case["op"] == "rerope"
    # stride 0 along the sequence: for q, k and dout (rerope.rerope only: the five tensors
    # differ per position), never for v: one value for every key makes every output row that
    # value, dq = dk = 0 exactly, and the test would judge rounding noise against zero
    seq_ok = [allow_seq, allow_seq, False, allow_seq]
    # broadcast along a dim: make the values repeat there, so the five tensors repeat too
    for i, layout in enumerate(case["layouts"]):
        dim = _broadcast_dim(shapes[i], seq_ok[i]) if layout == "broadcast" else None
        if dim is not None:
            values[i] = values[i].narrow(dim, 0, 1).expand(shapes[i]).clone()
    laid = [lay_out(v, layout, ok)
            for v, layout, ok in zip(values[:3], case["layouts"][:3], seq_ok)]
    leaves, given_qkv = [leaf for leaf, _ in laid], [g for _, g in laid]
    if allow_seq:        # rerope.rerope: judge the gradients of the given tensors themselves
        for g in given_qkv:
            if not g.is_leaf:
                g.retain_grad()
    dout = lay_out(values[3], case["layouts"][3], seq_ok[3])[1].detach()
    inv_freq = None
    if case.get("inv_freq"):       # a model's scaled RoPE: each frequency times 0.25 … 1
        scales = torch.rand(d // 2, generator=gen, dtype=torch.float64) * 0.75 + 0.25
        inv_freq = (rope_frequencies(d) * scales).to(torch.float32).to(device)
    rope_args = dict(base=case["base"] if inv_freq is None else 10000.0,   # not both
                     leaky=case["leaky"], logn_len=case["logn_len"], rotated=case["rotated"],
                     inv_freq=inv_freq)
    attention_args = dict(causal=case["causal"], sm_scale=case["sm_scale"])
    window = case["window"]
    if case.get("changed"):        # the same objects held other values in an earlier call
        with torch.no_grad():
            rerope.rerope(*given_qkv, window, **attention_args, **rope_args)
            for leaf in leaves:
                leaf.data.mul_(-0.5)           # exact in every dtype
            if inv_freq is not None:   # doubled: halved ones, with keys repeated along the
                # sequence (stride 0), rotate the keys so alike that fp16's dq is all cancellation
                inv_freq.data.mul_(case.get("freq_change", 2.0))

    with poisoned_empty():
        if case["op"] == "rerope":
            out = rerope.rerope(*given_qkv, window, **attention_args, **rope_args)
        else:
            q, k, v = given_qkv
            five = [t.to(dtype) for t in rerope_inputs(q.double(), k.double(), window, **rope_args)]
            lq, lk = case["layouts"][:2]
            five = [relay(five[0], lq), relay(five[1], lq), relay(five[2], lk),
                    relay(five[3], lk), v]
            out = rerope.rerope_attention(*five, window, **attention_args)
        out.backward(dout)
    assert out.dtype == dtype and out.shape == (b, hq, nq, d)
    judged = given_qkv if allow_seq else leaves
    got = {"out": out.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), judged)}}

    if inv_freq is not None:
        rope_args["inv_freq"] = inv_freq.to("cpu", torch.float64)
    ref_leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in leaves]
    ref_given = [leaf.expand(shape) for leaf, shape in zip(ref_leaves, shapes)]
    for g in ref_given:
        g.retain_grad()
    want = reference.rerope_from_relative_positions(*ref_given, window, **attention_args,
                                                    **rope_args)
    want.backward(dout.to("cpu", torch.float64))
    judged = ref_given if allow_seq else ref_leaves
    want = {"out": want.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), judged)}}
    return got, want


def check(case):
    note(f"case: {case}")
    if case["sm_scale"] is not None and case["sm_scale"] > SM_SCALE_MAX:
        with pytest.raises(ValueError, match="sm_scale must be between"):
            run_case(case)             # scaled fp32 scores could overflow: refused
        return
    got, want = run_case(case)
    problems = results_problems(got, want, tolerance(case["dtype"]))
    assert not problems, f"case {case}\n" + "\n".join(problems)


def probe(op, **changes):
    """An explicit example: a small fp32 case of ``op`` with ``changes``."""
    case = dict(op=op, batch=1, hq=2, hkv=1, n_queries=9, n_keys=9, d=16, dtype=torch.float32,
                window=4, causal=True, sm_scale=None, base=10000.0, leaky=None, logn_len=None,
                rotated=False, layouts=["contiguous"] * 4, seed=7, inv_freq=None, changed=False)
    return example(case={**case, **changes})


# The probes of "Reliability III": inv_freq tripled through .data after a call (answered from a
# stale cache before, off by 1.7), and sm_scale = 1e38 (NaN rows before; now refused).
@probe("rerope", inv_freq="scaled", changed=True, freq_change=3.0, leaky=4.0)
@probe("rerope", inv_freq="scaled", changed=True, freq_change=3.0, rotated=True, n_queries=3)
@probe("rerope", sm_scale=1e38)
@settings(PROFILE)
@given(case=cases("rerope"))
def test_fuzz_rerope(case):
    """``rerope.rerope(q, k, v, ...)``: every argument, forward and ``dq, dk, dv``."""
    check(case)


@probe("rerope_attention", inv_freq="scaled", changed=True, freq_change=3.0)
@probe("rerope_attention", sm_scale=1e38)
@settings(PROFILE)
@given(case=cases("rerope_attention"))
def test_fuzz_rerope_attention(case):
    """``rerope.rerope_attention`` on the caller's five tensors, judged on ``q, k, v``."""
    check(case)


def test_layouts_are_what_they_claim():
    """The layouts the fuzz test draws really are strided as named (else it tests less)."""
    values = torch.randn(2, 3, 5, 16)
    strides = {name: lay_out(values, name)[1].stride() for name in LAYOUTS}
    assert lay_out(values, "contiguous")[1].is_contiguous()
    assert strides["transposed"] == (240, 16, 48, 1)
    assert strides["broadcast"][1] == 0
    assert strides["lastdim"][-1] == 5
    sliced = lay_out(values, "sliced")[1]
    assert sliced.stride(-1) == 2 and not sliced.is_contiguous()
    assert torch.isnan(sliced._base).any()                     # NaN right next to the data
    for name in LAYOUTS:
        given_tensor = lay_out(values, name)[1]
        want = values[:, :1].expand(values.shape) if name == "broadcast" else values
        assert torch.equal(given_tensor, want), name
