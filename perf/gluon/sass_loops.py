"""The consumer loops of the SPLIT=3 (D64) kernels in sm_90 SASS, side by side; no GPU needed.

    /work/venv36/bin/python perf/gluon/sass_loops.py [--dtype bf16] > perf/gluon/sass_loops_3.6.txt

Cross-compiles (Triton 3.6, as cross_compile*.py) plain SPLIT=3, the ReRoPE three-tiles,
band-twice (pp) and LEAN SPLIT=3 kernels (2 stages, LSE on), disassembles the cubin with the
bundled ``cuobjdump -sass`` and lists every loop (a conditional backward branch over at least 100
instructions: the tile loops; the mbarrier retry loops are a few instructions) with its length and
per-iteration counts of HGMMA, MUFU.EX2, FMNMX, FSEL, ISETP (incl. UISETP), BAR.SYNC, SYNCS
(mbarrier wait / arrive); plus the kernel's code size and highest register. Then a cost model:
instructions a head needs at N 8192, W 2048 = sum over paths of (steps on that path, from
emulate_rerope.step_census) x (its instructions, given below from this listing).
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cross_compile as cc  # noqa: E402
import cross_compile_rerope as ccr  # noqa: E402

KERNELS = [("plain", (192, 128, 2, 4, 3, 0)), ("three", (192, 128, 2, 4, 3, 0)),
           ("pp", (192, 128, 2, 4, 3, 0, 1)), ("lean", (192, 128, 2, 4, 3, 0, 2))]
KEYS = ["HGMMA", "MUFU.EX2", "FMNMX", "FSEL", "ISETP", "BAR.SYNC", "SYNCS"]


def sass(kernel):
    from triton.backends.nvidia.compiler import get_ptxas
    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        open(path, "wb").write(kernel.asm["cubin"])
        out = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    ins = []
    for line in out.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            txt = m.group(2)
            pred = txt.split()[0] if txt.startswith("@") else ""
            ins.append((int(m.group(1), 16), pred, txt[len(pred):].strip()))
    return ins


def loops(ins, min_len=100):
    out = []
    for a, pred, txt in ins:
        m = re.match(r"BRA (0x[0-9a-f]+)$", txt)
        if pred and m and int(m.group(1), 16) <= a:
            body = [t for b, _, t in ins if int(m.group(1), 16) <= b <= a]
            if len(body) >= min_len:
                c = collections.Counter()
                for t in body:
                    op = t.split()[0]
                    for k in KEYS:
                        c[k] += op.startswith(k) or (k == "ISETP" and op.startswith("UISETP"))
                out.append((int(m.group(1), 16), a, len(body), c))
    return out


# instructions per step by path, read off this script's listing (fp16, Triton 3.6): plain's loops;
# three tiles: the band-halves loop; pp: its one loop (853) less the mask block it branches over
# (360); lean: the U loop; the M loop (875) less its skip block (12) = masked, less also its mask
# block (353) = unmasked; skip = the M loop's head (28) + skip block + tail (3).
PATH_COST = {"plain": {"unmasked": 466, "masked": 829},
             "three": {"unmasked": 467, "band": 1053, "masked": 829},
             "pp": {"unmasked": 493, "masked": 853},
             "lean": {"U": 469, "unmasked": 510, "masked": 863, "skip": 43}}


def main():
    dt = torch.bfloat16 if "bf16" in sys.argv else torch.float16
    print(f"{dt}, D64, sm_90 SASS (cuobjdump), Triton 3.6; loops of >= 100 instructions")
    for name, cfg in KERNELS:
        if name == "plain":
            k = cc.compile_variant(dt, 64, cfg)[0]
        else:
            k = ccr.compile_variant(dt, 64, cfg)
        ins = sass(k)
        regs = max(int(r) for _, _, t in ins for r in re.findall(r"\bR(\d+)\b", t))
        print(f"{name} {cfg}: {len(ins)} instructions ({16 * len(ins) // 1024} KB), highest "
              f"register R{regs}, shared {k.metadata.shared} B")
        for lo, hi, n, c in loops(ins):
            counts = "  ".join(f"{key} {c[key]}" for key in KEYS)
            print(f"  loop {lo:#07x}-{hi:#07x}: {n:4d} instr  {counts}")
    import emulate_rerope as er
    census = er.step_census()
    base = sum(n * PATH_COST["plain"][p] for p, n in census["plain"].items())
    print("cost model, N 8192 W 2048, one head, all partitions: steps by path -> instructions")
    for name in ("plain", "three", "pp", "lean"):
        total = sum(n * PATH_COST[name][p] for p, n in census[name].items())
        print(f"  {name:6s} {census[name]}  {total:,} instr  ({total / base:.3f} x plain)")


if __name__ == "__main__":
    main()
