"""Session 53 (issue 37): host µs of one Hugging Face decode layer call, before and after, CPU.

Triton's interpreter with every launch skipped (``launch.Launcher._slow_launch`` a no-op, as
in NOTES v18), one thread, one layer's tensors at 8192 keys: ``q`` (1, 32, 1, 64), ``k, v``
(1, 8, 8192, 64), fp32, window 2048, base 500000, ``scaling`` 0.125, ``position_ids`` (1, 1),
under ``torch.no_grad()`` (as ``generate``). The old code is the package at ``BASE`` (the
commit before this session's changes): its plain functions are executed from ``git show``
into copies of the current modules' namespaces, so old and new run in one process, in
alternating rounds (the order flips every round). Variants, each adding one change:

* ``before``: the package at ``BASE``;
* ``+scratch``: ``decode._outputs`` keeps the partials buffer (``decode._partials``);
* ``+fast path``: also the Hugging Face fast path (the settings tuple and its types kept per
  ``Settings``, so ``decode._exact_key`` does not recompute the types; no ``rerope_decode``
  wrapper, the position/log-n/group helpers skipped) but the output still allocated
  ``(B, Hq, 1, D)`` and transposed (``.transpose(1, 2).contiguous()``): the package's
  ``rerope_attention_forward`` run with a stand-in for ``decode._call``;
* ``after``: the package as it is (the output allocated heads-last, no transpose).

``rerope_decode`` (the public op, same tensors) has no fast path of its own: its ``after`` is
``+scratch`` but for the package's own ``_call`` and ``_run_step``. Also timed alone:
``_outputs`` and ``_exact_key``, old and new (new: with the settings' types given or not).

    PYTHONPATH=kernels:. python perf/runs/s53/host/measure.py [--rounds 30] [--calls 4000]
"""
import argparse
import ast
import os
import statistics
import subprocess
import sys
import time
import types

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import rerope  # noqa: E402
import rerope.hf as hf  # noqa: E402
from rerope import decode, launch  # noqa: E402

BASE = "cdea7eb5ec8c696863a9d05c9dbffb38753bf00d"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))


def old_namespace(module, path, overrides=()):
    """A copy of ``module``'s namespace with every undecorated top-level function of ``path``
    at ``BASE`` executed into it (then ``overrides``)."""
    source = subprocess.run(["git", "show", f"{BASE}:{path}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    ns = dict(vars(module))
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.decorator_list:
            exec(compile(ast.Module([node], []), f"{BASE[:7]}:{path}", "exec"), ns)
    ns.update(overrides)
    return ns


class Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4


def transposed_call(q, k_cache, v_cache, cache_seqlens, block_table, settings, types=None,
                    heads_last=False):
    """``decode._call`` with the output allocated ``(B, Hq, 1, D)`` and transposed, as before
    this session."""
    return decode._call(q, k_cache, v_cache, cache_seqlens, block_table, settings,
                        types=types).transpose(1, 2).contiguous()


def rebound(fn, **names):
    """``fn`` with its module globals but ``names`` replaced."""
    new = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def per_call_us(fn, calls):
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    launch.Launcher._slow_launch = lambda self, launch_args: None   # Python only

    old = old_namespace(decode, "kernels/rerope/decode.py")
    scratch = old_namespace(decode, "kernels/rerope/decode.py",
                            {"_outputs": decode._outputs})
    hf_of = {name: old_namespace(hf, "kernels/rerope/hf.py",
                                 {"rerope_decode": ns["rerope_decode"]})
             for name, ns in (("before", old), ("+scratch", scratch))}

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 64, generator=g)
    k = torch.randn(1, 8, 8192, 64, generator=g)
    v = torch.randn(1, 8, 8192, 64, generator=g)
    pos = torch.full((1, 1), 8191, dtype=torch.long)
    settings = hf.Settings(2048, base=500000.0)
    layer = Layer()

    def forward_of(fn):
        return lambda: fn(settings, layer, q, k, v, None, scaling=0.125, position_ids=pos)

    def decode_of(fn):
        return lambda: fn(q, k, v, 2048, sm_scale=0.125, base=500000.0, rotated=True)

    cases = {}
    for name, ns in hf_of.items():
        cases[f"rerope_attention_forward {name}"] = forward_of(ns["rerope_attention_forward"])
    cases["rerope_attention_forward +fast path"] = forward_of(
        rebound(hf.rerope_attention_forward, _decode_call=transposed_call))
    cases["rerope_attention_forward after"] = forward_of(hf.rerope_attention_forward)
    for name, ns in (("before", old), ("+scratch", scratch)):
        cases[f"rerope_decode {name}"] = decode_of(ns["rerope_decode"])
    cases["rerope_decode after"] = decode_of(rerope.rerope_decode)
    with torch.no_grad():
        for fn in cases.values():       # plans, steps, scratch: made once, outside the rounds
            fn()
        want = hf_of["before"]["rerope_attention_forward"](settings, layer, q, k, v, None,
                                                           scaling=0.125, position_ids=pos)[0]
        got = hf.rerope_attention_forward(settings, layer, q, k, v, None, scaling=0.125,
                                          position_ids=pos)[0]
        assert got.shape == want.shape and got.stride() == want.stride()
        step, n_max, step_args = decode._STEPS.values()[-1]
        plan, splits = step.plan, step.num_splits
        st = (2048, 0.125, 500000.0, None, None, True, None, None, None)
        types = tuple(map(type, st))
        cases["_outputs before"] = lambda: old["_outputs"](plan, splits, q)
        cases["_outputs after"] = lambda: decode._outputs(plan, splits, q)
        cases["_exact_key before"] = lambda: old["_exact_key"](q, k, v, None, None, st)
        cases["_exact_key after"] = lambda: decode._exact_key(q, k, v, None, None, st)
        cases["_exact_key after, types kept"] = lambda: decode._exact_key(q, k, v, None, None,
                                                                          st, types)
        times = {name: [] for name in cases}
        names = list(cases)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                times[name].append(per_call_us(cases[name], args.calls))
    print(f"# {sys.argv[0]} --rounds {args.rounds} --calls {args.calls}; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs, 1 thread; launches skipped; "
          f"{splits} splits")
    print(f"# µs per call over {args.rounds} rounds of {args.calls} calls")
    print(f"{'what':44s} {'median':>8s} {'min':>8s}")
    for name, ts in times.items():
        print(f"{name:44s} {statistics.median(ts):8.2f} {min(ts):8.2f}")


if __name__ == "__main__":
    main()
