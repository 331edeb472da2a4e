"""Every launch configuration compiles for every supported GPU, and fits its shared memory.

No GPU needed: ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda",
cc, 32))`` cross-compiles a kernel down to a cubin for compute capability ``cc``, and the
compiled kernel's ``metadata.shared`` is the shared memory one block needs. For each kernel of
:data:`rerope.attention._KERNELS` and each configuration :func:`rerope.configs.launch_configs`
returns for sm_75 (T4), sm_80 (A100), sm_89 (L4) and sm_90 (H100/H200) this checks

* the kernel compiles with that configuration (block sizes, warps, pipeline stages);
* ``metadata.shared <= configs.SHARED_MEMORY[cc]`` (else the launch fails on that GPU);
* ``configs.estimate_shared_memory(...) >= metadata.shared`` (the pruning estimate is safe).

Importing ``rerope`` without CUDA switches Triton to its interpreter, whose ``@triton.jit``
functions cannot be compiled; so the compiling runs in a child process started with
``TRITON_INTERPRET=0`` (this very file run as a script, see ``main``), which prints one JSON
result per configuration. Two children share the work (CI machines have two cores); they start
as soon as pytest has collected the tests (``start_background_work``, called from
``tests/conftest.py``), so they compile while the interpreter tests run.

Cross-compiling is slow (about 4-25 s per configuration; 15-60 s on sm_75, where ``tl.dot``
is lowered to FMA loops), so by default only the riskiest configurations compile: per GPU those
whose estimate is closest to, or over, its limit (9 compilations, about 3 CPU-minutes: under two
minutes on two cores); ``KERNEL_COMPILE_ALL=1`` runs the full matrix, about 150 (every
configuration for D = 64 and 128, 256 on sm_90; fp16 and fp32, bf16 from sm_80 on): 33
CPU-minutes, 17 minutes on two cores.
``COMPILE_TEST_REPORT=path.json`` saves every result (shared memory, estimate, seconds).

The signature is what the launchers pass for contiguous ``(B, H, N, D)`` tensors with
``N = 8192``: on a GPU Triton's JIT specializes pointers and integers divisible by 16
(``tt.divisibility``) and integers equal to 1 (the unit strides along ``D``, ``group`` for
plain multi-head attention) become constants, and shared memory depends on that (aligned,
contiguous loads are what the pipeliner stages through shared memory).
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = [(7, 5), (8, 0), (8, 9), (9, 0)]
FULL = os.environ.get("KERNEL_COMPILE_ALL", "") not in ("", "0")
WORKERS = 2

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# integer arguments that are floats at launch, and pointers to fp32 row statistics
FLOAT_ARGS = {"qk_scale", "sm_scale", "logn_factor"}
FP32_POINTERS = {"Lse", "Delta"}
TABLES = "Tables"            # a tuple of four fp32 pointers (two per product)

# The forms the kernels read (the flag groups ``INSIDE_FLAGS`` / ``OUTSIDE_FLAGS``): the five
# tensors of ``rerope_attention`` (``None``), and ``q, k`` of ``rerope`` with every rotation
# switched on (Leaky ReRoPE from raw inputs rotates both operands of both products) and log-n:
# the most the fused form ever does. "preturned": the backward of ``rerope`` on pre-turned
# operands (five-tensor reads, gradients turned back and summed in the store, ``PRETURNED``);
# the forward has no such form.
FORMS = {
    "five": dict(LOGN=False, INSIDE_FLAGS=None, OUTSIDE_FLAGS=None, PRETURNED=False),
    "fused": dict(LOGN=True, INSIDE_FLAGS=(True, False), OUTSIDE_FLAGS=(True, True),
                  PRETURNED=False),
    "preturned": dict(LOGN=True, INSIDE_FLAGS=(True, False), OUTSIDE_FLAGS=(True, True),
                      PRETURNED=True),
}
BACKWARD_ONLY = {"preturned"}


def _configs(kernel, form, head_dim, cap, elem_bytes):
    """Every configuration ``launch_configs`` gives, with its shared-memory estimate."""
    from rerope import configs
    from rerope_testing import all_launch_configs

    fused = form == "fused"
    out = []
    for c in all_launch_configs(kernel, head_dim, cap, elem_bytes, fused=fused):
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": c.num_warps,
                    "num_stages": c.num_stages,
                    "estimate": configs.estimate_shared_memory(kernel, bm, bn, c.num_stages,
                                                               head_dim, elem_bytes, fused)})
    return out


def jobs(full=FULL):
    """The compile matrix: one dict per (kernel, capability, D, dtype, configuration).

    Full: every configuration for D = 64 and 128 (and 256 on sm_90), fp16 and fp32, plus bf16
    from sm_80 on. Default: per capability, the configuration of the dK/dV and of the dQ kernel
    (they keep the most on chip) whose estimate is closest to, or over, the GPU's limit — the
    ones most likely not to fit — and of the forward too on sm_89 (quick to compile there); the
    pre-turned backward's form on sm_75 and sm_90 only.
    """
    from rerope import configs
    from rerope.attention import _KERNELS

    todo = []
    for cap in CAPABILITIES:
        limit = configs.SHARED_MEMORY[10 * cap[0] + cap[1]]
        head_dims = (64, 128, 256) if full and cap == (9, 0) else (64, 128)
        dtypes = ("fp16", "bf16", "fp32") if full and cap >= (8, 0) else ("fp16", "fp32")
        found = [{"kernel": kernel, "form": form, "capability": list(cap),
                  "head_dim": head_dim, "dtype": dtype, "limit": limit, **c}
                 for head_dim in head_dims for dtype in dtypes for kernel in _KERNELS
                 for form in FORMS if not (kernel == "fwd" and form in BACKWARD_ONLY)
                 for c in _configs(kernel, form, head_dim, cap, TORCH_DTYPES[dtype].itemsize)]
        if not full:
            riskiest = {}
            for job in sorted(found, key=lambda j: -j["estimate"] / j["limit"]):
                riskiest.setdefault((job["kernel"], job["form"]), job)
            kernels = ("dkdv", "dq", "fwd") if cap == (8, 9) else ("dkdv", "dq")
            # the pre-turned backward reads like the five-tensor one (same configurations):
            # by default compiled only where shared memory is tightest and where it is measured
            forms = [f for f in FORMS if f not in BACKWARD_ONLY or cap in ((7, 5), (9, 0))]
            found = [riskiest[kernel, form] for kernel in kernels for form in forms
                     if (kernel, form) in riskiest]
        todo += found
    return todo


def uses_tma(job):
    """Whether a launch with this job's GPU, dtype and D reads through TMA descriptors (as
    ``rerope.attention._use_tma`` decides for contiguous tensors)."""
    from rerope import configs

    return configs.tma_pays(job["capability"], TORCH_DTYPES[job["dtype"]].itemsize,
                            job["head_dim"])


def job_id(job):
    major, minor = job["capability"]
    return (f"{job['kernel']}-{job['form']}-sm{major}{minor}-D{job['head_dim']}-{job['dtype']}-"
            f"{job['BLOCK_M']}x{job['BLOCK_N']}w{job['num_warps']}s{job['num_stages']}")


# --- the child process ------------------------------------------------------------------------


def _source(job):
    """``ASTSource`` of one kernel, specialized as a launch on contiguous tensors would be."""
    from triton.compiler import ASTSource

    from rerope.attention import _KERNELS

    fn = _KERNELS[job["kernel"]]
    signature, constexprs, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name == TABLES:                                 # (table, offset) per product
            signature[name] = ("*fp32",) * 4
            attrs.update({(index, i): divisible for i in range(4)})
        elif name[0].isupper():                              # a pointer (Q1, K2, Out, Lse, …)
            signature[name] = "*fp32" if name in FP32_POINTERS else "*" + job["dtype"]
            attrs[(index,)] = divisible
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        elif name.startswith("s"):                           # strides: batch, head, row, 1
            signature[name] = ("i32", "i32", "i32", "constexpr")
            attrs.update({(index, i): divisible for i in range(3)})
            constexprs[(index, 3)] = 1
        elif name == "q_per_kv":                             # MHA: one query head per kv
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:                                                # strides, head counts, N, window
            signature[name] = "i32"
            attrs[(index,)] = divisible
    constexprs.update(HEAD_DIM=job["head_dim"], BLOCK_M=job["BLOCK_M"], BLOCK_N=job["BLOCK_N"],
                      CAUSAL=True, TMA=uses_tma(job), **FORMS[job["form"]])
    # the grid's axis order (attention.heads_first) only swaps the program ids: one of the two
    constexprs["HEADS_FIRST"] = True
    if job["kernel"] == "fwd":          # key tiles turned in the kernel (not pre-turned)
        for product in ("INSIDE_FLAGS", "OUTSIDE_FLAGS"):
            flags = constexprs[product]
            constexprs[product] = None if flags is None else (*flags, flags[0])
        del constexprs["PRETURNED"]         # a backward-only switch
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise RuntimeError(f"no value for constexpr parameters {missing} of {job['kernel']}")
    return ASTSource(fn, signature, constexprs, attrs)


def compile_job(job):
    import time

    import triton
    from triton.backends.compiler import GPUTarget

    start = time.time()
    cap = job["capability"]
    try:
        compiled = triton.compile(_source(job), target=GPUTarget("cuda", 10 * cap[0] + cap[1], 32),
                                  options={"num_warps": job["num_warps"],
                                           "num_stages": job["num_stages"]})
        result = {"shared": compiled.metadata.shared, "error": None}
    except Exception as error:   # reported, with the configuration, by the parent test
        result = {"shared": None, "error": f"{type(error).__name__}: {error}"[-3000:]}
    return {**job, **result, "seconds": round(time.time() - start, 2)}


def main():
    """Child: read jobs (JSON list) from stdin, print one JSON result per line."""
    from rerope.runtime import INTERPRET

    assert not INTERPRET, "run with TRITON_INTERPRET=0"
    for job in json.load(sys.stdin):
        print(json.dumps(compile_job(job)), flush=True)


# --- the parent test ----------------------------------------------------------------------------


def _shares(todo):
    """Split the jobs between the children, longest first onto the least loaded (a rough cost:
    sm_75 compiles FMA loops, fp32 compiles 3xTF32 products, bigger tiles take longer)."""
    def cost(job):
        return ((3 if job["capability"] == [7, 5] else 1) * (2 if job["dtype"] == "fp32" else 1)
                * (1 + job["estimate"] / 2 ** 17))

    shares, loads = [[] for _ in range(WORKERS)], [0.0] * WORKERS
    for job in sorted(todo, key=cost, reverse=True):
        least = loads.index(min(loads))
        shares[least].append(job)
        loads[least] += cost(job)
    return [share for share in shares if share]


_children = []   # (jobs, Popen, stdout file, stderr file) of the running children


def start_background_work(items=None):
    """Start the compiling children now. ``tests/conftest.py`` calls this as soon as collection
    is done (with this module's selected tests: nothing starts unless one of them needs the
    results), so that the compiles overlap the (single-threaded) interpreter tests that run
    before this module; the ``compiled`` fixture calls it too, in case it was not."""
    if items is not None and not any("compiled" in getattr(i, "fixturenames", ()) for i in items):
        return
    if _children or not JOBS or importlib.util.find_spec("triton.backends.nvidia") is None:
        return
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "kernels"), str(ROOT),
                                             os.environ.get("PYTHONPATH", "")])}
    for share in _shares(JOBS):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=out,
                                stderr=err, env=env, cwd=ROOT, text=True)
        proc.stdin.write(json.dumps(share))
        proc.stdin.close()
        _children.append((share, proc, out, err))


def stop_background_work():
    """Kill children still running (the session ended before their results were needed)."""
    for _, proc, out, err in _children:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    _children.clear()


def _collect_children(timeout=1800):
    results = []
    for share, proc, out, err in _children:
        proc.wait(timeout=timeout)
        out.seek(0)
        err.seek(0)
        found = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or len(found) != len(share):
            raise RuntimeError(f"compile child failed (rc {proc.returncode}):\n"
                               f"{err.read()[-5000:]}")
        results += found
    return results


JOBS = jobs() if __name__ != "__main__" else []     # the child needs none


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton.backends.nvidia", reason="Triton without the NVIDIA backend")
    start_background_work()
    try:
        results = _collect_children()
    finally:
        stop_background_work()
    report = os.environ.get("COMPILE_TEST_REPORT")
    if report:
        Path(report).write_text(json.dumps(results, indent=1))
    return {job_id(r): r for r in results}


@pytest.mark.parametrize("job", JOBS, ids=job_id)
def test_config_compiles_and_fits(job, compiled):
    result = compiled[job_id(job)]
    assert result["error"] is None, f"{job_id(job)} does not compile:\n{result['error']}"
    assert result["shared"] <= job["limit"], (
        f"{job_id(job)} needs {result['shared']} B of shared memory, sm_"
        f"{job['capability'][0]}{job['capability'][1]} has {job['limit']} B")


@pytest.mark.parametrize("job", JOBS, ids=job_id)
def test_shared_memory_estimate_is_safe(job, compiled):
    """``estimate_shared_memory`` (used to prune) is at least what the compiler allocates."""
    result = compiled[job_id(job)]
    if result["error"] is not None:
        pytest.skip("does not compile (reported by test_config_compiles_and_fits)")
    assert job["estimate"] >= result["shared"], (
        f"{job_id(job)}: estimate {job['estimate']} B < compiled {result['shared']} B")


def test_matrix_covers_every_kernel_and_capability():
    from rerope.attention import _KERNELS

    assert {j["kernel"] for j in JOBS} == set(_KERNELS)
    assert {j["form"] for j in JOBS} == set(FORMS)
    assert {tuple(j["capability"]) for j in JOBS} == set(CAPABILITIES)


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]
    main()
