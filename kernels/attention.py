"""The public ops: launchers, autograd, ``rerope_attention`` and ``rerope``.

``rerope_attention`` takes the five tensors (see :mod:`kernels.rope`); ``rerope`` takes ``q, k,
v`` as a model holds them, raw or already rotated, and rotates inside the kernels
(:mod:`kernels.rotary`). Both run the same three kernels (forward, dK/dV, dQ) and are
differentiable. On a GPU every kernel is autotuned over :func:`kernels.configs.launch_configs`;
under the CPU interpreter one fixed configuration runs (:mod:`kernels.runtime`).

Each op has two doors to the same launchers. Eagerly, a ``torch.autograd.Function``: the
lightest path from Python to the kernels (short sequences are bound by host time). Under
``torch.compile``, ops registered with ``torch.library`` (``torch.ops.kernels.*``, with fake
implementations and autograd formulas), which the compiler treats as opaque instead of tracing
into Triton; in eager mode they would cost 90 µs more per forward call (measured on the H200
host, perf/runs/host_fused_v1.json).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from . import configs
from ._validate import (Frequencies, as_frequencies, check_flag, check_head_dim,
                        check_logn_overflow, check_qkv, check_rope_settings, check_sm_scale,
                        check_window)
from .backward import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from .forward import _rerope_fwd_kernel
from .online_softmax import LOG2E
from .rotary import logn_factor, rotation_tables, turn_keys
from .runtime import INTERPRET, dot_precision, prepare_for_device

_KERNELS = {"fwd": _rerope_fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}
DECODE_MAX_QUERIES = 16      # kernels.rerope sends shorter causal inference calls to decoding


@functools.lru_cache(maxsize=None)
def _autotuned(kernel, head_dim, capability, elem_bytes, split):
    """The kernel wrapped in ``triton.autotune`` over the configs that fit this GPU (for the
    five-tensor or the fused form: ``split``).

    The window is not part of the key: it moves work between regions, not the best tile shape.
    """
    return triton.autotune(
        configs=configs.launch_configs(kernel, head_dim, capability, elem_bytes, split),
        key=["n_q", "n_k", "HEAD_DIM", "CAUSAL", "SPLIT", "LOGN"],
    )(_KERNELS[kernel])


@functools.lru_cache(maxsize=None)
def _capability(device):
    return torch.cuda.get_device_capability(device)


def _launch(kernel, blocks_of, rows, programs, args, **constexprs):
    """Launch ``kernel`` over ``(cdiv(rows, meta[blocks_of]), programs)``."""

    def grid(meta):
        return (triton.cdiv(rows, meta[blocks_of]), programs)

    if INTERPRET:
        _KERNELS[kernel][grid(configs.INTERPRETER_CONFIG)](
            *args, **constexprs, **configs.INTERPRETER_CONFIG)
    else:
        if constexprs["TMA"]:
            _ensure_scratch_allocator()
        capability = _capability(args[0].device)
        tuned = _autotuned(kernel, constexprs["HEAD_DIM"], capability, args[0].element_size(),
                           constexprs["SPLIT"])
        tuned[grid](*args, **constexprs)


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()]


def _tma_layout_ok(t):
    """TMA needs a 16-byte aligned start, unit column stride and a 16-byte aligned row stride
    (always: the descriptor uses it even for one row); batch and head strides matter only where
    there is more than one batch or head."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(-2) * size % 16 == 0
            and all(s * size % 16 == 0 for s, n in zip(t.stride()[:2], t.shape[:2]) if n > 1))


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
            _capability(t.device), t.element_size(), t.shape[-1])):
        return False
    return all(_tma_layout_ok(t) for t in tensors)   # the cheap checks first: this runs per call


# --- how the kernels read q and k ----------------------------------------------------------------


@dataclass(frozen=True)
class Operands:
    """What the kernels need to know about their operands, beyond the tensors.

    ``split=False``: the five-tensor form (``q1, q2, k1, k2`` given). ``split=True``: ``q, k``
    as a model holds them; ``tables`` are ``(inside table, inside offset, outside table,
    outside offset)`` from :mod:`kernels.rotary` and ``flags`` the compile-time switches.
    """

    split: bool
    tables: tuple
    flags: dict
    logn_factor: float = 0.0

    def constexprs(self, head_dim):
        return dict(SPLIT=self.split, TWO_DOTS=self.split and head_dim >= 32,
                    LOGN=self.logn_factor != 0.0, **self.flags)


_NO_ROTATION = dict(TURN_IN=False, SHIFT_IN=False, TURN_OUT=False, SHIFT_OUT=False)


def _five_tensors(placeholder):
    return Operands(split=False, tables=(placeholder,) * 4, flags=_NO_ROTATION)


_OPERANDS = {}


def _rotations(n_k, head_dim, base, window, leaky, logn_len, rotated, device, inv_freq=None):
    """The :class:`Operands` of the fused form, cached per setting (the tables themselves are
    shared by every setting with the same speed and frequencies:
    :func:`kernels.rotary.rotation_tables`). ``inv_freq``: ``None`` (``base``'s frequencies) or
    :class:`kernels.rope.Frequencies`."""
    key = (n_k, head_dim, base, window, leaky, logn_len, rotated, device, inv_freq)
    operands = _OPERANDS.get(key)
    if operands is None:
        if len(_OPERANDS) > 256:          # many lengths seen: keep the cache small
            _OPERANDS.clear()
        rotation = rotation_tables(n_k, head_dim, window, leaky, rotated, device, base, inv_freq)
        operands = _OPERANDS[key] = Operands(split=True, tables=rotation.tables,
                                             flags=rotation.flags,
                                             logn_factor=logn_factor(logn_len))
    return operands


# --- launchers -----------------------------------------------------------------------------------

PRETURN_MIN_KEYS = 4096      # from this many keys on, the forward pre-turns keys (see below)


def preturn_keys(n_k):
    """Whether the fused forward turns a product's keys once, before the kernel, rather than
    every key tile in every query block that reads it (:func:`kernels.rotary.turn_keys`).

    Pre-turning costs one more launch and one pass over ``k`` (``Hkv`` heads: small under
    grouped-query attention); turning in registers costs elementwise work and a trip of the
    turned tile through shared memory per (query block, key tile) of that product — most of
    the key axis for rotated inputs, whose outside product turns keys. Measured on the H200
    (book/data/preturn_h200.json, chapter 7): from ``PRETURN_MIN_KEYS`` keys on, pre-turning is faster.
    """
    return n_k >= PRETURN_MIN_KEYS


def rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale, operands=None, preturn=None):
    """Run the forward kernel; returns ``(out, lse)`` (``lse`` in log2 units, ``(B·Hq, Nq)``).

    ``operands=None``: the five-tensor form. Otherwise ``q1 is q2`` is ``q``, ``k1 is k2`` is
    ``k`` and ``operands`` (:class:`Operands`) says how they are rotated; ``preturn`` whether
    the products that turn keys get them turned once first (``None``: :func:`preturn_keys`).
    """
    batch, n_heads, n_q, head_dim = q1.shape
    n_k = k1.shape[2]
    out = torch.empty(q1.shape, dtype=q1.dtype, device=q1.device)
    lse = torch.empty(batch * n_heads, n_q, dtype=torch.float32, device=q1.device)
    operands = operands or _five_tensors(lse)
    turn_keys_in, turn_keys_out = operands.flags["TURN_IN"], operands.flags["TURN_OUT"]
    if (turn_keys_in or turn_keys_out) and (preturn_keys(n_k) if preturn is None else preturn):
        if turn_keys_in:
            k1 = turn_keys(k1, operands.tables[0])
        if turn_keys_out:
            k2 = turn_keys(k2, operands.tables[2])
        turn_keys_in = turn_keys_out = False
    _launch("fwd", "BLOCK_M", n_q, batch * n_heads,
            [q1, q2, k1, k2, v, out, lse, *operands.tables, *_strides(q1, q2, k1, k2, v, out),
             n_heads, n_heads // k1.shape[1], n_q, n_k, window, sm_scale * LOG2E,
             operands.logn_factor],
            HEAD_DIM=head_dim, CAUSAL=causal, DOT_PRECISION=dot_precision(q1.dtype),
            TMA=_use_tma(q1, q2, k1, k2, v), TURN_K_IN=turn_keys_in, TURN_K_OUT=turn_keys_out,
            **operands.constexprs(head_dim))
    return out, lse


def rerope_backward(dout, q1, q2, k1, k2, v, out, lse, window, causal, sm_scale, operands=None):
    """Run the three backward kernels: ``(dq1, dq2, dk1, dk2, dv)`` in the five-tensor form,
    ``(dq, dk, dv)`` with ``operands`` (see :func:`rerope_forward`)."""
    batch, n_heads, n_q, head_dim = q1.shape
    n_kv_heads, n_k = k1.shape[1], k1.shape[2]
    group = n_heads // n_kv_heads
    delta = torch.empty_like(lse)
    _bwd_delta_kernel[(triton.cdiv(n_q, configs.DELTA_BLOCK_M), batch * n_heads)](
        out, dout, delta, *_strides(out, dout), n_heads, n_q,
        HEAD_DIM=head_dim, BLOCK_M=configs.DELTA_BLOCK_M)
    split = operands is not None
    operands = operands or _five_tensors(lse)
    dq = [torch.empty(q1.shape, dtype=q1.dtype, device=q1.device) for _ in range(1 if split else 2)]
    dk = [torch.empty(k1.shape, dtype=k1.dtype, device=k1.device) for _ in range(1 if split else 2)]
    dv = torch.empty(k1.shape, dtype=k1.dtype, device=k1.device)
    strides = _strides(q1, q2, k1, k2, v, dout)
    common = dict(HEAD_DIM=head_dim, CAUSAL=causal, DOT_PRECISION=dot_precision(q1.dtype),
                  TMA=_use_tma(q1, q2, k1, k2, v, dout), **operands.constexprs(head_dim))
    _launch("dkdv", "BLOCK_N", n_k, batch * n_kv_heads,
            [q1, q2, k1, k2, v, dout, lse, delta, dk[0], dk[-1], dv, *operands.tables, *strides,
             n_heads, n_kv_heads, group, n_q, n_k, window, sm_scale * LOG2E, sm_scale,
             operands.logn_factor], **common)
    _launch("dq", "BLOCK_M", n_q, batch * n_heads,
            [q1, q2, k1, k2, v, dout, lse, delta, dq[0], dq[-1], *operands.tables, *strides,
             n_heads, group, n_q, n_k, window, sm_scale * LOG2E, sm_scale,
             operands.logn_factor], **common)
    return (dq[0], dk[0], dv) if split else (dq[0], dq[1], dk[0], dk[1], dv)


# --- the ops, registered with torch.library --------------------------------------------------------


@torch.library.custom_op("kernels::rerope_attention_fwd", mutates_args=())
def _five_fwd(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
              v: torch.Tensor, window: int, causal: bool,
              sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale)


@torch.library.custom_op("kernels::rerope_attention_bwd", mutates_args=())
def _five_bwd(dout: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor,
              k2: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              window: int, causal: bool, sm_scale: float) -> list[torch.Tensor]:
    return list(rerope_backward(dout.contiguous(), q1, q2, k1, k2, v, out, lse, window, causal,
                                sm_scale))


def _op_frequencies(inv_freq):
    """The custom ops take ``inv_freq`` as a list of floats (checked by their caller)."""
    return None if inv_freq is None else Frequencies(inv_freq)


@torch.library.custom_op("kernels::rerope_fwd", mutates_args=())
def _fused_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, causal: bool,
               sm_scale: float, base: float, leaky: Optional[float], logn_len: Optional[float],
               rotated: bool, inv_freq: Optional[list[float]] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    operands = _rotations(k.shape[2], q.shape[-1], base, window, leaky, logn_len, rotated,
                          q.device, _op_frequencies(inv_freq))
    return rerope_forward(q, q, k, k, v, window, causal, sm_scale, operands)


@torch.library.custom_op("kernels::rerope_bwd", mutates_args=())
def _fused_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, window: int, causal: bool, sm_scale: float,
               base: float, leaky: Optional[float], logn_len: Optional[float],
               rotated: bool, inv_freq: Optional[list[float]] = None) -> list[torch.Tensor]:
    operands = _rotations(k.shape[2], q.shape[-1], base, window, leaky, logn_len, rotated,
                          q.device, _op_frequencies(inv_freq))
    return list(rerope_backward(dout.contiguous(), q, q, k, k, v, out, lse, window, causal,
                                sm_scale, operands))


def _fake_fwd(q, *args, **kwargs):
    b, h, n, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b * h, n), dtype=torch.float32)


for _op in (_five_fwd, _fused_fwd):
    _op.register_fake(_fake_fwd)


@_five_bwd.register_fake
def _(dout, q1, q2, k1, k2, v, *args):
    return [torch.empty_like(t) for t in (q1, q2, k1, k2, v)]


@_fused_bwd.register_fake
def _(dout, q, k, v, *args):
    return [torch.empty_like(t) for t in (q, k, v)]


def _setup_context(ctx, inputs, output):
    """Save what the backward needs: the inputs (tensors first), ``out`` and the LSE."""
    n_tensors = sum(isinstance(x, torch.Tensor) for x in inputs)
    ctx.save_for_backward(*inputs[:n_tensors], *output)
    ctx.settings = inputs[n_tensors:]


def _five_grads(ctx, dout, dlse):
    *tensors, out, lse = ctx.saved_tensors
    return (*_five_bwd(dout, *tensors, out, lse, *ctx.settings), None, None, None)


def _fused_grads(ctx, dout, dlse):
    *tensors, out, lse = ctx.saved_tensors
    return (*_fused_bwd(dout, *tensors, out, lse, *ctx.settings), *(None,) * len(ctx.settings))


_five_fwd.register_autograd(_five_grads, setup_context=_setup_context)
_fused_fwd.register_autograd(_fused_grads, setup_context=_setup_context)


def _first_order_only(backward):
    """Run a backward without building a graph; where a graph was asked for
    (``create_graph=True``: a gradient penalty, say), return gradients whose own backward raises.

    ``torch.autograd.function.once_differentiable`` does this only when the upstream gradient
    requires grad; when it does not (``(g ** 2).sum()`` of ``g = grad(out.sum(), q,
    create_graph=True)``), it returns detached gradients and the penalty's gradient is silently
    dropped. Here the error is attached whenever grad mode is on.
    """
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled():
            return grads
        error = torch._C._functions.DelayedError(
            b"kernels: the ReRoPE backward is not differentiable (no double backward, e.g. "
            b"for gradient penalties); use kernels.reference for higher-order gradients",
            len(grads))
        tensors = [g.detach().requires_grad_() if g is not None else None for g in grads]
        return error(*tensors)

    return wrapper


class _FiveTensorAttention(torch.autograd.Function):
    """Eager autograd for the five-tensor op (see the module docstring)."""

    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, window, causal, sm_scale):
        out, lse = rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale)
        ctx.save_for_backward(q1, q2, k1, k2, v, out, lse)
        ctx.settings = (window, causal, sm_scale)
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, dout):
        *tensors, out, lse = ctx.saved_tensors
        return (*rerope_backward(dout, *tensors, out, lse, *ctx.settings), None, None, None)


class _FusedAttention(torch.autograd.Function):
    """Eager autograd for the fused-rotation op (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, window, causal, sm_scale, base, leaky, logn_len, rotated,
                inv_freq):
        operands = _rotations(k.shape[2], q.shape[-1], base, window, leaky, logn_len, rotated,
                              q.device, inv_freq)
        out, lse = rerope_forward(q, q, k, k, v, window, causal, sm_scale, operands)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (window, causal, sm_scale, operands)
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        window, causal, sm_scale, operands = ctx.settings
        grads = rerope_backward(dout, q, q, k, k, v, out, lse, window, causal, sm_scale, operands)
        return (*grads, *(None,) * 8)


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
    if torch.compiler.is_compiling():
        return restore(_five_fwd(q1, q2, k1, k2, v, window, causal, scale)[0])
    return restore(_FiveTensorAttention.apply(q1, q2, k1, k2, v, window, causal, scale))


def rerope(q, k, v, window, causal=True, sm_scale=None, base=10000.0, leaky=None, logn_len=None,
           rotated=False, inv_freq=None):
    """(Leaky) ReRoPE attention from ``q, k, v`` as a model holds them, rotation in the kernels.

    Args:
        q: ``(B, Hq, Nq, D)`` queries at positions ``Nk - Nq … Nk - 1`` (``Nq <= Nk``: a whole
            sequence, or the last chunk of one in chunked prefill).
        k, v: ``(B, Hkv, Nk, D)`` keys and values at positions ``0 … Nk - 1``, ``Hq % Hkv == 0``
            (grouped-query attention by indexing: K/V are never repeated in memory).
        window: int ``>= 1``: pairs closer than ``window`` get ordinary RoPE, the rest relative
            position ``window`` (ReRoPE) or ``window + (i - j - window) / leaky`` (Leaky).
        causal: mask keys after the query (``j > i``). Without it, future keys beyond the window
            get position ``+window``, like the far past.
        sm_scale: score scale, ``1/sqrt(D)`` when ``None``.
        base: RoPE base (Llama ``rotate_half`` convention: halves, not interleaved pairs).
        leaky: ``None`` for ReRoPE, or the Leaky ReRoPE factor ``> 1``.
        logn_len: if given, queries are scaled by ``max(1, log(i + 1) / log(logn_len))``.
        rotated: ``False``: raw ``q, k``. ``True``: ``q, k`` already carry RoPE at their
            positions, as a Hugging Face model and its KV cache hold them.
        inv_freq: ``None`` (the frequencies ``base ** (-2t / D)``), or RoPE's ``D/2`` angular
            frequencies as a 1-D tensor or a sequence of positive finite floats: a model's own
            (Llama 3's ``llama3``, ``linear`` or YaRN scaling change only these). ``base`` must
            then stay at its default (``ValueError`` otherwise). A tensor is read once and
            remembered while the same tensor is passed unmodified; a
            :class:`kernels.rope.Frequencies` skips every conversion. An attention factor
            (YaRN's ``attention_scaling``) is not applied here: it is in rotated inputs already.

    Returns ``(B, Hq, Nq, D)`` in the input dtype; differentiable in ``q, k, v``. fp16, bf16 or
    fp32; ``D`` in 16, 32, 64, 128, 256; any strides. No rotated copy of ``q`` or ``k`` is ever
    written: each kernel rotates tiles in registers (:mod:`kernels.rotary`).

    A decode step — ``causal``, at most ``DECODE_MAX_QUERIES`` (16) queries, no gradient needed
    (grad mode off, or no input requires grad) — goes to the split-KV kernel of
    :func:`kernels.rerope_decode`, which spreads the keys over the whole GPU; the prefill kernels
    would give each query head a single program.
    """
    check_qkv({"q": q}, {"k": k, "v": v}, fewer_queries=True)
    check_head_dim(q.shape[-1])
    inv_freq = check_rope_settings(window, base, leaky, logn_len, rotated,
                                   as_frequencies(inv_freq), q.shape[-1])
    check_logn_overflow(logn_len, k.shape[2], q.dtype)
    check_flag("causal", causal)
    check_sm_scale(sm_scale)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    window = min(int(window), k.shape[2])     # as in rerope_attention: >= Nk means plain RoPE
    if (causal and q.shape[2] <= DECODE_MAX_QUERIES and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                  or v.requires_grad))):
        from .decode import rerope_decode           # a decode step: split-KV (chapter 8)
        return rerope_decode(q, k, v, window, sm_scale=sm_scale, base=base, leaky=leaky,
                             logn_len=logn_len, rotated=rotated, inv_freq=inv_freq)
    (q, k, v), restore = prepare_for_device(q, k, v)
    settings = (window, causal, scale, float(base), None if leaky is None else float(leaky),
                None if logn_len is None else float(logn_len), rotated, inv_freq)
    if torch.compiler.is_compiling():
        return restore(_fused_fwd(q, k, v, *settings[:-1],
                                  None if inv_freq is None else list(inv_freq))[0])
    return restore(_FusedAttention.apply(q, k, v, *settings))
