"""The compiled kernels on a CUDA GPU (skipped without one): ``pytest tests/test_gpu.py -s``.

* ``test_large``: the benchmark's shape, B=1 H=32 N=8192 W=2048, D 64 and 128, fp16 and bf16,
  causal and not, through the production path (autotuned over the configurations that fit the
  GPU); forward and all five gradients against the reference computed on the GPU in float32,
  four heads at a time. Errors per tensor are printed (``-s``) and, if the environment variable
  ``GPU_TEST_REPORT`` names a file, written there as JSON.
* ``test_small_grid``: the CPU grid of ``tests/test_attention.py`` (``CASES``) on the GPU, through
  the production path, float64 reference.
* ``test_every_config``: every configuration ``configs.launch_configs`` gives this GPU, for every
  kernel, on sequences long enough that the big tiles make several tiles per row (fp16, bf16
  and fp32; D 64, 128, 256).
* ``test_backward_is_deterministic``: two backward passes, bit-identical gradients (no atomics);
  ``test_rerope_raw_inputs_on_gpu``: Leaky ReRoPE and log-n through ``rerope.rerope``.

Cost is compilation: every distinct specialization (dtype, D, causal, and Triton's integer
specialization: values equal to 1, multiples of 16) compiles each kernel once per configuration,
a few seconds each on the H200 host (Triton caches them on disk for later calls). With
``REROPE_AUTOTUNE=0`` (one configuration per kernel), roughly: ``-k "large or deterministic or
raw"`` 3 minutes (27 compilations), ``-k small_grid`` 5-6 minutes (27 specializations × 3
kernels), ``-k every_config`` 4-5 minutes (about 30 compilations, plus 7 slow fp32 ones: 3xTF32
dots take ~20 s each; ``-k "every_config and not float32"`` skips them). Without it, the
production path autotunes: about four times the compilations.
"""

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict

import pytest
import torch

import rerope
from rerope_testing import (CASES, F16, GRAD_NAMES, Case, all_launch_configs, describe,
                            error_stats, kernel_results, make_inputs, randn, raw_inputs,
                            reference_results, results_problems, tolerance)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def full_precision_reference():
    """Reference matmuls in true fp32/fp64 (no TF32) while these tests run."""
    was = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


@pytest.fixture(scope="module")
def report():
    """Errors per test and tensor; written to ``$GPU_TEST_REPORT`` after every test (one file
    per pytest-xdist worker, ``NAME.gw0.json`` …, so that parallel workers do not overwrite each
    other's records)."""
    records = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "tests": {}}
    path = os.environ.get("GPU_TEST_REPORT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if path and worker:
        path = f"{os.path.splitext(path)[0]}.{worker}.json"

    def add(name, entry):
        records["tests"][name] = entry
        if path:
            with open(path, "w") as f:
                json.dump(records, f, indent=1)

    return add


def print_errors(title, stats):
    print(f"\n{title}")
    for name, s in stats.items():
        print(f"  {name:4s} max|err| {s['max_abs']:.3e}  max|ref| {s['ref_max']:.3e}  "
              f"max|err|/max|ref| {s['scaled']:.3e}  ||err||/||ref|| {s['rel_norm']:.3e}")


# --- the benchmark shape ---------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_large(head_dim, dtype, causal, gen, report, request):
    batch, heads, n_ctx, window = 1, 32, 8192, 2048
    tensors, dout = make_inputs(gen, batch, heads, heads, n_ctx, head_dim, dtype, device="cuda")
    torch.cuda.synchronize()
    start = time.time()
    got = kernel_results(tensors, dout, window, causal)        # first call autotunes
    torch.cuda.synchronize()
    kernel_s = time.time() - start
    want = reference_results(tensors, dout, window, causal, dtype=torch.float32, head_chunk=4)
    stats = {name: error_stats(got[name], want[name]) for name in ("out",) + GRAD_NAMES}
    title = (f"B={batch} H={heads} N={n_ctx} D={head_dim} W={window} {dtype} "
             f"{'causal' if causal else 'non-causal'} (float32 reference)")
    print_errors(title, stats)
    report(request.node.name, {"shape": dict(B=batch, H=heads, N=n_ctx, D=head_dim, W=window),
                               "dtype": str(dtype), "causal": causal, "errors": stats,
                               "first_call_with_autotune_s": round(kernel_s, 2)})
    problems = results_problems(got, want, tolerance(dtype, "gpu"))
    assert not problems, title + "\n" + "\n".join(problems)


# --- small shapes, many configurations ------------------------------------------------------------


@contextmanager
def forced_configs(index):
    """Launch every kernel with its ``index``-th configuration (wrapping around) instead of
    autotuning. Patches ``configs.launch_configs``; the launcher's per-GPU cache is cleared
    before and after."""
    from rerope import attention, configs

    original = configs.launch_configs

    def one(kernel, head_dim, capability, elem_bytes=2, fused=False, autotune=None):
        found = all_launch_configs(kernel, head_dim, capability, elem_bytes, original, fused)
        return [found[index % len(found)]]

    attention._autotuned.cache_clear()
    configs.launch_configs = one
    try:
        yield
    finally:
        configs.launch_configs = original
        attention._autotuned.cache_clear()


def config_counts(head_dim, dtype):
    capability = torch.cuda.get_device_capability()
    size = torch.tensor([], dtype=dtype).element_size()
    return {k: len(all_launch_configs(k, head_dim, capability, size))
            for k in ("fwd", "dkdv", "dq")}


def check_case(case, gen, context):
    tensors, dout = make_inputs(gen, case.batch, case.hq, case.hkv, case.n, case.d, case.dtype,
                                device="cuda", layout=case.layout)
    got = kernel_results(tensors, dout, case.window, case.causal, case.sm_scale)
    want = reference_results(tensors, dout, case.window, case.causal, case.sm_scale)
    problems = results_problems(got, want, tolerance(case.dtype, "gpu"))
    assert not problems, context + "\n" + "\n".join(problems)
    return {name: error_stats(got[name], want[name]) for name in ("out",) + GRAD_NAMES}


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_small_grid(case, gen, report, request):
    stats = check_case(case, gen, describe(gen, **asdict(case)))
    report(request.node.name, {"case": case.id(), "errors": stats})


# Lengths not multiples of 16 and windows straddling the 64/128-wide tiles; GQA, batch, a
# layout per tensor (q2 strided, k1 poisoned, …).
SWEEP_CASES = [
    Case(333, 100, dtype=F16, d=64, batch=2, hq=4, hkv=2, layout="mixed"),
    Case(300, 129, causal=False, dtype=BF16, d=128, hq=2, hkv=1),
    Case(200, 33, dtype=F16, d=256),
    Case(333, 100, causal=False, dtype=torch.float32, d=64, hq=2, hkv=1),
]


@pytest.mark.parametrize("case", SWEEP_CASES, ids=Case.id)
def test_every_config(case, gen, report, request):
    counts = config_counts(case.d, case.dtype)
    all_stats = {}
    for index in range(max(counts.values())):
        with forced_configs(index):
            all_stats[index] = check_case(case, gen, describe(gen, config_index=index,
                                                              counts=counts, **asdict(case)))
    report(request.node.name, {"case": case.id(), "configs": counts, "errors": all_stats})


def test_backward_is_deterministic(gen):
    tensors, dout = make_inputs(gen, 2, 4, 2, 1000, 64, F16, device="cuda")
    first = kernel_results(tensors, dout, 100, True)
    second = kernel_results(tensors, dout, 100, True)
    for name in ("out",) + GRAD_NAMES:
        assert torch.equal(first[name], second[name]), f"{name} differs between two runs"


def test_rerope_raw_inputs_on_gpu(gen):
    """``rerope.rerope`` with Leaky ReRoPE and log-n on the GPU against the float64 reference."""
    from rerope import reference

    raw = raw_inputs(gen, 1, 4, 2, 500, 64, F16, device="cuda")
    out = rerope.rerope(*raw, 64, leaky=16.0, logn_len=128)
    dout = randn(gen, *out.shape, device="cuda")
    out.backward(dout.to(F16))
    ref_raw = [t.detach().double().requires_grad_() for t in raw]
    want = reference.rerope(*ref_raw, 64, leaky=16.0, logn_len=128)
    want.backward(dout)
    got = {"out": out, **{n: t.grad for n, t in zip(("dq", "dk", "dv"), raw)}}
    want = {"out": want, **{n: t.grad for n, t in zip(("dq", "dk", "dv"), ref_raw)}}
    problems = results_problems(got, want, tolerance(F16, "gpu"))
    assert not problems, "\n".join(problems)


def test_more_heads_than_the_grid_second_axis(gen):
    """B · H past CUDA's 65535 programs on a grid's second axis (2 × 32769 heads of 24 rows):
    the forward, the δ pass and both backward kernels launch (heads on the first axis), and a
    few heads, the last ones included, match the float64 reference computed on them alone."""
    from rerope import attention, reference

    batch, heads, n, d, window = 2, 32769, 24, 16, 7
    assert batch * heads > attention.GRID_Y_MAX
    raw = raw_inputs(gen, batch, heads, heads, n, d, F16, device="cuda")
    out = rerope.rerope(*raw, window)
    dout = randn(gen, *out.shape, device="cuda").to(F16)
    out.backward(dout)
    picks = [0, 1, heads - 1]
    ref_raw = [t.detach()[:, picks].double().requires_grad_() for t in raw]
    want = reference.rerope(*ref_raw, window)
    want.backward(dout[:, picks].double())
    got = {"out": out.detach()[:, picks],
           **{n: t.grad[:, picks] for n, t in zip(("dq", "dk", "dv"), raw)}}
    want = {"out": want, **{n: t.grad for n, t in zip(("dq", "dk", "dv"), ref_raw)}}
    problems = results_problems(got, want, tolerance(F16, "gpu"))
    assert not problems, "\n".join(problems)


# --- the fused-rotation op (rerope.rerope) ------------------------------------------------------


def _fused_check(case, gen, report, name, large=False):
    """``rerope.rerope`` against the float64 relative-position oracle, or (``large``) against
    ``reference.rerope`` in float32 on the GPU (the oracle's per-frequency graph would not fit)."""
    from rerope import reference
    from rerope_testing import fused_inputs, fused_results, oracle_results
    from rerope_testing import fused_settings as settings

    leaves, dout = fused_inputs(gen, case, device="cuda")
    got = fused_results(leaves, dout, case.window, **settings(case))
    if large:
        ref = [t.detach().float().requires_grad_() for t in leaves]
        out = reference.rerope(*ref, case.window, **settings(case))
        out.backward(dout.float())
        want = {"out": out.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), ref)}}
        del out, ref
    else:
        want = oracle_results(leaves, dout, case.window, **settings(case))
    stats = {n: error_stats(got[n], want[n]) for n in got}
    report(name, {"case": case.id(), "errors": stats})
    problems = results_problems(got, want, tolerance(case.dtype, "gpu"))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def _fused_cases():
    from rerope_testing import FUSED_CASES

    return FUSED_CASES


@pytest.mark.parametrize("case", _fused_cases(), ids=lambda c: c.id())
def test_fused_small_grid(case, gen, report, request):
    """The CPU grid of ``rerope.rerope`` (``FUSED_CASES``) on the GPU, float64 oracle."""
    _fused_check(case, gen, report, request.node.name)


def _fused_large_cases():
    from rerope_testing import FusedCase

    return [FusedCase(n_q, 8192, 2048, rotated=rotated, dtype=dtype, d=d, hq=4, hkv=2, **kw)
            for d in (64, 128) for dtype in (F16, BF16) for rotated in (False, True)
            for n_q, kw in ((8192, {}), (1000, dict(leaky=16.0, logn_len=4096.0)))]


@pytest.mark.parametrize("case", _fused_large_cases(), ids=lambda c: c.id())
def test_fused_large(case, gen, report, request):
    """N = 8192, W = 2048 (and a 1000-query chunk with Leaky + log-n); the reference at this
    size is float32 (``reference.rerope``), four query heads, two K/V heads."""
    _fused_check(case, gen, report, request.node.name, large=True)
