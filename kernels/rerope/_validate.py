"""Argument checks shared by the kernels, the references and the RoPE helpers.

Every check raises a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong
value) whose message names the argument and says what was expected.
"""

import math
import numbers
import sys
import warnings

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
HEAD_DIMS = (16, 32, 64, 128, 256)

# The kernels get the softmax scale as the fp32 number ``sm_scale·log2(e)`` (they use exp2) and
# ``sm_scale`` itself (backward). Both must be normal fp32 numbers: a subnormal one is flushed to
# zero on GPUs, and zero (or inf) turns every score into NaN. And the scaled fp32 scores must stay
# finite (an inf score makes its row NaN): a score is a dot product of D <= 256 entries, which
# for entries within SCORE_INPUT_ABS (fp16's largest finite value, far above what normalised
# activations reach) is at most 256 · 65504², so sm_scale·log2(e) · 256 · 65504² must stay below
# fp32's largest, with a factor 2 to spare for rounding. Hence the range below.
SCORE_INPUT_ABS = float(torch.finfo(torch.float16).max)
SM_SCALE_MIN = torch.finfo(torch.float32).tiny                       # 2**-126 ≈ 1.18e-38
SM_SCALE_MAX = torch.finfo(torch.float32).max / (
    2 * math.log2(math.e) * max(HEAD_DIMS) * SCORE_INPUT_ABS ** 2)   # ≈ 1.07e26
_FLOAT_MAX = sys.float_info.max


def check_window(window):
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int >= 1, got {type(window).__name__} {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_sm_scale(sm_scale, kernel=True):
    """``sm_scale``: ``None`` or a finite positive number; for the kernels (``kernel=True``) also
    within ``[SM_SCALE_MIN, SM_SCALE_MAX]``, where ``sm_scale·log2(e)`` is a normal fp32 number
    and no score of entries within ``SCORE_INPUT_ABS`` overflows fp32 once scaled. The float64
    references (``kernel=False``) take any finite positive value."""
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not 0 < sm_scale <= _FLOAT_MAX:
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")
    if kernel and not SM_SCALE_MIN <= sm_scale <= SM_SCALE_MAX:
        raise ValueError(
            f"sm_scale must be between {SM_SCALE_MIN:.4g} and {SM_SCALE_MAX:.4g} for the kernels, "
            f"got {sm_scale:g}: they compute with sm_scale·log2(e) in fp32, which must be a "
            "normal fp32 number (a smaller one flushes to zero and makes every score NaN), and "
            f"the fp32 scores scaled by it must stay finite for head dims up to {max(HEAD_DIMS)} "
            f"and entries up to {SCORE_INPUT_ABS:g} in magnitude (an inf score makes its row NaN)")


def _check_rank4(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have rank 4 (B, H, N, D), got shape {tuple(t.shape)}")


def check_int32(name, t, shape_ok, shape_text, device):
    """``t`` is an int32 tensor on ``device`` (q's) whose shape passes ``shape_ok`` (a
    function of the shape; ``shape_text`` says what it should be): lengths, cumulative
    lengths, block tables."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape {shape_text}, got "
                        f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if not shape_ok(tuple(t.shape)):
        raise ValueError(f"{name} must have shape {shape_text}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")


def check_block_table(block_table, batch, device, columns="max_blocks", row="sequence"):
    """A paged cache's block table: int32 ``(batch, columns)``, ``columns >= 1``, on
    ``device``."""
    check_int32("block_table", block_table,
                lambda shape: len(shape) == 2 and shape[0] == batch and shape[1] >= 1,
                f"({batch}, {columns}) with {columns} >= 1 (one row of page numbers per "
                f"{row})", device)


def check_alike(named):
    """Every tensor of ``named`` (name -> tensor) has the first one's dtype and device; returns
    that first ``(name, tensor)``."""
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                            "all inputs must share one dtype")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")
    return first_name, first


def check_qkv(queries, keys, dtypes=KERNEL_DTYPES, fewer_queries=False):
    """Check named query and key/value tensors; return ``(B, Hq, Hkv, N, D)``.

    ``queries`` and ``keys`` are dicts ``{name: tensor}``: queries ``(B, Hq, N, D)``, keys and
    values ``(B, Hkv, N, D)``, ``Hq % Hkv == 0``, one dtype and one device for all. With
    ``fewer_queries`` the keys may be longer, ``(B, Hkv, Nk, D)`` with ``Nk >= N`` (the queries
    are the last ``N`` positions); then ``(B, Hq, Hkv, N, Nk, D)`` is returned.
    """
    named = {**queries, **keys}
    for name, t in named.items():
        _check_rank4(name, t)
    first_name, first = check_alike(named)
    if first.dtype not in dtypes:
        raise TypeError(f"{first_name} has unsupported dtype {first.dtype}; "
                        f"expected one of {', '.join(str(d) for d in dtypes)}")
    q_name, q = next(iter(queries.items()))
    k_name, k = next(iter(keys.items()))
    batch, hq, n, d = q.shape
    hkv, n_keys = k.shape[1], k.shape[2]
    for name, t in queries.items():
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(q.shape)} "
                             f"like {q_name}")
    for name, t in keys.items():
        if t.shape[0] != batch:
            raise ValueError(f"{name} has batch {t.shape[0]}, expected {batch} like {q_name}")
        want, like = (n_keys, k_name) if fewer_queries else (n, q_name)
        if t.shape[2] != want:
            raise ValueError(f"{name} has sequence length {t.shape[2]}, expected {want} like {like}")
        if t.shape[3] != d:
            raise ValueError(f"{name} has head dim {t.shape[3]}, expected {d} like {q_name}")
        if t.shape[1] != hkv:
            raise ValueError(f"{name} has {t.shape[1]} heads, expected {hkv} like {k_name}")
    if n < 1:
        raise ValueError(f"{q_name} must have sequence length N >= 1, got {n}")
    if fewer_queries and n > n_keys:
        raise ValueError(f"{q_name} has {n} queries but {k_name} has {n_keys} keys; the queries "
                         "are the last positions of the keys' sequence, so Nq <= Nk is needed")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return (batch, hq, hkv, n, n_keys, d) if fewer_queries else (batch, hq, hkv, n, d)


def check_head_dim(d):
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported; expected one of {HEAD_DIMS}")


def check_rope_args(q, k, window, base, leaky, logn_len, rotated=False, inv_freq=None,
                    group=None):
    """Checks for the RoPE/ReRoPE helpers (``q``, ``k`` and the position settings); returns
    ``inv_freq`` as :class:`Frequencies` (``None`` when not given)."""
    check_qkv({"q": q}, {"k": k}, dtypes=REFERENCE_DTYPES, fewer_queries=True)
    if q.shape[-1] % 2:
        raise ValueError(f"q must have an even head dim for RoPE, got {q.shape[-1]}")
    return check_rope_settings(window, base, leaky, logn_len, rotated, inv_freq, q.shape[-1],
                               group)


def check_rope_settings(window, base, leaky, logn_len, rotated=False, inv_freq=None,
                        head_dim=None, group=None):
    """The position settings of :func:`check_rope_args`, for callers that checked the tensors;
    returns ``inv_freq`` as :class:`Frequencies` (``None`` when not given), of ``head_dim / 2``
    entries when ``head_dim`` is given (:func:`check_inv_freq`). ``group``: Self-Extend's group
    size (:func:`check_group`)."""
    check_flag("rotated", rotated)
    check_window(window)
    check_base(base)
    check_group(group, window, leaky)
    if leaky is not None:
        if isinstance(leaky, bool) or not isinstance(leaky, numbers.Real):
            raise TypeError(f"leaky must be a float > 1 or None, got {type(leaky).__name__}")
        if not 1 < leaky <= _FLOAT_MAX:
            raise ValueError(f"leaky must be a finite float > 1 (the Leaky ReRoPE factor), got {leaky}")
    if logn_len is not None:
        if isinstance(logn_len, bool) or not isinstance(logn_len, numbers.Real):
            raise TypeError(f"logn_len must be a number > 1 or None, got {type(logn_len).__name__}")
        if not logn_len > 1:
            raise ValueError(f"logn_len must be > 1 (a training length), got {logn_len}")
    return check_inv_freq(inv_freq, head_dim, base)


def check_group(group, window, leaky=None):
    """Self-Extend's group size: ``None`` (off) or an int ``>= 1`` that divides ``window`` (the
    grouped query position ``⌊i/G⌋ + w − w/G`` needs ``w/G`` whole), not with ``leaky`` (two
    different position schemes outside the window). Call after :func:`check_window`."""
    if group is None:
        return
    if isinstance(group, bool) or not isinstance(group, numbers.Integral):
        raise TypeError(f"group must be an int >= 1 (Self-Extend's group size) or None, got "
                        f"{type(group).__name__} {group!r}")
    if group < 1:
        raise ValueError(f"group must be >= 1 (Self-Extend's group size), got {group}")
    if leaky is not None:
        raise ValueError(f"group (Self-Extend) and leaky (Leaky ReRoPE) are two position schemes "
                         f"for the pairs outside the window; pass one of them, not both "
                         f"(got group={group!r}, leaky={leaky!r})")
    if window % group:
        raise ValueError(f"group must divide window (Self-Extend's grouped query position "
                         f"⌊i/group⌋ + window − window/group needs window/group whole), got "
                         f"window={window}, group={group}")


def check_base(base):
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be a number > 1 (the RoPE base, e.g. 10000.0), got "
                        f"{type(base).__name__} {base!r}")
    if not 1 < base <= _FLOAT_MAX:
        raise ValueError(f"base must be a finite number > 1 (the RoPE base), got {base!r}")


# --- RoPE frequencies given as a vector ------------------------------------------------------

DEFAULT_BASE = 10000.0


class Frequencies(tuple):
    """RoPE's ``D/2`` angular frequencies ``θ_t`` as a tuple of Python floats, checked once.

    What :func:`as_frequencies` makes of an ``inv_freq`` argument: hashable and cheap to hash
    (the kernels' caches of angle tables and launch plans are keyed by it), and passed on
    unchecked by every op that gets one. Build it once and pass it to every call of a loop to
    skip the conversion: ``Frequencies.of(model.model.rotary_emb.inv_freq)``.
    """

    __slots__ = ()

    @classmethod
    def of(cls, inv_freq):
        """``inv_freq`` (a 1-D tensor or a sequence of positive finite floats) checked."""
        return as_frequencies(inv_freq)

    def __repr__(self):
        return f"Frequencies({list(self)!r})"


def as_frequencies(inv_freq, name="inv_freq"):
    """``inv_freq`` as :class:`Frequencies` (``None`` stays ``None``): a 1-D floating-point tensor
    or a sequence of positive finite real numbers, at least one.

    A tensor is read on every call (``tolist``: for a GPU tensor a host sync), never remembered
    by identity: a change in place, even through ``.data`` (which no version counter sees),
    shows in the next call. A loop over a GPU tensor builds :class:`Frequencies` once instead
    and passes that (``Frequencies.of(model.model.rotary_emb.inv_freq)``).
    """
    if inv_freq is None or type(inv_freq) is Frequencies:
        return inv_freq
    if isinstance(inv_freq, torch.Tensor):
        if not inv_freq.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (RoPE's angular "
                            f"frequencies), got dtype {inv_freq.dtype}")
        if inv_freq.dim() != 1:
            raise ValueError(f"{name} must be 1-D (the D/2 frequencies of one head), got shape "
                             f"{tuple(inv_freq.shape)}")
        return _checked_frequencies(inv_freq.detach().to("cpu", torch.float64).tolist(), name)
    if isinstance(inv_freq, (str, bytes)) or not hasattr(inv_freq, "__len__"):
        raise TypeError(f"{name} must be a 1-D tensor or a sequence of floats (RoPE's D/2 "
                        f"angular frequencies), got {type(inv_freq).__name__}")
    values = []
    for i, x in enumerate(inv_freq):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{name}[{i}] must be a real number, got {type(x).__name__} {x!r}")
        values.append(float(x))
    return _checked_frequencies(values, name)


def _checked_frequencies(values, name):
    if not values:
        raise ValueError(f"{name} is empty; it needs D/2 frequencies")
    for i, x in enumerate(values):
        if not 0 < x <= _FLOAT_MAX:
            raise ValueError(f"{name}[{i}] = {x!r}: every frequency must be positive and finite")
    return Frequencies(values)


def check_inv_freq(inv_freq, head_dim=None, base=DEFAULT_BASE):
    """``inv_freq`` as :class:`Frequencies` (:func:`as_frequencies`), of ``head_dim / 2`` entries
    when ``head_dim`` is given; ``None`` when not given.

    ``inv_freq`` replaces ``base ** (-2t / D)`` altogether, so ``base`` must then be left at its
    default: a different base alongside it is refused rather than silently ignored.
    """
    if inv_freq is None:
        return None
    freqs = as_frequencies(inv_freq)
    if head_dim is not None and len(freqs) != head_dim // 2:
        raise ValueError(f"inv_freq has {len(freqs)} frequencies, but a head dim of {head_dim} "
                         f"needs {head_dim // 2} (one per pair of dimensions)")
    if base != DEFAULT_BASE:
        raise ValueError(f"pass either base or inv_freq, not both: inv_freq replaces the "
                         f"frequencies base ** (-2t / D), so base must stay at its default "
                         f"{DEFAULT_BASE} (got base={base!r})")
    return freqs


# Query entries of this magnitude must survive the log-n scale without overflowing (a warning
# otherwise): well above what normalised activations reach, far below any dtype's range.
LOGN_WARN_ABS = 16.0


def check_logn_overflow(logn_len, n_keys, dtype, name="q"):
    """Refuse or warn where the log-n query scale overflows ``dtype``; return the largest scale.

    Queries are scaled by ``max(1, log(i + 1) / log(logn_len))`` at positions ``i < n_keys``;
    the largest factor, ``s = max(1, log(n_keys) / log(logn_len))``, is at the last position.
    When the scaled queries are held in ``dtype`` (fp16: largest finite 65504):

    * ``s > finfo(dtype).max``: even entries of magnitude 1 become inf: ``ValueError``;
    * ``s · LOGN_WARN_ABS > finfo(dtype).max``: entries above ``finfo.max / s`` (< 16) become
      inf: ``RuntimeWarning``.

    A ``logn_len`` near 1 (e.g. 1.0001, a typo for a training length) is what gets here; with a
    training length ``>= 2`` the scale is at most ``log2(n_keys)``. ``logn_len=None``: returns
    1.0. Call after :func:`check_rope_args` (``logn_len`` already checked). ``name``: the query
    argument's name in messages.
    """
    if logn_len is None or n_keys < 1:
        return 1.0
    largest = max(1.0, math.log(n_keys) / math.log(logn_len))
    limit = torch.finfo(dtype).max
    if largest > limit:
        raise ValueError(
            f"logn_len={logn_len!r} scales the queries {name} by up to {largest:.3g} (log(n)/"
            f"log(logn_len) at position {n_keys - 1}), beyond the {dtype} range ({limit:g}): "
            f"entries of {name} of magnitude {limit / largest:.2g} or more overflow to inf. "
            "logn_len is the training length (e.g. 4096); use float32 inputs if such a scale "
            "is really meant")
    if largest * LOGN_WARN_ABS > limit:
        warnings.warn(
            f"logn_len={logn_len!r} scales the queries {name} by up to {largest:.3g} (log(n)/"
            f"log(logn_len) at position {n_keys - 1}): entries of {name} above "
            f"{limit / largest:.3g} in magnitude overflow {dtype} (largest {limit:g}) and give "
            "NaN. logn_len is the training length (e.g. 4096)", RuntimeWarning, stacklevel=3)
    return largest
