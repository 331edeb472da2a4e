"""``rerope.rerope``: rotation inside the kernels, against the float64 relative-position oracle.

The oracle (``rerope.reference.rerope_from_relative_positions``) never builds rotated tensors:
it scores every pair straight from ReRoPE's relative position, after rotating ``rotated=True``
inputs back in float64. Forward and ``dq, dk, dv`` are compared with the tolerance table of
``tests/conftest.py``; outputs are allocated poisoned (NaN), so an element a kernel forgets to
write fails. Under the interpreter the tiles are 16 × 16, so ``N = 40 … 100`` crosses every
kind of tile; chunked prefill puts ``Nq`` queries at the last positions of ``Nk`` keys, which
makes the dK/dV kernel's query axis start before its first key block (negative offsets).
"""

import contextlib
from dataclasses import asdict, dataclass

import pytest
import torch

import rerope
from rerope import reference
from rerope_testing import (F16, F32, _place, describe, error_stats, log_errors, poisoned_empty,
                            randn, results_problems, tolerance)

BF16 = torch.bfloat16
NAMES = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class FusedCase:
    n_q: int
    n_k: int
    window: int
    rotated: bool = False
    causal: bool = True
    dtype: torch.dtype = F32
    d: int = 32
    batch: int = 1
    hq: int = 1
    hkv: int = 1
    leaky: float = None
    logn_len: float = None
    layout: str = "contiguous"

    def id(self):
        parts = [f"Nq{self.n_q}", f"Nk{self.n_k}", f"w{self.window}",
                 "rotated" if self.rotated else "raw", "causal" if self.causal else "full",
                 str(self.dtype).replace("torch.", ""), f"D{self.d}"]
        if (self.batch, self.hq, self.hkv) != (1, 1, 1):
            parts.append(f"B{self.batch}H{self.hq}kv{self.hkv}")
        if self.leaky is not None:
            parts.append(f"leaky{self.leaky}")
        if self.logn_len is not None:
            parts.append(f"logn{self.logn_len}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts)


def C(n_q, n_k=None, window=9, **kw):
    return FusedCase(n_q, n_q if n_k is None else n_k, window, **kw)


CASES = [
    # both conventions, causal and not, windows against the 16-wide tile grid
    C(50, window=14), C(50, window=14, rotated=True), C(77, window=17, causal=False, dtype=F16),
    C(77, window=17, causal=False, rotated=True, dtype=F16), C(50, window=16, rotated=True),
    C(77, window=31, causal=False), C(50, window=33, rotated=True, causal=False, dtype=F16),
    # window 1 (only the diagonal inside) and window >= N (plain RoPE)
    C(40, window=1, rotated=True), C(40, window=1, causal=False, dtype=F16),
    C(40, window=40), C(40, window=500, rotated=True, causal=False),
    # chunked prefill: 1, 7, 33 queries at the end of 100 keys, both conventions
    C(1, 100, 13), C(1, 100, 13, rotated=True), C(7, 100, 13), C(7, 100, 13, rotated=True,
    dtype=F16), C(33, 100, 13, rotated=True), C(33, 100, 40, causal=False),
    C(33, 100, 13, causal=False, rotated=True, dtype=F16), C(17, 60, 70, rotated=True),
    # Leaky ReRoPE and log-n, both conventions
    C(50, window=9, leaky=4.0), C(50, window=9, leaky=16.0, rotated=True, dtype=F16),
    C(50, window=9, logn_len=8.0), C(40, window=9, logn_len=5.0, rotated=True, causal=False),
    C(33, 70, 9, leaky=3.0, logn_len=8.0, rotated=True), C(33, 70, 9, leaky=3.0, logn_len=8.0),
    # head dims: 16 (halves below tl.dot's minimum: joined), 64, 128
    C(40, window=7, d=16), C(40, window=7, d=16, rotated=True, causal=False, dtype=F16),
    C(40, window=9, d=64, dtype=F16), C(33, 50, 9, d=128, rotated=True, dtype=F16),
    # grouped-query attention and batch
    C(24, window=7, hq=4, hkv=1, rotated=True), C(24, 40, 7, batch=2, hq=4, hkv=2, dtype=F16),
    # layouts: transposed views of (B, N, H, D) buffers, and poisoned strided views
    C(40, window=10, hq=2, hkv=2, layout="transposed", rotated=True, dtype=F16),
    C(24, 40, 10, batch=2, hq=2, hkv=1, layout="poisoned"),
    # bf16 (computed in fp32 by the interpreter; real bf16 on a GPU)
    C(40, window=9, dtype=BF16, rotated=True),
]


def fused_inputs(gen, case, device=None):
    """Leaf ``q, k, v`` in ``case.layout`` and an upstream gradient, on the kernels' device."""
    from rerope_testing import kernel_device

    device = device or kernel_device()
    shapes = [(case.batch, case.hq, case.n_q, case.d), (case.batch, case.hkv, case.n_k, case.d),
              (case.batch, case.hkv, case.n_k, case.d)]
    leaves = [_place(randn(gen, *s, dtype=case.dtype, device=device), case.layout)
              .requires_grad_() for s in shapes]
    dout = randn(gen, *shapes[0], dtype=case.dtype, device=device)
    return leaves, dout


def settings(case):
    return dict(causal=case.causal, leaky=case.leaky, logn_len=case.logn_len,
                rotated=case.rotated)


def fused_results(leaves, dout, window, **kw):
    for t in leaves:
        t.grad = None
    with poisoned_empty():
        out = rerope.rerope(*leaves, window, **kw)
        out.backward(dout)
    return {"out": out.detach(), **{n: t.grad for n, t in zip(NAMES[1:], leaves)}}


def oracle_results(leaves, dout, window, **kw):
    ref = [t.detach().double().requires_grad_() for t in leaves]
    out = reference.rerope_from_relative_positions(*ref, window, **kw)
    out.backward(dout.double())
    return {"out": out.detach(), **{n: t.grad for n, t in zip(NAMES[1:], ref)}}


@pytest.mark.parametrize("case", CASES, ids=FusedCase.id)
def test_matches_oracle(case, gen):
    leaves, dout = fused_inputs(gen, case)
    got = fused_results(leaves, dout, case.window, **settings(case))
    want = oracle_results(leaves, dout, case.window, **settings(case))
    assert {t.dtype for t in got.values()} == {case.dtype}
    log_errors(case.dtype, {n: error_stats(got[n], want[n]) for n in NAMES})
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
@pytest.mark.parametrize("mode", ["off", "on"], ids=["pointers", "descriptors"])
def test_both_load_paths(rotated, mode, gen):
    """The halves are read through two tensor descriptors (TMA) or two pointer loads."""
    from rerope import attention

    case = C(33, 60, 11, rotated=rotated, dtype=F16, hq=2, hkv=1)
    leaves, dout = fused_inputs(gen, case)
    assert attention._use_tma(mode, *leaves, dout) == (mode == "on"), (
        "the path under test is not taken")
    with rerope.using_config(tma=mode):
        got = fused_results(leaves, dout, case.window, **settings(case))
    want = oracle_results(leaves, dout, case.window, **settings(case))
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, tma=mode, **asdict(case)) + "\n" + "\n".join(problems)


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
def test_chunked_prefill_is_the_tail_of_the_full_sequence(rotated, gen):
    """Queries as the last ``Nq`` of ``Nk`` positions give exactly those rows of the full op."""
    q, k, v = (randn(gen, 1, 2, 70, 32, dtype=F32) for _ in range(3))
    full = rerope.rerope(q, k, v, 12, rotated=rotated)
    tail = rerope.rerope(q[:, :, -23:], k, v, 12, rotated=rotated)
    torch.testing.assert_close(tail, full[:, :, -23:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
def test_decode_steps_go_to_the_split_kv_kernel(rotated, gen, monkeypatch):
    """Few causal queries with no gradient wanted take the decode kernel; the result is the
    prefill kernels' (and with a gradient wanted, the prefill kernels run)."""
    from rerope import attention

    q = randn(gen, 1, 4, 3, 32, dtype=F32)
    k, v = (randn(gen, 1, 2, 70, 32, dtype=F32) for _ in range(2))
    calls = []
    real = attention.rerope_decode
    monkeypatch.setattr(attention, "rerope_decode",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        routed = rerope.rerope(q, k, v, 12, rotated=rotated)
    assert calls, "a 3-query causal call under no_grad did not take rerope_decode"
    calls.clear()
    prefill = rerope.rerope(q.requires_grad_(), k, v, 12, rotated=rotated)
    assert not calls, "a call that needs gradients must take the prefill kernels"
    torch.testing.assert_close(routed, prefill.detach(), rtol=1e-5, atol=1e-5)


PRETURN_CASES = [
    C(50, window=9, leaky=4.0),                                        # raw Leaky: both products
    C(33, 70, 13, rotated=True, batch=2, hq=4, hkv=2, dtype=F16, layout="transposed"),
    C(7, 60, 11), C(40, window=9, dtype=BF16, rotated=True, logn_len=8.0),
    # Nk <= w: no outside tile, so only the inside product's keys (raw) or none (rotated) turn
    C(40, window=40, hq=2, hkv=1), C(17, 60, 70, rotated=True, leaky=4.0),
]


@pytest.mark.parametrize("case", PRETURN_CASES, ids=FusedCase.id)
def test_preturned_keys_match_turning_in_registers(case, gen):
    """Long sequences get the keys of each product that turns them turned once, before the
    forward kernel (``attention.preturn_keys``); both ways agree with the oracle and each other."""
    from rerope import attention
    from rerope.runtime import prepare_for_device

    leaves, _ = fused_inputs(gen, case)
    (q, k, v), restore = prepare_for_device(*(t.detach() for t in leaves))
    operands = attention._rotations(case.n_k, case.d, 10000.0, case.window, case.leaky,
                                    case.logn_len, case.rotated, q.device)
    assert operands.flags["TURN_IN"] or operands.flags["TURN_OUT"], "no key is turned here"
    outs = {}
    for preturn in (False, True):
        with poisoned_empty():
            out, _ = attention.rerope_forward(q, q, k, k, v, case.window, case.causal,
                                              case.d ** -0.5, operands, preturn)
        outs[preturn] = restore(out)
    want = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(),
                                                    case.window, **settings(case))
    for preturn, out in outs.items():
        problems = results_problems({"out": out}, {"out": want}, tolerance(case.dtype))
        assert not problems, describe(gen, preturn=preturn, **asdict(case)) + "\n" + "\n".join(
            problems)
    scale = want.abs().max().item()
    assert (outs[True].double() - outs[False].double()).abs().max().item() <= 1e-3 * scale


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
def test_preturn_skips_the_product_with_no_tile(rotated, gen, monkeypatch):
    """At ``Nk <= w`` no pair is ``w`` apart, so the outside product has no tile: pre-turned,
    the forward and the backward turn only the inside product's operands (raw inputs) or none
    at all (rotated), and the results still match the oracle."""
    from rerope import attention

    seen = []
    real = attention.turn_operands
    monkeypatch.setattr(attention, "turn_operands", lambda x, inside, outside, *a, **kw: (
        seen.append((inside is not None, outside is not None)) or real(x, inside, outside, *a,
                                                                        **kw)))
    case = C(20, 24, window=24, hq=2, hkv=1, rotated=rotated, dtype=F16)
    leaves, dout = fused_inputs(gen, case)
    with rerope.using_config(preturn_min_keys=0, preturn_bwd_min_keys=0,
                             preturn_bwd_max_bytes=1 << 62):
        got = fused_results(leaves, dout, case.window, **settings(case))
    # raw: the forward's keys, then the backward's q and k, each for the inside product only
    assert seen == ([] if rotated else [(True, False)] * 3), seen
    want = oracle_results(leaves, dout, case.window, **settings(case))
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def test_turn_keys_is_rope_at_the_table_speed(gen):
    """``turn_keys`` rotates row ``j`` by ``R(speed · j)``: RoPE at position ``speed · j``."""
    from rerope.rope import apply_rope
    from rerope.rotary import rope_table, turn_keys

    k = _place(randn(gen, 2, 3, 70, 32, dtype=F32), "transposed")
    for speed in (1.0, -1.0, 0.25):
        table = rope_table(70, 32, 10000.0, speed, k.device)
        want = apply_rope(k.double(), speed * torch.arange(70, dtype=torch.float64))
        got = turn_keys(k, table)
        assert got.is_contiguous() and got.dtype == k.dtype
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_rotated_inputs_are_raw_inputs_rotated(gen):
    """``rotated=True`` on RoPE-rotated ``q, k`` equals ``rotated=False`` on the raw ones."""
    from rerope.rope import apply_rope

    q, k, v = (randn(gen, 1, 2, 45, 32, dtype=F32) for _ in range(3))
    pos = torch.arange(45, dtype=torch.float64)
    raw = rerope.rerope(q, k, v, 10, leaky=8.0)
    turned = rerope.rerope(apply_rope(q, pos), apply_rope(k, pos), v, 10, leaky=8.0,
                           rotated=True)
    torch.testing.assert_close(turned, raw, rtol=1e-5, atol=1e-5)


def test_rotation_plan_products_match_relative_positions():
    """The speed/offset table of ``rerope.rotary``: with keys turned by ``speed·j`` and queries
    by ``speed·i + offset``, on inputs that already carry ``c·p`` (``c = 1`` if rotated), a
    product sees relative position ``(speed + c)(i − j) + offset`` — ``i − j`` inside the
    window, ``w`` (ReRoPE) or ``w + (i − j − w)/κ`` (Leaky) outside."""
    from rerope.rotary import rotation_plan

    w = 11
    i, j = torch.meshgrid(torch.arange(60.0), torch.arange(60.0), indexing="ij")
    for rotated in (False, True):
        c = 1.0 if rotated else 0.0
        for leaky in (None, 4.0):
            inside, outside = rotation_plan(w, leaky, rotated)
            far = torch.full_like(i, float(w)) if leaky is None else w + (i - j - w) / leaky
            for rot, want in ((inside, i - j), (outside, far)):
                seen = ((rot.speed + c) * i + rot.offset) - (rot.speed + c) * j
                torch.testing.assert_close(seen, want)


def test_tables_are_shared_and_long_enough():
    from rerope.rotary import rope_table

    a = rope_table(100, 32, 10000.0, 1.0, "cpu")
    assert a.shape[0] >= 100 + 256 and a.shape[0] % 4096 == 0 and a.dtype == F32
    assert rope_table(50, 32, 10000.0, 1.0, "cpu") is a            # cached, shared
    angles = torch.arange(a.shape[0], dtype=torch.float64)[:, None] * \
        rerope.rope.rope_frequencies(32)[None, :]
    torch.testing.assert_close(a, torch.cat((angles.cos(), angles.sin()), -1).float())


def test_no_grad_and_requires_grad_flags(gen):
    q, k, v = (randn(gen, 1, 1, 20, 16, dtype=F32) for _ in range(3))
    with torch.no_grad():
        assert not rerope.rerope(q, k, v, 5).requires_grad
    out = rerope.rerope(q.requires_grad_(), k, v, 5)
    assert out.requires_grad and out.grad_fn is not None


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


# --- the backward on pre-turned operands (attention.preturn_backward) -----------------------------


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


@pytest.mark.parametrize("case", CASES, ids=FusedCase.id)
def test_preturned_backward_matches_oracle(case, gen, backward_path):
    """The grid of ``test_matches_oracle`` with the backward on pre-turned operands."""
    calls = backward_path("preturned")
    leaves, dout = fused_inputs(gen, case)
    got = fused_results(leaves, dout, case.window, **settings(case))
    # rotated inputs at Nk <= w: only the outside product would change an operand, and it has
    # no tile, so there is nothing to pre-turn (attention._has_outside)
    nothing = case.rotated and case.logn_len is None and case.n_k <= case.window
    assert len(calls) == (0 if nothing else 2), "the backward did not pre-turn q and k"
    want = oracle_results(leaves, dout, case.window, **settings(case))
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
        got[path] = fused_results(leaves, dout, case.window, **settings(case))
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
        got[path] = fused_results(leaves, dout, case.window, **settings(case))
    assert torch.equal(got["in_registers"]["dq"], got["preturned"]["dq"])
    problems = results_problems(got["preturned"], got["in_registers"], tolerance(case.dtype),
                                names=["dk", "dv"])
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def _rotations_for(case, device="cpu"):
    from rerope import attention

    return attention._rotations(case.n_k, case.d, 10000.0, case.window, case.leaky,
                                case.logn_len, case.rotated, device)


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
def test_turn_operands_keys_are_turn_keys_bit_for_bit(rotated, gen):
    """Keys pre-turned for the backward are the forward's pre-turned keys (``turn_keys``), bit
    for bit; a product that does not turn keys gets ``k`` itself (no copy)."""
    from rerope.rotary import turn_keys, turn_operands

    case = C(70, window=9, rotated=rotated, leaky=4.0, dtype=F16)
    k = _place(randn(gen, 2, 3, 70, 32, dtype=F16), "transposed")
    ops = _rotations_for(case)
    tab_in, off_in, tab_out, off_out = ops.tables
    k1, k2 = turn_operands(k, (tab_in, off_in, ops.flags["TURN_IN"], False),
                           (tab_out, off_out, ops.flags["TURN_OUT"], False))
    for turned, table, turns in ((k1, tab_in, ops.flags["TURN_IN"]),
                                 (k2, tab_out, ops.flags["TURN_OUT"])):
        if turns:
            assert turned.is_contiguous() and turned.dtype == k.dtype
            assert torch.equal(turned, turn_keys(k, table))
        else:
            assert turned is k
    plain = C(70, window=9, rotated=rotated)            # ReRoPE: one product turns no keys
    ops = _rotations_for(plain)
    k1, k2 = turn_operands(k, (ops.tables[0], ops.tables[1], ops.flags["TURN_IN"], False),
                           (ops.tables[2], ops.tables[3], ops.flags["TURN_OUT"], False))
    assert (k1 is k) != (k2 is k)


@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
@pytest.mark.parametrize("logn_len", [None, 8.0], ids=["plain", "logn"])
def test_turn_operands_queries_are_rope_at_each_products_angle(rotated, logn_len, gen):
    """Query row ``r`` at position ``p = Nk − Nq + r``, for each product: scaled by log-n, then
    RoPE at ``speed · p + offset`` (float64 oracle); one that changes nothing returns ``q``."""
    from rerope.rope import apply_rope
    from rerope.rotary import logn_factor, rotation_plan, turn_operands

    case = C(23, 60, 9, rotated=rotated, leaky=4.0 if rotated else None, logn_len=logn_len)
    q = _place(randn(gen, 1, 4, 23, 32, dtype=F32), "transposed")
    ops = _rotations_for(case)
    tab_in, off_in, tab_out, off_out = ops.tables
    f = ops.flags
    turned = turn_operands(q, (tab_in, off_in, f["TURN_IN"], f["SHIFT_IN"]),
                           (tab_out, off_out, f["TURN_OUT"], f["SHIFT_OUT"]), 60 - 23,
                           logn_factor(logn_len))
    positions = torch.arange(37, 60, dtype=torch.float64)
    scale = (torch.ones_like(positions) if logn_len is None else
             (torch.log(positions + 1) / torch.log(torch.tensor(logn_len))).clamp(min=1))
    for got, rot in zip(turned, rotation_plan(case.window, case.leaky, rotated)):
        if not (rot.rotates_queries or logn_len):
            assert got is q
            continue
        want = apply_rope(q.double() * scale[:, None], rot.speed * positions + rot.offset)
        assert got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_preturn_policy_and_extra_bytes(gen):
    """The extra memory is one ``q``-sized tensor per product that changes its query operand and
    one ``k``-sized per product that turns keys; over the byte limit, or below
    ``preturn_bwd_min_keys`` keys, the backward turns tiles in registers."""
    from rerope import attention

    q = torch.empty(2, 4, 10, 32, dtype=F16)
    k = torch.empty(2, 2, 30, 32, dtype=F16)
    qb, kb = q.numel() * 2, k.numel() * 2
    for kw, want in ((dict(), 2 * qb + kb), (dict(rotated=True), qb + kb),
                     (dict(leaky=4.0), 2 * qb + 2 * kb), (dict(rotated=True, logn_len=8.0),
                                                          2 * qb + kb)):
        ops = _rotations_for(C(10, 30, 5, d=32, **kw))
        assert attention._preturned_shapes(q, k, ops)[1] == want, kw
        # no pair w or more apart (Nk <= w): the outside product's operands are not written
        inside_only = {(): qb + kb, ("rotated",): 0, ("leaky",): qb + kb,
                       ("logn_len", "rotated"): qb}[tuple(sorted(kw))]
        assert attention._preturned_shapes(q, k, ops, outside=False)[1] == inside_only, kw
    # the forward's keys: from preturn_min_keys keys on, where a key tile is read at least
    # twice (q_per_kv · cdiv(Nq, 128) programs)
    m = rerope.config().preturn_min_keys
    assert attention.preturn_keys(m, 4096) and not attention.preturn_keys(m - 1, 4096)
    assert not attention.preturn_keys(m, 128) and attention.preturn_keys(m, 129)
    assert attention.preturn_keys(m, 1, q_per_kv=2)
    assert not attention.preturn_keys(m, 1, q_per_kv=1)
    with rerope.using_config(preturn_bwd_max_bytes=1000) as config:
        assert attention.preturn_memory_limit("cpu") == 1000
        assert attention.preturn_backward(1 << 20, 1000, "cpu")
        assert not attention.preturn_backward(1 << 20, 1001, "cpu")
        assert not attention.preturn_backward(config.preturn_bwd_min_keys - 1, 0, "cpu")


def test_backward_falls_back_to_registers_when_memory_is_tight(gen, backward_path):
    """Long enough to pre-turn, but over the byte limit: the in-register path runs, and is right."""
    calls = backward_path("preturned", preturn_bwd_max_bytes=0)
    case = C(40, window=9, rotated=True)
    leaves, dout = fused_inputs(gen, case)
    got = fused_results(leaves, dout, case.window, **settings(case))
    assert not calls, "pre-turned although over the byte limit"
    want = oracle_results(leaves, dout, case.window, **settings(case))
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
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False          # a true float32 reference
    try:
        ref = torch.autograd.grad(reference.rerope(*leaves, w, rotated=rotated), leaves,
                                  dout[:, :2].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    want = dict(zip(NAMES[1:], ref))
    for p in (False, True):
        problems += results_problems({n_: g[:, :2] for n_, g in grads[p].items()}, want, tol)
    assert not problems, "\n".join(problems)
