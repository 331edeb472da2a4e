"""Self-Extend (``group=G``) as a position scheme of the ReRoPE ops. CPU, Triton's interpreter.

Self-Extend (Jin et al. 2024, "LLM Maybe LongLM"): a causal pair at distance ``d = i - j`` keeps
``d`` while ``d < w`` and gets ``⌊i/G⌋ - ⌊j/G⌋ + w - w/G`` beyond. What is checked:

* the float64 oracles (``rerope.rope.relative_positions``, ``reference.rerope`` and
  ``reference.rerope_from_relative_positions`` with ``group``) against constructions written
  here from the paper's definition: a pair-by-pair loop for the positions, and the authors'
  two-attention form (neighbour scores at ``i, j``, grouped scores at ``⌊i/G⌋ + w - w/G``,
  ``⌊j/G⌋``, merged by the window mask);
* ``rerope.rerope(..., group=G)`` forward and ``dq, dk, dv`` against the oracle, outputs
  poisoned, raw and rotated inputs, ``Nq < Nk``, odd ``N``, GQA, batch > 1, log-n, the window
  edge ``d = w - 1, w`` crossing the 16-wide tiles, ``G = 1`` and ``w >= N`` (plain RoPE);
* ``rerope.rerope_decode(..., group=G)`` on a rotated (and a raw) cache against
  ``rerope.rerope(..., group=G)`` on the same data, per-row ``cache_seqlens``, GQA, ``G``
  dividing the 16-key tile and not (one table row per key then);
* the ``torch.library`` op and its fake; the plan cache keeps settings apart;
* ``rerope.hf.enable_rerope(model, window, group=G)`` on the tiny models of
  ``tests/test_hf.py``: logits against a float64 reference model, ``generate`` with the cache
  equal to recomputation;
* bad ``group`` values raise ``TypeError`` / ``ValueError`` naming ``group``.
"""

from dataclasses import asdict, dataclass

import pytest
import torch
import triton
import triton.language as tl

import rerope
from rerope import reference, rope
from test_fused import fused_results, oracle_results   # the kernels and the oracle, forward + backward
from rerope_testing import (F16, F32, close_problems, describe, kernel_device, poisoned_empty,
                            randn, results_problems, tolerance)

BF16 = torch.bfloat16
NAMES = ("out", "dq", "dk", "dv")


# --- the oracle, against the paper's definition -----------------------------------------------


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


# --- the fused kernels against the oracle -------------------------------------------------------


@dataclass(frozen=True)
class Case:
    n_q: int
    n_k: int
    window: int
    group: int
    rotated: bool = False
    dtype: torch.dtype = F32
    d: int = 32
    batch: int = 1
    hq: int = 1
    hkv: int = 1
    logn_len: float = None

    def id(self):
        parts = [f"Nq{self.n_q}", f"Nk{self.n_k}", f"w{self.window}", f"G{self.group}",
                 "rotated" if self.rotated else "raw", str(self.dtype).replace("torch.", ""),
                 f"D{self.d}"]
        if (self.batch, self.hq, self.hkv) != (1, 1, 1):
            parts.append(f"B{self.batch}H{self.hq}kv{self.hkv}")
        if self.logn_len is not None:
            parts.append(f"logn{self.logn_len}")
        return "-".join(parts)


CASES = [
    # the window edge across 16-wide tiles; both conventions
    Case(40, 40, 8, 4), Case(40, 40, 8, 4, rotated=True), Case(40, 40, 16, 8, rotated=True,
                                                              dtype=F16),
    # odd N, a group that does not divide the tile, window = group
    Case(37, 37, 6, 3, dtype=F16), Case(37, 37, 4, 4, rotated=True),
    # chunked prefill: queries at the last positions
    Case(7, 50, 12, 4, rotated=True), Case(19, 45, 10, 5),
    # GQA and batch, log-n, bf16
    Case(24, 40, 8, 2, batch=2, hq=4, hkv=2, rotated=True, dtype=F16),
    Case(30, 30, 6, 2, logn_len=8.0, rotated=True), Case(30, 30, 9, 3, dtype=BF16, rotated=True),
    # G = 1 and w >= N: plain RoPE
    Case(30, 30, 5, 1, rotated=True), Case(30, 30, 40, 8),
]


def _inputs(gen, case):
    device = kernel_device()
    shapes = [(case.batch, case.hq, case.n_q, case.d), (case.batch, case.hkv, case.n_k, case.d),
              (case.batch, case.hkv, case.n_k, case.d)]
    leaves = [randn(gen, *s, dtype=case.dtype, device=device).requires_grad_() for s in shapes]
    return leaves, randn(gen, *shapes[0], dtype=case.dtype, device=device)


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_kernels_match_the_oracle(case, gen):
    leaves, dout = _inputs(gen, case)
    kw = dict(group=case.group, rotated=case.rotated, logn_len=case.logn_len)
    got = fused_results(leaves, dout, case.window, **kw)
    want = oracle_results(leaves, dout, case.window, **kw)
    assert {t.dtype for t in got.values()} == {case.dtype}
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def test_group_one_in_the_kernels_is_plain_rope(gen):
    q, k, v = (randn(gen, 1, 2, 33, 32, dtype=F32, device=kernel_device()) for _ in range(3))
    with torch.no_grad():
        plain = rerope.rerope(q, k, v, 33, rotated=True)
        grouped = rerope.rerope(q, k, v, 6, rotated=True, group=1)
    assert (grouped - plain).abs().max() < 1e-5


def test_rotated_self_extend_runs_reropes_kernel_variant():
    """Rotated inputs (a model's): the same compile-time switches as ReRoPE, only the table's
    rows differ; raw inputs turn their keys outside the window, like Leaky ReRoPE."""
    from rerope import attention
    for rotated in (False, True):
        se = attention._rotations(64, 32, 10000.0, 8, None, None, rotated, "cpu", None, 4)
        leaky = attention._rotations(64, 32, 10000.0, 8, 4.0, None, rotated, "cpu")
        assert se.flags == leaky.flags
        if rotated:
            assert se.flags == attention._rotations(64, 32, 10000.0, 8, None, None, True,
                                                    "cpu").flags
        table = se.tables[2]
        p = torch.arange(64, dtype=torch.float64)
        want = torch.div(p, 4, rounding_mode="floor") - rotated * p        # angle at θ_0 = 1
        assert torch.allclose(table[:64, 0].double(), torch.cos(want), atol=1e-6)


def test_plan_cache_keeps_groups_apart(gen):
    q, k, v = (randn(gen, 1, 1, 40, 32, dtype=F32, device=kernel_device()) for _ in range(3))
    with torch.no_grad():
        outs = {g: rerope.rerope(q, k, v, 8, rotated=True, group=g) for g in (None, 2, 4, 2)}
        again = rerope.rerope(q, k, v, 8, rotated=True, group=4)
    assert torch.equal(again, outs[4])
    assert (outs[2] - outs[4]).abs().max() > 1e-4 and (outs[None] - outs[2]).abs().max() > 1e-4
    ref = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), 8,
                                                   rotated=True, group=2)
    assert (outs[2].double() - ref).abs().max() < 1e-5


def test_library_op_and_fake_take_group(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = (randn(gen, 1, 2, 24, 32, dtype=F32, device=kernel_device()) for _ in range(3))
    out, lse = torch.ops.rerope.rerope_fwd(q, k, v, 8, True, 32 ** -0.5, 10000.0, None, None,
                                           True, None, 4)
    want = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), 8,
                                                    rotated=True, group=4)
    assert (out.double() - want).abs().max() < 1e-5 and lse.shape == (2, 24)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fout, flse = torch.ops.rerope.rerope_fwd(fq, fk, fv, 8, True, 32 ** -0.5, 10000.0,
                                                 None, None, True, None, 4)
        grads = torch.ops.rerope.rerope_bwd(fout, fq, fk, fv, fout, flse, 8, True, 32 ** -0.5,
                                            10000.0, None, None, True, None, 4)
    assert fout.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_compiled_forward_backward_and_decode_take_group(gen):
    """Under ``torch.compile(fullgraph=True)`` the opaque library ops carry ``group``: forward,
    backward and the decode op equal eager calls."""
    import torch._dynamo
    device = kernel_device()
    q, k, v = (randn(gen, 1, 2, 24, 32, dtype=F32, device=device).requires_grad_()
               for _ in range(3))
    out = rerope.rerope(q, k, v, 8, rotated=True, group=4)
    want = [out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))]
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: rerope.rerope(q, k, v, 8, rotated=True, group=4),
                       fullgraph=True, backend="aot_eager")
    out = fn(q, k, v)
    got = [out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))]
    step = torch.compile(lambda q, k, v: rerope.rerope_decode(q, k, v, 8, group=4),
                         fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got_step = step(q[:, :, -1:].detach(), k.detach(), v.detach())
        want_step = rerope.rerope_decode(q[:, :, -1:].detach(), k.detach(), v.detach(), 8,
                                         group=4)
    torch._dynamo.reset()
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_step, want_step)


# --- decoding on the model's cache ---------------------------------------------------------------


@pytest.mark.parametrize("n_max, lengths, n_q, window, group, hq, hkv, rotated", [
    (70, (70,), 1, 16, 4, 2, 1, True),            # G divides the 16-key tile: the angle split
    (70, (70, 33), 3, 12, 3, 4, 2, True),         # G does not: one table row per key
    (90, (90, 41, 2), 2, 32, 32, 2, 2, True),     # G larger than a tile
    (64, (64, 50), 1, 8, 8, 2, 1, False),         # a raw cache
])
def test_decode_matches_the_prefill_op(n_max, lengths, n_q, window, group, hq, hkv, rotated, gen):
    device = kernel_device()
    batch = len(lengths)
    q = randn(gen, batch, hq, n_q, 32, dtype=F32, device=device)
    k_cache = randn(gen, batch, hkv, n_max, 32, dtype=F32, device=device)
    v_cache = randn(gen, batch, hkv, n_max, 32, dtype=F32, device=device)
    for b, length in enumerate(lengths):          # slots past a row's length are never read
        k_cache[b, :, length:] = float("nan")
        v_cache[b, :, length:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with poisoned_empty():
        got = rerope.rerope_decode(q, k_cache, v_cache, window, cache_seqlens=seqlens,
                                   rotated=rotated, group=group)
    for b, length in enumerate(lengths):
        rows = [t[b:b + 1] for t in (q, k_cache[:, :, :length], v_cache[:, :, :length])]
        # inputs that require grad: rerope.rerope runs its prefill kernels, not the decode one
        want = rerope.rerope(*(t.clone().requires_grad_() for t in rows), window,
                             rotated=rotated, group=group).detach()
        oracle = reference.rerope_from_relative_positions(
            *(t.double() for t in rows), window, rotated=rotated, group=group)
        problems = (close_problems(f"row {b} vs prefill", got[b:b + 1], want, tolerance(F32))
                    + close_problems(f"row {b} vs oracle", got[b:b + 1].double(), oracle,
                                     tolerance(F32)))
        assert not problems, describe(gen, lengths=lengths, group=group) + "\n".join(problems)


def test_decode_route_of_rerope_passes_group(gen):
    """A short no-grad call of rerope.rerope goes to the decode kernel, with the group."""
    q = randn(gen, 1, 2, 2, 32, dtype=F32, device=kernel_device())
    k, v = (randn(gen, 1, 1, 50, 32, dtype=F32, device=kernel_device()) for _ in range(2))
    with torch.no_grad():
        got = rerope.rerope(q, k, v, 8, rotated=True, group=4)
    want = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), 8,
                                                    rotated=True, group=4)
    assert (got.double() - want).abs().max() < 1e-5


# --- bad arguments -----------------------------------------------------------------------------


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


# --- Hugging Face ---------------------------------------------------------------------------------


def _hf():
    transformers = pytest.importorskip("transformers")
    import test_hf  # the tiny-model setup of tests/test_hf.py
    return transformers, test_hf


def _register_self_extend_reference(window, group, base=10000.0):
    """An attention implementation that un-rotates the model's q, k in float64 and runs
    ``reference.rerope(..., group=)``, positions from ``position_ids`` (unpadded rows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    _, test_hf = _hf()
    name = f"test_self_extend_w{window}_g{group}"

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        positions = kw["position_ids"][:1]
        n_q, n_k = query.shape[2], key.shape[2]
        key_positions = positions if n_q == n_k else torch.arange(n_k)[None]
        q_raw = test_hf.unrotate(query, positions, base)
        k_raw = test_hf.unrotate(key, key_positions, base)
        out = reference.rerope(q_raw, k_raw, value.double(), window, sm_scale=scaling,
                               group=group)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def test_hf_self_extend_matches_the_reference_model():
    import rerope.hf as hf
    _, test_hf = _hf()
    config = test_hf.tiny_config(kv_heads=2)
    ids = torch.randint(1, test_hf.VOCAB, (2, 29), generator=torch.Generator().manual_seed(3))
    model = test_hf.build(config)
    reference_model = test_hf.build(config)
    reference_model.set_attn_implementation(_register_self_extend_reference(8, 4))
    want = test_hf.logits_of(reference_model, ids)
    hf.enable_rerope(model, 8, group=4)
    assert model.config._attn_implementation == "rerope_w8_group4"
    got = test_hf.logits_of(model, ids)
    assert test_hf.max_error(got, want) < 2e-4
    plain = hf.disable_rerope(model)
    assert test_hf.max_error(test_hf.logits_of(plain, ids), want) > 1e-3   # the group matters


def test_hf_generate_with_the_cache_equals_recomputation(monkeypatch):
    import rerope.hf as hf
    from rerope import decode
    _, test_hf = _hf()
    model = hf.enable_rerope(test_hf.build(test_hf.tiny_config()), 8, group=4)
    ids = torch.randint(1, test_hf.VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    calls = []
    real = decode.rerope_decode
    monkeypatch.setattr(hf, "rerope_decode",
                        lambda *a, **kw: calls.append(kw.get("group")) or real(*a, **kw))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=3, do_sample=False)
        seq = ids
        for _ in range(3):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq)
    assert calls and set(calls) == {4}


def test_hf_bad_group_and_shifted_positions_raise():
    import rerope.hf as hf
    _, test_hf = _hf()
    model = test_hf.build(test_hf.tiny_config())
    with pytest.raises(ValueError, match="group must divide window"):
        hf.enable_rerope(model, 8, group=3)
    with pytest.raises(ValueError, match="group .* and leaky"):
        hf.enable_rerope(model, 8, leaky=2.0, group=2)
    hf.enable_rerope(model, 8, group=4)
    ids = torch.randint(1, test_hf.VOCAB, (1, 20))
    with pytest.raises(ValueError, match="groups absolute positions"):
        test_hf.logits_of(model, ids, position_ids=torch.arange(3, 23)[None])


# --- the chapter-7 exercise's checker -------------------------------------------------------------


@triton.jit
def _angles_split(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    freqs = tl.arange(0, HALF)[None, :]
    first = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + freqs
    cos_r, sin_r = tl.load(Table + first), tl.load(Table + first + HALF)
    cos_0 = tl.load(Table + start * (2 * HALF) + freqs)
    sin_0 = tl.load(Table + start * (2 * HALF) + HALF + freqs)
    return cos_r * cos_0 - sin_r * sin_0, sin_r * cos_0 + cos_r * sin_0


@triton.jit
def _angles_row_per_key(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = (start + tl.arange(0, BLOCK))[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(Table + rows), tl.load(Table + rows + HALF)


@triton.jit
def _angles_first_tile_only(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(Table + rows), tl.load(Table + rows + HALF)


@triton.jit
def _angles_too_wide(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    return tl.load(Table + rows), tl.load(Table + rows)


@triton.jit
def _angles_one_value(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(Table + rows)


@triton.jit
def _angles_raises(Table, start, BLOCK: tl.constexpr, HALF: tl.constexpr):
    return undefined_name(Table)  # noqa: F821


def test_tile_angles_checker_accepts_the_split_and_rejects_slips():
    from rerope import exercises

    assert exercises.check_tile_angles(_angles_split) == "correct"
    verdict = exercises.check_tile_angles(_angles_row_per_key)
    assert "read table rows other than" in verdict and "tiles 1–3" in verdict, verdict
    assert "wrong on tiles 1–3, keys 16–63" in exercises.check_tile_angles(_angles_first_tile_only)
    for answer in (_angles_too_wide, _angles_one_value, _angles_raises):
        verdict = exercises.check_tile_angles(answer)
        assert "your function raised" in verdict and "(BLOCK, HALF)" in verdict, verdict


# --- GPU: the benchmark's shape ------------------------------------------------------------------


def _float32_reference(leaves, window, **kw):
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False          # a true float32 reference
    try:
        return reference.rerope(*leaves, window, **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_gpu_full_size(dtype, d, rotated):
    """B=1 H=32 N=8192 W=2048 G=8: forward and gradients against a float32 reference on two
    heads; a decode step against a 32k rotated cache (Hq=32, Hkv=8) on the whole row."""
    n, w, g = 8192, 2048, 8
    gen = torch.Generator(device="cuda").manual_seed(d + rotated)
    q, k, v, dout = (torch.randn(1, 32, n, d, device="cuda", dtype=dtype, generator=gen)
                     for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = rerope.rerope(*leaves, w, rotated=rotated, group=g)
    got = dict(zip(NAMES, (out, *torch.autograd.grad(out, leaves, dout))))
    ref_leaves = [t[:, :2].float().requires_grad_() for t in (q, k, v)]
    ref = _float32_reference(ref_leaves, w, rotated=rotated, group=g)
    want = dict(zip(NAMES, (ref, *torch.autograd.grad(ref, ref_leaves, dout[:, :2].float()))))
    tol = tolerance(dtype, "gpu")
    problems = results_problems({name: t[:, :2] for name, t in got.items()}, want, tol)
    if rotated:
        qd = torch.randn(1, 32, 1, d, device="cuda", dtype=dtype, generator=gen)
        kc, vc = (torch.randn(1, 8, 32768, d, device="cuda", dtype=dtype, generator=gen)
                  for _ in range(2))
        with torch.no_grad():
            step = rerope.rerope_decode(qd, kc, vc, w, group=g)
        ref = _float32_reference([t.float() for t in (qd, kc, vc)], w, rotated=True, group=g)
        problems += close_problems("decode", step, ref, tol)
    assert not problems, "\n".join(problems)
