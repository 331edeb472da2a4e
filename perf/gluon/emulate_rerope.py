"""CPU emulation (torch, float32) of rerope_fwd's tile schedules against bench_rerope.ref_rows.
Catches schedule/mask logic errors, not Gluon ones.

1. rerope_fwd_causal_kernel: _regions, per-partition n_full, BAND select + causal mask, INSIDE mask
   from the partition's diagonal, online softmax (exp2).
2. rerope_fwd_twice_kernel (BAND_TWICE, config[6] == 1): the producer's step list (ring step k ->
   tile t, K2 or K1) against every consumer partition's; the outside walk (Q2 K2^T over tiles
   [0, n_in), band tiles masked to i-j >= w) then the inside walk (Q1 K1^T over [n_out, n_tiles),
   band tiles masked to 0 <= i-j < w, causal mask from the partition's diagonal), with the kernel's
   -inf-safe online softmax (m_use). N = 1024, 1000 (zero-padded to a multiple of 128 as TMA pads
   out-of-bounds tiles; the kernel itself wants N % 128 == 0) and 8192 (--quick: 1024 only).
    python perf/gluon/emulate_rerope.py [--quick]"""
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


NO_MASK, MASK_OUT, MASK_IN, MASK_CAUSAL = 0, 1, 2, 3


def twice_steps(n_out, n_in, nt):
    """rerope_fwd._producer_twice's loads: [(ring step k, tile t, 'K2' | 'K1')]."""
    off = n_in - n_out
    return [(t, t, "K2") for t in range(0, n_in)] + [(t + off, t, "K1") for t in range(n_out, nt)]


def twice_consumer_steps(ms, n_out, n_in, nt, BN):
    """rerope_fwd._consumer_twice's visits for a partition starting at row ms: [(k, t, K, MODE)]."""
    n_full = max(ms // BN, n_in)
    off = n_in - n_out
    return ([(t, t, "K2", NO_MASK) for t in range(0, n_out)]
            + [(t, t, "K2", MASK_OUT) for t in range(n_out, n_in)]
            + [(t + off, t, "K1", MASK_IN) for t in range(n_out, n_in)]
            + [(t + off, t, "K1", NO_MASK) for t in range(n_in, n_full)]
            + [(t + off, t, "K1", MASK_CAUSAL) for t in range(n_full, nt)])


def emulate_twice(q1, q2, k1, k2, v, w, BM, BN, SPLIT):
    N, D = q1.shape
    Np = -(-N // BM) * BM  # zero-pad (TMA fills out-of-bounds rows with zeros)
    pad = lambda t: torch.cat([t, t.new_zeros(Np - N, D)])  # noqa: E731
    q1, q2, k1, k2, v = map(pad, (q1, q2, k1, k2, v))
    scale = math.log2(math.e) / math.sqrt(D)
    o = torch.empty(Np, D)
    lse = torch.empty(Np)
    visits = 0
    for m0 in range(0, Np, BM):
        nt = -(-(m0 + BM) // BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        prod = twice_steps(n_out, n_in, nt)
        assert [k for k, _, _ in prod] == list(range(len(prod))), "ring steps not consecutive"
        SUB = BM // SPLIT
        for h in range(SPLIT):
            ms = m0 + h * SUB
            cons = twice_consumer_steps(ms, n_out, n_in, nt, BN)
            assert [c[:3] for c in cons] == prod, ("producer/consumer step lists differ", m0, h, w)
            rows = torch.arange(ms, ms + SUB)
            m = torch.full((SUB,), -math.inf)
            l = torch.zeros(SUB)
            acc = torch.zeros(SUB, D)
            for k, t, kname, mode in cons:
                cols = torch.arange(t * BN, t * BN + BN)
                qq, kk = (q2, k2) if kname == "K2" else (q1, k1)
                s = (qq[rows] @ kk[cols].T) * scale
                if mode == NO_MASK:
                    mn = torch.maximum(m, s.max(1).values)
                    mu = mn
                else:
                    d = rows[:, None] - cols[None]
                    keep = {MASK_OUT: d >= w, MASK_IN: (d >= 0) & (d < w), MASK_CAUSAL: d >= 0}[mode]
                    s = torch.where(keep, s, -math.inf)
                    mn = torch.maximum(m, s.max(1).values)
                    mu = torch.where(mn == -math.inf, torch.zeros_like(mn), mn)
                alpha = torch.exp2(m - mu)
                p = torch.exp2(s - mu[:, None])
                l = l * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ v[cols]
                m = mn
                visits += 1
            o[rows] = acc / l[:, None]
            lse[rows] = (m + torch.log2(l)) * math.log(2)
    return o[:N], lse[:N], visits


def check_twice(Ns, windows):
    worst = worst_lse = 0.0
    for N in Ns:
        torch.manual_seed(N)
        D = 16
        ts = [torch.randn(N, D) for _ in range(5)]
        refs = {}
        for w in windows:
            chunks = [ref_rows(*ts, w, torch.arange(r, min(r + 1024, N))) for r in range(0, N, 1024)]
            refs[w] = (torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]))
        for BM, BN, SPLIT in ((128, 128, 2), (128, 64, 2), (128, 128, 1), (128, 64, 1)):
            line = []
            for w in windows:
                o, lse, visits = emulate_twice(*ts, w, BM, BN, SPLIT)
                err = (o - refs[w][0]).abs().max().item()
                err_lse = (lse - refs[w][1]).abs().max().item()
                worst, worst_lse = max(worst, err), max(worst_lse, err_lse)
                assert math.isfinite(err) and err < 1e-4 and err_lse < 1e-4, (N, BM, BN, SPLIT, w, err, err_lse)
                line.append(f"w{w}:{err:.0e}")
            print(f"  BAND_TWICE N={N} BLOCK_M/N={BM}/{BN} SPLIT={SPLIT}: OK  max|dO| " + " ".join(line), flush=True)
    return worst, worst_lse


def main():
    quick = "--quick" in sys.argv
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
    print(f"emulation OK: 4 tilings x 15 windows, worst max|dO| {worst:.1e}", flush=True)

    windows = (1, 2, 63, 64, 65, 127, 128, 1000, 4096)
    Ns = (1024,) if quick else (1024, 1000, 8192)
    w_o, w_l = check_twice(Ns, windows)
    print(f"BAND_TWICE emulation OK: N {Ns} x 4 tilings x windows {windows}, "
          f"worst max|dO| {w_o:.1e}, max|dLSE| {w_l:.1e}")


if __name__ == "__main__":
    main()
