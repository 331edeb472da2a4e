"""Chapter 8's stage kernels: split-KV decoding against a rotated cache, and the merge.

One decode step has one query per head. :func:`split_kernel` cuts each cache row into
``num_splits`` tile-aligned chunks and gives each (row, KV head, chunk) its own program,
so that all of a GPU's SMs stream the cache; a program writes its chunk's normalised
output and log-sum-exp (log2 units), and :func:`merge_kernel` combines them exactly:
``o = Σ_s 2^(lse_s − M) o_s / Σ_s 2^(lse_s − M)``, ``M`` the row's largest ``lse_s``.

The cache holds keys as a Llama model keeps them, RoPE-rotated at their positions, and
the query arrives rotated at position ``i = N − 1``. Inside the window the score is
RoPE's, ``R(i) q · R(j) k``, from the cache as it is; outside, ``R(w − i) q_rot ·
R(−j) k_rot = R(w) q · k`` (chapter 7's plan for rotated inputs): the key tile is turned
back in registers. The ``group = Hq / Hkv`` query heads of a KV head share each tile
they load (grouped-query attention). Contiguous cache, every row ``N`` keys long, ReRoPE
only.
"""

import torch
import triton
import triton.language as tl

from .._validate import check_head_dim, check_qkv
from ..online_softmax import LOG2E, _softmax_step
from ..runtime import INTERPRET, dot_precision, kernels_decorated, prepare_for_device
from .fused_rotation import _angles, _dot_halves, _halves, _turn, rope_table

# Decorated in the package's mode, as in rerope.teach.fused_rotation.
_DECORATING = kernels_decorated()
_DECORATING.__enter__()


@triton.jit
def _turn_back(x_a, x_b, cos, sin):
    """``R(p)ᵀ x = R(−p) x`` on the halves: ``[a cos + b sin, b cos − a sin]``."""
    return x_a * cos + x_b * sin, x_b * cos - x_a * sin


@triton.jit
def _chunk_bounds(n_keys, split, num_splits, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` of chunk ``split``: equal, tile-aligned chunks, the last one
    shorter, spare ones empty (``hi <= lo``)."""
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return lo, tl.minimum(lo + chunk, n_keys)


@triton.jit
def split_kernel(Q, K, V, Part, Lse, Table, n_keys, group, num_splits, window, qk_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Grid ``(B · Hkv, num_splits)``. ``Q``: contiguous ``(B · Hq, D)``, the rotated
    queries at position ``n_keys − 1``; ``K, V``: contiguous ``(B · Hkv, n_keys, D)``,
    keys rotated at their positions; ``Part``: fp32 ``(num_splits, B · Hq, D)``,
    ``Lse``: fp32 ``(num_splits, B · Hq)``;
    ``BLOCK_M >= group`` rows, one per query head of the group."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = K.dtype.element_ty
    kv_row, split = tl.program_id(0), tl.program_id(1)
    heads = tl.arange(0, BLOCK_M)
    q_a, q_b = _halves(Q + kv_row * group * HEAD_DIM, heads, group, HALF)
    position = n_keys - 1                                      # the query's i
    cos, sin = _angles(Table, window + 0 * heads, HALF)
    q2_a, q2_b = _turn(q_a, q_b, cos, sin)
    cos, sin = _angles(Table, position + 0 * heads, HALF)
    q2_a, q2_b = _turn_back(q2_a, q2_b, cos, sin)              # R(w − i) q_rot
    q_a, q_b, q2_a, q2_b = q_a.to(dtype), q_b.to(dtype), q2_a.to(dtype), q2_b.to(dtype)
    kv_base = kv_row.to(tl.int64) * n_keys * HEAD_DIM
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi = _chunk_bounds(n_keys, split, num_splits, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k_a, k_b = _halves(K + kv_base, cols, hi, HALF)       # zeros past the chunk
        v = tl.load(V + kv_base + cols[:, None] * HEAD_DIM + dims[None, :],
                    mask=cols[:, None] < hi, other=0.0)
        scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if start <= position - window:                         # a key outside: turn
            cos_k, sin_k = _angles(Table, cols, HALF)
            k2_a, k2_b = _turn_back(k_a, k_b, cos_k, sin_k)    # R(−j) R(j) k = k
            scores = _dot_halves(q2_a, q2_b, k2_a.to(dtype), k2_b.to(dtype),
                                 DOT_PRECISION)
        if start + BLOCK_N - 1 > position - window:            # a key inside: as cached
            inside = _dot_halves(q_a, q_b, k_a.to(dtype), k_b.to(dtype), DOT_PRECISION)
            scores = tl.where(position - cols[None, :] < window, inside, scores)
        scores = tl.where(cols[None, :] < hi, scores, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, scores, v, qk_scale, DOT_PRECISION)
    seen = l_i > 0                                             # an empty chunk: no key
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    rows = kv_row * group + heads                              # rows of B · Hq
    n_rows = tl.num_programs(0) * group
    ok = heads < group
    tl.store(Lse + split * n_rows + rows, lse, mask=ok)
    tl.store(Part + (split * n_rows + rows)[:, None] * HEAD_DIM + dims[None, :],
             acc / tl.where(seen, l_i, 1.0)[:, None], mask=ok[:, None])


@triton.jit
def merge_kernel(Part, Lse, Out, num_splits, HEAD_DIM: tl.constexpr,
                 SPLITS: tl.constexpr):
    """One program per row of ``Out`` (``(rows, D)``): the chunks' partials ``Part``
    (fp32 ``(num_splits, rows, D)``) weighed by ``2^(lse_s − M)``; ``SPLITS >=
    num_splits``, a power of two."""
    row = tl.program_id(0)
    n_rows = tl.num_programs(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < num_splits
    lse = tl.load(Lse + splits * n_rows + row, mask=ok, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))               # an empty chunk: 0
    part = tl.load(Part + (splits[:, None] * n_rows + row) * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(Out + row * HEAD_DIM + dims, out.to(Out.dtype.element_ty))


def split_decode(q, k_cache, v_cache, window, num_splits=None, sm_scale=None,
                 block_n=None):
    """One ReRoPE decode step through :func:`split_kernel` and :func:`merge_kernel`.

    Args:
        q: ``(B, Hq, 1, D)``, the new token's query, RoPE-rotated at position ``N − 1``;
            fp16 or fp32 (bf16 on a GPU), ``D`` 32, 64 or 128.
        k_cache, v_cache: ``(B, Hkv, N, D)``, keys RoPE-rotated at their positions
            ``0 … N−1`` (the query's own key included), ``Hq`` a multiple of ``Hkv``,
            ``Hq / Hkv <= 64``.
        window: int ``>= 1``, ReRoPE's window.
        num_splits: chunks per cache row; by default about one per 256 keys, at most 16.
        sm_scale: the softmax scale, ``D ** -0.5`` by default.
        block_n: keys per tile (16 under the interpreter, 64 on a GPU by default).

    Returns:
        ``(B, Hq, 1, D)`` in ``q``'s dtype: what ``rerope.rerope_decode(q, k_cache,
        v_cache, window)`` gives.
    """
    check_qkv({"q": q}, {"k_cache": k_cache, "v_cache": v_cache}, fewer_queries=True)
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_keys = k_cache.shape[1], k_cache.shape[2]
    check_head_dim(head_dim)
    if n_q != 1 or head_dim not in (32, 64, 128) or heads // kv_heads > 64:
        raise ValueError(f"q: one query per head, D of 32, 64 or 128 and Hq / Hkv <= "
                         f"64 here, got shape {tuple(q.shape)} against {kv_heads} KV "
                         "heads")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    (q, k_cache, v_cache), restore = prepare_for_device(q, k_cache, v_cache)
    block_n = block_n or (16 if INTERPRET else 64)
    if num_splits is None:
        num_splits = max(1, min(16, triton.cdiv(n_keys, 256)))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) \
            or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    group = heads // kv_heads
    table = rope_table(max(n_keys, window + 1) + block_n, head_dim, device=q.device)
    part = torch.empty(num_splits, batch * heads, head_dim, dtype=torch.float32,
                       device=q.device)
    lse = torch.empty(num_splits, batch * heads, dtype=torch.float32, device=q.device)
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    split_kernel[(batch * kv_heads, num_splits)](
        q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), part, lse, table,
        n_keys, group, num_splits, window, scale * LOG2E,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype), num_stages=2)
    out = torch.empty(batch * heads, head_dim, dtype=q.dtype, device=q.device)
    merge_kernel[(batch * heads,)](part, lse, out, num_splits, HEAD_DIM=head_dim,
                                   SPLITS=triton.next_power_of_2(num_splits))
    return restore(out.view(batch, heads, 1, head_dim))


_DECORATING.__exit__(None, None, None)
