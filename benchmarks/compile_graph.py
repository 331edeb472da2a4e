"""What ``torch.compile`` makes of a fused-QKV ReRoPE block: guards, graph breaks, recompiles,
and the extra work Inductor puts around the ``rerope`` custom ops. Runs on the CPU (Triton's
interpreter; no GPU needed), so it counts, it does not time::

    python -m benchmarks.compile_graph --out /tmp/compile_graph.json

The block is the one of ``tests/test_generation.py`` at the issue-37 width: ``Linear(512, 1536)``
→ view/permute (q, k, v strided views of one buffer) → ``rerope.rerope(window=16)`` →
``Linear(512, 512)``, B=1, N=32 (small: the interpreter is slow). It reports

* ``dynamo``: from ``torch._dynamo.explain``: graphs, graph breaks, FX ops, graph outputs (a
  graph should return the block's output only), guards in all and guards on the package's
  module-level caches (``_OPERANDS``, ``_TABLES``, ``_OFFSETS``, ``PLANS``, ...: such a guard
  fails, and the block recompiles, whenever an eager call elsewhere adds an entry), and the FX
  ops other than the block's own (``extra_fx_ops``: traced work such as table building);
* ``recompiles``: frames compiled for ``compiled(x); eager call at another shape; compiled(x)``
  (1 means no recompile);
* ``host_us_launches_skipped``: host µs per call, eager and compiled, forward and training
  step, of a narrower block (2 heads of 64, N=32: its ``Linear`` layers cost little on the
  CPU) with the package's Triton launches skipped (:func:`host_us`), one CPU thread: the
  compiled forward split into Inductor's generated call and the wrappers around it, the same
  block without ``rerope`` (what compiling costs any block), one call of each op and of its
  implementation, and the Python calls per call (deterministic where the times are noisy);
  ``--host-only`` measures this alone;
* ``inductor_fwd`` / ``inductor_train``: in the code Inductor generates (forward under
  ``no_grad``; forward and backward of a training step): generated kernels, calls to the
  ``rerope`` ops, ``extern_kernels`` calls (matmuls), copies (``clone``/``copy_``/``as_strided``
  materialisations) and ``reinterpret_tensor`` views.
"""

import argparse
import collections
import copy
import json
import os
import re
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

import rerope  # noqa: E402

from . import compile_block  # noqa: E402
from .harness import write_json  # noqa: E402

CACHE_NAMES = ("_OPERANDS", "_TABLES", "_OFFSETS", "PLANS", "_LAUNCHERS", "_STEPS", "_CLASSES",
               "_entries")
BLOCK_OPS = {"linear", "view", "permute", "getitem", "transpose", "reshape", "rerope"}


def Block(dim=512, heads=8, window=16):
    """The compile benchmark's block (:class:`benchmarks.compile_block.Block`), window 16."""
    return compile_block.Block(dim, heads, window)


def _fx_op_name(node):
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if "rerope" in str(target):
        return "rerope"
    return name


def dynamo_counts(block, x):
    """Counts from ``torch._dynamo.explain`` of one call of ``block(x)``."""
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x)
    guards = [g.name for g in explained.out_guards]
    on_caches = [n for n in guards if any(c in n for c in CACHE_NAMES) and "rerope" in n]
    on_package = [n for n in guards if "rerope" in n]
    outputs, extra = 0, collections.Counter()
    for gm in explained.graphs:
        for node in gm.graph.nodes:
            if node.op == "output":
                outputs += len(node.args[0]) if isinstance(node.args[0], (tuple, list)) else 1
            elif node.op in ("call_function", "call_method"):
                name = _fx_op_name(node)
                if name not in BLOCK_OPS:
                    extra[name] += 1
    torch._dynamo.reset()
    return dict(graphs=explained.graph_count, graph_breaks=explained.graph_break_count,
                fx_ops=explained.op_count, graph_outputs=outputs, guards=len(guards),
                guards_on_package=len(on_package), guards_on_caches=len(on_caches),
                extra_fx_ops=sum(extra.values()), extra_fx_op_kinds=dict(extra))


def recompiles(block, x, other):
    """Frames compiled by ``compiled(x)``, an eager call of ``block(other)`` (another shape:
    new entries in the package's caches), ``compiled(x)`` again."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled_frames = []

    def backend(gm, example_inputs):
        compiled_frames.append(len(gm.graph.nodes))
        return gm.forward

    compiled = torch.compile(block, backend=backend)
    with torch.no_grad():
        compiled(x)
        block(other)                  # eager, another N
        compiled(x)
    torch._dynamo.reset()
    return len(compiled_frames)


def _count(pattern, code):
    return len(re.findall(pattern, code))


def inductor_counts(block, x, train):
    """What the code Inductor generates for ``block`` holds besides the block's own work."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(block)
    if train:
        def run():
            out = compiled(x)
            out.square().sum().backward()
            return out
    else:
        def run():
            with torch.no_grad():
                return compiled(x)
    _, codes = run_and_get_code(run)
    torch._dynamo.reset()
    code = "\n".join(codes)
    return dict(
        generated_modules=len(codes),
        generated_kernels=_count(r"\bcpp_fused_\w+\s*=\s*async_compile", code)
        + _count(r"\btriton_\w+\s*=\s*async_compile", code),
        rerope_op_calls=_count(r"= torch\.ops\.rerope\.\w+\.default\(", code),
        extern_kernel_calls=_count(r"extern_kernels\.\w+\(", code),
        copies=_count(r"\.clone\(|\.copy_\(|aten\.copy|as_strided_scatter", code),
        reinterpret_tensor=_count(r"reinterpret_tensor\(", code),
        empty_strided=_count(r"empty_strided\w*\(", code),
        table_ops=_count(r"\b(cos|sin|arange)\b", code),
    ), code


def host_us(block, x, calls=200, rounds=9):
    """Host microseconds per call, with every Triton launch of the package skipped
    (``rerope.launch.Launcher`` made a no-op: the outputs are garbage, the Python around the
    kernels is what is timed; the two ``Linear`` layers run on the CPU), one CPU thread; the
    minimum over ``rounds`` interleaved rounds (this shared machine's times move by 2×).

    * ``{eager,compiled}_{fwd,train}_us``: ``block`` forward (``no_grad``) and training step
      (gradients set to ``None``, forward, backward), eager and compiled (Inductor);
      ``compiled_fwd_graph_us`` the part of a compiled forward inside Inductor's generated
      ``call`` (the rest: Dynamo's guards and frame, AOTAutograd's runtime wrapper);
    * ``floor_*``: the same block with ``q * 2`` in place of ``rerope``: what compiling costs
      a block with no custom op;
    * ``op_fwd_us`` / ``op_bwd_us``: one ``torch.ops.rerope.rerope_fwd`` / ``rerope_bwd`` call
      (what the compiled graph runs), ``*_body_us`` their implementations called directly,
      ``eager_rerope_us`` one eager ``rerope.rerope`` call, on the block's q, k, v layout;
    * ``*_python_calls``: Python calls per call (cProfile's count: deterministic).
    """
    import cProfile
    import pstats

    import torch._dynamo
    from torch._inductor import output_code

    from rerope import attention, launch

    inside = [0.0]
    graph_call = output_code.CompiledFxGraph.__call__

    def timed_graph_call(self, inputs):
        start = time.perf_counter()
        try:
            return graph_call(self, inputs)
        finally:
            inside[0] += time.perf_counter() - start

    def python_calls(fn, count=10):
        fn()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(count):
            fn()
        profiler.disable()
        return pstats.Stats(profiler).total_calls // count

    floor = copy.deepcopy(block)
    floor.attention = False
    b, n, dim = x.shape
    q, k, v = block.qkv(x).detach().view(b, n, 3, block.heads, dim // block.heads).permute(
        2, 0, 3, 1, 4)
    settings = (block.window, True, (dim // block.heads) ** -0.5, 10000.0, None, None, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    saved = launch.Launcher._slow_launch
    launch.Launcher._slow_launch = lambda self, args: None
    output_code.CompiledFxGraph.__call__ = timed_graph_call
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            out, lse = torch.ops.rerope.rerope_fwd(q, k, v, *settings)
        dout = torch.randn_like(out)
        cases = {"eager_rerope": lambda: rerope.rerope(q, k, v, block.window),
                 "op_fwd": lambda: torch.ops.rerope.rerope_fwd(q, k, v, *settings),
                 "op_fwd_body": lambda: attention._fused_fwd_impl(q, k, v, *settings),
                 "op_bwd": lambda: torch.ops.rerope.rerope_bwd(dout, q, k, v, out, lse,
                                                               *settings),
                 "op_bwd_body": lambda: attention._fused_bwd_impl(dout, q, k, v, out, lse,
                                                                  *settings)}
        no_grad = set(cases)
        for tag, model in (("", block), ("floor_", floor)):
            compiled = torch.compile(model, fullgraph=True)
            for name, fn in (("eager", model), ("compiled", compiled)):
                xg = x.detach().requires_grad_()

                def train(fn=fn, xg=xg, params=list(model.parameters())):
                    xg.grad = None
                    for p in params:
                        p.grad = None
                    fn(xg).sum().backward()

                cases[f"{tag}{name}_fwd"] = lambda fn=fn: fn(x)
                cases[f"{tag}{name}_train"] = train
                no_grad.add(f"{tag}{name}_fwd")
        times = {name: [] for name in cases}
        graph_us = []
        for name, fn in cases.items():           # warm: compile, plans
            with torch.set_grad_enabled(name not in no_grad):
                for _ in range(3):
                    fn()
        for _ in range(rounds):
            for name, fn in cases.items():
                with torch.set_grad_enabled(name not in no_grad):
                    inside[0] = 0.0
                    start = time.perf_counter()
                    for _ in range(calls // rounds):
                        fn()
                    times[name].append((time.perf_counter() - start) / (calls // rounds))
                    if name == "compiled_fwd":
                        graph_us.append(inside[0] / (calls // rounds))
        result = {f"{name}_us": round(min(t) * 1e6, 1) for name, t in times.items()}
        result["compiled_fwd_graph_us"] = round(min(graph_us) * 1e6, 1)
        for name in ("eager_fwd", "compiled_fwd", "eager_train", "compiled_train"):
            with torch.set_grad_enabled(name.endswith("train")):
                result[f"{name}_python_calls"] = python_calls(cases[name])
    finally:
        output_code.CompiledFxGraph.__call__ = graph_call
        launch.Launcher._slow_launch = saved
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    return result


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_graph",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="a JSON file for the counts")
    parser.add_argument("--code-dir", default=None,
                        help="a folder for Inductor's generated code (fwd.py, train.py)")
    parser.add_argument("--skip-inductor", action="store_true")
    parser.add_argument("--host-only", action="store_true",
                        help="only host_us_launches_skipped (no counts, no generated code)")
    parser.add_argument("--n", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(1, args.n, 512)
    other = torch.randn(1, args.n + 16, 512)
    t0 = time.time()
    result = {"device": "cpu (Triton interpreter)", "torch": torch.__version__,
              "block": "Linear(512,1536) -> view/permute -> rerope(window=16) -> Linear(512,512)"
                       f", B=1, N={args.n}, 8 heads of 64, fp32"}
    if not args.host_only:
        result["dynamo"] = dynamo_counts(block, x)
        result["frames_compiled_with_eager_call_between"] = recompiles(block, x, other)
        print(json.dumps(result, indent=1), flush=True)
    if not args.skip_inductor:
        torch.manual_seed(0)
        result["host_us_launches_skipped"] = host_us(Block(dim=128, heads=2),
                                                     torch.randn(1, 32, 128))
        print("host us", result["host_us_launches_skipped"], flush=True)
    if not args.skip_inductor and not args.host_only:
        for name, train in (("inductor_fwd", False), ("inductor_train", True)):
            counts, code = inductor_counts(block, x, train)
            result[name] = counts
            print(name, counts, flush=True)
            if args.code_dir:
                os.makedirs(args.code_dir, exist_ok=True)
                with open(os.path.join(args.code_dir, f"{name}.py"), "w") as file:
                    file.write(code)
    result["seconds"] = round(time.time() - t0, 1)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
