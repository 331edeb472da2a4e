"""Chapter 7's stage kernel: ReRoPE's forward from raw ``q, k``, turned in registers.

Chapter 4's kernels read five tensors, ``q1 = R(i) q``, ``q2 = R(w) q``,
``k1 = R(j) k``, ``k2 = k`` and ``v``, built in torch beforehand. This kernel reads
``q, k, v`` as a model holds them (raw: not yet rotated) and builds each product's
operands itself, in registers, from a table of ``cos`` and ``sin``:

* a query block is turned twice, once per product: ``R(i) q`` and ``R(w) q``;
* a key tile is turned by ``R(j)`` only when it holds a pair inside the window; the
  outside product uses the raw keys as they are (ReRoPE's ``k2 = k``);
* the head dim is loaded as two halves, so ``rotate_half`` moves no data and a score is
  two ``D/2``-wide dots into one accumulator.

Chapter 4's regions, tile by tile: a tile pays only for the products it has pairs for
(the finished kernels go further, with runs of unmasked tiles). Forward only, ReRoPE
only (no Leaky, no log-n), queries and keys of one length.
"""

import torch
import triton
import triton.language as tl

from .._validate import check_head_dim, check_qkv
from ..online_softmax import LOG2E, _softmax_step
from ..rope import rope_frequencies
from ..runtime import INTERPRET, dot_precision, kernels_decorated, prepare_for_device

# Decorated in the package's mode (interpreted where rerope chose the interpreter, see
# rerope.runtime); the window closes at the end of the module.
_DECORATING = kernels_decorated()
_DECORATING.__enter__()


def rope_table(n_rows, head_dim, base=10000.0, device=None):
    """``(n_rows, D)`` float32: row ``p`` is ``[cos(p·θ) | sin(p·θ)]`` over the ``D/2``
    frequencies ``θ_t``. The angles are formed in float64: an fp32 ``p·θ`` would be off
    by up to 5e-3 rad at ``p ≈ 10^5``."""
    angles = (torch.arange(n_rows, dtype=torch.float64, device=device)[:, None]
              * rope_frequencies(head_dim, base, device=device)[None, :])
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().contiguous()


@triton.jit
def _turn(x_a, x_b, cos, sin):
    """``R(p) x`` on the halves ``[x_a, x_b]``: ``[a cos − b sin, b cos + a sin]``."""
    return x_a * cos - x_b * sin, x_b * cos + x_a * sin


@triton.jit
def _angles(Table, positions, HALF: tl.constexpr):
    """``cos, sin`` of ``positions × θ``, ``(len(positions), D/2)``: table rows."""
    row = Table + positions[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(row), tl.load(row + HALF)


@triton.jit
def _halves(X, rows, n_rows, HALF: tl.constexpr):
    """The two halves of rows ``rows`` of a contiguous ``(n_rows, D)`` slice, in fp32,
    zeros for rows at and past ``n_rows``."""
    first = X + rows[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    ok = rows[:, None] < n_rows
    return (tl.load(first, mask=ok, other=0.0).to(tl.float32),
            tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _dot_halves(x_a, x_b, y_a, y_b, DOT_PRECISION: tl.constexpr):
    """``x · yᵀ`` from the halves: two ``D/2``-wide dots into one accumulator."""
    s = tl.dot(x_a, tl.trans(y_a), input_precision=DOT_PRECISION)
    return tl.dot(x_b, tl.trans(y_b), s, input_precision=DOT_PRECISION)


@triton.jit
def rerope_turning_fwd_kernel(Q, K, V, Out, Table, n_ctx, group, window, qk_scale,
                              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_M), B · Hq)``. ``Q, Out``: contiguous ``(B · Hq, N, D)``;
    ``K, V``: ``(B · Hkv, N, D)``, raw; ``group = Hq / Hkv``; ``Table``:
    :func:`rope_table`, with rows for every position and for ``window``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = V.dtype.element_ty
    start_m = tl.program_id(0) * BLOCK_M
    q_base = tl.program_id(1).to(tl.int64) * n_ctx * HEAD_DIM
    kv_base = (tl.program_id(1) // group).to(tl.int64) * n_ctx * HEAD_DIM  # KV head
    rows = start_m + tl.arange(0, BLOCK_M)
    q_a, q_b = _halves(Q + q_base, rows, n_ctx, HALF)
    cos, sin = _angles(Table, rows, HALF)
    q1_a, q1_b = _turn(q_a, q_b, cos, sin)                     # R(i) q: inside
    cos, sin = _angles(Table, window + 0 * rows, HALF)
    q2_a, q2_b = _turn(q_a, q_b, cos, sin)                     # R(w) q: outside
    q1_a, q1_b = q1_a.to(dtype), q1_b.to(dtype)               # rounded once, as the
    q2_a, q2_b = q2_a.to(dtype), q2_b.to(dtype)               # tensor cores take them
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, n_ctx) if CAUSAL else n_ctx
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_a, k_b = _halves(K + kv_base, cols, n_ctx, HALF)
        v = tl.load(V + kv_base + cols[:, None] * HEAD_DIM + dims[None, :],
                    mask=cols[:, None] < n_ctx, other=0.0)
        gap = rows[:, None] - cols[None, :]                    # i − j
        # the tile's largest and smallest |i − j|: which products it has pairs for
        far = tl.maximum(start_m + BLOCK_M - 1 - start_n,
                         start_n + BLOCK_N - 1 - start_m)
        near = tl.maximum(tl.maximum(start_n - start_m - BLOCK_M + 1,
                                     start_m - start_n - BLOCK_N + 1), 0)
        scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if far >= window:                                      # R(w) q · k, raw keys
            scores = _dot_halves(q2_a, q2_b, k_a.to(dtype), k_b.to(dtype),
                                 DOT_PRECISION)
        if near < window:                                      # R(i) q · R(j) k
            cos_k, sin_k = _angles(Table, cols, HALF)
            k1_a, k1_b = _turn(k_a, k_b, cos_k, sin_k)
            inside = _dot_halves(q1_a, q1_b, k1_a.to(dtype), k1_b.to(dtype),
                                 DOT_PRECISION)
            scores = tl.where(tl.abs(gap) < window, inside, scores)
        keep = cols[None, :] < n_ctx
        if CAUSAL:
            keep = keep & (gap >= 0)
        scores = tl.where(keep, scores, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    tl.store(Out + q_base + rows[:, None] * HEAD_DIM + dims[None, :],
             (acc / l_i[:, None]).to(dtype), mask=rows[:, None] < n_ctx)


def rerope_turning(q, k, v, window, causal=True, sm_scale=None, block_m=None,
                   block_n=None):
    """ReRoPE attention from raw ``q, k`` through :func:`rerope_turning_fwd_kernel`.

    Args:
        q: ``(B, Hq, N, D)`` raw queries, fp16 or fp32 (bf16 on a GPU), ``D`` 32, 64 or
            128 (a half must be 16 wide for ``tl.dot``; 256 would not fit every GPU's
            shared memory with these tiles).
        k, v: ``(B, Hkv, N, D)``, raw keys and values, ``Hq`` a multiple of ``Hkv``.
        window: int ``>= 1``: pairs with ``|i − j| < window`` use RoPE, others ``R(w)``.
        causal: bool.
        sm_scale: the softmax scale, ``D ** -0.5`` by default.
        block_m, block_n: tile sizes (16 under the interpreter; 64 × 32 on a GPU, two
            pipeline stages: under 100 KB of shared memory at ``D = 128``).

    Returns:
        ``(B, Hq, N, D)`` in ``q``'s dtype: what :func:`rerope.rerope` gives for raw
        inputs (forward only: no autograd).
    """
    check_qkv({"q": q}, {"k": k, "v": v})
    check_head_dim(q.shape[-1])
    batch, heads, n_ctx, head_dim = q.shape
    if head_dim not in (32, 64, 128):
        raise ValueError(f"q: this kernel takes a head dim of 32, 64 or 128, got "
                         f"{head_dim}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    (q, k, v), restore = prepare_for_device(q, k, v)
    block_m = block_m or (16 if INTERPRET else 64)
    block_n = block_n or (16 if INTERPRET else 32)
    table = rope_table(max(n_ctx, window + 1) + max(block_m, block_n), head_dim,
                       device=q.device)
    q3, k3, v3 = (t.contiguous().flatten(0, 1) for t in (q, k, v))
    out = torch.empty_like(q3)
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    rerope_turning_fwd_kernel[(triton.cdiv(n_ctx, block_m), batch * heads)](
        q3, k3, v3, out, table, n_ctx, heads // k.shape[1], window, scale * LOG2E,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(q.dtype), num_stages=2)
    return restore(out.view(batch, heads, n_ctx, head_dim))


_DECORATING.__exit__(None, None, None)
