"""RoPE, ReRoPE and Leaky ReRoPE: the position encodings, and the five tensors the
kernel reads.

Chapter 1 of the book. Conventions (Llama / Hugging Face):

* ``R(p) x = x * cos(p θ) + rotate_half(x) * sin(p θ)``, with ``rotate_half([a, b]) =
  [-b, a]`` acting on the two *halves* of the head vector and ``θ_t = base ** (-2t /
  D)`` (:func:`rope_frequencies`), or any other vector of ``D/2`` frequencies passed as
  ``inv_freq``: a model's own, e.g. Llama 3's ``llama3``, ``linear`` or YaRN scaling,
  which change the per-frequency angles only (:func:`frequencies`).
* ``(R(p) q) · (R(s) k)`` depends on ``p - s`` only: attention sees relative positions.

ReRoPE with window ``w`` uses the relative position ``i - j`` while ``|i - j| < w`` and
``w`` beyond. In the five-tensor form the attention kernel consumes, that is

* ``q1 = R(i) q_i``, ``k1 = R(j) k_j``  (ordinary RoPE: used inside the window)
* ``q2 = R(w) q_i``, ``k2 = k_j``       (the key unrotated: used outside the window)

Leaky ReRoPE with factor ``leaky = κ > 1`` lets the position grow again, slowly, beyond
the window: ``w + (i - j - w) / κ``, i.e. ``q2 = R((i + w (κ - 1)) / κ) q_i``,
``k2 = R(j / κ) k_j``.

Self-Extend (Jin et al. 2024, "LLM Maybe LongLM") with group size ``group = G`` (``G``
divides ``w``) groups positions beyond the window instead: ``⌊i/G⌋ − ⌊j/G⌋ + w − w/G``,
i.e. ``q2 = R(⌊i/G⌋ + w − w/G) q_i``, ``k2 = R(⌊j/G⌋) k_j`` — Leaky ReRoPE with ``κ =
G`` and the positions floored. At ``i − j = w`` it is ``w``, like the others.
"""

import math

import torch

# rerope.rope.Frequencies: inv_freq, checked
from ._validate import Frequencies  # noqa: F401
from ._validate import check_inv_freq, check_logn_overflow, check_rope_args


def rotate_half(x):
    """Map the halves ``[a, b]`` of the last dimension to ``[-b, a]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_frequencies(head_dim, base=10000.0, device=None):
    """The ``D/2`` angular frequencies ``θ_t = base ** (-2t / D)``, in float64."""
    even = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
    exponents = even / head_dim
    return base ** (-exponents)


def frequencies(head_dim, base=10000.0, inv_freq=None, device=None):
    """The ``D/2`` angular frequencies in float64: ``inv_freq`` when given (a 1-D tensor
    or a sequence of ``D/2`` positive finite floats, e.g. a transformers model's
    ``rotary_emb.inv_freq``; ``base`` must then stay at its default), else
    :func:`rope_frequencies` of ``base``."""
    freqs = check_inv_freq(inv_freq, head_dim, base)
    if freqs is None:
        return rope_frequencies(head_dim, base, device=device)
    return torch.tensor(freqs, dtype=torch.float64, device=device)


def apply_rope(x, positions, base=10000.0, inv_freq=None):
    """Rotate every head vector of ``x`` (``(..., N, D)``) by RoPE at ``positions``
    (``(N,)``).

    ``positions`` may be fractional (Leaky ReRoPE) or all equal (ReRoPE's ``R(w)``).
    Angles are formed in float64 and the rotation is done in float32 (float64 for
    float64 input), then cast back to ``x.dtype``, so low-precision inputs are rounded
    once. ``inv_freq``: the ``D/2`` frequencies instead of ``base``'s
    (:func:`frequencies`).
    """
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    theta = frequencies(x.shape[-1], base, inv_freq, device=x.device)
    angles = positions.to(torch.float64)[:, None] * theta[None, :]   # (N, D/2)
    angles = torch.cat((angles, angles), dim=-1)   # cos/sin repeat over halves
    cos, sin = angles.cos().to(compute_dtype), angles.sin().to(compute_dtype)
    x_c = x.to(compute_dtype)
    return (x_c * cos + rotate_half(x_c) * sin).to(x.dtype)


def logn_scale(seq_len, train_len, device=None):
    """Query scale ``max(1, log(i + 1) / log(train_len))`` at positions ``i < seq_len``.
    """
    positions = torch.arange(seq_len, dtype=torch.float64, device=device)
    return torch.clamp(torch.log(positions + 1) / math.log(train_len), min=1.0)


def rerope_inputs(q, k, window, base=10000.0, leaky=None, logn_len=None, rotated=False,
                  inv_freq=None, group=None):
    """Build the five-tensor form ``(q1, q2, k1, k2)`` of (Leaky) ReRoPE or Self-Extend.

    Args:
        q: queries ``(B, Hq, Nq, D)``; k: keys ``(B, Hkv, Nk, D)``, ``Nq <= Nk``: the
            queries sit at the last positions ``Nk - Nq … Nk - 1``, the keys at
            ``0 … Nk - 1``.
        window: ReRoPE window ``w >= 1``: pairs with ``|i - j| < w`` use ordinary RoPE.
            Every pair has ``|i - j| <= Nk - 1``, so any ``w >= Nk`` is the same (plain
            RoPE); such a window is taken as ``Nk`` (``q2``, then never read, is built
            at ``Nk``).
        base: RoPE base.
        leaky: ``None`` for ReRoPE, or the Leaky ReRoPE factor ``κ > 1``.
        logn_len: if given, scale queries by ``max(1, log(i + 1) / log(logn_len))``
            first.
        rotated: ``q, k`` already carry RoPE at their positions (as a Hugging Face model
            and its KV cache hold them); they are rotated back first (``R(-p) R(p) x =
            x``).
        inv_freq: ``None``, or the ``D/2`` frequencies to rotate with instead of
            ``base``'s (:func:`frequencies`; ``base`` must then stay at its default).
        group: ``None``, or Self-Extend's group size ``G >= 1`` dividing ``window`` (not
            with ``leaky``): ``q2 = R(⌊i/G⌋ + w − w/G) q``, ``k2 = R(⌊j/G⌋) k``.

    Returns ``(q1, q2, k1, k2)`` in the dtype of ``q``/``k``; differentiable. A
    ``logn_len`` whose scale overflows that dtype is refused or warned about
    (:func:`check_logn_overflow`).
    """
    inv_freq = check_rope_args(q, k, window, base, leaky, logn_len, rotated, inv_freq,
                               group)
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    check_logn_overflow(logn_len, n_keys, q.dtype)
    window = min(window, n_keys)   # any w >= Nk is plain RoPE (and float(w) is finite)
    key_pos = torch.arange(n_keys, dtype=torch.float64, device=q.device)
    query_pos = key_pos[n_keys - n_queries:]
    if rotated:
        q = apply_rope(q, -query_pos, base, inv_freq)
        k = apply_rope(k, -key_pos, base, inv_freq)
    if logn_len is not None:
        scale = logn_scale(n_keys, logn_len, device=q.device)[n_keys - n_queries:, None]
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        q = (q.to(compute) * scale).to(q.dtype)
    q1 = apply_rope(q, query_pos, base, inv_freq)
    k1 = apply_rope(k, key_pos, base, inv_freq)
    if group is not None:
        q2 = apply_rope(q, torch.div(query_pos, group, rounding_mode="floor")
                        + (window - window // group), base, inv_freq)
        k2 = apply_rope(k, torch.div(key_pos, group, rounding_mode="floor"), base,
                        inv_freq)
    elif leaky is None:
        q2 = apply_rope(q, torch.full_like(query_pos, float(window)), base, inv_freq)
        k2 = k
    else:
        q2 = apply_rope(q, (query_pos + window * (leaky - 1)) / leaky, base, inv_freq)
        k2 = apply_rope(k, key_pos / leaky, base, inv_freq)
    return q1, q2, k1, k2


def relative_positions(n, window, leaky=None, device=None, n_keys=None, group=None):
    """The ``(n, n_keys)`` matrix of relative positions ReRoPE assigns to (query ``i``,
    key ``j``).

    ``i - j`` inside the window; ``w`` (ReRoPE), ``w + (i - j - w) / leaky`` (Leaky) or
    ``⌊i/G⌋ - ⌊j/G⌋ + w - w/G`` (Self-Extend, ``group = G`` dividing ``w``) outside.
    With ``window >= n_keys`` it is plain RoPE's ``i - j``. ``n_keys`` (default ``n``)
    keys sit at positions ``0 … n_keys - 1`` and the ``n`` queries at the last ``n`` of
    them.
    """
    n_keys = n if n_keys is None else n_keys
    window = min(window, n_keys)   # |i - j| <= n_keys - 1: larger windows are the same
    keys = torch.arange(n_keys, dtype=torch.float64, device=device)
    rel = keys[n_keys - n:, None] - keys[None, :]
    if group is not None:
        grouped = torch.div(keys, group, rounding_mode="floor")
        far = grouped[n_keys - n:, None] - grouped[None, :] + (window - window // group)
    elif leaky is None:
        far = torch.full_like(rel, float(window))
    else:
        far = window + (rel - window) / leaky
    return torch.where(rel.abs() < window, rel, far)


def self_extend_group(train_len, window, length):
    """Self-Extend's group size for reading ``length`` tokens with a model trained to
    ``train_len``: the smallest power of two ``G`` dividing ``window`` whose reach
    covers it, ``(train_len - window) · G + window >= length`` (the largest relative
    position Self-Extend gives then stays below ``train_len``; Jin et al. 2024, "LLM
    Maybe LongLM", section 3).

    ``G = 1`` (plain RoPE) up to ``train_len``. Where even the largest power of two
    dividing ``window`` falls short, that one is returned (``length`` is then past what
    this window can reach). All three arguments are ints, ``1 <= window < train_len``,
    ``length >= 1``.
    """
    for name, value in (("train_len", train_len), ("window", window),
                        ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} "
                            f"{value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if window >= train_len:
        raise ValueError(f"window must be below train_len (the neighbour window sits "
                         f"inside the trained positions), got window={window}, "
                         f"train_len={train_len}")
    largest = window & -window   # the largest power of two dividing window
    group = 1
    while (train_len - window) * group + window < length and group < largest:
        group *= 2
    return group
