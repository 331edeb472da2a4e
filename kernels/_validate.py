"""Argument checks shared by the kernels, the references and the RoPE helpers.

Every check raises a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong
value) whose message names the argument and says what was expected.
"""

import numbers

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
HEAD_DIMS = (16, 32, 64, 128, 256)


def check_window(window):
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int >= 1, got {type(window).__name__} {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_sm_scale(sm_scale):
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not (sm_scale > 0 and sm_scale < float("inf")):
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")


def _check_rank4(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have rank 4 (B, H, N, D), got shape {tuple(t.shape)}")


def check_qkv(queries, keys, dtypes=KERNEL_DTYPES):
    """Check named query and key/value tensors; return ``(B, Hq, Hkv, N, D)``.

    ``queries`` and ``keys`` are dicts ``{name: tensor}``: queries ``(B, Hq, N, D)``, keys and
    values ``(B, Hkv, N, D)``, ``Hq % Hkv == 0``, one dtype and one device for all.
    """
    named = {**queries, **keys}
    for name, t in named.items():
        _check_rank4(name, t)
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                            "all inputs must share one dtype")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")
    if first.dtype not in dtypes:
        raise TypeError(f"{first_name} has unsupported dtype {first.dtype}; "
                        f"expected one of {', '.join(str(d) for d in dtypes)}")
    q_name, q = next(iter(queries.items()))
    k_name, k = next(iter(keys.items()))
    batch, hq, n, d = q.shape
    hkv = k.shape[1]
    for name, t in queries.items():
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(q.shape)} "
                             f"like {q_name}")
    for name, t in keys.items():
        if t.shape[0] != batch:
            raise ValueError(f"{name} has batch {t.shape[0]}, expected {batch} like {q_name}")
        if t.shape[2] != n:
            raise ValueError(f"{name} has sequence length {t.shape[2]}, expected {n} like {q_name}")
        if t.shape[3] != d:
            raise ValueError(f"{name} has head dim {t.shape[3]}, expected {d} like {q_name}")
        if t.shape[1] != hkv:
            raise ValueError(f"{name} has {t.shape[1]} heads, expected {hkv} like {k_name}")
    if n < 1:
        raise ValueError(f"{q_name} must have sequence length N >= 1, got {n}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return batch, hq, hkv, n, d


def check_head_dim(d):
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported; expected one of {HEAD_DIMS}")


def check_rope_args(q, k, window, base, leaky, logn_len):
    """Checks for the RoPE/ReRoPE helpers (raw ``q``, ``k`` and the position settings)."""
    check_qkv({"q": q}, {"k": k}, dtypes=REFERENCE_DTYPES)
    if q.shape[-1] % 2:
        raise ValueError(f"q must have an even head dim for RoPE, got {q.shape[-1]}")
    check_window(window)
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    if leaky is not None:
        if isinstance(leaky, bool) or not isinstance(leaky, numbers.Real):
            raise TypeError(f"leaky must be a float > 1 or None, got {type(leaky).__name__}")
        if not (leaky > 1 and leaky < float("inf")):
            raise ValueError(f"leaky must be a finite float > 1 (the Leaky ReRoPE factor), got {leaky}")
    if logn_len is not None:
        if isinstance(logn_len, bool) or not isinstance(logn_len, numbers.Real):
            raise TypeError(f"logn_len must be a number > 1 or None, got {type(logn_len).__name__}")
        if not logn_len > 1:
            raise ValueError(f"logn_len must be > 1 (a training length), got {logn_len}")
