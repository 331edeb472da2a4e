"""Compile perf/gluon/plain_fwd.py ahead of time for sm_90 with Triton 3.6, no GPU needed.

    /work/venv36/bin/python perf/gluon/cross_compile.py > perf/gluon/cross_compile_3.6.txt
    (--split3: only the SPLIT=3 configs, BLOCK_M 192, fp16 and bf16)

How (Triton 3.6): a ``@gluon.jit`` function is compiled from ``triton.experimental.gluon._runtime.GluonASTSource`` (a subclass of ASTSource,
language GLUON, "ttgir" stage); ``triton.compile(src, target=GPUTarget("cuda", 90, 32),
options={"num_warps": ...})`` runs the NVIDIA backend (ttgir -> llir -> ptx -> cubin with the
bundled ptxas). The tensor-descriptor argument types are the strings the JIT itself would produce:
``triton.runtime.jit.mangle_type`` applied to a host ``TensorDescriptor`` over a CPU tensor gives
``tensordesc<fp16[128, 64],NVMMASharedLayout(...)>``.
"""
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plain_fwd as pf  # noqa: E402


def compile_variant(dtype, D, config=None, store_lse=True):
    config = tuple(config or pf.default_config(D))
    BLOCK_M, BLOCK_N, STAGES, CW, SPLIT, PIPE = config[:6]
    PINGPONG = pf.pingpong(config)
    SUB_M = BLOCK_M // SPLIT
    N = 1024
    gdt = pf._gl_dtype(dtype)
    t = torch.empty((N, D), dtype=dtype)  # CPU tensor: only shape/stride/dtype/alignment matter
    q_desc = TensorDescriptor.from_tensor(t, [SUB_M, D], pf.smem_layout([SUB_M, D], gdt))
    kv_desc = TensorDescriptor.from_tensor(t, [BLOCK_N, D], pf.smem_layout([BLOCK_N, D], gdt))
    fn = pf.attn_fwd_causal_kernel
    signature = {
        "q_desc": mangle_type(q_desc), "k_desc": mangle_type(kv_desc), "v_desc": mangle_type(kv_desc),
        "o_desc": mangle_type(q_desc), "lse_ptr": "*fp32", "N": "i32", "qk_scale": "fp32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD_D": "constexpr", "STAGES": "constexpr",
        "CONSUMER_WARPS": "constexpr", "STORE_LSE": "constexpr", "SPLIT": "constexpr", "PIPE": "constexpr",
        "PINGPONG": "constexpr",
    }
    constexprs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "HEAD_D": D, "STAGES": STAGES, "CONSUMER_WARPS": CW,
                  "STORE_LSE": store_lse, "SPLIT": SPLIT, "PIPE": PIPE,
                  "PINGPONG": PINGPONG}
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k), ): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": CW})
    return kernel, config, signature


def ptxas_info(ptx):
    """Registers per thread and spill bytes, from the bundled ptxas -v (metadata has no n_regs)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    info = r.stderr + r.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return (int(regs.group(1)) if regs else None,
            f"{spills.group(1)}/{spills.group(2)}" if spills else None)


def main():
    print(f"triton {triton.__version__}, torch {torch.__version__}, target cuda sm_90 (warp size 32)")
    fails = 0
    first = True
    jobs = [(D, dtype, None) for D in (64, 128) for dtype in (torch.float16, torch.bfloat16)]
    jobs += [(D, torch.float16, cfg) for D in (64, 128) for cfg in pf.EXTRA_CONFIGS[D]]
    jobs += [(64, torch.bfloat16, cfg) for cfg in pf.SPLIT3_CONFIGS]  # SPLIT=3 (D64) in both dtypes
    if "--split3" in sys.argv:  # only the SPLIT=3 configs (BLOCK_M 192, three consumer partitions)
        jobs = [j for j in jobs if j[2] in pf.SPLIT3_CONFIGS]
    for D, dtype, config in jobs:
            name = f"D{D} {str(dtype).replace('torch.', '')}" + ("" if config is None else " (extra)")
            try:
                k, cfg, sig = compile_variant(dtype, D, config)
            except Exception as e:  # report and go on
                fails += 1
                print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:2000]}")
                continue
            if first:
                print(f"signature (D{D}): {sig['q_desc']}")
                first = False
            ptx = k.asm["ptx"]
            md = k.metadata
            regs, spills = ptxas_info(ptx)
            n_wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
            n_tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
            setmaxnreg = sorted(set(re.findall(r"setmaxnreg\.((?:inc|dec))\.sync\.aligned\.u32\s+(\d+)", ptx)))
            print(f"{name}: BLOCK_M/N={cfg[0]}/{cfg[1]} STAGES={cfg[2]} consumer warps={cfg[3]} x{cfg[4]} partition(s) pipe={cfg[5]} pingpong={pf.pingpong(cfg)} "
                  f"num_warps(total)={md.num_warps} shared={md.shared} B "
                  f"({'fits' if md.shared <= pf.SMEM_LIMIT_SM90 else 'DOES NOT FIT'} sm_90) "
                  f"regs/thread={regs} spills={spills} wgmma.mma_async x{n_wgmma} cp.async.bulk.tensor x{n_tma} "
                  f"setmaxnreg={' '.join(a + ':' + b for a, b in setmaxnreg)} cubin={len(k.asm['cubin'])} B")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
