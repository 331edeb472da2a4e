"""Probe: part of the online softmax's exponentials computed on the FMA units instead of the
special-function units (MUFU), FlashAttention-4's trick, in the forward kernel.

A forward tile of 128 x 64 scores costs 8192 ``exp2`` on the MUFU (16 per clock per SM on
Hopper: 512 clocks) against 512 clocks of tensor-core work for its two 128 x 64 x 64 dots at
D=64; unless the two overlap, the exponentials are half the loop. ``2^x`` for ``x <= 0`` is
also a handful of FMA-pipe instructions: round ``x`` to the nearest integer ``n`` with the
``1.5 · 2^23`` trick, a degree-4 polynomial for ``2^f`` on ``f = x - n`` in ``[-0.5, 0.5]``
(max relative error 8.4e-6), ``n`` added to its exponent bits. This probe makes copies of the
package whose ``online_softmax._softmax_step`` sends a share of the tile's columns (``half``:
odd columns; ``quarter``: one in four) through that polynomial, and times the forward against
main in one process each (``benchmarks.attention``), alternating; the copies' correctness is the
benchmark's own check against the naive reference, and ``--errors`` compares outputs with
main's on the GPU.

    python3 perf/probe_exp2.py --copy half        # prints the copy's folder
    python3 perf/probe_exp2.py --ptx              # CPU: cross-compile the fwd for sm_90, count ops
"""
import argparse
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POLY = '''

@triton.jit
def _exp2_fma(x):
    """``2^x`` for ``x <= 0`` on the FMA units (0 below -126): nearest integer ``n`` by the
    ``1.5 * 2^23`` trick, ``2^(x - n)`` by a degree-4 polynomial, ``n`` added to the exponent."""
    xc = tl.maximum(x, -126.0)
    j = xc + 12582912.0
    n = j.to(tl.int32, bitcast=True) - 0x4B400000
    f = xc - (j - 12582912.0)
    p = 0.00925496406853199 * f + 0.05585603043437004
    p = p * f + 0.24031251668930054
    p = p * f + 0.693130612373352
    p = p * f + 0.9999977946281433
    r = (p.to(tl.int32, bitcast=True) + n * 8388608).to(tl.float32, bitcast=True)
    return tl.where(x < -126.0, 0.0, r)


@triton.jit
def _exp2_mixed(x, SHARE: tl.constexpr):
    """``exp2(x)``, a share of the columns (``SHARE`` 2: every second, 4: every fourth) on the
    FMA units."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (M, N // 2, 2)))
    if SHARE == 2:
        b = _exp2_fma(b)
    else:
        b1, b2 = tl.split(tl.reshape(b, (M, N // 4, 2)))
        b = tl.reshape(tl.join(tl.math.exp2(b1), _exp2_fma(b2)), (M, N // 2))
    return tl.reshape(tl.join(tl.math.exp2(a), b), (M, N))
'''

LINE = "    p = tl.math.exp2(scores * qk_scale - m_shift[:, None])\n"
SHARES = {"half": 2, "quarter": 4}


def exp2_copy(variant, folder=None):
    """A copy of the package (``kernels/`` and ``perf/``) whose softmax step sends a share of
    each tile's exponentials through :data:`POLY`; returns its folder."""
    folder = folder or tempfile.mkdtemp(prefix=f"exp2_{variant}_")
    shutil.copytree(os.path.join(ROOT, "kernels"), os.path.join(folder, "kernels"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "perf"), os.path.join(folder, "perf"),
                    ignore=shutil.ignore_patterns("__pycache__", "runs"))
    path = os.path.join(folder, "kernels", "online_softmax.py")
    with open(path) as f:
        source = f.read()
    assert source.count(LINE) == 1, "the softmax step's exp2 line not found once"
    source = source.replace(LINE, LINE.replace(
        "tl.math.exp2(scores * qk_scale - m_shift[:, None])",
        f"_exp2_mixed(scores * qk_scale - m_shift[:, None], {SHARES[variant]})"))
    marker = "\n\n@triton.jit\ndef _softmax_step("
    assert source.count(marker) == 1
    source = source.replace(marker, POLY + marker)
    with open(path, "w") as f:
        f.write(source)
    return folder


def ptx_counts(folder):
    """Cross-compile the five-tensor forward (sm_90, fp16, D=64, 128x64, 4 warps, 3 stages, TMA)
    from ``folder``'s package and count a few instructions in its PTX and TTGIR."""
    import subprocess
    code = r'''
import re, sys, json
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import importlib.util
spec = importlib.util.spec_from_file_location("rerope_testing", "tests/conftest.py")
helpers = importlib.util.module_from_spec(spec); sys.modules["rerope_testing"] = helpers
spec.loader.exec_module(helpers)
import test_compile as tc
from triton.backends.compiler import GPUTarget
import triton
job = dict(kernel="fwd", form="five", capability=[9, 0], head_dim=64, dtype="fp16",
           BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
k = triton.compile(tc._source(job), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
print(json.dumps({"ex2": len(re.findall(r"ex2\.approx", ptx)),
                  "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
                  "convert_layout": ttgir.count("ttg.convert_layout"),
                  "local_alloc": ttgir.count("ttg.local_alloc"),
                  "shared": k.metadata.shared}))
'''
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, text=True,
                          capture_output=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copy", choices=sorted(SHARES))
    parser.add_argument("--ptx", action="store_true")
    args = parser.parse_args()
    if args.copy:
        print(exp2_copy(args.copy))
    if args.ptx:
        for name, folder in (("main", ROOT), *((v, exp2_copy(v)) for v in SHARES)):
            for part in ("tests", "tools") if folder != ROOT else ():
                shutil.copytree(os.path.join(ROOT, part), os.path.join(folder, part),
                                ignore=shutil.ignore_patterns("__pycache__"))
            result = ptx_counts(folder)
            print(name, result.stdout.strip() or result.stderr[-2000:])


if __name__ == "__main__":
    main()
