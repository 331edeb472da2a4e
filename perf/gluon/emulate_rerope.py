"""CPU emulation (torch, float32) of rerope_fwd's tile schedule: _regions, per-partition n_full,
BAND select + causal mask, INSIDE mask from the partition's diagonal, online softmax (exp2), against
bench_rerope.ref_rows. Catches schedule/mask logic errors, not Gluon ones.
    python perf/gluon/emulate_rerope.py"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rerope import ref_rows  # noqa: E402


def regions(m0, w, nt, BM, BN):  # mirror of rerope_fwd._regions
    n_out = max(m0 - w + 1, 0) // BN
    n_in = (max(m0 + BM - 1 - w, -1) + BN) // BN
    return n_out, min(max(n_in, n_out), nt)


def emulate(q1, q2, k1, k2, v, w, BM, BN, SPLIT):
    N, D = q1.shape
    scale = math.log2(math.e) / math.sqrt(D)
    o = torch.empty(N, D)
    for m0 in range(0, N, BM):
        nt = -(-(m0 + BM) // BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        SUB = BM // SPLIT
        for h in range(SPLIT):
            ms = m0 + h * SUB
            rows = torch.arange(ms, ms + SUB)
            n_full = max(ms // BN, n_in)
            m = torch.full((SUB,), -math.inf)
            l = torch.zeros(SUB)
            acc = torch.zeros(SUB, D)
            for t in range(nt):
                cols = torch.arange(t * BN, t * BN + BN)
                if t < n_out:
                    s, mask = q2[rows] @ k2[cols].T, False
                elif t < n_in:
                    s = torch.where((rows[:, None] - cols[None]) < w, q1[rows] @ k1[cols].T, q2[rows] @ k2[cols].T)
                    mask = True
                else:
                    s, mask = q1[rows] @ k1[cols].T, t >= n_full
                s = s * scale
                if mask:
                    s = torch.where(rows[:, None] >= cols[None], s, -math.inf)
                mn = torch.maximum(m, s.max(1).values)
                alpha = torch.exp2(m - mn)
                p = torch.exp2(s - mn[:, None])
                l = l * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ v[cols]
                m = mn
            o[rows] = acc / l[:, None]
    return o


def main():
    torch.manual_seed(0)
    N, D = 512, 16
    ts = [torch.randn(N, D) for _ in range(5)]
    worst = 0.0
    for BM, BN, SPLIT in ((128, 128, 2), (128, 128, 1), (128, 64, 2), (128, 64, 1)):
        for w in (1, 2, 63, 64, 65, 100, 127, 128, 129, 200, 256, 300, 511, 512, 4096):
            ref, _ = ref_rows(*ts, w, torch.arange(N))
            err = (emulate(*ts, w, BM, BN, SPLIT) - ref).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, (BM, BN, SPLIT, w, err)
    print(f"emulation OK: 4 tilings x 15 windows, worst max|dO| {worst:.1e}")


if __name__ == "__main__":
    main()
