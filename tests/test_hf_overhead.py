"""Overhead around the kernels (issue 37): what ``torch.compile`` traces and guards, and what a
Hugging Face generation step does per layer besides launching. Fast CPU tests, no timing:

* a compiled fused-QKV block traces no table building and no module-level cache: its graph
  returns the block's output only, Dynamo puts no guard on the package's caches (such a guard
  fails whenever an eager call elsewhere adds an entry), and an eager call at another shape
  between two compiled calls causes no recompile; the guards on the package stay bounded;
* the backward op hands ``dout`` to the kernels with its own strides (no hidden copy);
* a call of the ops (what a compiled graph runs per step) costs their implementation's Python
  and nothing around it, and compiled gradients still equal eager ones;
* a generation step reads no ``position_ids`` values (on a GPU a host sync per step) unless
  log-n or Self-Extend need them, and gives the same result as without them;
* a decode over a growing cache through ``rerope.hf`` keeps one decode plan
  (``rerope.decode.PLANS.built``).
"""

import copy

import pytest
import torch

import rerope
from rerope import attention, decode

from benchmarks import compile_block
from conftest import kernel_device

CACHE_NAMES = ("_OPERANDS", "_TABLES", "_OFFSETS", "PLANS", "_LAUNCHERS", "_STEPS", "_CLASSES",
               "_entries")
# Guards on names in the package (functions and constants the traced code reads: checks, flags,
# the ops) at this block: 75 on torch 2.13 (2026-12-05, before: 125 with 29 on caches).
MAX_PACKAGE_GUARDS = 100


def Block():
    """The compile benchmark's fused-QKV block (:class:`benchmarks.compile_block.Block`), small."""
    return compile_block.Block(dim=32, heads=2, window=5)


@pytest.fixture
def dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def test_traced_block_builds_no_tables_and_guards_no_cache(dynamo):
    """The traced plan reads settings only: no rotation tables built in the graph (they were
    returned from it and written into the package's caches by Dynamo after every call), no guard
    on a module-level cache, few guards on the package."""
    torch.manual_seed(0)
    block = Block().to(kernel_device())
    x = torch.randn(2, 19, 32, device=kernel_device())
    explained = dynamo.explain(block)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    (graph,) = explained.graphs
    output = next(node for node in graph.graph.nodes if node.op == "output")
    assert len(output.args[0]) == 1, f"the graph returns more than the block's output: {output}"
    traced = {str(getattr(node.target, "__name__", node.target)) for node in graph.graph.nodes
              if node.op in ("call_function", "call_method")}
    assert not traced & {"arange", "cos", "sin", "cat", "pow"}, f"table building traced: {traced}"
    guards = [g.name for g in explained.out_guards]
    on_caches = [n for n in guards if "rerope" in n and any(c in n for c in CACHE_NAMES)]
    assert not on_caches, f"guards on the package's caches: {on_caches}"
    on_package = [n for n in guards if "rerope" in n]
    assert len(on_package) <= MAX_PACKAGE_GUARDS, f"{len(on_package)} guards on the package"


def test_no_recompile_after_eager_call_at_another_shape(dynamo):
    """compiled(x), then the block eagerly at another length (new plans, tables and operands in
    the package's caches), then compiled(x): one frame compiled, and the same output."""
    torch.manual_seed(0)
    block = Block().to(kernel_device())
    x = torch.randn(1, 19, 32, device=kernel_device())
    other = torch.randn(1, 27, 32, device=kernel_device())
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    compiled = torch.compile(block, backend=backend)
    with torch.no_grad():
        first = compiled(x)
        block(other)
        again = compiled(x)
    assert len(frames) == 1, f"{len(frames)} frames compiled: an eager call made Dynamo recompile"
    assert torch.equal(first, again)


def test_backward_op_passes_dout_strides_through(monkeypatch, gen):
    """``rerope_bwd`` gives the kernels ``dout`` as it comes (a transposed view, say), not a
    contiguous copy: the kernels take strides, and a copy is one more kernel per backward."""
    device = kernel_device()
    q, k, v = (torch.randn(1, 6, 2, 16, generator=gen).to(device).transpose(1, 2)
               for _ in range(3))
    settings = (5, True, 0.25, 10000.0, None, None, False)
    out, lse = torch.ops.rerope.rerope_fwd(q, k, v, *settings)
    dout = torch.randn(1, 6, 2, 16, generator=gen).to(device).transpose(1, 2)
    seen = []
    real = attention.rerope_backward

    def spy(dout_given, *args, **kwargs):
        seen.append((dout_given.stride(), dout_given.data_ptr()))
        return real(dout_given, *args, **kwargs)

    monkeypatch.setattr(attention, "rerope_backward", spy)
    got = torch.ops.rerope.rerope_bwd(dout, q, k, v, out, lse, *settings)
    monkeypatch.undo()
    assert seen == [(dout.stride(), dout.data_ptr())]
    want = torch.ops.rerope.rerope_bwd(dout.contiguous(), q, k, v, out, lse, *settings)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _python_calls(fn):
    """Python function calls made by ``fn()`` (``sys.setprofile``: deterministic)."""
    import sys

    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame) if event == "call" else None)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(calls)


def test_op_call_costs_its_body_alone(monkeypatch, gen):
    """What a compiled graph runs per step: ``torch.ops.rerope.rerope_fwd`` makes (nearly) no
    Python calls besides its implementation's (plan lookup, allocation, launch): no Python
    autograd kernel, redispatch or wrapper (``torch.library.custom_op`` added 14, about
    10 µs per call on the CPU). Launches are skipped: only the Python around them counts."""
    from rerope import launch

    monkeypatch.setattr(launch.Launcher, "_slow_launch", lambda self, args: None)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen).to(kernel_device()) for _ in range(3))
    settings = (5, True, 0.25, 10000.0, None, None, False)
    op = torch.ops.rerope.rerope_fwd.default
    with torch.no_grad():
        op(q, k, v, *settings)
        body = _python_calls(lambda: attention._fused_fwd_impl(q, k, v, *settings))
        through_op = _python_calls(lambda: op(q, k, v, *settings))
    assert through_op <= body + 2, f"{through_op} Python calls through the op, {body} in its body"


@pytest.mark.parametrize("five", [False, True], ids=["rerope", "rerope_attention"])
def test_compiled_gradients_come_from_the_backward_op(dynamo, five, gen):
    """Compiled (``aot_eager``, fullgraph), ``rerope`` and ``rerope_attention`` get their
    gradient from the traced autograd Function around the ops (the ops themselves are not
    differentiable): forward and gradients equal eager, ``lse`` included."""
    device = kernel_device()
    tensors = [torch.randn(1, 2, 21, 16, generator=gen).to(device) for _ in range(5 if five
                                                                                  else 3)]

    def fn(*ts):
        if five:
            return rerope.rerope_attention(*ts, 6, return_lse=True)
        return rerope.rerope(*ts, 6, leaky=4.0, return_lse=True)

    results = []
    for run in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        inputs = [t.clone().requires_grad_() for t in tensors]
        out, lse = run(*inputs)
        out.square().sum().backward()
        results.append((out.detach(), lse, *(t.grad for t in inputs)))
    assert not results[1][1].requires_grad
    op = torch.ops.rerope.rerope_attention_fwd if five else torch.ops.rerope.rerope_fwd
    settings = (6, True, 0.25) if five else (6, True, 0.25, 10000.0, 4.0, None, False)
    out, _ = op(*(t.clone().requires_grad_() for t in tensors), *settings)
    assert not out.requires_grad          # the op alone: no gradient (a fallthrough), no warning
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- Hugging Face generation steps ----------------------------------------------------------------

transformers_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None,
    reason="Hugging Face transformers is not installed")


class _Layer(torch.nn.Module):
    is_causal = True


@transformers_missing
def test_generation_step_reads_no_positions(gen):
    """A one-token step without log-n or Self-Extend never reads ``position_ids``' values (on a
    GPU a host sync per step): a meta tensor, which has none, is accepted, and the result is the
    one without positions. Log-n needs them: there they are read (and the meta tensor fails)."""
    import rerope.hf as hf

    device = kernel_device()
    q = torch.randn(1, 4, 1, 16, generator=gen).to(device)
    k, v = (torch.randn(1, 2, 23, 16, generator=gen).to(device) for _ in range(2))
    meta = torch.empty(1, 1, dtype=torch.long, device="meta")
    for settings in (hf.Settings(8), hf.Settings(8, leaky=4.0)):
        want, _ = hf.rerope_attention_forward(settings, _Layer(), q, k, v, None)
        got, _ = hf.rerope_attention_forward(settings, _Layer(), q, k, v, None,
                                             position_ids=meta)
        assert torch.equal(got, want)
    with pytest.raises(Exception):
        hf.rerope_attention_forward(hf.Settings(8, logn_len=16.0), _Layer(), q, k, v, None,
                                    position_ids=meta)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        hf.rerope_attention_forward(hf.Settings(8), _Layer(), q, k, v, None,
                                    position_ids=torch.zeros(1, 2, dtype=torch.long))


@transformers_missing
def test_growing_cache_generation_keeps_one_decode_plan():
    """``generate`` with the dynamic cache: every step's cache is one token longer, and every
    layer's step is served by the one decode plan (``rerope.decode.PLANS.built == 1``; a
    prompt of more than 16 tokens: a shorter one's prefill is a decode call of its own shape)."""
    import rerope.hf as hf
    from test_hf import build, tiny_config

    model = build(tiny_config()).to(kernel_device())
    hf.enable_rerope(model, window=8)
    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    decode.PLANS.clear()
    with torch.no_grad():
        out = model.generate(ids.to(kernel_device()), max_new_tokens=6, do_sample=False)
    assert out.shape[1] == 26
    assert decode.PLANS.built == 1 and len(decode.PLANS) == 1


@transformers_missing
@pytest.mark.parametrize("options", [{}, {"leaky": 4.0}, {"inv_freq": "tensor"}],
                         ids=["rerope", "leaky", "inv_freq_tensor"])
def test_generation_step_fast_path_equals_the_general_path(options, monkeypatch, gen):
    """A one-token step with no padding mask, log-n nor Self-Extend goes straight to the decode
    step (``decode._call`` with ``heads_last``: no ``rerope_decode`` wrapper, the output in
    the model's heads-last layout, no transpose): its first call (a new signature) and its
    kept calls give the general path's bits, shape and strides, also with every new buffer
    NaN (``poisoned_empty``). Frequencies given as a tensor are read on every call (a change
    through ``.data`` shows); as :class:`rerope.rope.Frequencies` the settings are kept."""
    import rerope.hf as hf
    from conftest import poisoned_empty
    from rerope.rope import rope_frequencies

    device = kernel_device()
    if options.get("inv_freq") == "tensor":
        options = {"inv_freq": rope_frequencies(16).float().to(device)}
    settings = hf.Settings(8, **options)
    q = torch.randn(1, 4, 1, 16, generator=gen).to(device)
    k, v = (torch.randn(1, 2, 23, 16, generator=gen).to(device) for _ in range(2))
    pos = torch.full((1, 1), 22, dtype=torch.long, device=device)

    def general():
        return hf._attend(q, k, v, settings, 0.3, None).transpose(1, 2).contiguous()

    real = hf.rerope_decode
    monkeypatch.setattr(hf, "rerope_decode", lambda *a, **kw: pytest.fail("general path"))
    with torch.no_grad():
        outs = [hf.rerope_attention_forward(settings, _Layer(), q, k, v, None, scaling=0.3,
                                            position_ids=pos)[0] for _ in range(2)]
        with poisoned_empty():
            outs.append(hf.rerope_attention_forward(settings, _Layer(), q, k, v, None,
                                                    scaling=0.3, position_ids=pos)[0])
        monkeypatch.setattr(hf, "rerope_decode", real)
        want = general()
    for got in outs:
        assert torch.equal(got, want) and got.stride() == want.stride()
        assert got.shape == (1, 1, 4, 16) and got.is_contiguous()
    kept = settings._decode_settings(0.3)
    assert (settings._decode_settings(0.3)[0] is kept[0]) == ("inv_freq" not in options)
    if "inv_freq" in options:
        options["inv_freq"].data.mul_(2)
        with torch.no_grad():
            got = hf.rerope_attention_forward(settings, _Layer(), q, k, v, None, scaling=0.3)[0]
            assert torch.equal(got, general()) and not torch.equal(got, want)


@transformers_missing
def test_steps_the_fast_path_leaves_to_the_general_path(monkeypatch, gen):
    """Several new tokens, log-n, Self-Extend, a padding mask and inputs that want gradients
    take the general path (``rerope_decode`` or ``rerope``), as before."""
    import rerope.hf as hf

    device = kernel_device()
    calls = []
    real = hf.rerope_decode
    monkeypatch.setattr(hf, "rerope_decode", lambda *a, **kw: calls.append(a[0].shape[2])
                        or real(*a, **kw))
    k, v = (torch.randn(1, 2, 23, 16, generator=gen).to(device) for _ in range(2))
    q1, q3 = (torch.randn(1, 4, n, 16, generator=gen).to(device) for n in (1, 3))
    with torch.no_grad():
        hf.rerope_attention_forward(hf.Settings(8), _Layer(), q3, k, v, None)
        hf.rerope_attention_forward(hf.Settings(8, logn_len=16.0), _Layer(), q1, k, v, None)
        hf.rerope_attention_forward(hf.Settings(8, group=4), _Layer(), q1, k, v, None)
        rows = hf.PaddedRows((0,), (23,), 23)
        hf.rerope_attention_forward(hf.Settings(8), _Layer(), q1, k, v, rows)
    assert calls == [3, 1, 1, 1]
    out, _ = hf.rerope_attention_forward(hf.Settings(8), _Layer(), q1.requires_grad_(), k, v,
                                         None)
    assert out.requires_grad and calls == [3, 1, 1, 1]
