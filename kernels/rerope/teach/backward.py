"""The ReRoPE backward, in its teaching form. Chapter 5 of the book.

Three kernels, as FlashAttention-2 has them. With the forward's log-sum-exp
``lse`` (log2 units) a tile of probabilities is one ``exp2`` away from its scores, so
``P`` is never stored:

* :func:`_delta_kernel`: ``δ_i = rowsum(dO ∘ O)``, one number per query row;
* :func:`_dkdv_kernel`: one program per key block, walking the query tiles:
  ``dV += Pᵀ dO``, ``dK1 += τ (dS ∘ W)ᵀ Q1``, ``dK2 += τ (dS ∘ ¬W)ᵀ Q2``;
* :func:`_dq_kernel`: one program per query block, walking the key tiles:
  ``dQ1 += τ (dS ∘ W) K1``, ``dQ2 += τ (dS ∘ ¬W) K2``;

with ``dS = P ∘ (dO Vᵀ − δ)`` and ``W`` the window mask ``|i − j| < w``. Every tile
computes both products and keeps each entry's own (chapter 4's band rule everywhere);
the finished kernels walk chapter 4's regions instead, one product per tile off the
band.

Checked against autograd of the float64 reference and against the gradients of
:func:`rerope.rerope_attention` (tests/).
"""

import torch
import triton
import triton.language as tl

from ..online_softmax import LOG2E
from ..runtime import dot_precision, kernels_decorated, prepare_for_device
from .three_regions import _in_window, three_regions_attention

# Decorated in the package's mode (interpreted where rerope chose the interpreter).
_DECORATING = kernels_decorated()
_DECORATING.__enter__()


@triton.jit
def _delta_kernel(Out, DO, Delta, n_ctx, BLOCK_M: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """``Delta[bh, i] = Σ_d O[bh, i, d] · dO[bh, i, d]``, one program per row block."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    ptrs = head * n_ctx * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=rows[:, None] < n_ctx, other=0.0).to(tl.float32)
    tl.store(Delta + head * n_ctx + rows, tl.sum(o * do, 1), mask=rows < n_ctx)


@triton.jit
def _probabilities(q1, q2, k1, k2, rows, cols, lse, n_ctx, window, qk_scale,
                   CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A tile of ``P`` recomputed from its scores and ``lse``; and its window mask."""
    inside = _in_window(rows, cols, window)
    near = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    far = tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
    valid = (rows[:, None] < n_ctx) & (cols[None, :] < n_ctx)
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    scores = tl.where(inside, near, far)
    p = tl.where(valid, tl.math.exp2(scores * qk_scale - lse[:, None]), 0.0)
    return p, inside


@triton.jit
def _dkdv_kernel(Q1, Q2, K1, K2, V, DO, Lse, Delta, DK1, DK2, DV, n_ctx, window,
                 qk_scale, sm_scale, group, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One program per (key block, batch · key/value head), over its query heads."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    kv_ptrs = (kv_head.to(tl.int64) * n_ctx * HEAD_DIM + cols[:, None] * HEAD_DIM
               + dims[None, :])
    key_ok = cols[:, None] < n_ctx
    k1 = tl.load(K1 + kv_ptrs, mask=key_ok, other=0.0)
    k2 = tl.load(K2 + kv_ptrs, mask=key_ok, other=0.0)
    v = tl.load(V + kv_ptrs, mask=key_ok, other=0.0)
    dk1 = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dk2 = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # causal: query tiles that end before this key block see none of its keys
    first = tl.program_id(0) * BLOCK_N // BLOCK_M * BLOCK_M if CAUSAL else 0
    for head in range(kv_head * group, kv_head * group + group):   # GQA: its heads
        for start_m in range(first, n_ctx, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < n_ctx
            q_rows = head * n_ctx + rows      # rows of the flat (B·H·N, D) view
            q_ptrs = q_rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
            q1 = tl.load(Q1 + q_ptrs, mask=row_ok[:, None], other=0.0)
            q2 = tl.load(Q2 + q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + q_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(Lse + q_rows, mask=row_ok, other=0.0)
            delta = tl.load(Delta + q_rows, mask=row_ok, other=0.0)
            p, inside = _probabilities(q1, q2, k1, k2, rows, cols, lse, n_ctx, window,
                                       qk_scale, CAUSAL, DOT_PRECISION)
            dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            ds_in = tl.trans(tl.where(inside, ds, 0.0)).to(q1.dtype)    # dS ∘ W
            ds_out = tl.trans(tl.where(inside, 0.0, ds)).to(q2.dtype)   # dS ∘ ¬W
            dk1 = tl.dot(ds_in, q1, dk1, input_precision=DOT_PRECISION)
            dk2 = tl.dot(ds_out, q2, dk2, input_precision=DOT_PRECISION)
    tl.store(DK1 + kv_ptrs, (dk1 * sm_scale).to(DK1.dtype.element_ty), mask=key_ok)
    tl.store(DK2 + kv_ptrs, (dk2 * sm_scale).to(DK2.dtype.element_ty), mask=key_ok)
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _dq_kernel(Q1, Q2, K1, K2, V, DO, Lse, Delta, DQ1, DQ2, n_ctx, window, qk_scale,
               sm_scale, group, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """One program per (query block, batch · query head), walking the key tiles."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < n_ctx
    q_base = head.to(tl.int64) * n_ctx * HEAD_DIM
    q_ptrs = q_base + rows[:, None] * HEAD_DIM + dims[None, :]
    q1 = tl.load(Q1 + q_ptrs, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(Q2 + q_ptrs, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_ptrs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + head * n_ctx + rows, mask=row_ok, other=0.0)
    delta = tl.load(Delta + head * n_ctx + rows, mask=row_ok, other=0.0)
    kv = (head // group).to(tl.int64) * n_ctx * HEAD_DIM
    dq1 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq2 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, n_ctx) if CAUSAL else n_ctx
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_ptrs = kv + cols[:, None] * HEAD_DIM + dims[None, :]
        key_ok = cols[:, None] < n_ctx
        k1 = tl.load(K1 + kv_ptrs, mask=key_ok, other=0.0)
        k2 = tl.load(K2 + kv_ptrs, mask=key_ok, other=0.0)
        v = tl.load(V + kv_ptrs, mask=key_ok, other=0.0)
        p, inside = _probabilities(q1, q2, k1, k2, rows, cols, lse, n_ctx, window,
                                   qk_scale, CAUSAL, DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        ds_in = tl.where(inside, ds, 0.0).to(k1.dtype)      # dS ∘ W
        ds_out = tl.where(inside, 0.0, ds).to(k2.dtype)     # dS ∘ ¬W
        dq1 = tl.dot(ds_in, k1, dq1, input_precision=DOT_PRECISION)
        dq2 = tl.dot(ds_out, k2, dq2, input_precision=DOT_PRECISION)
    dq1 = (dq1 * sm_scale).to(DQ1.dtype.element_ty)
    dq2 = (dq2 * sm_scale).to(DQ2.dtype.element_ty)
    tl.store(DQ1 + q_ptrs, dq1, mask=row_ok[:, None])
    tl.store(DQ2 + q_ptrs, dq2, mask=row_ok[:, None])


def three_regions_backward(q1, q2, k1, k2, v, out, lse, dout, window, causal=True,
                           sm_scale=None, block_m=16, block_n=16):
    """The five gradients through the three teaching kernels.

    Args:
        q1, q2, k1, k2, v: the forward's inputs, as for
            :func:`rerope.teach.three_regions.three_regions_attention`.
        out, lse: what that forward returned, ``(B, Hq, N, D)`` and ``(B, Hq, N)``.
        dout: ``(B, Hq, N, D)``, the gradient of the loss with respect to ``out``.
        window, causal, sm_scale, block_m, block_n: as in the forward.

    Returns:
        ``(dq1, dq2, dk1, dk2, dv)``, each shaped and typed like its input.
    """
    (q1, q2, k1, k2, v, out, dout), restore = prepare_for_device(
        q1, q2, k1, k2, v, out, dout)
    q1, q2, k1, k2, v, out, dout = (
        t.contiguous() for t in (q1, q2, k1, k2, v, out, dout))
    batch, hq, n, d = q1.shape
    hkv = k1.shape[1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    delta = torch.empty_like(lse)
    _delta_kernel[(triton.cdiv(n, block_m), batch * hq)](
        out, dout, delta, n, BLOCK_M=block_m, HEAD_DIM=d)
    grads = [torch.empty_like(t) for t in (q1, q2, k1, k2, v)]
    common = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
                  DOT_PRECISION=dot_precision(q1.dtype))
    args = (q1, q2, k1, k2, v, dout, lse.contiguous(), delta)
    _dkdv_kernel[(triton.cdiv(n, block_n), batch * hkv)](
        *args, *grads[2:], n, window, scale * LOG2E, scale, hq // hkv,
        **common)
    _dq_kernel[(triton.cdiv(n, block_m), batch * hq)](
        *args, *grads[:2], n, window, scale * LOG2E, scale, hq // hkv,
        **common)
    return tuple(restore(g) for g in grads)


class ThreeRegionsAttention(torch.autograd.Function):
    """The teaching forward and backward as one differentiable op (five tensors)."""

    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, window, causal, sm_scale):
        out, lse = three_regions_attention(q1, q2, k1, k2, v, window, causal, sm_scale)
        ctx.save_for_backward(q1, q2, k1, k2, v, out, lse)
        ctx.settings = window, causal, sm_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = three_regions_backward(*ctx.saved_tensors, dout, *ctx.settings)
        return (*grads, None, None, None)


_DECORATING.__exit__(None, None, None)
