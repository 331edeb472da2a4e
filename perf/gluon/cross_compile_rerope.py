"""Compile perf/gluon/rerope_fwd.py ahead of time for sm_90 with Triton 3.6, no GPU needed.

    /work/venv36/bin/python perf/gluon/cross_compile_rerope.py > perf/gluon/cross_compile_rerope_3.6.txt

Same method as ``cross_compile.py`` (whose ``ptxas_info`` it reuses): every config of
``rerope_fwd.all_configs(D, retired=True)`` for D 64/128 in fp16, the defaults and the BAND_TWICE
configs (seventh field 1: ``rerope_fwd_twice_kernel``; with PIPE (sixth) or PINGPONG (eighth) = 1,
or SPLIT (fifth) = 3: ``rerope_fwd_twice_pp_kernel``) and the SPLIT=3 configs also in bf16, LSE on.
``--twice``: only the BAND_TWICE configs; ``--fa3``: only the pp kernel's; ``--split3``: only
SPLIT=3; ``--lean``: only the LEAN ones (seventh field 2: ``rerope_fwd_lean_kernel``).
(/work/venv36: a venv with the triton-3.6.0 wheel and a .pth onto the main .venv's
site-packages for torch; see README.md.)
"""
import os
import re
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rerope_fwd as rf  # noqa: E402
from cross_compile import ptxas_info  # noqa: E402


def compile_variant(dtype, D, config, store_lse=True):
    BLOCK_M, BLOCK_N, STAGES, CW, SPLIT, PIPE = config[:6]
    SUB_M = BLOCK_M // SPLIT
    gdt = rf._gl_dtype(dtype)
    t = torch.empty((1024, D), dtype=dtype)
    q = mangle_type(TensorDescriptor.from_tensor(t, [SUB_M, D], rf.smem_layout([SUB_M, D], gdt)))
    kv = mangle_type(TensorDescriptor.from_tensor(t, [BLOCK_N, D], rf.smem_layout([BLOCK_N, D], gdt)))
    fn = rf.kernel_for(config)
    signature = {"q1_desc": q, "q2_desc": q, "k1_desc": kv, "k2_desc": kv, "v_desc": kv, "o_desc": q,
                 "lse_ptr": "*fp32", "N": "i32", "window": "i32", "qk_scale": "fp32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD_D": "constexpr", "STAGES": "constexpr",
                 "CONSUMER_WARPS": "constexpr", "STORE_LSE": "constexpr", "SPLIT": "constexpr"}
    constexprs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "HEAD_D": D, "STAGES": STAGES, "CONSUMER_WARPS": CW,
                  "STORE_LSE": store_lse, "SPLIT": SPLIT}
    if rf.lean(config) or rf.fa3_sched(config):  # the package's kernels: the GQA group too
        signature["group"] = "i32"
    if rf.fa3_sched(config):  # rerope_fwd_twice_pp_kernel: two more constexprs
        signature.update(PIPE="constexpr", PINGPONG="constexpr")
        constexprs.update(PIPE=PIPE, PINGPONG=rf.pingpong(config))
    signature = {k: signature[k] for k in fn.arg_names}  # in the kernel's argument order
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k), ): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": CW})


def main():
    print(f"triton {triton.__version__}, torch {torch.__version__}, target cuda sm_90 (warp size 32), rerope_fwd")
    jobs = [(D, dt, c) for D in (64, 128) for c in rf.all_configs(D, retired=True)
            for dt in (torch.float16, torch.bfloat16)
            if dt == torch.float16 or c == rf.default_config(D) or rf.band_twice(c)
            or c in rf.SPLIT3_CONFIGS]
    if "--split3" in sys.argv:  # only the SPLIT=3 configs (BLOCK_M 192, three consumer partitions)
        jobs = [j for j in jobs if j[2] in rf.SPLIT3_CONFIGS]
    if "--twice" in sys.argv:
        jobs = [j for j in jobs if rf.band_twice(j[2])]
    if "--lean" in sys.argv:
        jobs = [j for j in jobs if rf.lean(j[2])]
    if "--fa3" in sys.argv:  # only rerope_fwd_twice_pp_kernel's configs (PIPE / PINGPONG)
        jobs = [j for j in jobs if rf.fa3_sched(j[2])]
    fails = 0
    for D, dt, cfg in jobs:
        name = (f"D{D} {str(dt).replace('torch.', '')} {cfg}{' BAND_TWICE' if rf.band_twice(cfg) else ''}"
                f"{' PIPE' if rf.fa3_sched(cfg) and cfg[5] else ''}{' PINGPONG' if rf.pingpong(cfg) else ''}")
        name += (" SPLIT3" if cfg[4] == 3 else "") + (" LEAN" if rf.lean(cfg) else "")
        t0 = time.time()
        try:
            k = compile_variant(dt, D, cfg)
        except Exception as e:
            fails += 1
            print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:3000]}", flush=True)
            continue
        ptx = k.asm["ptx"]
        regs, spills = ptxas_info(ptx)
        sh = k.metadata.shared
        nreg = sorted(set(re.findall(r"setmaxnreg\.((?:inc|dec))\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(f"{name}: num_warps(total)={k.metadata.num_warps} shared={sh} B "
              f"({'fits' if sh <= rf.SMEM_LIMIT_SM90 else 'DOES NOT FIT'} sm_90) regs/thread={regs} spills={spills} "
              f"wgmma.mma_async x{len(re.findall(r'wgmma.mma_async', ptx))} "
              f"cp.async.bulk.tensor x{len(re.findall(r'cp.async.bulk.tensor', ptx))} "
              f"wgmma.wait_group1 x{len(re.findall(r'wgmma.wait_group.sync.aligned 1;', ptx))} "
              f"mbarrier.arrive x{len(re.findall(r'mbarrier.arrive', ptx))} "
              f"setmaxnreg={' '.join(a + ':' + b for a, b in nreg)} compile={time.time() - t0:.1f}s", flush=True)
        fails += sh > rf.SMEM_LIMIT_SM90
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
