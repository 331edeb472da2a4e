"""Fast generation (issue 18): plans per call signature, custom ops that compile, static caches.

CPU, through Triton's interpreter, small shapes:

* the plan caches: a repeated call hits, a changed stride, dtype or setting misses, the caches
  stay bounded;
* ``torch.library.opcheck`` of every op over the layouts models hand them: fused-QKV views
  (``qkv(x).view(B, N, 3, H, D).permute(2, 0, 3, 1, 4)``), ``(B, N, H, D).transpose(1, 2)``
  views, a slice of a preallocated cache;
* ``torch.compile(fullgraph=True)`` of a fused-QKV attention block, forward and backward, equal to
  eager (and to the float64 oracle);
* a Hugging Face model with a static cache (``cache_implementation="static"``), eager and with
  ``torch.compile(model.forward, fullgraph=True)``: the same tokens as the dynamic cache.

On a GPU (``-m gpu``): the same block compiled by Inductor (also with CUDA graphs,
``mode="reduce-overhead"``, training steps), and a static-cache ``generate`` whose
forward is compiled with ``mode="reduce-overhead"`` (CUDA graphs around the decode kernel).
"""

import copy

import pytest
import torch

import rerope
from rerope import attention, decode
from rerope.caches import LRUCache
from rerope.reference import rerope_from_relative_positions

from benchmarks import compile_block
from conftest import kernel_device, randn, results_problems, tolerance

F32 = torch.float32
CUDA = torch.cuda.is_available()


def _qkv(gen, b=1, hq=2, hkv=1, n=12, d=16, dtype=F32, n_queries=None):
    device = kernel_device()
    return (randn(gen, b, hq, n_queries or n, d, dtype=dtype, device=device),
            randn(gen, b, hkv, n, d, dtype=dtype, device=device),
            randn(gen, b, hkv, n, d, dtype=dtype, device=device))


# --- plans ----------------------------------------------------------------------------------------


def test_plan_cache_hits_and_misses(gen):
    """A repeated call reuses its plan; a changed stride, dtype or setting builds a new one."""
    attention.PLANS.clear()
    q, k, v = _qkv(gen)
    first = rerope.rerope(q, k, v, 5, causal=False)
    assert len(attention.PLANS) == 1
    again = rerope.rerope(q.clone(), k.clone(), v.clone(), 5, causal=False)
    assert len(attention.PLANS) == 1, "the same signature built a second plan"
    assert torch.equal(first, again)
    rerope.rerope(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, 5, causal=False)
    assert len(attention.PLANS) == 2, "a changed stride did not build a new plan"
    rerope.rerope(q.double().float(), k, v, 6, causal=False)
    assert len(attention.PLANS) == 3, "a changed window did not build a new plan"
    with pytest.raises(TypeError, match="window must be an int"):
        rerope.rerope(q, k, v, 5.0, causal=False)      # 5.0 == 5 hashes alike: still checked
    with pytest.raises(TypeError, match="causal must be a bool"):
        rerope.rerope(q, k, v, 5, causal=0)            # 0 == False: still checked


def test_plan_cache_dtype_and_grad_mode(gen):
    """Whether a gradient is needed decides the route to decoding, before any planning: a
    decode step is checked and planned by ``rerope_decode`` alone."""
    attention.PLANS.clear()
    q, k, v = _qkv(gen, n=8, n_queries=2)
    with torch.no_grad():
        rerope.rerope(q, k, v, 3)
    assert len(attention.PLANS) == 0 and attention.PLANS.built == 0, "planned twice"
    q.requires_grad_()
    out = rerope.rerope(q, k, v, 3)
    assert out.requires_grad, "a call needing a gradient took the forward-only decode route"
    assert len(attention.PLANS) == 1


@pytest.mark.parametrize("preturn, rotated", [(False, False), (True, True)],
                         ids=["in_registers-raw", "preturned-rotated"])
def test_repeated_call_runs_the_kept_call(preturn, rotated, gen):
    """From its second call on, a plan runs the forward and backward it kept (launchers and the
    arguments after the tensors; keys and operands pre-turned or not as on the first call):
    the same outputs and gradients, bit for bit, and new data gives new results."""
    min_keys = 0 if preturn else 2 ** 62
    attention.PLANS.clear()
    first, second = _qkv(gen, hq=4, hkv=2, n=24, d=16), _qkv(gen, hq=4, hkv=2, n=24, d=16)
    results = []
    with rerope.using_config(preturn_min_keys=min_keys, preturn_bwd_min_keys=min_keys):
        for data in (first, first, second):
            q, k, v = (t.clone().requires_grad_() for t in data)
            out = rerope.rerope(q, k, v, 7, rotated=rotated)
            results.append((out, *torch.autograd.grad(out, (q, k, v),
                                                      torch.ones_like(out) / 3)))
    (plan,) = attention.PLANS.values()
    calls = plan.state.forward_calls
    backward = [call for kept in plan.state.backward.values() for call in kept.calls.values()]
    assert calls and backward, (calls, backward)
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], results[2][0]), "the kept call ignored its inputs"


def test_plan_cache_is_bounded():
    cache = LRUCache(size=3)
    for i in range(10):
        cache.put(i, object())
        assert len(cache) <= 3
        cache.get(0)                  # the most recently used entry stays
    assert cache.get(9) is not None and cache.get(0) is not None and cache.get(1) is None


def test_decode_plan_key_has_stride_classes(gen):
    """The decode plan is keyed by each stride's class, not its value: a transposed copy
    (every stride still a multiple of 16) reuses the contiguous cache's plan, a padded
    cache (rows 17 elements apart) gets a plan of its own; all three give the same rows."""
    decode.PLANS.clear()
    q, k, v = _qkv(gen, b=2, hq=4, hkv=2, n=40, n_queries=1)
    want = rerope.rerope_decode(q, k, v, 7)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(rerope.rerope_decode(q, k_t, v_t, 7), want)
    assert len(decode.PLANS) == 1
    k_p = torch.cat([k, k[..., :1]], dim=-1)[..., :16]
    v_p = torch.cat([v, v[..., :1]], dim=-1)[..., :16]
    assert k_p.stride(2) == 17
    assert torch.equal(rerope.rerope_decode(q, k_p, v_p, 7), want)
    assert len(decode.PLANS) == 2
    assert decode.decode_plan(q, k, v, 7) is not decode.decode_plan(q, k_p, v_p, 7)


# --- custom ops over layouts ----------------------------------------------------------------------


def _layouts(gen, b=1, h=2, n=12, d=16, dtype=F32):
    """``q, k, v`` in the layouts models produce: views of one fused ``Linear`` output (MHA),
    and ``(B, N, H, D)`` buffers seen as ``(B, H, N, D)``."""
    device = kernel_device()
    fused = randn(gen, b, n, 3, h, d, dtype=dtype, device=device).permute(2, 0, 3, 1, 4)
    bnhd = [randn(gen, b, n, h, d, dtype=dtype, device=device).transpose(1, 2)
            for _ in range(3)]
    return {"fused_qkv": tuple(fused), "bnhd_transposed": tuple(bnhd)}


@pytest.mark.parametrize("layout", ["fused_qkv", "bnhd_transposed"])
def test_opcheck_fused_ops(layout, gen):
    """``torch.library.opcheck`` of the fused forward and backward ops: schema, fake tensors
    (output strides equal the real ones), autograd registration (the ops are not
    differentiable themselves: their outputs carry no gradient; ``rerope.rerope`` gives it),
    AOT dispatch."""
    q, k, v = (t.detach() for t in _layouts(gen)[layout])
    settings = (5, True, 0.25, 10000.0, None, None, False)
    torch.library.opcheck(torch.ops.rerope.rerope_fwd.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *settings))
    out, lse = torch.ops.rerope.rerope_fwd(q.detach(), k.detach(), v.detach(), *settings)
    dout = torch.randn_like(out).transpose(1, 2).contiguous().transpose(1, 2)  # strided too
    torch.library.opcheck(torch.ops.rerope.rerope_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, *settings))


def test_opcheck_decode_op(gen):
    """The decode op on a slice of a preallocated ``(B, Nmax, Hkv, D)`` cache, with lengths."""
    device = kernel_device()
    cache = randn(gen, 2, 2, 48, 2, 16, dtype=F32, device=device)   # (kv, B, Nmax, Hkv, D)
    k_cache, v_cache = (c.transpose(1, 2)[:, :, :40] for c in cache)  # a slice of the buffer
    q = randn(gen, 2, 4, 1, 16, dtype=F32, device=device)
    lengths = torch.tensor([40, 23], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.rerope.rerope_decode.default,
                          (q, k_cache, v_cache, lengths, 9, None, 10000.0, None, None, True,
                           None))


# --- torch.compile of a fused-QKV block -----------------------------------------------------------


def Block():
    """The compile benchmark's fused-QKV block (:class:`benchmarks.compile_block.Block`), small,
    with Leaky ReRoPE: q, k, v are strided views of one buffer, as most models write it."""
    return compile_block.Block(dim=32, heads=2, window=5, leaky=8.0)


def _block_results(block, x):
    block.zero_grad()
    x = x.detach().requires_grad_()
    out = block(x)
    out.square().sum().backward()
    return {"out": out.detach(), "dx": x.grad,
            **{name: p.grad.clone() for name, p in block.named_parameters()}}


def _compiled_block_problems(backend, device, dtype, gen):
    import torch._dynamo

    torch.manual_seed(0)
    block = Block().to(device=device, dtype=dtype)
    x = randn(gen, 2, 19, 32, dtype=dtype, device=device)     # odd N, batch 2
    eager = _block_results(block, x)
    torch._dynamo.reset()
    compiled_block = copy.deepcopy(block)
    compiled_block.forward = torch.compile(compiled_block.forward, fullgraph=True,
                                           backend=backend)
    compiled = _block_results(compiled_block, x)
    torch._dynamo.reset()
    return results_problems(compiled, eager, tolerance(dtype))


def test_compile_fused_qkv_block(gen):
    """``torch.compile(fullgraph=True)`` of the fused-QKV block, forward and backward, equals
    eager: the backward op's fake gradients are contiguous, as the real ones (they used to copy
    the views' strides and fail). ``aot_eager``: the compiler's tracing and fake tensors
    without code generation (cheap on CPU); Inductor runs on the GPU test below."""
    problems = _compiled_block_problems("aot_eager", kernel_device(), F32, gen)
    assert not problems, "compiled != eager:\n" + "\n".join(problems)


def test_compile_block_matches_oracle(gen):
    """The block's attention under compile equals the float64 relative-position oracle."""
    import torch._dynamo

    torch.manual_seed(1)
    block = Block().to(kernel_device())
    x = randn(gen, 1, 13, 32, dtype=F32, device=kernel_device())
    b, n, dim = x.shape
    q, k, v = block.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: rerope.rerope(q, k, v, 5, leaky=8.0), fullgraph=True,
                       backend="aot_eager")
    got = fn(q, k, v).detach()
    torch._dynamo.reset()
    want = rerope_from_relative_positions(*(t.detach().double().cpu() for t in (q, k, v)), 5,
                                          leaky=8.0)
    problems = results_problems({"out": got}, {"out": want}, tolerance(F32))
    assert not problems, "\n".join(problems)


def test_compile_decode_fullgraph(gen):
    """``rerope_decode`` inside ``torch.compile(fullgraph=True)``: an opaque op (no tracing into
    Triton), the same result as eager."""
    import torch._dynamo

    q, k, v = _qkv(gen, b=2, hq=4, hkv=2, n=33, n_queries=1)
    lengths = torch.tensor([33, 20], dtype=torch.int32, device=q.device)
    want = rerope.rerope_decode(q, k, v, 6, cache_seqlens=lengths)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, n: rerope.rerope_decode(q, k, v, 6, cache_seqlens=n),
                       fullgraph=True, backend="aot_eager")
    got = fn(q, k, v, lengths)
    torch._dynamo.reset()
    assert torch.equal(got, want)


# --- Hugging Face: static cache, compiled forward -------------------------------------------------


def _tiny_model(window):
    pytest.importorskip("transformers")
    import rerope.hf as hf
    from test_hf import build, tiny_config

    model = build(tiny_config())
    return hf.enable_rerope(model, window=window)


@pytest.mark.parametrize("prompt", [12, 21])     # prefill by the decode kernel (<= 16) or not
def test_static_cache_generate_equals_dynamic(prompt):
    """``generate(cache_implementation="static")`` gives the dynamic cache's tokens (greedy,
    float32); the final length passes the window, so both products run."""
    model = _tiny_model(window=8)
    torch.manual_seed(3)
    ids = torch.randint(1, 97, (1, prompt), device=kernel_device())
    options = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        dynamic = model.generate(ids, **options)
        static = model.generate(ids, cache_implementation="static", **options)
    assert static.tolist() == dynamic.tolist(), _first_difference(static, dynamic)


def test_static_cache_compiled_generate_equals_dynamic():
    """The same with ``torch.compile(model.forward, fullgraph=True)`` (transformers' recipe,
    without CUDA graphs on the CPU): no graph break anywhere in a step, the prefill of 21 tokens
    by the fused forward, the steps by the decode op on the whole static cache."""
    import torch._dynamo

    model = _tiny_model(window=8)
    torch.manual_seed(3)
    ids = torch.randint(1, 97, (1, 21), device=kernel_device())
    options = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        dynamic = model.generate(ids, **options)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        compiled = model.generate(ids, cache_implementation="static", **options)
        torch._dynamo.reset()
    assert compiled.tolist() == dynamic.tolist(), _first_difference(compiled, dynamic)


def test_dynamic_cache_compiled_forward_generates():
    """``torch.compile(model.forward)`` (not fullgraph) with the default dynamic cache: the
    decode op is opaque to the compiler (it used to trace into Triton's interpreter and fail at
    the first step, issue 24); the mask function's host reads break the graph; the tokens equal
    eager generation."""
    import torch._dynamo

    model = _tiny_model(window=6)
    torch.manual_seed(4)
    ids = torch.randint(1, 97, (1, 9), device=kernel_device())
    options = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        eager = model.generate(ids, **options)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="aot_eager")
        compiled = model.generate(ids, **options)
        torch._dynamo.reset()
    assert compiled.tolist() == eager.tolist(), _first_difference(compiled, eager)


def test_static_cache_refuses_padding():
    model = _tiny_model(window=8)
    ids = torch.randint(1, 97, (2, 10), device=kernel_device())
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="padding"):
        model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=2,
                       do_sample=False)


def _first_difference(got, want):
    got, want = got.tolist()[0], want.tolist()[0]
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return f"first differing token at {index}: {got} vs {want}"


# --- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_compile_fused_qkv_block_inductor(dtype, gen):
    problems = _compiled_block_problems("inductor", "cuda", dtype, gen)
    assert not problems, "compiled != eager:\n" + "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_compile_fused_qkv_block_reduce_overhead(gen):
    """``mode="reduce-overhead"`` (CUDA graphs) of the block, forward and backward through the
    traced autograd Function around the ops: three training steps, each begun with
    ``cudagraph_mark_step_begin`` and its gradients set to ``None`` (as
    ``benchmarks/compile_block.py`` does), each equal to eager."""
    import torch._dynamo

    torch.manual_seed(0)
    block = Block().to(device="cuda", dtype=torch.float16)
    x = randn(gen, 2, 19, 32, dtype=torch.float16, device="cuda")
    eager = _block_results(block, x)
    torch._dynamo.reset()
    compiled_block = copy.deepcopy(block)
    compiled_block.forward = torch.compile(compiled_block.forward, fullgraph=True,
                                           mode="reduce-overhead")
    try:
        for step in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            got = {name: t.clone() for name, t in _block_results(compiled_block, x).items()}
            problems = results_problems(got, eager, tolerance(torch.float16))
            assert not problems, f"step {step}: compiled != eager:\n" + "\n".join(problems)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_launchers_are_bound(gen):
    """On a GPU a repeated call launches through the bound compiled kernels (no Triton Python
    launch path), with bit-identical results."""
    q, k, v = _qkv(gen, b=1, hq=4, hkv=2, n=300, d=64, dtype=torch.float16)
    first = rerope.rerope(q, k, v, 37)
    second = rerope.rerope(q, k, v, 37)
    assert torch.equal(first, second)
    assert all(launcher.bound for launcher in attention._LAUNCHERS.values())
    with torch.no_grad():
        a = rerope.rerope_decode(q[:, :, -1:], k, v, 37)
        b = rerope.rerope_decode(q[:, :, -1:], k, v, 37)
    assert torch.equal(a, b)
    assert decode.decode_plan(q[:, :, -1:], k, v, 37).bound


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_static_generate_reduce_overhead(dtype):
    """transformers' fast-generation recipe: a static cache, whose decode steps ``generate``
    compiles with ``mode="reduce-overhead", fullgraph=True`` (a CUDA graph around each step, the
    decode kernel inside), against eager generation with the dynamic cache (greedy).

    float32: the same tokens. bf16: Inductor's fused RMSNorm, MLP and rounding differ from eager
    (its first H200 run differed at the 19th new token of 24), so the step scores must agree
    within bf16's rounding until the first differing token, and there eager's two best tokens
    must be a near tie."""
    import torch._dynamo
    transformers = pytest.importorskip("transformers")
    import rerope.hf as hf
    from test_hf import build, tiny_config

    model = build(tiny_config(head_dim=64, hidden_size=256, heads=4)).to("cuda", dtype)
    hf.enable_rerope(model, window=32)
    ids = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(3)).to("cuda")
    options = dict(max_new_tokens=24, do_sample=False, output_scores=True,
                   return_dict_in_generate=True)
    config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        dynamic = model.generate(ids, **options)
        torch._dynamo.reset()
        compiled = model.generate(ids, cache_implementation="static", compile_config=config,
                                  **options)
        assert hasattr(model, "_compiled_call"), "generate did not compile the decode steps"
        torch._dynamo.reset()
    got, want = compiled.sequences, dynamic.sequences
    if dtype == torch.float32:
        assert got.tolist() == want.tolist(), _first_difference(got, want)
        return
    new = (got[0, ids.shape[1]:] != want[0, ids.shape[1]:]).nonzero()
    agree = len(dynamic.scores) if len(new) == 0 else int(new[0])
    scale = max(float(s.abs().max()) for s in dynamic.scores)
    for step in range(agree):
        torch.testing.assert_close(compiled.scores[step], dynamic.scores[step], rtol=0,
                                   atol=0.05 * scale, msg=lambda m: f"step {step}: {m}")
    if agree < len(dynamic.scores):
        top = dynamic.scores[agree][0].topk(2).values
        assert float(top[0] - top[1]) <= 0.05 * scale, (
            f"tokens differ at new token {agree} without a near tie: "
            + _first_difference(got, want))
