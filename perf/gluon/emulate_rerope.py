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
3. rerope_fwd_twice_pp_kernel (BAND_TWICE with PIPE / PINGPONG, config[5] / config[7]): its run-time
   step classification (_step_pp: tile, Q1/Q2, mask lo <= i-j < hi) against _consumer_twice's five
   loops, and the PIPE=1 recurrence (acc_k = (acc_{k-1} + P_{k-1} V_{k-1}) * alpha_k, last P V after
   the loop) against the reference.
4. --protocol (also run by default): the barrier protocol of rerope_fwd_twice_pp_kernel (producer
   with k_empty / v_empty, two consumers, PIPE 0/1, PINGPONG 0/1, ``turn`` barriers) on random
   interleavings with mbarrier parity semantics: no deadlock, no parity wait that could alias (the
   awaited phase is always the last completed or the current one), no ring slot overwritten while
   read, GEMM sections in ping-pong order.
5. SPLIT=3 (BLOCK_M 192 = three 64-row consumer parts, BLOCK_N 128; the grid is cdiv(N, 192), key
   tiles stop at N, a part whose rows start at or past N drains the ring): the plain kernel and the
   three-tiles kernel (band tiles whole and in two key halves, _band_tile_halves) for N = 1024, 1000
   (padded to 1024), 1152 (192 divides it) and 8192 x 17 windows; the band-twice pp kernel
   (PIPE 0 / 1) for N = 1024, 1000, 8192 x the same windows; and, with --protocol, the rings with
   1-3 active parts and the others draining (plain_fwd._drain, rerope_fwd._drain_pp).
6. LEAN (rerope_fwd_lean_kernel, seventh field 2, SPLIT=3): the producer's step list against each
   part's (U: plain's unmasked body; M: diagonal then band visits classified skip / unmasked /
   masked, the classification checked on the mask), N = 1024, 1000, 8192 x 17 windows; its ring
   (plain's, parts skipping random steps) with --protocol; step_census: steps by loop path at
   N 8192 W 2048 of plain / three tiles / pp / LEAN (sass_loops.py's cost model). --lean: 6 only.
    python perf/gluon/emulate_rerope.py [--quick] [--protocol] [--lean]"""
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rerope import ref_rows  # noqa: E402


def regions(m0, w, nt, BM, BN):  # mirror of rerope_fwd._regions
    n_out = max(m0 - w + 1, 0) // BN
    n_in = (max(m0 + BM - 1 - w, -1) + BN) // BN
    return n_out, min(max(n_in, n_out), nt)


def block_tiles(m0, N, BM, BN):
    """Mirror of plain_fwd._block_rows' n_tiles: key tiles of query block m0 (they stop at N, which
    only matters for SPLIT=3, BLOCK_M 192, where the grid is cdiv(N, 192))."""
    return -(-min(m0 + BM, N) // BN)


def pad128(t):
    """Zero rows up to a multiple of 128, the N every config takes (plain_fwd.check_n); TMA reads
    zeros past the tensor, and keys past the real N sit above every real row's diagonal."""
    n = -(-t.shape[0] // 128) * 128
    return torch.cat([t, t.new_zeros(n - t.shape[0], t.shape[1])])


def softmax_step(m, l, acc, s, v_tile, safe=False):
    """One online-softmax step over a tile's base-2 scores ``s`` and values: the new ``(m, l,
    acc)``. ``safe``: exponents against 0 where the running max is still -inf (a row the
    masks hide so far), as the kernels' masked steps do, so no -inf - -inf NaN."""
    mn = torch.maximum(m, s.max(1).values)
    mu = torch.where(mn == -math.inf, torch.zeros_like(mn), mn) if safe else mn
    alpha = torch.exp2(m - mu)
    p = torch.exp2(s - mu[:, None])
    return mn, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v_tile


def emulate(q1, q2, k1, k2, v, w, BM, BN, SPLIT, halves=False):
    """rerope_fwd_causal_kernel (three tiles a slot): N % 128 == 0; grid cdiv(N, BM); a SPLIT part
    whose rows start at or past N drains (computes nothing); ``halves`` (SPLIT=3): band tiles as two
    BN/2-key online-softmax steps (_band_tile_halves). Returns (o, number of drained parts)."""
    N, D = q1.shape
    SUB = BM // SPLIT
    assert N % SUB == 0 and N % BN == 0
    scale = math.log2(math.e) / math.sqrt(D)
    o = torch.full((N, D), math.nan)
    drained = 0
    for m0 in range(0, N, BM):
        nt = block_tiles(m0, N, BM, BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        for h in range(SPLIT):
            ms = m0 + h * SUB
            if ms >= N:  # plain_fwd._drain
                drained += 1
                continue
            rows = torch.arange(ms, ms + SUB)
            n_full = max(ms // BN, n_in)
            m = torch.full((SUB,), -math.inf)
            l = torch.zeros(SUB)
            acc = torch.zeros(SUB, D)
            for t in range(nt):
                band = n_out <= t < n_in
                # (key range, mask) steps of this tile: one, or two halves of a band tile
                if band and halves:
                    parts = [(t * BN, BN // 2), (t * BN + BN // 2, BN // 2)]
                else:
                    parts = [(t * BN, BN)]
                for c0, width in parts:
                    cols = torch.arange(c0, c0 + width)
                    if t < n_out:
                        s, mask = q2[rows] @ k2[cols].T, False
                    elif band:
                        s = torch.where((rows[:, None] - cols[None]) < w, q1[rows] @ k1[cols].T,
                                        q2[rows] @ k2[cols].T)
                        mask = True
                    else:
                        s, mask = q1[rows] @ k1[cols].T, t >= n_full
                    s = s * scale
                    if mask:
                        s = torch.where(rows[:, None] >= cols[None], s, -math.inf)
                    m, l, acc = softmax_step(m, l, acc, s, v[cols])
            o[rows] = acc / l[:, None]
    return o, drained


def emulate_plain(q, k, v, BM, BN, SPLIT):
    """plain_fwd.attn_fwd_causal_kernel (PIPE=0): per part, unmasked tiles below n_full = ms // BN,
    causal mask from there to the block's n_tiles; parts past N drain. Returns (o, lse, drained)."""
    N, D = q.shape
    SUB = BM // SPLIT
    assert N % SUB == 0 and N % BN == 0
    scale = math.log2(math.e) / math.sqrt(D)
    o, lse = torch.full((N, D), math.nan), torch.full((N,), math.nan)
    drained = 0
    for m0 in range(0, N, BM):
        nt = block_tiles(m0, N, BM, BN)
        for h in range(SPLIT):
            ms = m0 + h * SUB
            if ms >= N:
                drained += 1
                continue
            rows = torch.arange(ms, ms + SUB)
            m, l, acc = torch.full((SUB,), -math.inf), torch.zeros(SUB), torch.zeros(SUB, D)
            for t in range(nt):
                cols = torch.arange(t * BN, t * BN + BN)
                s = (q[rows] @ k[cols].T) * scale
                if t >= ms // BN:
                    s = torch.where(rows[:, None] >= cols[None], s, -math.inf)
                m, l, acc = softmax_step(m, l, acc, s, v[cols])
            o[rows] = acc / l[:, None]
            lse[rows] = (m + torch.log2(l)) * math.log(2)
    return o, lse, drained


SPLIT3_WINDOWS = (1, 2, 63, 64, 65, 100, 127, 128, 129, 191, 192, 193, 300, 1000, 1024, 2048, 4096)


def check_split3(Ns, windows=SPLIT3_WINDOWS):
    """SPLIT=3 / BLOCK_M 192 (three-tiles kernel with band halves, and plain) on N that 192 does not
    divide (ragged last block: one or two parts drain) and one it does, against the float32
    reference; N = 1000 is zero-padded to 1024 first (pad128) and compared on its 1000 rows."""
    worst = 0.0
    for N in Ns:
        torch.manual_seed(N + 3)
        D = 16
        ts = [torch.randn(N, D) for _ in range(5)]
        tp = [pad128(t) for t in ts]
        Np = tp[0].shape[0]
        # plain causal attention (the ReRoPE reference with window > N)
        q, k, v = ts[0], ts[2], ts[4]
        chunks = [ref_rows(q, q, k, k, v, N + 1, torch.arange(r, min(r + 1024, N)))
                  for r in range(0, N, 1024)]
        ref_o, ref_l = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
        for BM, BN, SPLIT in ((192, 128, 3), (128, 128, 2)):
            o, lse, drained = emulate_plain(tp[0], tp[2], tp[4], BM, BN, SPLIT)
            err = max((o[:N] - ref_o).abs().max().item(), (lse[:N] - ref_l).abs().max().item())
            worst = max(worst, err)
            assert math.isfinite(err) and err < 1e-4, ("plain", N, BM, BN, SPLIT, err)
            print(f"  plain N={N} (kernel N {Np}) BLOCK_M/N={BM}/{BN} SPLIT={SPLIT}: OK max err "
                  f"{err:.0e}, {drained} part(s) drained", flush=True)
        line = []
        for w in windows:
            chunks = [ref_rows(*ts, w, torch.arange(r, min(r + 1024, N))) for r in range(0, N, 1024)]
            ref_o = torch.cat([c[0] for c in chunks])
            wk = min(w, Np + 1)  # rerope_attention's clamp (window >= N: all inside)
            for halves in (True, False):
                o, drained = emulate(*tp, wk, 192, 128, 3, halves=halves)
                err = (o[:N] - ref_o).abs().max().item()
                worst = max(worst, err)
                assert math.isfinite(err) and err < 1e-4, ("three tiles", N, w, halves, err)
            line.append(f"w{w}:{err:.0e}")
        print(f"  three tiles N={N} (kernel N {Np}) BLOCK_M/N=192/128 SPLIT=3, band in halves and "
              f"whole: OK, {drained} part(s) drained; max|dO| " + " ".join(line), flush=True)
    return worst


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
    q1, q2, k1, k2, v = map(pad128, (q1, q2, k1, k2, v))  # the kernel's N: a multiple of 128
    Np = q1.shape[0]
    scale = math.log2(math.e) / math.sqrt(D)
    o = torch.empty(Np, D)
    lse = torch.empty(Np)
    visits = 0
    for m0 in range(0, Np, BM):
        nt = block_tiles(m0, Np, BM, BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        prod = twice_steps(n_out, n_in, nt)
        assert [k for k, _, _ in prod] == list(range(len(prod))), "ring steps not consecutive"
        SUB = BM // SPLIT
        for h in range(SPLIT):
            ms = m0 + h * SUB
            if ms >= Np:  # SPLIT=3's ragged last block: this part drains (_drain_pp)
                continue
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
                if mode != NO_MASK:
                    d = rows[:, None] - cols[None]
                    keep = {MASK_OUT: d >= w, MASK_IN: (d >= 0) & (d < w), MASK_CAUSAL: d >= 0}[mode]
                    s = torch.where(keep, s, -math.inf)
                m, l, acc = softmax_step(m, l, acc, s, v[cols], safe=mode != NO_MASK)
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


BIG = 1 << 30  # rerope_fwd.BIG


def pp_steps(n_out, n_in, n_full, nt, w):
    """Mirror of rerope_fwd._step_pp for every step k: [(k, t, 'K2' | 'K1', (masked, lo, hi))]."""
    out = []
    for k in range(n_in + nt - n_out):
        ins = int(k >= n_in)
        t = k - (n_in - n_out) * ins
        band_in = ins == 1 and t < n_in
        masked = (ins == 0 and t >= n_out) or band_in or (ins == 1 and t >= n_full)
        lo = w * (1 - ins)
        hi = BIG + (w - BIG) * int(band_in)
        out.append((k, t, "K1" if ins else "K2", (masked, lo, hi)))
    return out


def mode_as_bounds(mode, w):
    return {NO_MASK: (False,), MASK_OUT: (True, w, BIG), MASK_IN: (True, 0, w), MASK_CAUSAL: (True, 0, BIG)}[mode]


def emulate_pp(q1, q2, k1, k2, v, w, BM, BN, SPLIT, PIPE):
    """rerope_fwd_twice_pp_kernel's consumers (run-time masks; PIPE=1: the pipelined recurrence);
    SPLIT=3 (BLOCK_M 192): grid cdiv(N, 192), parts past N drain."""
    N, D = q1.shape
    q1, q2, k1, k2, v = map(pad128, (q1, q2, k1, k2, v))
    Np = q1.shape[0]
    scale = math.log2(math.e) / math.sqrt(D)
    o = torch.empty(Np, D)
    lse = torch.empty(Np)
    for m0 in range(0, Np, BM):
        nt = block_tiles(m0, Np, BM, BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        SUB = BM // SPLIT
        for h in range(SPLIT):
            ms = m0 + h * SUB
            if ms >= Np:  # _drain_pp
                continue
            n_full = max(ms // BN, n_in)
            steps = pp_steps(n_out, n_in, n_full, nt, w)
            ref_steps = twice_consumer_steps(ms, n_out, n_in, nt, BN)
            got = [(k, t, kn, mk if mk[0] else (False,)) for k, t, kn, mk in steps]
            want = [(k, t, kn, mode_as_bounds(mode, w)) for k, t, kn, mode in ref_steps]
            assert got == want, ("_step_pp differs from _consumer_twice", m0, h, w)
            rows = torch.arange(ms, ms + SUB)
            m = torch.full((SUB,), -math.inf)
            l = torch.zeros(SUB)
            acc = torch.zeros(SUB, D)
            prev = None  # PIPE=1: (p, cols) of the previous step, its P V not yet added
            for k, t, kname, (masked, lo, hi) in steps:
                cols = torch.arange(t * BN, t * BN + BN)
                qq, kk = (q2, k2) if kname == "K2" else (q1, k1)
                s = (qq[rows] @ kk[cols].T) * scale
                if masked:
                    d = rows[:, None] - cols[None]
                    s = torch.where((d >= lo) & (d < hi), s, -math.inf)
                mn = torch.maximum(m, s.max(1).values)
                mu = torch.where(mn == -math.inf, torch.zeros_like(mn), mn)
                alpha = torch.exp2(m - mu)
                p = torch.exp2(s - mu[:, None])
                l = l * alpha + p.sum(1)
                m = mn
                if PIPE:
                    if prev is not None:
                        acc = (acc + prev[0] @ v[prev[1]]) * alpha[:, None]
                    prev = (p.half().float(), cols)  # P goes through fp16 registers on the GPU
                else:
                    acc = acc * alpha[:, None] + p.half().float() @ v[cols]
            if PIPE:
                acc = acc + prev[0] @ v[prev[1]]
            o[rows] = acc / l[:, None]
            lse[rows] = (m + torch.log2(l)) * math.log(2)
    return o[:N], lse[:N]


PP_TILINGS = ((128, 128, 2), (128, 64, 2), (128, 128, 1), (192, 128, 3))


def check_pp(Ns, windows, tilings=PP_TILINGS):
    worst = 0.0
    for N in Ns:
        torch.manual_seed(N + 1)
        D = 16
        ts = [torch.randn(N, D) for _ in range(5)]
        for w in windows:
            chunks = [ref_rows(*ts, w, torch.arange(r, min(r + 1024, N))) for r in range(0, N, 1024)]
            ref_o, ref_l = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
            for BM, BN, SPLIT in tilings:
                for PIPE in (0, 1):
                    o, lse = emulate_pp(*ts, w, BM, BN, SPLIT, PIPE)
                    err = (o - ref_o).abs().max().item()
                    err_l = (lse - ref_l).abs().max().item()
                    worst = max(worst, err)
                    assert math.isfinite(err) and err < 5e-3 and err_l < 1e-4, (N, w, BM, BN, SPLIT, PIPE, err, err_l)
        names = ", ".join(f"{bm}/{bn}x{sp}" for bm, bn, sp in tilings)
        print(f"  FA3-scheduled BAND_TWICE N={N}: OK for windows {windows}, tilings {names}, "
              f"PIPE 0 and 1", flush=True)
    return worst


def lean_steps(n_out, n_in, nt):
    """rerope_fwd._producer_lean's loads: [(ring step k, tile t, 'K2' | 'K1')]: outside, inside,
    then each band tile twice (K2, K1)."""
    n_u = n_out + nt - n_in
    return ([(t, t, "K2") for t in range(n_out)]
            + [(n_out + t - n_in, t, "K1") for t in range(n_in, nt)]
            + [(n_u + jj, n_out + jj // 2, "K1" if jj % 2 else "K2")
               for jj in range(2 * (n_in - n_out))])


def lean_consumer_steps(ms, SUB, n_out, n_in, nt, BN, w):
    """Mirror of rerope_fwd._consumer_lean (same integer formulas): [(k, t, K, kind, lo, hi)],
    kind 'U' (plain's unmasked body), 'skip', 'unmasked' or 'masked' (the M loop)."""
    n_full = max(ms // BN, n_in)
    out = []
    for r in range(2):
        k_off = (n_out - n_in) * r
        for t in range(n_in * r, n_out + (n_full - n_out) * r):
            out.append((t + k_off, t, "K1" if r else "K2", "U", None, None))
    n_diag = nt - n_full
    k0 = n_out + n_full - n_in
    for j in range(n_diag + 2 * (n_in - n_out)):
        jb = max(j - n_diag, 0)
        band = int(j >= n_diag)
        ins = 1 - band * (1 - (jb & 1))
        t = band * (n_out + jb // 2) + (1 - band) * (n_full + j)
        lo = w * (1 - ins)
        hi = BIG + (w - BIG) * (band * ins)
        d_min = ms - t * BN - (BN - 1)
        d_max = ms + SUB - 1 - t * BN
        if d_max < lo or d_min >= hi:
            kind = "skip"
        else:
            kind = "masked" if (d_min < lo or d_max >= hi) else "unmasked"
        out.append((k0 + j, t, "K1" if ins else "K2", kind, lo, hi))
    return out


def emulate_lean(q1, q2, k1, k2, v, w, BM=192, BN=128, SPLIT=3, stats=None):
    """rerope_fwd_lean_kernel: every partition's step list (ring step k -> tile, K) equals the
    producer's; 'skip' visits keep nothing, 'unmasked' and 'U' ones keep everything (checked on the
    mask itself); U steps use the plain softmax (no m_use), M steps the -inf-safe one."""
    N, D = q1.shape
    q1, q2, k1, k2, v = map(pad128, (q1, q2, k1, k2, v))
    Np = q1.shape[0]
    scale = math.log2(math.e) / math.sqrt(D)
    o = torch.full((Np, D), math.nan)
    lse = torch.full((Np,), math.nan)
    SUB = BM // SPLIT
    for m0 in range(0, Np, BM):
        nt = block_tiles(m0, Np, BM, BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        prod = lean_steps(n_out, n_in, nt)
        assert [k for k, _, _ in prod] == list(range(len(prod))), "ring steps not consecutive"
        assert len(prod) == nt + n_in - n_out  # _drain's step count
        for h in range(SPLIT):
            ms = m0 + h * SUB
            if ms >= Np:  # plain_fwd._drain
                continue
            cons = lean_consumer_steps(ms, SUB, n_out, n_in, nt, BN, w)
            assert [c[:3] for c in cons] == prod, ("producer/consumer step lists differ", m0, h, w)
            rows = torch.arange(ms, ms + SUB)
            m, l, acc = torch.full((SUB,), -math.inf), torch.zeros(SUB), torch.zeros(SUB, D)
            for k, t, kname, kind, lo, hi in cons:
                if stats is not None:
                    stats[kind] = stats.get(kind, 0) + 1
                cols = torch.arange(t * BN, t * BN + BN)
                d = rows[:, None] - cols[None]
                if kind == "U":  # the region's own rule must hold for every pair
                    rule = (d >= w) if kname == "K2" else ((d >= 0) & (d < w))
                    assert bool(rule.all()), ("U step outside its region", m0, h, t, w)
                    keep = None
                else:
                    keep = (d >= lo) & (d < hi)
                    assert kind != "skip" or not bool(keep.any()), ("skip keeps keys", m0, h, t, w)
                    assert kind != "unmasked" or bool(keep.all()), ("unmasked drops keys", m0, h, t)
                    if kind == "skip":
                        continue
                qq, kk = (q2, k2) if kname == "K2" else (q1, k1)
                s = (qq[rows] @ kk[cols].T) * scale
                if kind == "masked":
                    s = torch.where(keep, s, -math.inf)
                m, l, acc = softmax_step(m, l, acc, s, v[cols], safe=kind != "U")
            o[rows] = acc / l[:, None]
            lse[rows] = (m + torch.log2(l)) * math.log(2)
    return o[:N], lse[:N]


def check_lean(Ns, windows=SPLIT3_WINDOWS):
    """The LEAN walk (SPLIT=3, BLOCK_M 192, BLOCK_N 128) against the float32 reference."""
    worst = 0.0
    for N in Ns:
        torch.manual_seed(N + 7)
        D = 16
        ts = [torch.randn(N, D) for _ in range(5)]
        line = []
        for w in windows:
            chunks = [ref_rows(*ts, w, torch.arange(r, min(r + 1024, N)))
                      for r in range(0, N, 1024)]
            ref_o, ref_l = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
            o, lse = emulate_lean(*ts, min(w, -(-N // 128) * 128 + 1))
            err = max((o - ref_o).abs().max().item(), (lse - ref_l).abs().max().item())
            worst = max(worst, err)
            assert math.isfinite(err) and err < 1e-4, ("lean", N, w, err)
            line.append(f"w{w}:{err:.0e}")
        print(f"  LEAN N={N} BLOCK_M/N=192/128 SPLIT=3: OK max|dO|,|dLSE| " + " ".join(line),
              flush=True)
    return worst


def step_census(N=8192, w=2048, BM=192, BN=128, SPLIT=3):
    """Per-block ring steps of each SPLIT=3 walk at (N, w), summed over blocks and partitions, by
    the loop path a partition takes (for perf/gluon/sass_loops.py's cost model)."""
    SUB = BM // SPLIT
    c = {"plain": {}, "three": {}, "pp": {}, "lean": {}}

    def add(name, kind, n=1):
        c[name][kind] = c[name].get(kind, 0) + n
    for m0 in range(0, N, BM):
        nt = block_tiles(m0, N, BM, BN)
        n_out, n_in = regions(m0, w, nt, BM, BN)
        for h in range(SPLIT):
            ms = m0 + h * SUB
            if ms >= N:
                continue
            n_full_plain = ms // BN
            add("plain", "unmasked", n_full_plain)
            add("plain", "masked", nt - n_full_plain)
            n_full = max(ms // BN, n_in)
            add("three", "unmasked", n_out + n_full - n_in)
            add("three", "band", n_in - n_out)
            add("three", "masked", nt - n_full)
            for _, _, _, (masked, _, _) in pp_steps(n_out, n_in, n_full, nt, w):
                add("pp", "masked" if masked else "unmasked")
            for step in lean_consumer_steps(ms, SUB, n_out, n_in, nt, BN, w):
                add("lean", step[3])
    return c


# ---------------------------------------------------------------- barrier protocol (random interleavings)
class Bar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.done = name, count, count, 0  # done = completed phases

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, f"{self.name}: too many arrivals"
        if self.pending == 0:
            self.done += 1
            self.pending = self.count

    def ready(self, phase):
        """Hardware: wait(parity = phase & 1) passes iff the current phase's parity differs. The
        awaited phase must be the last completed one or the current one, else the parity lies."""
        assert phase <= self.done <= phase + 1, \
            f"{self.name}: parity alias (waits for phase {phase}, {self.done} completed)"
        return (self.done & 1) != (phase & 1)


def protocol_run(n_steps, STAGES, SPLIT, PIPE, PP, rng, n_active=None):
    """One random interleaving of rerope_fwd_twice_pp_kernel's partitions for a block of n_steps
    steps; consumers me >= n_active (SPLIT=3's parts past N) run _drain_pp instead."""
    n_active = SPLIT if n_active is None else n_active
    kr = [Bar(f"k_ready{s}", 1) for s in range(STAGES)]
    vr = [Bar(f"v_ready{s}", 1) for s in range(STAGES)]
    ke = [Bar(f"k_empty{s}", SPLIT) for s in range(STAGES)]
    ve = [Bar(f"v_empty{s}", SPLIT) for s in range(STAGES)]
    turn = [Bar("turn0", 1), Bar("turn1", 1)]
    slot = {("K", s): None for s in range(STAGES)}
    slot.update({("V", s): None for s in range(STAGES)})
    inflight = []  # TMA copies: (kind, s, k, ready barrier)
    sections = []

    def producer():
        for k in range(n_steps):
            s = k % STAGES
            yield ("wait", ke[s], k // STAGES - 1)  # parity ((k // STAGES) & 1) ^ 1; -1: fresh barrier
            inflight.append(("K", s, k, kr[s]))
            yield ("wait", ve[s], k // STAGES - 1)
            inflight.append(("V", s, k, vr[s]))

    def use(kind, k):  # a wgmma reads slot k % STAGES: it must hold step k's tile (checked at issue and at release)
        assert slot[(kind, k % STAGES)] == k, f"{kind} slot {k % STAGES} holds {slot[(kind, k % STAGES)]}, step {k} reads"

    def drain_pp():  # rerope_fwd._drain_pp
        for k in range(n_steps):
            s = k % STAGES
            yield ("wait", kr[s], k // STAGES)
            yield ("arrive", ke[s])
            yield ("wait", vr[s], k // STAGES)
            yield ("arrive", ve[s])

    def consumer(me):
        def turn_wait(k):
            return ("wait", turn[me], k - 1 + me)  # parity (k & 1) ^ (1 - me)

        def section(k):
            sections.append((me, k))

        ks = range(n_steps)
        if PIPE:
            yield ("wait", kr[0], 0)
            if PP:
                yield turn_wait(0)
            section(0)
            use("K", 0)
            if PP:
                yield ("arrive", turn[1 - me])
            use("K", 0)
            yield ("arrive", ke[0])
            for k in ks[1:]:
                s, sp = k % STAGES, (k - 1) % STAGES
                yield ("wait", kr[s], k // STAGES)
                if PP:
                    yield turn_wait(k)
                section(k)
                use("K", k)
                yield ("wait", vr[sp], (k - 1) // STAGES)
                use("V", k - 1)
                if PP:
                    yield ("arrive", turn[1 - me])
                yield ("tick",)  # the S wgmma runs
                use("K", k)
                yield ("arrive", ke[s])
                yield ("tick",)  # softmax while P V runs
                use("V", k - 1)
                yield ("arrive", ve[sp])
            last = n_steps - 1
            yield ("wait", vr[last % STAGES], last // STAGES)
            use("V", last)
            yield ("tick",)
            use("V", last)
            yield ("arrive", ve[last % STAGES])
        else:
            for k in ks:
                s = k % STAGES
                yield ("wait", kr[s], k // STAGES)
                if PP:
                    yield turn_wait(k)
                section(k)
                use("K", k)
                if PP:
                    yield ("arrive", turn[1 - me])
                yield ("tick",)
                use("K", k)
                yield ("arrive", ke[s])
                yield ("wait", vr[s], k // STAGES)
                use("V", k)
                yield ("tick",)
                use("V", k)
                yield ("arrive", ve[s])

    agents = {"P": producer()}
    for me in range(SPLIT):
        agents[f"C{me}"] = consumer(me) if me < n_active else drain_pp()
    return _interleave(agents, inflight, slot, rng), sections


def _interleave(agents, inflight, slot, rng):
    """Run generator agents (yielding ("wait", bar, phase) / ("arrive", bar) / ("tick",)) and the
    in-flight TMA copies (kind, slot, step, ready barrier) in a random order until all are done."""
    nxt = {a: None for a in agents}  # pending action per agent
    while agents or inflight:
        runnable = []
        for a, g in agents.items():
            if nxt[a] is None:
                try:
                    nxt[a] = next(g)
                except StopIteration:
                    nxt[a] = "done"
            act = nxt[a]
            if act == "done" or act[0] != "wait" or act[1].ready(act[2]):
                runnable.append(a)
        choices = runnable + (["tma"] if inflight else [])
        assert choices, f"DEADLOCK: {[(a, nxt[a][0], nxt[a][1].name, nxt[a][2]) for a in agents]}"
        c = rng.choice(choices)
        if c == "tma":
            kind, s, k, bar = inflight.pop(rng.randrange(len(inflight)))
            slot[(kind, s)] = k
            bar.arrive()
            continue
        act = nxt[c]
        nxt[c] = None
        if act == "done":
            del agents[c]
        elif act[0] == "arrive":
            act[1].arrive()
    return True


def protocol_pp(n_steps, STAGES, SPLIT, PIPE, PP, rng, n_active=None):
    ok, sections = protocol_run(n_steps, STAGES, SPLIT, PIPE, PP, rng, n_active)
    if PP:
        assert sections == [(me, k) for k in range(n_steps) for me in range(2)], "sections not in ping-pong order"
    return len(sections)


def protocol_ring_run(n_tiles, STAGES, SPLIT, n_active, rng, skips=(), skip_waits_v=True):
    """The plain / three-tiles kernels' ring (one kv_empty per slot counting SPLIT arrivals, K and V
    ready barriers; rerope's band K1 + K2 on one k_ready is the same protocol) with consumers
    me >= n_active running plain_fwd._drain (wait k_ready, arrive kv_empty). ``skips``: (me, i)
    pairs where an active consumer skips step i as rerope_fwd._consumer_lean does (wait k_ready and
    v_ready, arrive kv_empty; ``skip_waits_v=False`` plants the bug of not waiting for V)."""
    kr = [Bar(f"k_ready{s}", 1) for s in range(STAGES)]
    vr = [Bar(f"v_ready{s}", 1) for s in range(STAGES)]
    ke = [Bar(f"kv_empty{s}", SPLIT) for s in range(STAGES)]
    slot = {(kind, s): None for kind in "KV" for s in range(STAGES)}
    inflight = []

    def producer():
        for i in range(n_tiles):
            s = i % STAGES
            yield ("wait", ke[s], i // STAGES - 1)
            inflight.append(("K", s, i, kr[s]))
            inflight.append(("V", s, i, vr[s]))

    def use(kind, i):
        held = slot[(kind, i % STAGES)]
        assert held == i, f"{kind} slot {i % STAGES} holds {held}, tile {i} reads"

    def consumer(me=0):
        for i in range(n_tiles):
            s = i % STAGES
            yield ("wait", kr[s], i // STAGES)
            if (me, i) in skips:
                if skip_waits_v:
                    yield ("wait", vr[s], i // STAGES)
                yield ("arrive", ke[s])
                continue
            use("K", i)
            yield ("tick",)  # S = Q K^T, softmax
            use("K", i)
            yield ("wait", vr[s], i // STAGES)
            use("V", i)
            yield ("tick",)  # O += P V
            use("K", i)
            use("V", i)
            yield ("arrive", ke[s])

    def drain():
        for i in range(n_tiles):
            s = i % STAGES
            yield ("wait", kr[s], i // STAGES)
            yield ("arrive", ke[s])

    agents = {"P": producer()}
    for me in range(SPLIT):
        agents[f"C{me}"] = consumer(me) if me < n_active else drain()
    return _interleave(agents, inflight, slot, rng)


def check_protocol_lean(runs=300, seed=1):
    """rerope_fwd_lean_kernel's ring: plain's, with active parts skipping random steps (wait K and
    V, release) and parts past N draining; and the planted bug (a skip that does not wait for V,
    every active part skipping a step) must be caught (parity alias or slot overwritten)."""
    rng = random.Random(seed)
    n = 0
    for STAGES in (1, 2, 3):
        for n_active in (1, 2, 3):
            for n_steps in (1, 2, 3, 5, 8):
                for _ in range(runs // 30 + 1):
                    skips = {(me, i) for me in range(n_active) for i in range(n_steps)
                             if rng.random() < 0.4}
                    protocol_ring_run(n_steps, STAGES, 3, n_active, rng, skips)
                    n += 1
    caught = 0
    for _ in range(200):
        try:
            protocol_ring_run(6, 2, 3, 1, rng, {(0, 1), (0, 2)}, skip_waits_v=False)
        except AssertionError:
            caught += 1
    assert caught, "planted bug (skip without the V wait) not caught"
    print(f"LEAN ring protocol OK: {n} random interleavings (STAGES 1-3, 1-3 active parts skipping "
          f"random steps, the others draining); planted bug caught in {caught}/200", flush=True)


def check_protocol(runs=300, seed=0):
    rng = random.Random(seed)
    n = 0
    for STAGES in (1, 2, 3):
        for SPLIT, PP in ((1, 0), (2, 0), (2, 1)):
            for PIPE in (0, 1):
                for n_steps in (1, 2, 3, 5, 8):
                    for _ in range(runs // 30 + 1):
                        protocol_pp(n_steps, STAGES, SPLIT, PIPE, PP, rng)
                        n += 1
    print(f"barrier protocol OK: {n} random interleavings (STAGES 1-3, SPLIT 1/2, PIPE 0/1, PINGPONG 0/1, "
          f"1-8 steps): no deadlock, no parity alias, no slot overwritten while read, ping-pong order", flush=True)
    n3 = 0
    for STAGES in (1, 2, 3):
        for n_active in (1, 2, 3):
            for n_steps in (1, 2, 3, 5, 8):
                for _ in range(runs // 30 + 1):
                    for PIPE in (0, 1):
                        protocol_pp(n_steps, STAGES, 3, PIPE, 0, rng, n_active)
                    protocol_ring_run(n_steps, STAGES, 3, n_active, rng)
                    n3 += 3
    print(f"SPLIT=3 barrier protocol OK: {n3} random interleavings (STAGES 1-3, 1-3 active parts, "
          f"the others draining; band-twice ring PIPE 0/1 and the plain / three-tiles ring, 1-8 "
          f"steps)", flush=True)
    check_protocol_lean(runs)


def main():
    quick = "--quick" in sys.argv
    if "--protocol" in sys.argv:
        check_protocol()
        return
    if "--lean" in sys.argv:  # only the LEAN walk (item 6) and its ring
        check_lean((1024,) if quick else (1024, 1000, 8192))
        check_protocol_lean()
        return
    torch.manual_seed(0)
    N, D = 512, 16
    ts = [torch.randn(N, D) for _ in range(5)]
    worst = 0.0
    for BM, BN, SPLIT in ((128, 128, 2), (128, 128, 1), (128, 64, 2), (128, 64, 1)):
        for w in (1, 2, 63, 64, 65, 100, 127, 128, 129, 200, 256, 300, 511, 512, 4096):
            ref, _ = ref_rows(*ts, w, torch.arange(N))
            err = (emulate(*ts, w, BM, BN, SPLIT)[0] - ref).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, (BM, BN, SPLIT, w, err)
    print(f"emulation OK: 4 tilings x 15 windows, worst max|dO| {worst:.1e}", flush=True)
    Ns = (1024,) if quick else (1024, 1000, 1152, 8192)
    w3 = check_split3(Ns)
    print(f"SPLIT=3 (BLOCK_M 192) emulation OK: N {Ns}, plain and three tiles (band in halves) x "
          f"windows {SPLIT3_WINDOWS}, worst error {w3:.1e}", flush=True)

    windows = (1, 2, 63, 64, 65, 127, 128, 1000, 4096)
    Ns = (1024,) if quick else (1024, 1000, 8192)
    w_o, w_l = check_twice(Ns, windows)
    print(f"BAND_TWICE emulation OK: N {Ns} x 4 tilings x windows {windows}, "
          f"worst max|dO| {w_o:.1e}, max|dLSE| {w_l:.1e}")
    w_p = check_pp((1024,) if quick else (1024, 1000), windows)
    print(f"FA3-scheduled BAND_TWICE emulation OK: worst max|dO| {w_p:.1e} (P rounded to fp16 as on the GPU)")
    Ns = (1024,) if quick else (1024, 1000, 8192)
    w_p = check_pp(Ns, SPLIT3_WINDOWS, tilings=((192, 128, 3),))
    print(f"SPLIT=3 BAND_TWICE (rerope_fwd_twice_pp_kernel) emulation OK: N {Ns}, worst max|dO| "
          f"{w_p:.1e}")
    w_n = check_lean(Ns)
    print(f"SPLIT=3 LEAN (rerope_fwd_lean_kernel) emulation OK: N {Ns} x windows {SPLIT3_WINDOWS}, "
          f"worst max|dO|, |dLSE| {w_n:.1e}; steps at N 8192 W 2048 by path: {step_census()}")
    check_protocol()


if __name__ == "__main__":
    main()
