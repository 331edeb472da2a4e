"""Plain torch references: the oracle of the tests and chapter 2 of the book.

``rerope_attention`` is the naive five-tensor method: two full ``N × N`` score matrices,
a select by ``|i - j| < window``, softmax, times ``V``. ``rerope`` adds the position
encoding from raw ``q, k``. ``rerope_from_relative_positions`` is an independent second
oracle: it never builds the five tensors, it evaluates every score straight from its
    relative position, so the
tests cannot share a bug between the five-tensor form and its reference.

All three accept float64 (use it for oracles) and work on any device; memory is
``O(N²)``.
"""

import torch

from ._validate import (REFERENCE_DTYPES, check_flag, check_qkv, check_rope_args,
                        check_sm_scale, check_window)
from .rope import apply_rope, frequencies, logn_scale, relative_positions, rerope_inputs


def _expand_heads(t, group):
    """Repeat key/value heads for grouped-query attention (fine for a reference, not a
    kernel)."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _softmax_times_v(scores, v, causal):
    """Causal mask (keys after the query get ``-inf``), softmax in float32 or better,
    ``@ v``.

    ``scores`` is ``(..., Nq, Nk)`` with the queries at the last ``Nq`` of the ``Nk``
    positions.
    """
    n_queries, n_keys = scores.shape[-2:]
    if causal:
        future = torch.ones(n_queries, n_keys, dtype=torch.bool,
                            device=scores.device).triu(n_keys - n_queries + 1)
        scores = scores.masked_fill(future, float("-inf"))
    softmax_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype)
    return probs.to(v.dtype) @ v


def rerope_attention(q1, q2, k1, k2, v, window, causal=True, sm_scale=None):
    """ReRoPE attention from the five tensors, the naive way (two ``N × N`` matrices).

    Score ``(i, j)`` is ``sm_scale * q1_i · k1_j`` where ``|i - j| < window`` and
    ``sm_scale * q2_i · k2_j`` elsewhere. Shapes ``(B, Hq, Nq, D)`` for ``q1, q2`` and
    ``(B, Hkv, Nk, D)`` for ``k1, k2, v``, ``Nq <= Nk`` (the queries are the last ``Nq``
    positions). Returns ``(B, Hq, Nq, D)`` in the input dtype.
    """
    _, hq, hkv, n_queries, n_keys, d = check_qkv(
        {"q1": q1, "q2": q2}, {"k1": k1, "k2": k2, "v": v}, dtypes=REFERENCE_DTYPES,
        fewer_queries=True)
    check_window(window)
    check_flag("causal", causal)
    check_sm_scale(sm_scale, kernel=False)
    window = min(window, n_keys)   # |i - j| <= Nk - 1: larger windows are the same
    scale = d ** -0.5 if sm_scale is None else sm_scale
    k1, k2, v = (_expand_heads(t, hq // hkv) for t in (k1, k2, v))
    scores_inside = (q1 @ k1.transpose(-1, -2)) * scale    # N × N, ordinary RoPE
    scores_outside = (q2 @ k2.transpose(-1, -2)) * scale   # N × N, clamped at w
    keys = torch.arange(n_keys, device=q1.device)
    in_window = (keys[n_keys - n_queries:, None] - keys[None, :]).abs() < window
    scores = torch.where(in_window, scores_inside, scores_outside)
    return _softmax_times_v(scores, v, causal)


def rerope(q, k, v, window, causal=True, sm_scale=None, base=10000.0, leaky=None,
           logn_len=None, rotated=False, inv_freq=None, group=None):
    """(Leaky) ReRoPE or Self-Extend attention from ``q, k, v``: build the five tensors,
    then the naive op.

    Arguments as :func:`rerope.rerope` (``q`` ``(B, Hq, Nq, D)``, ``k, v`` ``(B, Hkv,
    Nk, D)``, ``Nq <= Nk``; ``rotated=True``: ``q, k`` already carry RoPE at their
    positions; ``inv_freq``: the ``D/2`` frequencies instead of ``base``'s; ``group``:
    Self-Extend's group size, dividing ``window``, causal only).
    """
    check_qkv({"q": q}, {"k": k, "v": v}, dtypes=REFERENCE_DTYPES, fewer_queries=True)
    _check_group_causal(group, causal)
    q1, q2, k1, k2 = rerope_inputs(q, k, window, base=base, leaky=leaky,
                                   logn_len=logn_len, rotated=rotated,
                                   inv_freq=inv_freq, group=group)
    return rerope_attention(q1, q2, k1, k2, v, window, causal=causal, sm_scale=sm_scale)


def _check_group_causal(group, causal):
    if group is not None and causal is not True:
        raise ValueError("group (Self-Extend) needs causal=True: its grouped positions "
                         "are defined for keys at or before the query only")


def rerope_from_relative_positions(q, k, v, window, causal=True, sm_scale=None,
                                   base=10000.0, leaky=None, logn_len=None,
                                   rotated=False, inv_freq=None, group=None):
    """Independent oracle: each score straight from its ReRoPE (or Self-Extend:
    ``group``) relative position.

    With halves ``q = [a, b]``, ``k = [c, d]`` and frequencies ``θ_t``, RoPE's score at
    relative position ``r`` is ``Σ_t (a_t c_t + b_t d_t) cos(r θ_t) + (a_t d_t - b_t
    c_t) sin(r θ_t)``.
    ``r`` comes from :func:`rerope.rope.relative_positions`. ``q`` ``(B, Hq, Nq, D)``,
    ``k, v`` ``(B, Hkv, Nk, D)``, ``Nq <= Nk``, queries at the last ``Nq`` positions;
    with ``rotated``, ``q, k`` carry RoPE at their positions and are rotated back first
    (in float64). Computes in float64; returns the input dtype. Memory ``O(B·H·Nq·Nk)``:
    for small test sizes. ``inv_freq``: the ``D/2`` frequencies ``θ_t`` instead of
    ``base``'s (:func:`rerope.rope.frequencies`).
    """
    _, hq, hkv, n_queries, n_keys, d = check_qkv(
        {"q": q}, {"k": k, "v": v}, dtypes=REFERENCE_DTYPES, fewer_queries=True)
    inv_freq = check_rope_args(q, k, window, base, leaky, logn_len, rotated, inv_freq,
                               group)
    check_sm_scale(sm_scale, kernel=False)
    check_flag("causal", causal)
    _check_group_causal(group, causal)
    qd, kd = q.double(), _expand_heads(k, hq // hkv).double()
    if rotated:
        key_pos = torch.arange(n_keys, dtype=torch.float64, device=q.device)
        qd = apply_rope(qd, -key_pos[n_keys - n_queries:], base, inv_freq)
        kd = apply_rope(kd, -key_pos, base, inv_freq)
    if logn_len is not None:
        logn = logn_scale(n_keys, logn_len, device=q.device)
        qd = qd * logn[n_keys - n_queries:, None]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    a, b = qd[..., : d // 2], qd[..., d // 2:]
    c, e = kd[..., : d // 2], kd[..., d // 2:]
    rel = relative_positions(n_queries, window, leaky=leaky, device=q.device,
                             n_keys=n_keys, group=group)
    scores = torch.zeros(*q.shape[:2], n_queries, n_keys, dtype=torch.float64,
                         device=q.device)
    for t, theta in enumerate(frequencies(d, base, inv_freq, device=q.device)):
        a_t, b_t = a[..., t, None], b[..., t, None]        # query halves, one frequency
        c_t, e_t = c[..., None, :, t], e[..., None, :, t]  # key halves
        same = a_t * c_t + b_t * e_t
        cross = a_t * e_t - b_t * c_t
        scores += same * torch.cos(rel * theta) + cross * torch.sin(rel * theta)
    out = _softmax_times_v(scores * scale, _expand_heads(v, hq // hkv).double(), causal)
    return out.to(v.dtype)


def rerope_attention_with_lse(q1, q2, k1, k2, v, window, causal=True, sm_scale=None):
    """:func:`rerope_attention` and the log-sum-exp of each row's scaled, unmasked scores
    ``log Σ_j exp(s_ij)`` (natural log, ``(B, Hq, Nq)``, float64 for float64 inputs): the
    oracle of ``return_lse=True``. Arguments as :func:`rerope_attention`."""
    out = rerope_attention(q1, q2, k1, k2, v, window, causal=causal, sm_scale=sm_scale)
    hq, hkv = q1.shape[1], k1.shape[1]
    n_queries, n_keys, d = q1.shape[2], k1.shape[2], q1.shape[-1]
    window = min(window, n_keys)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    k1, k2 = (_expand_heads(t, hq // hkv) for t in (k1, k2))
    keys = torch.arange(n_keys, device=q1.device)
    in_window = (keys[n_keys - n_queries:, None] - keys[None, :]).abs() < window
    scores = torch.where(in_window, q1 @ k1.transpose(-1, -2), q2 @ k2.transpose(-1, -2))
    scores = scores * scale
    if causal:
        future = keys[None, :] > keys[n_keys - n_queries:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return out, torch.logsumexp(scores, dim=-1)


def rerope_with_lse(q, k, v, window, causal=True, sm_scale=None, base=10000.0, leaky=None,
                    logn_len=None, rotated=False, inv_freq=None, group=None):
    """:func:`rerope` and the log-sum-exp of each row's scaled, unmasked scores (natural log,
    ``(B, Hq, Nq)``): the oracle of ``return_lse=True`` (give it float64 inputs). Arguments
    as :func:`rerope`."""
    check_qkv({"q": q}, {"k": k, "v": v}, dtypes=REFERENCE_DTYPES, fewer_queries=True)
    _check_group_causal(group, causal)
    q1, q2, k1, k2 = rerope_inputs(q, k, window, base=base, leaky=leaky,
                                   logn_len=logn_len, rotated=rotated,
                                   inv_freq=inv_freq, group=group)
    return rerope_attention_with_lse(q1, q2, k1, k2, v, window, causal=causal,
                                     sm_scale=sm_scale)


def rerope_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window, causal=True, **options):
    """The packed variable-length op, one sequence at a time through :func:`rerope_with_lse`
    (float64 inputs for an oracle): ``q`` ``(total_q, Hq, D)``, ``k, v`` ``(total_k, Hkv,
    D)``, ``cu_seqlens_*`` ``(B + 1,)`` cumulative lengths; sequence ``b``'s queries are the
    last ``Lq_b`` of its ``Lk_b`` positions. ``options``: :func:`rerope`'s keywords
    (``sm_scale``, ``base``, ``leaky``, ``logn_len``, ``rotated``, ``inv_freq``, ``group``).
    Returns ``(out, lse)``: ``(total_q, Hq, D)`` and ``(Hq, total_q)``, as
    :func:`rerope.rerope_varlen` with ``return_lse=True``."""
    outs, lses = [], []
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        if qs.shape[2] == 0:
            outs.append(q.new_zeros(0, *q.shape[1:]))
            lses.append(torch.zeros(q.shape[1], 0, dtype=torch.float64, device=q.device))
            continue
        out, lse = rerope_with_lse(qs, ks, vs, window, causal=causal, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
