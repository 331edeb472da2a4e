"""Plans of the custom ops' real calls and the host-time shortcuts of issue 18.

CPU, through Triton's interpreter, small shapes:

* ``torch.ops.rerope.rerope_fwd`` / ``rerope_bwd`` (what a compiled graph calls) and the
  five-tensor ops keep a plan per call signature: the second call is a lookup plus the kept
  calls, bit-identical to the first, and new data gives new results;
* a graph compiled with ``torch.compile(fullgraph=True)`` runs through those plans: its second
  step builds no plan and equals its first;
* a call that needs no gradient skips ``torch.autograd.Function`` and equals the autograd
  path's output bit for bit; a call that needs one still gets its ``grad_fn``; the float64
  oracle agrees with both.

The two ways a launch reads ``rerope.rerope``'s operands: two tensor descriptors (TMA) or two
pointer loads, both against the float64 oracle.

On a GPU (``-m gpu``): every launcher the plans keep is bound to its compiled kernel.
"""

import copy
from dataclasses import asdict

import pytest
import torch

import rerope
from rerope import attention, rotary
from rerope.launch import Launcher
from rerope.reference import rerope_from_relative_positions

from rerope_testing import (F16, C, describe, fused_inputs, fused_results, fused_settings,
                            kernel_device, oracle_results, randn, results_problems, tolerance)

F32 = torch.float32
CUDA = torch.cuda.is_available()
SETTINGS = (5, True, 0.25, 10000.0, None, None, False)     # window, causal, scale, base, ...


def _fused_qkv(gen, b=1, h=2, n=20, d=16, dtype=F32):
    # 20 queries: more than a decode step (rerope.rerope would send 16 or fewer to decoding)
    """q, k, v as strided views of one fused ``Linear`` output (what a model hands the op)."""
    return tuple(randn(gen, b, n, 3, h, d, dtype=dtype, device=kernel_device())
                 .permute(2, 0, 3, 1, 4))


def _op_plans():
    return [plan for plan in attention.PLANS.values()
            if isinstance(plan, attention.OpPlan)]


def _states(plan):
    """A plan's :class:`rerope.attention.PlanState` objects: its own, and an op plan's
    backward's (one per layout of ``out`` and ``lse``)."""
    return [plan.state, *getattr(plan, "backward_states", {}).values()]


def _kept_calls(plan):
    """Which kept calls a plan holds: ``"forward call"``, ``"backward call"``."""
    names = []
    for state in _states(plan):
        names += ["forward call"] * len(state.forward_calls)
        names += ["backward call"] * sum(len(b.calls) for b in state.backward.values())
    return names


def test_plan_state_is_typed(gen):
    """A plan keeps its decisions and launches in typed fields (:class:`rerope.attention.
    PlanState`): after a first call with a gradient, the grid order, both pre-turn decisions and
    both TMA decisions are made (the forward's in the plan, the backward's per layout of
    ``dout``), the kept forward is filed under the plan's pre-turn decision and the kept
    backward under the backward's, and every launch kept is a :class:`Launcher`. A second call
    with the same shapes builds no plan and creates no launcher."""
    attention.PLANS.clear()
    q, k, v = (t.detach().requires_grad_() for t in _fused_qkv(gen))
    dout = randn(gen, *q.shape, dtype=F32, device=kernel_device())

    def step():
        out = rerope.rerope(q, k, v, 5, leaky=8.0)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    first = step()
    (plan,) = attention.PLANS.values()
    state = plan.state
    assert isinstance(state, attention.PlanState)
    assert state.heads_first is True              # 20 keys: heads first (rerope.Config)
    assert state.preturn_keys is False and state.preturn_backward is False
    assert state.tma is False                     # never under the interpreter
    assert list(state.forward_calls) == [state.preturn_keys]
    (backward,) = state.backward.values()
    assert isinstance(backward, attention.BackwardState) and backward.tma is False
    assert list(backward.calls) == [state.preturn_backward]
    launchers = state.kept_launchers()
    assert launchers and all(isinstance(launcher, Launcher) for launcher in launchers)
    assert all(launcher in launchers for launcher in backward.launchers.values())
    second = step()
    assert attention.PLANS.built == 1 and len(state.backward) == 1
    assert [id(launcher) for launcher in state.kept_launchers()] == list(map(id, launchers))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("leaky", [None, 8.0], ids=["rerope", "leaky"])
def test_fused_ops_reuse_their_plan(leaky, gen):
    """The second call of ``rerope_fwd`` / ``rerope_bwd`` with one signature builds no plan and
    runs the kept forward and backward calls: bit-identical outputs and gradients; other data
    through the same plan gives other results (the kept calls read their inputs)."""
    attention.PLANS.clear()
    settings = (*SETTINGS[:4], leaky, *SETTINGS[5:])
    first, second = _fused_qkv(gen), _fused_qkv(gen)
    dout = randn(gen, *first[0].shape, dtype=F32, device=kernel_device())
    results = []
    for q, k, v in (first, first, second):
        out, lse = torch.ops.rerope.rerope_fwd(q, k, v, *settings)
        grads = torch.ops.rerope.rerope_bwd(dout, q, k, v, out, lse, *settings)
        results.append((out, lse, *grads))
    (plan,) = _op_plans()
    names = _kept_calls(plan)
    assert "forward call" in names and "backward call" in names, names
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], results[2][0]), "the kept call ignored its inputs"
    # the eager op computes the same (its own plan, the same kernels)
    q, k, v = first
    assert torch.equal(rerope.rerope(q, k, v, 5, sm_scale=0.25, leaky=leaky), results[0][0])


def test_fused_op_backward_keyed_by_out_layout(gen):
    """The backward op's kept call is per layout of ``out`` too: a strided ``out`` (an op's
    caller may pass any) gets its own launchers and the contiguous one's gradients."""
    attention.PLANS.clear()
    q, k, v = _fused_qkv(gen)
    dout = randn(gen, *q.shape, dtype=F32, device=kernel_device())
    out, lse = torch.ops.rerope.rerope_fwd(q, k, v, *SETTINGS)
    want = torch.ops.rerope.rerope_bwd(dout, q, k, v, out, lse, *SETTINGS)
    strided = out.transpose(1, 2).contiguous().transpose(1, 2)
    got = torch.ops.rerope.rerope_bwd(dout, q, k, v, strided, lse, *SETTINGS)
    (plan,) = _op_plans()
    assert len(plan.backward_states) == 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_five_tensor_ops_reuse_their_plan(gen):
    attention.PLANS.clear()
    device = kernel_device()
    tensors = [randn(gen, 1, 2, 20, 16, dtype=F32, device=device) for _ in range(5)]
    dout = randn(gen, 1, 2, 20, 16, dtype=F32, device=device)
    results = []
    for _ in range(2):
        out, lse = torch.ops.rerope.rerope_attention_fwd(*tensors, 4, True, 0.25)
        grads = torch.ops.rerope.rerope_attention_bwd(dout, *tensors, out, lse, 4, True, 0.25)
        results.append((out, lse, *grads))
    assert len(_op_plans()) == 1
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.equal(rerope.rerope_attention(*tensors, 4, sm_scale=0.25), results[0][0])


def test_compiled_block_runs_through_op_plans(gen):
    """A fused-QKV block compiled with ``fullgraph=True`` (``aot_eager``: the compiler's graph
    of custom-op calls, no code generation): its second training step builds no plan, runs the
    kept calls, and equals its first step and the eager block."""
    import torch._dynamo
    from test_generation import Block, _block_results

    torch.manual_seed(0)
    block = Block()
    x = randn(gen, 2, 11, 32, dtype=F32, device=kernel_device())
    eager = _block_results(block, x)
    compiled_block = copy.deepcopy(block)
    torch._dynamo.reset()
    compiled_block.forward = torch.compile(compiled_block.forward, fullgraph=True,
                                           backend="aot_eager")
    attention.PLANS.clear()
    first = _block_results(compiled_block, x)
    plans = _op_plans()
    assert len(plans) == 1, "the compiled graph did not call the ops through one plan"
    second = _block_results(compiled_block, x)
    torch._dynamo.reset()
    assert _op_plans() == plans, "the second compiled step built a new plan"
    names = _kept_calls(plans[0])
    assert "forward call" in names and "backward call" in names, names
    for name in first:
        assert torch.equal(first[name], second[name]), name
    problems = results_problems(first, eager, tolerance(F32))
    assert not problems, "compiled != eager:\n" + "\n".join(problems)


@pytest.mark.parametrize("rotated", [False, True])
def test_no_grad_call_skips_autograd(rotated, gen):
    """Without a gradient the op runs the kernels directly (no autograd node): the same output,
    bit for bit, as a call that records one, and both the float64 oracle's."""
    attention.PLANS.clear()
    q, k, v = _fused_qkv(gen)
    with torch.no_grad():
        plain = rerope.rerope(q, k, v, 6, rotated=rotated)
    assert plain.grad_fn is None
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
    tracked = rerope.rerope(q_, k_, v_, 6, rotated=rotated)
    assert tracked.grad_fn is not None, "a call that needs a gradient lost its autograd node"
    assert torch.equal(plain, tracked.detach())
    plans = list(attention.PLANS.values())
    assert sorted(p.grad for p in plans) == [False, True]
    want = rerope_from_relative_positions(*(t.double().cpu() for t in (q, k, v)), 6,
                                          rotated=rotated)
    problems = results_problems({"out": plain}, {"out": want}, tolerance(F32))
    assert not problems, "\n".join(problems)


def test_no_grad_five_tensor_call_skips_autograd(gen):
    attention.PLANS.clear()
    device = kernel_device()
    tensors = [randn(gen, 1, 2, 9, 16, dtype=F32, device=device) for _ in range(5)]
    with torch.no_grad():
        plain = rerope.rerope_attention(*tensors, 3)
    tracked = rerope.rerope_attention(*(t.clone().requires_grad_() for t in tensors), 3)
    assert plain.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())


def test_config_is_part_of_the_plan_key(gen):
    """A call under another ``rerope.Config`` gets its own plan, made for that configuration;
    back under the first, the first plan serves again (nothing rebuilt)."""
    attention.PLANS.clear()
    q, k, v = _fused_qkv(gen)
    first = rerope.rerope(q, k, v, 5)
    with rerope.using_config(heads_first_max_keys=0) as blocks_first:
        other = rerope.rerope(q, k, v, 5)
    again = rerope.rerope(q, k, v, 5)
    assert attention.PLANS.built == 2 and len(attention.PLANS) == 2
    assert sorted(p.config.heads_first_max_keys for p in attention.PLANS.values()) == sorted(
        [blocks_first.heads_first_max_keys, rerope.config().heads_first_max_keys])
    assert torch.equal(first, other) and torch.equal(first, again)


def test_kernel_signatures_stay_short():
    """The kernels take a tuple per tensor's strides and one flag group per product: the
    forward at most 30 parameters, the backward kernels at most 36."""
    from rerope import backward, forward

    assert len(forward._rerope_fwd_kernel.arg_names) <= 30
    assert len(backward._bwd_dkdv_kernel.arg_names) <= 36
    assert len(backward._bwd_dq_kernel.arg_names) <= 35


def test_wrong_device_still_raises_every_call(gen):
    """The device check moved into the plan: a call on the wrong device raises each time (no
    plan is kept for it)."""
    q, k, v = _fused_qkv(gen)
    wrong = "meta"
    for _ in range(2):
        with pytest.raises(ValueError, match="inputs are on"):
            rerope.rerope(q.to(wrong), k.to(wrong), v.to(wrong), 5)


# --- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("preturn", [False, True], ids=["in_registers", "preturned"])
def test_gpu_plan_launchers_are_bound(preturn, gen):
    """Eagerly and through the ops, every launcher a plan keeps is bound to its compiled kernel
    after the first call, and the second call (bound launches, tables passed as addresses)
    gives the first's results bit for bit; ``preturned``: with the forward's key turn and the
    backward's operand turns (kept turns, :func:`rerope.rotary.kept_turn`)."""
    min_keys = 0 if preturn else 1 << 62
    attention.PLANS.clear()
    q, k, v = (t.to(torch.float16).requires_grad_() for t in _fused_qkv(gen, h=4, n=300, d=64))
    dout = torch.randn_like(q)
    runs = []
    with rerope.using_config(preturn_min_keys=min_keys, preturn_bwd_min_keys=min_keys):
        for _ in range(2):
            out = rerope.rerope(q, k, v, 37, leaky=8.0)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
            o, lse = torch.ops.rerope.rerope_fwd(q, k, v, 37, True, 0.125, 10000.0, 8.0, None,
                                                 False)
            runs[-1] += (o, *torch.ops.rerope.rerope_bwd(dout, q, k, v, o, lse, 37, True,
                                                         0.125, 10000.0, 8.0, None, False))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    launchers = [l for plan in attention.PLANS.values()
                 for l in attention.plan_launchers(plan)]
    assert len(launchers) >= 8 and all(l.bound for l in launchers)
    turns = [launcher for launcher in launchers
             if launcher.kernel is rotary._turn_operands_kernel]
    assert bool(turns) == preturn, turns


# --- the load paths: tensor descriptors (TMA) or pointer loads ---------------------------------


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
        got = fused_results(leaves, dout, case.window, **fused_settings(case))
    want = oracle_results(leaves, dout, case.window, **fused_settings(case))
    problems = results_problems(got, want, tolerance(case.dtype))
    assert not problems, describe(gen, tma=mode, **asdict(case)) + "\n" + "\n".join(problems)
