"""The public ops: launchers, the autograd function, ``rerope_attention`` and ``rerope``.

``rerope_attention`` takes the five tensors (see :mod:`kernels.rope`); ``rerope`` takes raw
``q, k, v`` and builds them first. Both are differentiable. On a GPU every kernel is autotuned
over :func:`kernels.configs.launch_configs`; under the CPU interpreter one fixed configuration
runs (:mod:`kernels.runtime`).
"""

import functools

import torch
import triton

from . import configs
from ._validate import check_flag, check_head_dim, check_qkv, check_sm_scale, check_window
from .backward import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from .forward import _rerope_fwd_kernel
from .online_softmax import LOG2E
from .rope import rerope_inputs
from .runtime import INTERPRET, dot_precision, prepare_for_device

_KERNELS = {"fwd": _rerope_fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}


@functools.lru_cache(maxsize=None)
def _autotuned(kernel, head_dim, capability, elem_bytes):
    """The kernel wrapped in ``triton.autotune`` over the configs that fit this GPU."""
    return triton.autotune(
        configs=configs.launch_configs(kernel, head_dim, capability, elem_bytes),
        key=["n_ctx", "window", "HEAD_DIM", "CAUSAL"],
    )(_KERNELS[kernel])


def _launch(kernel, blocks_of, programs, args, **constexprs):
    """Launch ``kernel`` over ``(cdiv(N, meta[blocks_of]), programs)``."""
    n_ctx = constexprs.pop("n_ctx")

    def grid(meta):
        return (triton.cdiv(n_ctx, meta[blocks_of]), programs)

    if INTERPRET:
        _KERNELS[kernel][grid(configs.INTERPRETER_CONFIG)](
            *args, **constexprs, **configs.INTERPRETER_CONFIG)
    else:
        if constexprs["TMA"]:
            _ensure_scratch_allocator()
        capability = torch.cuda.get_device_capability(args[0].device)
        tuned = _autotuned(kernel, constexprs["HEAD_DIM"], capability, args[0].element_size())
        tuned[grid](*args, **constexprs)


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()]


def _tma_layout_ok(t):
    """TMA needs a 16-byte aligned start, unit column stride and 16-byte aligned other strides."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(s * size % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))


def _torch_scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator():
    """Descriptors built inside a kernel live in a small global scratch buffer that Triton asks
    an allocator for: give it torch's, unless the caller installed one."""
    from triton.runtime import _allocation
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)


def _use_tma(*tensors):
    """Whether the kernels read tiles through TMA tensor descriptors (see ``configs.TMA``)."""
    if configs.TMA == "0":
        return False
    t = tensors[0]
    if configs.TMA != "1" and (INTERPRET or not configs.tma_pays(
            torch.cuda.get_device_capability(t.device), t.element_size(), t.shape[-1])):
        return False
    return all(_tma_layout_ok(t) for t in tensors)   # the cheap checks first: this runs per call


def rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale):
    """Run the forward kernel; returns ``(out, lse)`` (``lse`` in log2 units, ``(B·Hq, N)``)."""
    batch, n_heads, n_ctx, head_dim = q1.shape
    group = n_heads // k1.shape[1]
    out = torch.empty_like(q1, memory_format=torch.contiguous_format)
    lse = torch.empty(batch * n_heads, n_ctx, dtype=torch.float32, device=q1.device)
    _launch("fwd", "BLOCK_M", batch * n_heads,
            [q1, q2, k1, k2, v, out, lse, *_strides(q1, q2, k1, k2, v, out),
             n_heads, group, n_ctx, window, sm_scale * LOG2E],
            n_ctx=n_ctx, HEAD_DIM=head_dim, CAUSAL=causal, DOT_PRECISION=dot_precision(q1.dtype),
            TMA=_use_tma(q1, q2, k1, k2, v))
    return out, lse


def rerope_backward(dout, q1, q2, k1, k2, v, out, lse, window, causal, sm_scale):
    """Run the three backward kernels; returns ``(dq1, dq2, dk1, dk2, dv)``."""
    batch, n_heads, n_ctx, head_dim = q1.shape
    n_kv_heads = k1.shape[1]
    group = n_heads // n_kv_heads
    delta = torch.empty_like(lse)
    _bwd_delta_kernel[(triton.cdiv(n_ctx, configs.DELTA_BLOCK_M), batch * n_heads)](
        out, dout, delta, *_strides(out, dout), n_heads, n_ctx,
        HEAD_DIM=head_dim, BLOCK_M=configs.DELTA_BLOCK_M)
    dq1, dq2 = (torch.empty(q1.shape, dtype=q1.dtype, device=q1.device) for _ in range(2))
    dk1, dk2, dv = (torch.empty(k1.shape, dtype=k1.dtype, device=k1.device) for _ in range(3))
    strides = _strides(q1, q2, k1, k2, v, dout)
    common = dict(n_ctx=n_ctx, HEAD_DIM=head_dim, CAUSAL=causal,
                  DOT_PRECISION=dot_precision(q1.dtype), TMA=_use_tma(q1, q2, k1, k2, v, dout))
    _launch("dkdv", "BLOCK_N", batch * n_kv_heads,
            [q1, q2, k1, k2, v, dout, lse, delta, dk1, dk2, dv, *strides,
             n_heads, n_kv_heads, group, n_ctx, window, sm_scale * LOG2E, sm_scale], **common)
    _launch("dq", "BLOCK_M", batch * n_heads,
            [q1, q2, k1, k2, v, dout, lse, delta, dq1, dq2, *strides,
             n_heads, group, n_ctx, window, sm_scale * LOG2E, sm_scale], **common)
    return dq1, dq2, dk1, dk2, dv


class ReRoPEAttention(torch.autograd.Function):
    """Autograd wrapper: forward saves ``out`` and the log-sum-exp, backward runs the kernels."""

    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, window, causal, sm_scale):
        out, lse = rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale)
        ctx.save_for_backward(q1, q2, k1, k2, v, out, lse)
        ctx.window, ctx.causal, ctx.sm_scale = window, causal, sm_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q1, q2, k1, k2, v, out, lse = ctx.saved_tensors
        grads = rerope_backward(dout, q1, q2, k1, k2, v, out, lse,
                                ctx.window, ctx.causal, ctx.sm_scale)
        return (*grads, None, None, None)


def rerope_attention(q1, q2, k1, k2, v, window, causal=True, sm_scale=None):
    """Fused ReRoPE attention from the five tensors; differentiable in all five.

    Score ``(i, j)`` is ``sm_scale · q1_i · k1_j`` where ``|i − j| < window``, else
    ``sm_scale · q2_i · k2_j``; with ``causal`` keys ``j > i`` are masked; softmax over ``j``;
    times ``v``.

    Args:
        q1, q2: ``(B, Hq, N, D)`` queries (RoPE at ``i``; at ``w`` for ReRoPE).
        k1, k2, v: ``(B, Hkv, N, D)`` with ``Hq % Hkv == 0`` (grouped-query attention is done by
            indexing, K/V are never repeated in memory).
        window: int ``>= 1``; ``window >= N`` gives plain RoPE attention.
        causal: mask keys after the query.
        sm_scale: score scale, ``1/sqrt(D)`` when ``None``.

    fp16, bf16 or fp32 (fp32 uses 3xTF32 dot products, near-fp32 accuracy); ``D`` in 16, 32,
    64, 128, 256; any ``N >= 1``; any strides. Returns ``(B, Hq, N, D)`` in the input dtype.
    """
    check_qkv({"q1": q1, "q2": q2}, {"k1": k1, "k2": k2, "v": v})
    check_head_dim(q1.shape[-1])
    check_window(window)
    check_flag("causal", causal)
    check_sm_scale(sm_scale)
    scale = q1.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    # every pair has |i - j| <= N - 1, so any window >= N means the same (and the kernels'
    # int32 index arithmetic never sees a huge window)
    window = min(int(window), q1.shape[2])
    (q1, q2, k1, k2, v), restore = prepare_for_device(q1, q2, k1, k2, v)
    return restore(ReRoPEAttention.apply(q1, q2, k1, k2, v, window, causal, scale))


def rerope(q, k, v, window, causal=True, sm_scale=None, base=10000.0, leaky=None, logn_len=None):
    """(Leaky) ReRoPE attention from raw, un-rotated ``q`` (``(B, Hq, N, D)``), ``k``, ``v``.

    Applies RoPE (Llama ``rotate_half`` convention, ``base``) and ReRoPE's window — Leaky ReRoPE
    with factor ``leaky > 1`` if given; queries scaled by ``max(1, log(i+1)/log(logn_len))`` if
    ``logn_len`` is given — then calls :func:`rerope_attention`. Differentiable in ``q, k, v``.
    """
    q1, q2, k1, k2 = rerope_inputs(q, k, window, base=base, leaky=leaky, logn_len=logn_len)
    return rerope_attention(q1, q2, k1, k2, v, window, causal=causal, sm_scale=sm_scale)
