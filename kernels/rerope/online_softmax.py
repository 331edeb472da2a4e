"""Tiled online softmax: attention without the ``N × N`` matrix. Chapter 3 of the book.

Softmax over a row of scores needs the row's maximum and normaliser, which seem to need
the whole row. The online recurrence keeps, per query row, a running max ``m``, a
running normaliser ``l`` and an unnormalised output ``acc``, and folds in one block of
keys at a time:

    m_new = max(m, max_j s_j)
    alpha = exp(m - m_new)                   # rescales what was accumulated so far
    p_j   = exp(s_j - m_new)
    l     = alpha * l + Σ_j p_j
    acc   = alpha * acc + Σ_j p_j v_j

and returns ``acc / l`` at the end. It is exact: the same numbers as softmax,
rearranged.

This module holds the recurrence twice: in plain torch (to read and to plot), and as the
Triton step ``_softmax_step`` that every forward kernel in the package calls, plus a
small Triton kernel for *plain* attention built on it (the stepping stone to the ReRoPE
forward).
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634   # exp(x) == exp2(x * log2(e)): the GPU's fast path is exp2


def online_softmax_attention(q, k, v, block_n=16, causal=False, sm_scale=None,
                             trace_row=None):
    """Plain attention computed block-by-block with the online softmax, in torch.

    ``q, k, v``: ``(..., N, D)``. Returns ``out`` — or ``(out, trace)`` when
    ``trace_row`` is an int: ``trace`` lists, after each key block, that row's running
    max and normaliser (the figure of chapter 3).
    """
    n_queries, n_keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    l = torch.zeros(q.shape[:-1], dtype=compute, device=q.device)
    acc = torch.zeros_like(q)
    rows = torch.arange(n_queries, device=q.device)
    trace = []
    for start in range(0, n_keys, block_n):
        cols = torch.arange(start, min(start + block_n, n_keys), device=q.device)
        s = (q @ k[..., cols, :].transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)   # exp(-inf - -inf): nothing seen
        p = torch.exp(s - m_new[..., None]).nan_to_num(0.0)
        l = alpha * l + p.sum(dim=-1)
        acc = alpha[..., None] * acc + p @ v[..., cols, :]
        m = m_new
        if trace_row is not None:
            trace.append((start, m[..., trace_row].clone(), l[..., trace_row].clone()))
    out = acc / l[..., None]
    return out if trace_row is None else (out, trace)


@triton.jit
def _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION: tl.constexpr):
    """Fold one tile of raw scores ``q · kᵀ`` (masked entries ``-inf``) into the state.

    ``acc``: ``(BLOCK_M, D)`` fp32, ``l_i``/``m_i``: ``(BLOCK_M,)`` fp32 in log2 units,
    ``v``: ``(BLOCK_N, D)``. ``qk_scale = sm_scale · log2(e) > 0`` turns a raw score
    into log2 units; it is applied to the row maximum and then inside one fused
    multiply-add per score, ``scores · qk_scale − m``, rather than in a separate pass
    over the tile.

    ``m_i`` starts at ``-inf``. A row whose scores so far are all masked keeps ``m =
    -inf``; it is shifted by 0 instead (``-inf - -inf`` would be NaN), so its weights
    stay exactly 0 and a row of very negative but finite scores (below -1e30, say) is
    still computed exactly.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(scores * qk_scale - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _plain_attention_fwd_kernel(
    Q, K, V, Out, stride_bh, stride_n, n_ctx, qk_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Plain attention, one program per (query block, batch·head); contiguous
    ``(BH, N, D)``.

    The simplest correct tiling: one loop over all key blocks, masks on every tile. The
    ReRoPE forward (``kernels/rerope/forward.py``) keeps this loop body but splits the
    loop by region.
    """
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * stride_bh
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + rows[:, None] * stride_n + dims[None, :],
                mask=rows[:, None] < n_ctx)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, n_ctx) if CAUSAL else n_ctx
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K + base + cols[:, None] * stride_n + dims[None, :],
                    mask=cols[:, None] < n_ctx)
        v = tl.load(V + base + cols[:, None] * stride_n + dims[None, :],
                    mask=cols[:, None] < n_ctx)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        keep = cols[None, :] < n_ctx
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(Out + base + rows[:, None] * stride_n + dims[None, :],
             out.to(Out.dtype.element_ty), mask=rows[:, None] < n_ctx)


def plain_attention(q, k, v, causal=True, sm_scale=None, block_m=16, block_n=16):
    """Forward-only plain attention through ``_plain_attention_fwd_kernel`` (chapter 3).

    ``q, k, v``: ``(B, H, N, D)``, same shape, fp16/fp32 (bf16 on a GPU), ``D`` a power
    of two >= 16. Small blocks by default so that the CPU interpreter runs it quickly.
    """
    from ._validate import check_head_dim, check_qkv
    from .runtime import dot_precision, prepare_for_device

    check_qkv({"q": q}, {"k": k, "v": v})
    check_head_dim(q.shape[-1])
    if k.shape != q.shape:
        raise ValueError(f"plain_attention needs k and q of one shape, got "
                         f"{tuple(k.shape)} and {tuple(q.shape)}")
    (q, k, v), restore = prepare_for_device(q, k, v)
    b, h, n, d = q.shape
    q, k, v = (t.contiguous().view(b * h, n, d) for t in (q, k, v))
    out = torch.empty_like(q)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    grid = (triton.cdiv(n, block_m), b * h)
    _plain_attention_fwd_kernel[grid](
        q, k, v, out, q.stride(0), q.stride(1), n, scale * LOG2E,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
        DOT_PRECISION=dot_precision(q.dtype))
    return restore(out.view(b, h, n, d))


@triton.jit
def _scores(x_a, x_b, y_a, y_b, TWO_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``x · yᵀ`` (fp32) for rows given as halves ``[x_a | x_b]``, ``[y_a | y_b]``
    (``TWO_DOTS``), or as whole rows ``x_a``, ``y_a`` (``x_b``, ``y_b`` unread).

    Halves take two ``D/2``-wide dots into one accumulator, so ``rotate_half`` needs no
    data movement; halves narrower than ``tl.dot``'s minimum of 16 are summed elementwise.
    """
    if not TWO_DOTS:
        return tl.dot(x_a, tl.trans(y_a), input_precision=DOT_PRECISION)
    elif x_a.shape[1] >= 16:
        s = tl.dot(x_a, tl.trans(y_a), input_precision=DOT_PRECISION)
        return tl.dot(x_b, tl.trans(y_b), s, input_precision=DOT_PRECISION)
    else:
        a = x_a.to(tl.float32)[:, None, :] * y_a.to(tl.float32)[None, :, :]
        b = x_b.to(tl.float32)[:, None, :] * y_b.to(tl.float32)[None, :, :]
        return tl.sum(a, 2) + tl.sum(b, 2)


LN2 = 0.6931471805599453     # log(2): a log2-unit log-sum-exp times this is natural-log


def natural_lse(lse2):
    """The log-sum-exp of the scaled scores in natural-log units, from the kernels' own.

    The kernels keep the running max and normaliser in log2 units (scores times
    ``sm_scale · log2(e)``, every exponential an ``exp2``), so the per-row log-sum-exp they
    write is ``log2 Σ_j 2^(s_j · log2 e) = log2 Σ_j exp(s_j)`` for the scaled scores ``s_j``;
    ``ln Σ_j exp(s_j)`` is that times ``ln 2``. What ``return_lse=True`` returns
    (:func:`rerope.rerope`, :func:`rerope.rerope_decode`, :func:`rerope.rerope_varlen`): the
    quantity FlashAttention returns, to merge partial attentions (``out = Σ_p exp(lse_p −
    lse) out_p`` with ``lse = logsumexp_p lse_p``). ``lse2``: a float32 tensor, any shape.
    """
    return lse2 * LN2
