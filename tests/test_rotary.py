"""``rerope.rotary``: RoPE turned by tables (speeds, offsets, the cos/sin table), keys and
queries turned once before the kernels (pre-turned) or tile by tile in registers.

CPU, Triton's interpreter; the cases are ``rerope.rerope``'s (``FusedCase`` of
``tests/conftest.py``), judged against the float64 relative-position oracle.
"""

from dataclasses import asdict

import pytest
import torch

import rerope
from rerope import reference
from rerope_testing import (BF16, C, F16, F32, FusedCase, _place, describe, fused_inputs,
                            fused_results, fused_settings, oracle_results, poisoned_empty, randn,
                            results_problems, tolerance)


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
                                                    case.window, **fused_settings(case))
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
        got = fused_results(leaves, dout, case.window, **fused_settings(case))
    # raw: the forward's keys, then the backward's q and k, each for the inside product only
    assert seen == ([] if rotated else [(True, False)] * 3), seen
    want = oracle_results(leaves, dout, case.window, **fused_settings(case))
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


@pytest.mark.parametrize("heads_per_program", [2, 4])
def test_turn_kernel_several_heads_a_program_bit_for_bit(heads_per_program, gen):
    """``_turn_operands_kernel`` turning several heads a program (``HEADS``: the table rows
    read once for all of them) writes what one head a program writes, bit for bit: both
    products, log-n and a shift, batch 2 of 8 heads, a ragged last block of rows."""
    import triton

    from rerope.rotary import _turn_operands_kernel, logn_factor

    case = C(23, 60, 9, rotated=True, leaky=4.0, logn_len=8.0)
    ops = _rotations_for(case)
    f = ops.flags
    x = _place(randn(gen, 2, 8, 23, 32, dtype=F16), "transposed")
    outs = {}
    for group in (1, heads_per_program):
        y1, y2 = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        _turn_operands_kernel[(2 * 8 // group, triton.cdiv(23, 16))](
            x, y1, y2, ops.tables, x.stride(), 8, 23, 60 - 23, logn_factor(8.0), HEAD_DIM=32,
            BLOCK=16, HEADS=group, LOGN=True, FIRST=(f["TURN_IN"], f["SHIFT_IN"]),
            SECOND=(f["TURN_OUT"], f["SHIFT_OUT"]))
        outs[group] = (y1, y2)
    for one, several in zip(outs[1], outs[heads_per_program]):
        assert not one.isnan().any()
        assert torch.equal(one, several)


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
