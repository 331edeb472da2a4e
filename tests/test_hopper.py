"""The Gluon forward on Hopper (:mod:`rerope.hopper`).

* On every machine: when it runs (:func:`rerope.hopper.applies`, :func:`available`), its
  configuration switch, and that the package never imports the Gluon kernels where they cannot
  run.
* ``test_cross_compile_sm90``: both production kernels compiled for sm_90, no GPU needed, where
  the installed Triton is a 3.6 release (the API they are written for; skipped elsewhere:
  ``make test-floor`` runs it with Triton 3.6).
* GPU (``-m gpu``, on an sm_90 GPU with Triton 3.6): the float64 oracle grid through
  ``rerope_attention`` with the Gluon forward (output, log-sum-exp and the five gradients, whose
  backward reads the Gluon forward's output and log-sum-exp), window boundaries, GQA, batch > 1,
  fp16 and bf16, D 64 and 128; ``rerope.rerope`` through it (raw and rotated ``q, k``, Leaky,
  log-n) against the relative-position oracle; the calls it must leave to the Triton kernels;
  a plan's bound launch on fresh data; and the Gluon and Triton forwards side by side on the
  benchmark's shape.
"""

import sys
from dataclasses import replace

import pytest
import torch
import triton

import rerope
from rerope import attention, configs, hopper, reference
from rerope_testing import (close_problems, error_stats, kernel_results, make_inputs, randn,
                            reference_results, results_problems, tolerance, true_float32)


def _hopper_here():
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and hopper.available()[0])


def _tensors(n, d=64, dtype=torch.float16, hq=2, hkv=2, batch=1, device="cpu"):
    return make_inputs(torch.Generator().manual_seed(0), batch, hq, hkv, n, d, dtype,
                       device=device)[0]


# --- everywhere -------------------------------------------------------------------------------


def test_available_says_why():
    ok, why = hopper.available()
    series = hopper._series(triton.__version__)
    assert ok == (series == hopper.TRITON_SERIES and "rerope.hopper.kernels" in sys.modules)
    assert isinstance(why, str) and why
    if series != hopper.TRITON_SERIES:
        assert "3.6" in why and "rerope.hopper.kernels" not in sys.modules


@pytest.mark.parametrize("version, series", [("3.6.0", (3, 6)), ("3.6.1+git0abc", (3, 6)),
                                             ("3.9.0", (3, 9)), ("nightly", None)])
def test_series(version, series):
    assert hopper._series(version) == series


def test_source_reads_the_file():
    """The book's listings: a kernel function's text, read without importing Gluon."""
    text = hopper.source("_step_pp")
    assert text.startswith("@gluon.jit\ndef _step_pp(") and "return t, ins, masked, lo, hi" in text
    with pytest.raises(ValueError, match="no top-level function 'nope'"):
        hopper.source("nope")


def test_not_on_cpu_tensors():
    assert not hopper.applies(*_tensors(256), True, configs.current())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_what_it_leaves_to_triton_on_this_gpu():
    """Only sm_90 with Triton 3.6 runs it; there, only what it is written for."""
    config = replace(configs.current(), gluon_min_keys=0)
    if not _hopper_here():
        assert not hopper.applies(*_tensors(256, device="cuda"), True, config)
        return
    assert hopper.applies(*_tensors(256, device="cuda"), True, config)
    assert not hopper.applies(*_tensors(256, device="cuda"), False, config)       # not causal
    assert not hopper.applies(*_tensors(200, device="cuda"), True, config)        # N % 128
    assert not hopper.applies(*_tensors(256, d=32, device="cuda"), True, config)  # D
    assert not hopper.applies(*_tensors(256, dtype=torch.float32, device="cuda"), True, config)
    assert not hopper.applies(*_tensors(256, device="cuda"), True, replace(config, gluon=False))
    assert not hopper.applies(*_tensors(256, device="cuda"), True, configs.current())  # too short
    assert not hopper.applies(*_tensors(256, batch=0, device="cuda"), True, config)   # empty
    q1, q2, k1, k2, v = _tensors(256, device="cuda")
    assert not hopper.applies(q1.transpose(2, 3).contiguous().transpose(2, 3), q2, k1, k2, v,
                              True, config)                                       # layout


def test_switch(monkeypatch):
    monkeypatch.setenv("REROPE_GLUON", "off")
    assert configs.Config.from_environment().gluon is False
    monkeypatch.setenv("REROPE_GLUON", "1")
    assert configs.Config.from_environment().gluon is True
    monkeypatch.setenv("REROPE_GLUON", "sometimes")
    with pytest.raises(ValueError, match="REROPE_GLUON"):
        configs.Config.from_environment()
    with pytest.raises(ValueError, match="gluon"):
        configs.Config(gluon="yes")
    with pytest.raises(ValueError, match="gluon_min_keys"):
        configs.Config(gluon_min_keys=-1)
    with pytest.raises(ValueError, match="gluon_turn_queries"):
        configs.Config(gluon_turn_queries=1)
    assert configs.Config().gluon_turn_queries is True


@pytest.mark.parametrize("in_kernel", [False, True], ids=["turned", "queries_in_kernel"])
def test_fused_branch_turns_the_operands(in_kernel, monkeypatch):
    """``rerope.rerope``'s way into the Gluon forward, on any machine: with ``hopper.plan``
    standing in a forward that runs the Triton five-tensor kernel, the operands turned once by
    the plan give ``rerope``'s own result (raw and rotated, Leaky, log-n, GQA), also on a
    plan's later calls (the kept turn), and the backward on that output is the oracle's. With
    ``gluon_turn_queries`` the plan turns only the keys and the stand-in turns the queries as
    its ``q_turn`` says (what the kernel does per tile, here by ``turn_operands``)."""
    from rerope.rotary import turn_operands
    from rerope_testing import (FusedCase, fused_inputs, fused_results, fused_settings,
                                oracle_results)

    calls = []

    def plan(q1, q2, k1, k2, v, window, causal, sm_scale, config, q_turn=None):
        if not config.gluon:
            return False
        assert (q_turn is not None) == in_kernel and q1 is q2
        five = replace(config, gluon=False)

        def forward(q1, q2, k1, k2, v):
            calls.append(tuple(t.shape for t in (q1, q2, k1, k2, v)))
            if q_turn is not None:
                assert q2 is q1
                (first, second, logn), (tab1, off1, tab2, off2, factor) = q_turn
                assert logn == (factor != 0.0)
                q1, q2 = turn_operands(q1, (tab1, off1, *first), (tab2, off2, *second), 0,
                                       factor)
            return attention.rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale,
                                            config=five)
        return forward

    monkeypatch.setattr(hopper, "plan", plan)
    attention.PLANS.clear()
    cases = [FusedCase(24, 24, 7, dtype=torch.float32, hq=4, hkv=2),
             FusedCase(24, 24, 5, rotated=True, dtype=torch.float32, hq=2, hkv=1,
                       leaky=4.0, logn_len=8.0)]
    gen = torch.Generator().manual_seed(3)
    for case in cases:
        for call in range(2):
            leaves, dout = fused_inputs(gen, case)
            with configs.using(gluon_turn_queries=in_kernel):
                got = fused_results(leaves, dout, case.window, **fused_settings(case))
            want = oracle_results(leaves, dout, case.window, **fused_settings(case))
            problems = results_problems(got, want, tolerance(case.dtype))
            assert not problems, f"{case.id()}, call {call}: " + "\n".join(problems)
    assert len(calls) == 4 and all(len(c) == 5 for c in calls)
    attention.PLANS.clear()


# --- cross-compiling for sm_90 ------------------------------------------------------------------

CROSS_COMPILE = r'''
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from rerope import hopper
from rerope.hopper import kernels

# the five tensors as given (q_turn None), and rerope's queries turned in the kernel: rotated
# inputs (the outside product's turn and shift) and raw ones with log-n (both products turn)
Q_TURNS = {torch.float16: [None, ((False, False), (True, True), False)],
           torch.bfloat16: [None, ((True, False), (False, True), True)]}
f32 = torch.empty(8, dtype=torch.float32)
for d, config in sorted(hopper.CONFIGS.items()):
    block_m, block_n, stages, warps, split, pipe, walk, pingpong = config
    fn = kernels.rerope_fwd_lean_kernel if walk == 2 else kernels.rerope_fwd_twice_pp_kernel
    for dtype, q_turn in [(t, f) for t, flags in Q_TURNS.items() for f in flags]:
        gdt = kernels._gl_dtype(dtype)
        t = torch.empty((1024, d), dtype=dtype)
        q = mangle_type(TensorDescriptor.from_tensor(
            t, [block_m // split, d], kernels.smem_layout([block_m // split, d], gdt)))
        kv = mangle_type(TensorDescriptor.from_tensor(
            t, [block_n, d], kernels.smem_layout([block_n, d], gdt)))
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=d, STAGES=stages,
                          CONSUMER_WARPS=warps, STORE_LSE=True, SPLIT=split, Q_TURN=q_turn)
        if walk != 2:
            constexprs.update(PIPE=pipe, PINGPONG=pingpong)
        types = dict(q1_desc=q, q2_desc=q, k1_desc=kv, k2_desc=kv, v_desc=kv, o_desc=q,
                     lse_ptr="*fp32", N="i32", window="i32", qk_scale="fp32", group="i32")
        if q_turn is None:
            constexprs["q_turn"] = None
        else:
            types["q_turn"] = mangle_type((f32, f32, f32, f32, 0.5))
        signature = {a: types.get(a, "constexpr") for a in fn.arg_names}
        src = GluonASTSource(fn, signature, constexprs={
            (fn.arg_names.index(k),): v for k, v in constexprs.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = k.asm["ptx"]
        print(d, str(dtype), q_turn is not None, k.metadata.shared,
              ptx.count("wgmma.mma_async"), ptx.count("cp.async.bulk.tensor"), flush=True)
'''


def test_cross_compile_sm90(tmp_path):
    """Both production kernels compile for sm_90 in fp16 and bf16, with the five tensors as
    given and with ``rerope``'s queries turned in the kernel (``Q_TURN``: rotated; raw with
    log-n), fit its shared memory and issue wgmma and TMA copies (fewer with ``Q_TURN``: one
    Q tile a partition, not two)."""
    from rerope_testing import cross_compile

    if hopper._series(triton.__version__) != hopper.TRITON_SERIES:
        pytest.skip("the Gluon kernels are written for Triton 3.6 (make test-floor)")
    lines = cross_compile(tmp_path, CROSS_COMPILE)
    assert len(lines) == 4 * len(hopper.CONFIGS), lines
    copies = {}
    for line in lines:
        d, dtype, turned, shared, wgmma, tma = line.split()
        assert int(shared) <= 232448, line            # sm_90: 227 KiB a block
        assert int(wgmma) > 0 and int(tma) > 0, line
        copies.setdefault(d, {})[turned] = int(tma)
    assert all(c["True"] < c["False"] for c in copies.values()), copies


# --- on an sm_90 GPU --------------------------------------------------------------------------

@pytest.fixture
def gluon_calls(monkeypatch):
    """Counts the Gluon forward's runs; it runs from any length (``gluon_min_keys=0``)."""
    calls = []
    real = hopper.Forward.__call__

    def counted(self, *args):
        calls.append(args[0].shape)
        return real(self, *args)

    monkeypatch.setattr(hopper.Forward, "__call__", counted)
    rerope.attention.PLANS.clear()
    with configs.using(gluon_min_keys=0):
        yield calls


# (N, window, D, dtype, batch, Hq, Hkv): window boundaries against the 64- and 128-key tiles
# and the 128/192-row query blocks, w = 1, w >= N, GQA and batch > 1.
GRID = [(n, w, d, dt, b, hq, hkv)
        for d in (64, 128) for dt in (torch.float16, torch.bfloat16)
        for n, w, b, hq, hkv in [(128, 1, 1, 2, 2), (256, 63, 2, 4, 2), (384, 128, 1, 3, 1),
                                 (640, 129, 2, 2, 2), (1024, 300, 1, 4, 1),
                                 (1152, 1151, 1, 2, 2), (512, 4096, 1, 2, 1)]]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_here(), reason="needs an sm_90 GPU and Triton 3.6")
@pytest.mark.parametrize("n, window, d, dtype, batch, hq, hkv", GRID,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_oracle_grid(n, window, d, dtype, batch, hq, hkv, gluon_calls):
    gen = torch.Generator().manual_seed(n * 7 + window)
    tensors, dout = make_inputs(gen, batch, hq, hkv, n, d, dtype, device="cuda")
    got = kernel_results(tensors, dout, window)
    assert gluon_calls, "the Gluon forward did not run"
    want = reference_results(tensors, dout, window)
    problems = results_problems(got, want, tolerance(dtype, "gpu"))
    assert not problems, "\n".join(problems)
    with torch.no_grad():
        out, lse = rerope.rerope_attention(*tensors, window, return_lse=True)
    _, ref_lse = reference.rerope_attention_with_lse(*(t.detach().double() for t in tensors),
                                                     window)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    assert torch.equal(out, got["out"])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_here(), reason="needs an sm_90 GPU and Triton 3.6")
def test_left_to_triton(gluon_calls):
    """Not causal, N not a multiple of 128, a transposed layout, fp32, the switch off: the
    Triton forward, correct as ever."""
    gen = torch.Generator().manual_seed(1)
    cases = [dict(n=256, causal=False), dict(n=200), dict(n=256, layout="transposed"),
             dict(n=256, dtype=torch.float32), dict(n=256, off=True)]
    for case in cases:
        tensors, dout = make_inputs(gen, 1, 2, 1, case["n"], 64,
                                    case.get("dtype", torch.float16), device="cuda",
                                    layout=case.get("layout", "contiguous"))
        causal = case.get("causal", True)
        with configs.using(gluon=not case.get("off", False)):
            got = kernel_results(tensors, dout, 77, causal=causal)
        want = reference_results(tensors, dout, 77, causal=causal)
        problems = results_problems(got, want, tolerance(tensors[0].dtype, "gpu"))
        assert not problems, f"{case}: " + "\n".join(problems)
    assert not gluon_calls


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_here(), reason="needs an sm_90 GPU and Triton 3.6")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_large_against_triton(d, dtype, gluon_calls):
    """The benchmark's shape (B1 H32 N8192 W2048): the Gluon and Triton forwards against a
    float32 reference on four heads, and against each other on all 32."""
    gen = torch.Generator().manual_seed(d)
    tensors = [randn(gen, 1, 32, 8192, d, dtype=dtype, device="cuda") for _ in range(5)]
    with torch.no_grad():
        glu, glu_lse = rerope.rerope_attention(*tensors, 2048, return_lse=True)
        with configs.using(gluon=False):
            tri, tri_lse = rerope.rerope_attention(*tensors, 2048, return_lse=True)
    assert gluon_calls
    with true_float32():
        want = reference_results([t[:, :4] for t in tensors], torch.zeros_like(tensors[0][:, :4]),
                                 2048, dtype=torch.float32)["out"]
    tol = tolerance(dtype, "gpu")
    for name, got in (("gluon", glu), ("triton", tri)):
        print(name, d, dtype, error_stats(got[:, :4], want))
        problems = close_problems(name, got[:, :4], want, tol)
        assert not problems, "\n".join(problems)
    assert (glu.float() - tri.float()).abs().max().item() <= 2 * tol.atol
    assert (glu_lse - tri_lse).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_here(), reason="needs an sm_90 GPU and Triton 3.6")
@pytest.mark.parametrize("d", [64, 128])
def test_bound_launch(d, gluon_calls):
    """From its second call a plan's Gluon forward launches through the bound compiled kernel
    (no Triton launch path); on new data of the same layout it is as right as the first."""
    gen = torch.Generator().manual_seed(d + 1)
    for call in range(3):
        tensors = [randn(gen, 2, h, 384, d, dtype=torch.bfloat16, device="cuda")
                   for h in (4, 4, 2, 2, 2)]
        with torch.no_grad():
            out = rerope.rerope_attention(*tensors, 100)
        want = reference_results(tensors, torch.zeros_like(out), 100)["out"]
        problems = close_problems("out", out, want, tolerance(torch.bfloat16, "gpu"))
        assert not problems, f"call {call}: " + "\n".join(problems)
    plans = [p for p in rerope.attention.PLANS._entries.values()
             if getattr(getattr(p, "state", None), "gluon", None)]
    assert len(plans) == 1 and plans[0].state.gluon.launcher.bound
    assert len(gluon_calls) == 3


def _fused_grid():
    from rerope_testing import FusedCase

    f16, bf16 = torch.float16, torch.bfloat16
    return [FusedCase(256, 256, 100, dtype=f16, d=64, batch=2, hq=4, hkv=2),
            FusedCase(384, 384, 129, rotated=True, dtype=bf16, d=64, hq=2, hkv=1),
            FusedCase(256, 256, 64, rotated=True, dtype=f16, d=128, hq=2, hkv=2, leaky=4.0,
                      logn_len=128.0),
            FusedCase(384, 384, 1, dtype=bf16, d=128, hq=3, hkv=1, leaky=16.0),
            FusedCase(256, 256, 500, rotated=True, dtype=f16, d=64, hq=2, hkv=1),
            FusedCase(512, 512, 200, dtype=bf16, d=64, batch=2, hq=2, hkv=2, logn_len=64.0)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_here(), reason="needs an sm_90 GPU and Triton 3.6")
@pytest.mark.parametrize("in_kernel", [False, True], ids=["turned", "queries_in_kernel"])
@pytest.mark.parametrize("case", _fused_grid(), ids=lambda c: c.id())
def test_fused_oracle(case, in_kernel, gluon_calls):
    """``rerope.rerope`` (raw or rotated ``q, k``, Leaky ReRoPE, log-n, GQA, w = 1, w >= N)
    through the Gluon forward (its operands turned by a pass; with ``gluon_turn_queries`` the
    keys by a pass, the queries in the kernel), and the Triton backward on its output and
    log-sum-exp: against the float64 relative-position oracle."""
    from rerope_testing import fused_inputs, fused_results, fused_settings, oracle_results

    gen = torch.Generator().manual_seed(case.n_q + case.window)
    leaves, dout = fused_inputs(gen, case, device="cuda")
    with configs.using(gluon_turn_queries=in_kernel):
        got = fused_results(leaves, dout, case.window, **fused_settings(case))
    assert gluon_calls, "the Gluon forward did not run"
    want = oracle_results(leaves, dout, case.window, **fused_settings(case))
    problems = results_problems(got, want, tolerance(case.dtype, "gpu"))
    assert not problems, "\n".join(problems)
