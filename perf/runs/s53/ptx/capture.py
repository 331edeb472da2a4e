"""Record (and compile for sm_90 with Triton 3.6, nothing launched) every Triton kernel launch of
one ``rerope.rerope_attention(q1, q2, k1, k2, v, window=2048, causal=...)`` forward+backward,
as benchmarks/attention.py runs it (B, H, N, D; contiguous (B, H, N, D) inputs, requires_grad;
torch.autograd.grad with a contiguous upstream gradient), for either package.

    PYTHONPATH=kernels            /work/venv36/bin/python perf/runs/s53/ptx/capture.py new N dtype causal OUTDIR
    PYTHONPATH=.dev/b98/pkg       /work/venv36/bin/python perf/runs/s53/ptx/capture.py old N dtype causal OUTDIR

Env (as in perf/runs/s53/device_ab.sh): REROPE_AUTOTUNE=0. The old package reads KERNELS_AUTOTUNE
instead; with ALL_CANDIDATES=1 every autotune candidate is also compiled (tagged "candidate").

How: a mock driver whose target is cuda sm_90 (as perf/gluon/launch_path_check.py);
JITFunction.run is wrapped to force warmup=True (compile, do not launch) and to record the launch;
Autotuner._bench compiles each candidate instead of timing it; Launcher._bind is skipped (it would
load the cubin); device checks are bypassed (CPU tensors with real shapes, torch.empty: only
shape/stride/dtype/alignment matter). Outputs per launch: <OUTDIR>/<i>_<kernel>.{ttir,ttgir,llir,ptx,json}
and launches.json.
"""
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
import triton.runtime.driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402


class MockDriver:
    def get_current_device(self): return 0
    def get_current_stream(self, d=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def __getattr__(self, name): raise AttributeError(f"MockDriver has no {name}")


triton.runtime.driver.set_active(MockDriver())
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.is_current_stream_capturing = lambda: False


class _Props:
    total_memory = 80 * 2**30
    multi_processor_count = 132
    name = "mock H100"


torch.cuda.get_device_properties = lambda device=None: _Props()

pkg, N, dtype_name, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "true"
outdir = sys.argv[5]
os.makedirs(outdir, exist_ok=True)
TAG = [None]
launches = []


def _describe(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype), "shape": list(v.shape), "stride": list(v.stride()),
                "align16": v.data_ptr() % 16 == 0}
    if isinstance(v, (tuple, list)):
        return [_describe(x) for x in v]
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return repr(v)


_orig_run = JITFunction.run


def run(self, *args, grid, warmup, **kwargs):
    kernel = _orig_run(self, *args, grid=grid, warmup=True, **kwargs)
    i = len(launches)
    name = self.fn.__name__
    g = grid(kwargs) if callable(grid) else grid
    bound = dict(zip(self.arg_names, args))
    bound.update(kwargs)
    md = kernel.metadata
    rec = {"i": i, "kernel": name, "tag": TAG[0], "grid": list(g),
           "num_warps": md.num_warps, "num_stages": md.num_stages, "shared": md.shared,
           "args": {k: _describe(v) for k, v in bound.items()},
           "src_signature": {str(k): str(v) for k, v in kernel.src.signature.items()}
           if hasattr(kernel, "src") and hasattr(kernel.src, "signature") else None,
           "attrs": repr(getattr(kernel.src, "attrs", None)) if hasattr(kernel, "src") else None}
    stem = os.path.join(outdir, f"{i:02d}_{name}" + (f"_{TAG[0]}" if TAG[0] else ""))
    for ext in ("ttir", "ttgir", "llir", "ptx"):
        if ext in kernel.asm:
            with open(f"{stem}.{ext}", "w") as f:
                f.write(kernel.asm[ext])
    try:
        rec["metadata"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                           for k, v in md._asdict().items()}
    except Exception as e:  # noqa: BLE001
        rec["metadata"] = repr(e)
    with open(f"{stem}.json", "w") as f:
        json.dump(rec, f, indent=1, default=repr)
    launches.append(rec)
    return kernel


JITFunction.run = run


def _bench(self, *args, config, **meta):
    """Compile the candidate (recorded, tag 'candidate'); never time it. Keeps candidate order:
    the first gets the lowest 'time', so the launch that follows uses the first config (the
    real autotuner would pick whichever was fastest on the GPU)."""
    if os.environ.get("ALL_CANDIDATES") == "1":
        TAG[0] = "candidate_" + "_".join(f"{k}{v}" for k, v in config.kwargs.items()) + \
            f"_w{config.num_warps}_s{config.num_stages}"
        try:
            self.fn.run(*args, **dict(meta, **config.all_kwargs()))
        finally:
            TAG[0] = None
    idx = self.configs.index(config)
    return [float(idx)] * 3


Autotuner._bench = _bench

import rerope  # noqa: E402
import rerope.runtime  # noqa: E402
import rerope.launch  # noqa: E402

assert not rerope.runtime.INTERPRET
_orig_prep = rerope.runtime.prepare_for_device


def prepare_for_device(*tensors):
    return tensors, (lambda t: t)


for mod in list(sys.modules.values()):
    if getattr(mod, "__name__", "").startswith("rerope"):
        for attr, val in list(vars(mod).items()):
            if val is _orig_prep:
                setattr(mod, attr, prepare_for_device)
rerope.launch.Launcher._bind = lambda self, compiled, args, meta: None

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten_ops = []


class _AtenLog(TorchDispatchMode):
    """Every aten op the call runs besides the Triton kernels (allocations, copies, fills)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
        aten_ops.append(f"{func} {shapes}" + (f" after launch {len(launches) - 1}" if launches else ""))
        return res


dtype = getattr(torch, dtype_name)
B, H, D, window = 1, 32, 128, 2048
leaves = [torch.empty(B, H, N, D, dtype=dtype).requires_grad_() for _ in range(5)]
with _AtenLog():
    out = rerope.rerope_attention(*leaves, window, causal=causal)
upstream = torch.empty_like(out)
with _AtenLog():
    torch.autograd.grad(out, leaves, grad_outputs=upstream)
with open(os.path.join(outdir, "aten_ops.txt"), "w") as f:
    f.write("\n".join(aten_ops) + "\n")
print("aten ops:", len(aten_ops))
for a in aten_ops:
    print("   ", a)
with open(os.path.join(outdir, "launches.json"), "w") as f:
    json.dump(launches, f, indent=1, default=repr)
for r in launches:
    cons = {k: v for k, v in r["args"].items() if k.isupper() and not isinstance(v, (dict, list))}
    print(r["i"], r["kernel"], r["tag"] or "", "grid", r["grid"], "warps", r["num_warps"],
          "stages", r["num_stages"], "shared", r["shared"], cons)
