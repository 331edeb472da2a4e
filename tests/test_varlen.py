"""``rerope.rerope_varlen``: packed variable-length ReRoPE (FlashAttention's varlen layout).

Against the float64 reference run one sequence at a time (``rerope.reference.rerope_varlen``)
on fresh random inputs, with the suite's per-dtype tolerances: mixed lengths (odd ones, one
query, a chunk after a cached prefix ``Lq < Lk``), windows at the boundaries (``w = 1``, ``w >=
N``), GQA, causal or not, raw or rotated inputs, Leaky, log-n, Self-Extend, a model's own
frequencies; gradients of the contiguous form; the paged form (pages read in place: pages
smaller than, as large as and larger than the key tile, shuffled, the table's unused entries
poisoned, pre-turned keys) against the reference and the contiguous one; the checks; NaN for lengths out of range where they are not checked (GPU
tensors); poisoned memory; and a serving step end to end: ``rerope_varlen`` over the prefill
tokens of three requests and ``rerope_decode`` over two decoding ones, all in one page pool,
each request's output equal to running it alone through the dense reference.

CPU sizes stay tiny (the interpreter runs every program in Python); ``-m gpu`` runs a larger
case, the benchmark's packed batch shape, and a CUDA-graph capture of the decode half.
"""

from dataclasses import dataclass

import pytest
import torch

import rerope
from rerope import reference, varlen
from benchmarks.varlen import page_pool
from rerope_testing import (close_problems, cross_compile, describe, kernel_device,
                            poisoned_empty, randn, results_problems, tolerance)

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

def cumulative(lengths, device):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Case:
    lq: tuple
    lk: tuple
    window: int
    hq: int = 2
    hkv: int = 1
    d: int = 16
    dtype: torch.dtype = F32
    causal: bool = True
    options: tuple = ()          # (name, value) pairs of rerope's keywords

    def id(self):
        parts = ["q" + "-".join(map(str, self.lq)), "k" + "-".join(map(str, self.lk)),
                 f"w{self.window}", f"H{self.hq}kv{self.hkv}", f"D{self.d}",
                 str(self.dtype).replace("torch.", ""), "causal" if self.causal else "full"]
        parts += [f"{k}{v}" for k, v in self.options]
        return "-".join(parts)


CASES = [
    Case((5, 17, 1), (9, 17, 20), 5),                         # prefix, whole prompt, 1 query
    Case((7, 3), (7, 19), 1, hq=4, hkv=2),                    # w = 1, GQA
    Case((11, 6), (11, 13), 64, causal=False),                # w >= N, not causal
    Case((13, 2), (21, 2), 4, dtype=F16, options=(("rotated", True),)),
    Case((9, 4), (9, 12), 3, dtype=BF16, options=(("leaky", 4.0), ("logn_len", 6.0))),
    Case((10, 5), (10, 18), 4, options=(("group", 2), ("rotated", True))),
    Case((6, 0, 8), (6, 5, 8), 3, causal=False, d=32,
         options=(("inv_freq", tuple(1.0 / (100.0 ** (i / 16)) for i in range(16))),)),
]


def packed(gen, case, device=None, grad=False):
    device = device or kernel_device()
    total_q, total_k = sum(case.lq), sum(case.lk)
    q = randn(gen, total_q, case.hq, case.d, dtype=case.dtype, device=device)
    k = randn(gen, total_k, case.hkv, case.d, dtype=case.dtype, device=device)
    v = randn(gen, total_k, case.hkv, case.d, dtype=case.dtype, device=device)
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, cumulative(case.lq, device), cumulative(case.lk, device)


def options_of(case):
    options = dict(case.options)
    if "inv_freq" in options:
        options["inv_freq"] = list(options["inv_freq"])
    return options


def reference_of(q, k, v, cu_q, cu_k, case):
    return reference.rerope_varlen(q.detach().double(), k.detach().double(),
                                   v.detach().double(), cu_q.cpu(), cu_k.cpu(), case.window,
                                   causal=case.causal, **options_of(case))


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_forward_and_lse_match_reference(gen, case):
    q, k, v, cu_q, cu_k = packed(gen, case)
    with poisoned_empty():
        out, lse = rerope.rerope_varlen(q, k, v, cu_q, cu_k, max(case.lq), max(case.lk),
                                        case.window, causal=case.causal, return_lse=True,
                                        **options_of(case))
    want_out, want_lse = reference_of(q, k, v, cu_q, cu_k, case)
    assert out.dtype == case.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (case.hq, sum(case.lq))
    tol = tolerance(case.dtype)
    problems = results_problems({"out": out}, {"out": want_out}, tol)
    problems += close_problems("lse", lse, want_lse, tolerance(F32)
                               if case.dtype == F32 else tol)
    assert not problems, describe(gen, case=case.id()) + "\n" + "\n".join(problems)


def test_no_lse_is_the_same_output(gen):
    case = CASES[0]
    q, k, v, cu_q, cu_k = packed(gen, case)
    args = (q, k, v, cu_q, cu_k, max(case.lq), max(case.lk), case.window)
    out = rerope.rerope_varlen(*args)
    out2, _ = rerope.rerope_varlen(*args, return_lse=True)
    assert torch.equal(out, out2)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4], CASES[5], CASES[6]],
                         ids=Case.id)
def test_gradients_match_reference(gen, case):
    q, k, v, cu_q, cu_k = packed(gen, case, grad=True)
    with poisoned_empty():
        out, lse = rerope.rerope_varlen(q, k, v, cu_q, cu_k, max(case.lq), max(case.lk),
                                        case.window, causal=case.causal, return_lse=True,
                                        **options_of(case))
    assert out.requires_grad and not lse.requires_grad
    dout = randn(gen, *out.shape, dtype=case.dtype, device=out.device)
    got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out, _ = reference.rerope_varlen(*leaves, cu_q.cpu(), cu_k.cpu(), case.window,
                                          causal=case.causal, **options_of(case))
    want = dict(zip(("dq", "dk", "dv"),
                    torch.autograd.grad(want_out, leaves, dout.double())))
    problems = results_problems({"out": out, **got}, {"out": want_out, **want},
                                tolerance(case.dtype))
    assert not problems, describe(gen, case=case.id()) + "\n" + "\n".join(problems)


def test_one_sequence_equals_rerope(gen):
    """One sequence, ``Lq < Lk``: the varlen kernel runs the same per-program code as
    ``rerope`` on ``(1, H, L, D)``."""
    device = kernel_device()
    q = randn(gen, 9, 2, 16, device=device, dtype=F32)
    k = randn(gen, 21, 1, 16, device=device, dtype=F32)
    v = randn(gen, 21, 1, 16, device=device, dtype=F32)
    out, lse = rerope.rerope_varlen(q, k, v, cumulative([9], device), cumulative([21], device),
                                    9, 21, 6, leaky=3.0, return_lse=True)
    want, want_lse = rerope.rerope(*(t.transpose(0, 1)[None] for t in (q, k, v)), 6,
                                   leaky=3.0, return_lse=True)
    assert torch.allclose(out, want[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert torch.allclose(lse, want_lse[0], atol=1e-6, rtol=1e-6)


def pool_of(gen, k, v, lk, page_size, spare=3):
    """A page pool holding the contiguous keys of each sequence on shuffled pages, and its
    block table: unused entries -1, free slots NaN (a kernel that reads either shows it)."""
    return page_pool(k, v, lk, page_size, gen, spare, unused=-1,
                     fill=lambda shape: torch.full(shape, float("nan")))


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=Case.id)
def test_paged_equals_contiguous(gen, case):
    q, k, v, cu_q, cu_k = packed(gen, case)
    kp, vp, table = pool_of(gen, k, v, case.lk, 16)
    args = (cu_q, cu_k, max(case.lq), max(case.lk), case.window)
    kwargs = dict(causal=case.causal, return_lse=True, **options_of(case))
    with poisoned_empty():
        out, lse = rerope.rerope_varlen(q, kp, vp, *args, block_table=table, **kwargs)
    want, want_lse = rerope.rerope_varlen(q, k, v, *args, **kwargs)
    assert torch.allclose(out, want) and torch.allclose(lse, want_lse)


# 16-key tiles under the interpreter: 4 and 8 keys a page (one table entry per page of
# the tile), 12 (one per key), 16 (a page a tile), 48 (three tiles a page).
@pytest.mark.parametrize("page_size", [4, 8, 12, 16, 48])
@pytest.mark.parametrize("rotated", [False, True], ids=["raw", "rotated"])
def test_paged_reads_the_pages_in_place(gen, page_size, rotated):
    """The paged form against the float64 reference: GQA, odd lengths, chunks after a
    cached prefix (``Lq < Lk``), pages in shuffled order, free slots NaN and the table's
    entries past each sequence's pages poisoned (-1, then pages far outside the pool)."""
    case = Case((7, 1, 19, 3), (23, 9, 19, 3), 5, hq=4, hkv=2,
                options=(("rotated", True),) if rotated else ())
    q, k, v, cu_q, cu_k = packed(gen, case)
    kp, vp, table = pool_of(gen, k, v, case.lk, page_size)
    table = torch.cat([table, torch.full((4, 2), 10 ** 6, dtype=torch.int32)], 1)
    with poisoned_empty():
        out, lse = rerope.rerope_varlen(q, kp, vp, cu_q, cu_k, max(case.lq), max(case.lk),
                                        case.window, block_table=table, return_lse=True,
                                        **options_of(case))
    want_out, want_lse = reference_of(q, k, v, cu_q, cu_k, case)
    problems = results_problems({"out": out}, {"out": want_out}, tolerance(F32))
    problems += close_problems("lse", lse, want_lse, tolerance(F32))
    assert not problems, describe(gen, case=case.id()) + "\n" + "\n".join(problems)


@pytest.mark.parametrize("page_size", [16, 48, 12])
@pytest.mark.parametrize("preturn", [False, True], ids=["in-registers", "preturned"])
def test_paged_tiles_through_descriptors(gen, page_size, preturn):
    """TMA on (forced; the interpreter runs descriptors): where a page holds whole 16-key
    tiles (16, 48) each tile is one descriptor copy from its page, else (12) pointer loads
    as before. Equal to the pointer loads bit for bit, free slots NaN and table entries past
    the pages poisoned; a page outside the pool still makes its rows NaN."""
    case = Case((7, 1, 19, 3), (23, 9, 19, 3), 5, hq=4, hkv=2, options=(("rotated", True),))
    q, k, v, cu_q, cu_k = packed(gen, case)
    kp, vp, table = pool_of(gen, k, v, case.lk, page_size)
    table = torch.cat([table, torch.full((4, 2), 10 ** 6, dtype=torch.int32)], 1)
    settings = (case.window, True, None, 10000.0, None, None, True, None, None)
    outs, plans = {}, {}
    for mode in ("off", "on"):
        with rerope.using_config(tma=mode), poisoned_empty():
            plans[mode] = varlen._plan(q, 23, settings)      # the plan holds the config
            outs[mode] = varlen._forward(q, kp, vp, cu_q, cu_k, 19, 23, plans[mode],
                                         preturn=preturn, block_table=table)
    assert torch.equal(outs["on"][0], outs["off"][0])
    assert torch.equal(outs["on"][1], outs["off"][1])
    want, _ = reference_of(q, k, v, cu_q, cu_k, case)
    assert not close_problems("out", outs["on"][0], want, tolerance(F32))
    bad = table.clone()
    bad[2, 0] = kp.shape[0] + 5                       # sequence 2's first keys: no page
    out, _ = varlen._forward(q, kp, vp, cu_q, cu_k, 19, 23, plans["on"], preturn=preturn,
                             block_table=bad)
    first, end = cu_q[2].item(), cu_q[3].item()       # sequence 2: 19 queries, NaN
    assert torch.isnan(out[first:end]).all()
    assert not torch.isnan(out[:first]).any() and not torch.isnan(out[end:]).any()


@pytest.mark.parametrize("preturn", [False, True], ids=["in-registers", "preturned"])
def test_pages_outside_the_pool_give_nan_rows_where_unchecked(gen, preturn):
    """On a GPU a bad page is not checked (no sync): its sequence's rows that read it come
    back NaN, the other sequences are right; entries past a sequence's pages are never
    read, whatever they hold."""
    case = CASES[0]
    q, k, v, cu_q, cu_k = packed(gen, case)
    kp, vp, table = pool_of(gen, k, v, case.lk, 8)
    bad = table.clone()
    bad[2, 1] = 99                                    # keys 8..15 of sequence 2
    bad[0, 2:] = 10 ** 6                              # past sequence 0's 9 keys: unread
    plan = varlen._plan(q, 20, (case.window, True, None, 10000.0, None, None, False, None,
                                None))
    out, _ = varlen._forward(q, kp, vp, cu_q, cu_k, 17, 20, plan, preturn=preturn,
                             block_table=bad)
    assert torch.isnan(out[22:]).all()                # sequence 2's one query reads all keys
    want, _ = reference_of(q, k, v, cu_q, cu_k, case)
    assert not close_problems("out", out[:22], want[:22], tolerance(F32))


def test_lengths_out_of_range_give_nan_rows_where_unchecked(gen, monkeypatch):
    """What a GPU call with bad lengths gets (its lengths are never read on the host): the
    kernel poisons the bad sequence's rows and leaves the others right."""
    case = CASES[0]
    q, k, v, cu_q, cu_k = packed(gen, case)
    monkeypatch.setattr(varlen, "_check_lengths_on_host", lambda *args: None)
    lq = torch.tensor([5, 17, 1])
    lk = torch.tensor([9, 15, 22])                    # sequence 1: Lq 17 > Lk 15
    out, lse = rerope.rerope_varlen(q, k, v, cu_q, cumulative(lk.tolist(), q.device), 17,
                                    20, case.window, return_lse=True)
    assert torch.isnan(out[5:22]).all() and torch.isnan(lse[:, 5:22]).all()
    want, _ = reference_of(q, k, v, cu_q, cu_k, case)
    assert torch.allclose(out[:5], want[:5].float(), atol=1e-5)
    assert int(lq.sum()) == q.shape[0]


def test_poisoned_strided_inputs(gen):
    """Inputs as views into NaN-filled buffers (a kernel reading anything but its own
    elements sees NaN), gradients into poisoned memory."""
    case = CASES[1]
    q0, k0, v0, cu_q, cu_k = packed(gen, case)

    def poisoned(t):
        buffer = torch.full((t.shape[0] + 4, t.shape[1] + 1, 2 * t.shape[2]), float("nan"),
                            dtype=t.dtype, device=t.device)
        view = buffer[2:-2, 1:, ::2]
        view.copy_(t)
        return view.requires_grad_()

    q, k, v = (poisoned(t) for t in (q0, k0, v0))
    with poisoned_empty():
        out = rerope.rerope_varlen(q, k, v, cu_q, cu_k, max(case.lq), max(case.lk),
                                   case.window)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    want, _ = reference_of(q0, k0, v0, cu_q, cu_k, case)
    assert not close_problems("out", out, want, tolerance(case.dtype))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


def test_under_torch_compile_runs_eagerly(gen):
    case = CASES[0]
    q, k, v, cu_q, cu_k = packed(gen, case)
    args = (q, k, v, cu_q, cu_k, max(case.lq), max(case.lk), case.window)
    compiled = torch.compile(lambda *a: rerope.rerope_varlen(*a, return_lse=True),
                             backend="eager")
    out, lse = compiled(*args)
    want, want_lse = rerope.rerope_varlen(*args, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


# --- checks ------------------------------------------------------------------------------


def _bad_calls():
    """(description, change to the good call's arguments, error type, words in the
    message)."""
    i32 = torch.int32
    return [
        ("cu int64", dict(cu_q=torch.tensor([0, 3, 8])), TypeError, "cu_seqlens_q"),
        ("cu decreasing", dict(cu_q=torch.tensor([0, 6, 5], dtype=i32),
                               cu_k=torch.tensor([0, 6, 11], dtype=i32)),
         ValueError, "must not decrease"),
        ("cu k length", dict(cu_k=torch.tensor([0, 11], dtype=i32)), ValueError,
         "cu_seqlens_k"),
        ("cu start", dict(cu_q=torch.tensor([1, 3, 8], dtype=i32)), ValueError,
         "cu_seqlens_q[0]"),
        ("cu total", dict(cu_k=torch.tensor([0, 6, 12], dtype=i32)), ValueError,
         "total_k"),
        ("Lq > Lk", dict(cu_q=torch.tensor([0, 4, 8], dtype=i32),
                         cu_k=torch.tensor([0, 3, 11], dtype=i32), max_k=8), ValueError,
         "Lq <= Lk"),
        ("max_q small", dict(max_q=4), ValueError, "max_seqlen_q"),
        ("max_k small", dict(max_k=5), ValueError, "max_seqlen_k = 5 is too small"),
        ("max_q type", dict(max_q=5.0), TypeError, "max_seqlen_q"),
        ("q rank", dict(q=torch.zeros(1, 8, 2, 16)), ValueError, "q must have rank 3"),
        ("k heads", dict(k=torch.zeros(11, 3, 16), v=torch.zeros(11, 3, 16)), ValueError,
         "multiple"),
        ("v shape", dict(v=torch.zeros(11, 1, 32)), ValueError, "k and v"),
        ("q dtype", dict(q=torch.zeros(8, 2, 16, dtype=torch.float64)), TypeError, "dtype"),
        ("window", dict(window=0), ValueError, "window"),
        ("group not causal", dict(causal=False, group=2), ValueError, "group"),
        ("table dtype", dict(paged=True, table=torch.zeros(2, 1, dtype=torch.int64)),
         TypeError, "block_table"),
        ("table shape", dict(paged=True, table=torch.zeros(3, 1, dtype=i32)), ValueError,
         "block_table"),
        ("page outside the pool", dict(paged=True, table=torch.tensor([[0], [4]], dtype=i32)),
         ValueError, "block_table[1, 0]"),
        ("table capacity", dict(paged=True, max_k=20), ValueError, "capacity"),
    ]


@pytest.mark.parametrize("bad", _bad_calls(), ids=lambda b: b[0])
def test_bad_arguments_name_the_argument(bad):
    _, change, error, words = bad
    i32 = torch.int32
    call = dict(q=torch.zeros(8, 2, 16), k=torch.zeros(11, 1, 16), v=torch.zeros(11, 1, 16),
                cu_q=torch.tensor([0, 3, 8], dtype=i32), cu_k=torch.tensor([0, 5, 11], dtype=i32),
                max_q=5, max_k=6, window=4)
    call.update(change)
    kwargs = {name: call.pop(name) for name in ("causal", "group") if name in call}
    if call.pop("paged", False):
        call["k"], call["v"] = torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 16)
        kwargs["block_table"] = call.pop("table", torch.tensor([[0], [1]], dtype=i32))
    with pytest.raises(error) as raised:
        rerope.rerope_varlen(call["q"], call["k"], call["v"], call["cu_q"], call["cu_k"],
                             call["max_q"], call["max_k"], call["window"], **kwargs)
    assert words in str(raised.value)


def test_paged_form_is_forward_only():
    i32 = torch.int32
    q = torch.zeros(8, 2, 16, requires_grad=True)
    with pytest.raises(ValueError, match="forward-only"):
        rerope.rerope_varlen(q, torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 16),
                             torch.tensor([0, 3, 8], dtype=i32),
                             torch.tensor([0, 5, 11], dtype=i32), 5, 6, 4,
                             block_table=torch.tensor([[0], [1]], dtype=i32))


# --- a serving step, end to end ------------------------------------------------------------


def serving_step(gen, device, dtype, hq, hkv, d, page_size, window, prefill, decoding,
                 num_blocks, rotated=True):
    """One engine step over one page pool: requests in ``prefill`` are ``(cached, new)``
    token counts (a new prompt: ``cached = 0``; a prompt continuing after a cached prefix),
    requests in ``decoding`` are cache lengths before this step's one token. Returns, per
    request, the step's output and the dense reference over the request's whole sequence
    (its last rows)."""
    requests = [(c, n) for c, n in prefill] + [(n, 1) for n in decoding]
    totals = [c + n for c, n in requests]
    kp = torch.zeros(num_blocks, page_size, hkv, d, dtype=dtype, device=device)
    vp = torch.zeros_like(kp)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-t // page_size) for t in totals)
    table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    seqs = []
    for r, total in enumerate(totals):
        q = randn(gen, total, hq, d, dtype=dtype, device=device)
        k = randn(gen, total, hkv, d, dtype=dtype, device=device)
        v = randn(gen, total, hkv, d, dtype=dtype, device=device)
        for j in range(-(-total // page_size)):          # the engine wrote k, v to the pool
            page = order.pop()
            table[r, j] = page
            rows = slice(j * page_size, min(total, (j + 1) * page_size))
            kp[page, :rows.stop - rows.start] = k[rows]
            vp[page, :rows.stop - rows.start] = v[rows]
        seqs.append((q, k, v))
    table = table.to(device)
    n_pre = len(prefill)
    # prefill half: the new tokens of the prefill requests, packed
    q_pre = torch.cat([seqs[r][0][c:] for r, (c, n) in enumerate(prefill)])
    cu_q = cumulative([n for _, n in prefill], device)
    cu_k = cumulative([c + n for c, n in prefill], device)
    out_pre = rerope.rerope_varlen(q_pre, kp, vp, cu_q, cu_k, max(n for _, n in prefill),
                                   max(c + n for c, n in prefill), window, rotated=rotated,
                                   block_table=table[:n_pre].contiguous())
    # decode half: one token each
    q_dec = torch.stack([seqs[n_pre + r][0][-1:] for r in range(len(decoding))])  # (B,1,H,D)
    lengths = torch.tensor([t for t in totals[n_pre:]], dtype=torch.int32, device=device)
    out_dec = rerope.rerope_decode(q_dec.transpose(1, 2), kp, vp, window,
                                   cache_seqlens=lengths, rotated=rotated,
                                   block_table=table[n_pre:].contiguous())
    results = []
    for r, (q, k, v) in enumerate(seqs):
        want = reference.rerope(*(t.double().transpose(0, 1)[None] for t in (q, k, v)),
                                window, rotated=rotated)[0].transpose(0, 1)
        if r < n_pre:
            got = out_pre[int(cu_q[r]):int(cu_q[r + 1])]
        else:
            got = out_dec[r - n_pre, :, 0][None]
        results.append((got, want[-got.shape[0]:]))
    return results


def test_serving_step(gen):
    """A new prompt, a prompt after a cached prefix (not page aligned), and two decoding
    requests, in one page pool: each output equals the request run alone, densely."""
    results = serving_step(gen, kernel_device(), F32, hq=2, hkv=1, d=16, page_size=16,
                           window=6, prefill=[(0, 13), (19, 7)], decoding=[21, 34],
                           num_blocks=16)
    for r, (got, want) in enumerate(results):
        problems = close_problems(f"request {r}", got, want, tolerance(F32))
        assert not problems, "\n".join(problems)


_COMPILE_CHILD = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rerope import varlen

DIV = [["tt.divisibility", 16]]


def source(fn, dtype, constexprs):
    signature, fixed, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name == "Tables":
            signature[name] = ("*fp32",) * 4
            attrs.update({(i, j): DIV for j in range(4)})
        elif name == "Cu":              # (cu_seqlens_q, cu_seqlens_k)
            signature[name] = ("*i32", "*i32")
            attrs.update({(i, j): DIV for j in range(2)})
        elif name == "CuK":
            signature[name], attrs[(i,)] = "*i32", DIV
        elif name == "Pages":           # (block_table, its two strides, num_blocks)
            signature[name] = ("*i32", "i32", "i32", "i32")
            attrs[(i, 0)] = DIV
        elif name in ("Lse", "Delta"):
            signature[name], attrs[(i,)] = "*fp32", DIV
        elif name[0].isupper():
            signature[name], attrs[(i,)] = "*" + dtype, DIV
        elif name in ("qk_scale", "sm_scale", "logn_factor"):
            signature[name] = "fp32"
        elif name.startswith("s") and len(name) <= 3:     # (0, head, row, 1)
            signature[name] = ("i32", "i32", "i32", "constexpr")
            fixed[(i, 3)] = 1
        else:
            signature[name] = "i32"
    fixed.update(constexprs)
    return ASTSource(fn, signature, fixed, attrs)


common = dict(HEAD_DIM=128, CAUSAL=True, TMA=True, LOGN=True, HEADS_FIRST=False)
jobs = [
    (varlen._varlen_fwd_kernel, dict(common, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=0,
                                     INSIDE_FLAGS=(True, False, True),
                                     OUTSIDE_FLAGS=(True, True, False)), 8, 3),
    # paged: a page a tile, pages of 16 keys (one entry per page), 24 (one per key);
    # with TMA, a descriptor copy per tile (64, 128) or pointer loads (16)
    *((varlen._varlen_fwd_kernel, dict(common, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=page,
                                       TMA=tma, INSIDE_FLAGS=(False, False, False),
                                       OUTSIDE_FLAGS=(True, True, False)), 8, 3)
      for page, tma in ((64, False), (16, False), (24, False), (64, True), (128, True),
                        (16, True))),
    (varlen._varlen_dq_kernel, dict(common, BLOCK_M=64, BLOCK_N=64,
                                    INSIDE_FLAGS=(True, False), OUTSIDE_FLAGS=(True, True)),
     4, 2),
    (varlen._varlen_dkdv_kernel, dict(common, BLOCK_M=64, BLOCK_N=64,
                                      INSIDE_FLAGS=(True, False),
                                      OUTSIDE_FLAGS=(True, True)), 4, 2),
    *((varlen._varlen_turn_keys_kernel, dict(HEAD_DIM=128, BLOCK=64, FIRST=(True, False),
                                             SECOND=(True, False), PAGE_SIZE=page), 4, 1)
      for page in (0, 64)),
]
for fn, constexprs, warps, stages in jobs:
    kernel = triton.compile(source(fn, "bf16", constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    print(json.dumps([fn.__name__, kernel.metadata.shared]))
"""


def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter runs code the compiler refuses: the varlen entry kernels (TMA reads
    from each sequence's first row, the bad-length branch, pages read in place) and the key
    turn cross-compile for sm_90 here, no GPU needed, and fit its shared memory."""
    import json

    shared = [json.loads(line) for line in cross_compile(tmp_path, _COMPILE_CHILD)]
    assert len(shared) == 11, shared
    assert all(size <= 232448 for _, size in shared), shared


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("rotated", [False, True])
def test_gpu_larger_packed_batch(gen, dtype, rotated):
    case = Case((300, 1, 640, 77), (300, 513, 1024, 77), 128, hq=8, hkv=2, d=128,
                dtype=dtype, options=(("rotated", rotated), ("logn_len", 256.0)))
    q, k, v, cu_q, cu_k = packed(gen, case, grad=True)
    out, lse = rerope.rerope_varlen(q, k, v, cu_q, cu_k, max(case.lq), max(case.lk),
                                    case.window, return_lse=True, **options_of(case))
    dout = randn(gen, *out.shape, dtype=dtype, device=out.device)
    got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference.rerope_varlen(*leaves, cu_q.cpu(), cu_k.cpu(), case.window,
                                                 **options_of(case))
    want = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(want_out, leaves, dout.double())))
    tol = tolerance(dtype)
    problems = results_problems({"out": out, **got}, {"out": want_out, **want}, tol)
    problems += close_problems("lse", lse, want_lse, tol)
    kp, vp, table = pool_of(gen, k.detach(), v.detach(), case.lk, 64)
    with torch.no_grad():
        paged = rerope.rerope_varlen(q, kp, vp, cu_q, cu_k, max(case.lq), max(case.lk),
                                     case.window, block_table=table, **options_of(case))
    problems += close_problems("paged", paged, want_out, tol)
    assert not problems, describe(gen, case=case.id()) + "\n" + "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_serving_step_and_decode_graph(gen):
    """The serving step at realistic sizes on the GPU (bf16 against the float64 reference),
    then the decode half captured in a CUDA graph and replayed: the same output."""
    results = serving_step(gen, "cuda", BF16, hq=32, hkv=8, d=128, page_size=64,
                           window=512, prefill=[(0, 700), (1000, 300)],
                           decoding=[1500, 2100], num_blocks=128)
    for r, (got, want) in enumerate(results):
        problems = close_problems(f"request {r}", got, want, tolerance(BF16))
        assert not problems, "\n".join(problems)
    # the decode half under a CUDA graph
    kp = randn(gen, 64, 64, 8, 128, dtype=BF16, device="cuda")
    vp = randn(gen, 64, 64, 8, 128, dtype=BF16, device="cuda")
    table = torch.randperm(64, generator=gen)[:2 * 32].view(2, 32).to(torch.int32).cuda()
    lengths = torch.tensor([1500, 2047], dtype=torch.int32, device="cuda")
    q = randn(gen, 2, 32, 1, 128, dtype=BF16, device="cuda")

    def step():
        return rerope.rerope_decode(q, kp, vp, 512, cache_seqlens=lengths, block_table=table)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    lengths.fill_(1800)                        # the graph reads the new lengths
    graph.replay()
    assert torch.equal(captured, step())


@pytest.mark.parametrize("options", [{}, {"rotated": True}, {"leaky": 3.0, "rotated": True}],
                         ids=["raw", "rotated", "leaky-rotated"])
@pytest.mark.parametrize("page_size", [0, 8, 32], ids=["contiguous", "pages8", "pages32"])
def test_preturned_keys_give_the_same_bits(gen, options, page_size):
    """Long sequences get their keys turned once before the kernel (:func:`varlen.turn_keys`,
    at each key's position within its sequence; paged: read from the pool in place, written
    packed): the same output, bit for bit, as turning every key tile in registers."""
    case = Case((5, 17, 3), (9, 17, 40), 6, hq=4, hkv=2, d=32, options=tuple(options.items()))
    q, k, v, cu_q, cu_k = packed(gen, case)
    table = None
    if page_size:
        k, v, table = pool_of(gen, k, v, case.lk, page_size)
    plan = varlen._plan(q, 40, (6, True, None, 10000.0, options.get("leaky"), None,
                                options.get("rotated", False), None, None))
    turned = varlen._forward(q, k, v, cu_q, cu_k, 17, 40, plan, preturn=True,
                             block_table=table)
    in_registers = varlen._forward(q, k, v, cu_q, cu_k, 17, 40, plan, preturn=False,
                                   block_table=table)
    assert torch.equal(turned[0], in_registers[0]) and torch.equal(turned[1], in_registers[1])


def test_grid_orders_agree(gen):
    """Heads first (short sequences, what the CPU cases run) and blocks first (long ones, as
    ``rerope`` orders its grids): the same bits, forward and backward."""
    case = CASES[1]
    results = []
    for max_keys in (1 << 20, 0):
        q, k, v, cu_q, cu_k = packed(torch.Generator().manual_seed(7), case, grad=True)
        with rerope.using_config(heads_first_max_keys=max_keys):
            out = rerope.rerope_varlen(q, k, v, cu_q, cu_k, max(case.lq), max(case.lk),
                                       case.window)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, *grads))
    assert all(torch.equal(a, b) for a, b in zip(*results))
