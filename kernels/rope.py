"""RoPE, ReRoPE and Leaky ReRoPE: the position encodings, and the five tensors the kernel reads.

Chapter 1 of the book. Conventions (Llama / Hugging Face):

* ``R(p) x = x * cos(p θ) + rotate_half(x) * sin(p θ)``, with ``rotate_half([a, b]) = [-b, a]``
  acting on the two *halves* of the head vector and ``θ_t = base ** (-2t / D)``.
* ``(R(p) q) · (R(s) k)`` depends on ``p - s`` only: attention sees relative positions.

ReRoPE with window ``w`` uses the relative position ``i - j`` while ``|i - j| < w`` and ``w``
beyond. In the five-tensor form the attention kernel consumes, that is

* ``q1 = R(i) q_i``, ``k1 = R(j) k_j``  (ordinary RoPE: used inside the window)
* ``q2 = R(w) q_i``, ``k2 = k_j``       (the key unrotated: used outside the window)

Leaky ReRoPE with factor ``leaky = κ > 1`` lets the position grow again, slowly, beyond the
window: ``w + (i - j - w) / κ``, i.e. ``q2 = R((i + w (κ - 1)) / κ) q_i``, ``k2 = R(j / κ) k_j``.
"""

import math

import torch

from ._validate import check_rope_args


def rotate_half(x):
    """Map the halves ``[a, b]`` of the last dimension to ``[-b, a]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_frequencies(head_dim, base=10000.0, device=None):
    """The ``D/2`` angular frequencies ``θ_t = base ** (-2t / D)``, in float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return base ** (-exponents)


def apply_rope(x, positions, base=10000.0):
    """Rotate every head vector of ``x`` (``(..., N, D)``) by RoPE at ``positions`` (``(N,)``).

    ``positions`` may be fractional (Leaky ReRoPE) or all equal (ReRoPE's ``R(w)``). Angles are
    formed in float64 and the rotation is done in float32 (float64 for float64 input), then cast
    back to ``x.dtype``, so low-precision inputs are rounded once.
    """
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    theta = rope_frequencies(x.shape[-1], base, device=x.device)
    angles = positions.to(torch.float64)[:, None] * theta[None, :]      # (N, D/2)
    angles = torch.cat((angles, angles), dim=-1)                        # cos/sin repeat over halves
    cos, sin = angles.cos().to(compute_dtype), angles.sin().to(compute_dtype)
    x_c = x.to(compute_dtype)
    return (x_c * cos + rotate_half(x_c) * sin).to(x.dtype)


def logn_scale(seq_len, train_len, device=None):
    """Per-position query scale ``max(1, log(i + 1) / log(train_len))`` for ``i < seq_len``."""
    positions = torch.arange(seq_len, dtype=torch.float64, device=device)
    return torch.clamp(torch.log(positions + 1) / math.log(train_len), min=1.0)


def rerope_inputs(q, k, window, base=10000.0, leaky=None, logn_len=None):
    """Build the five-tensor form ``(q1, q2, k1, k2)`` of (Leaky) ReRoPE.

    Args:
        q: raw queries ``(B, Hq, N, D)``; k: raw keys ``(B, Hkv, N, D)`` (un-rotated).
        window: ReRoPE window ``w >= 1``: pairs with ``|i - j| < w`` use ordinary RoPE.
        base: RoPE base.
        leaky: ``None`` for ReRoPE, or the Leaky ReRoPE factor ``κ > 1``.
        logn_len: if given, scale queries by ``max(1, log(i + 1) / log(logn_len))`` first.

    Returns ``(q1, q2, k1, k2)`` in the dtype of ``q``/``k``; differentiable.
    """
    check_rope_args(q, k, window, base, leaky, logn_len)
    n = q.shape[-2]
    positions = torch.arange(n, dtype=torch.float64, device=q.device)
    if logn_len is not None:
        scale = logn_scale(n, logn_len, device=q.device)[:, None]
        q = (q.to(torch.float64 if q.dtype == torch.float64 else torch.float32) * scale).to(q.dtype)
    q1 = apply_rope(q, positions, base)
    k1 = apply_rope(k, positions, base)
    if leaky is None:
        q2 = apply_rope(q, torch.full_like(positions, float(window)), base)
        k2 = k
    else:
        q2 = apply_rope(q, (positions + window * (leaky - 1)) / leaky, base)
        k2 = apply_rope(k, positions / leaky, base)
    return q1, q2, k1, k2


def relative_positions(n, window, leaky=None, device=None):
    """The ``(n, n)`` matrix of relative positions ReRoPE assigns to (query ``i``, key ``j``).

    ``i - j`` inside the window; ``w`` (ReRoPE) or ``w + (i - j - w) / leaky`` (Leaky) outside.
    With ``window >= n`` it is plain RoPE's ``i - j``.
    """
    idx = torch.arange(n, dtype=torch.float64, device=device)
    rel = idx[:, None] - idx[None, :]
    far = torch.full_like(rel, float(window)) if leaky is None else window + (rel - window) / leaky
    return torch.where(rel.abs() < window, rel, far)
