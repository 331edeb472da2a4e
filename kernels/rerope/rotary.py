"""Rotation inside the kernels: RoPE applied to tiles in registers. Chapter 7 of the book.

A model holds ``q, k`` either raw or already rotated by RoPE at their positions (a Hugging Face
model and its KV cache hold them rotated). ReRoPE needs two products per pair, each with its
own rotation; writing the rotated copies ``q1, q2, k1, k2`` to memory first costs more than the
attention itself. Here every rotation is a *speed* and an *offset*: product ``P`` sees

* the key at position ``j`` rotated by ``R(speed · j)``,
* the query at position ``i`` rotated by ``R(speed · i + offset)``,

so that its score is ReRoPE's. With ``c = 1`` for rotated inputs and ``0`` for raw ones
(:func:`rotation_plan`):

=========================  ========================  ==================
product                    key angle at ``p``        query offset
=========================  ========================  ==================
inside the window          ``(1 - c) p``             ``0``
outside (ReRoPE)           ``-c p``                  ``w``
outside (Leaky, κ)         ``(1/κ - c) p``           ``w (κ - 1) / κ``
outside (Self-Extend, G)   ``⌊p/G⌋ - c p``           ``w - w/G``
=========================  ========================  ==================

(``R(a) x · R(b) y`` depends on ``a - b`` only; e.g. rotated inputs outside the window:
``R(w - i) R(i) q · R(-j) R(j) k = R(w) q · k``, ReRoPE's clamped score.) A speed of 0 means no
key rotation at all: raw inputs need none outside the window, rotated inputs none inside.

Self-Extend's grouped positions are not a speed times ``p``, but the kernels never multiply a
position by a speed: they read row ``p`` of a table. Its table simply holds the angles of
``⌊p/G⌋ - c p`` (:func:`rope_table` with ``group``), and every kernel runs unchanged. The one
place that used linearity, the decode kernel's split of a tile's angles ``R(σ (j0 + r)) =
R(σ j0) R(σ r)``, still holds for tiles starting at multiples of ``G``:
``⌊(j0 + r)/G⌋ = j0/G + ⌊r/G⌋`` when ``G`` divides ``j0``.

Angles come from a float64-accurate table of ``cos(speed · p · θ_t), sin(speed · p · θ_t)``
(:func:`rope_table`, cached per speed, head dim, frequencies and device, shared by every head,
batch and layer), not from ``sin``/``cos`` of an fp32 angle, which at ``p ≈ 10⁵`` is off by
10⁻² rad. The frequencies ``θ_t`` are ``base ** (-2t / D)`` or any vector ``inv_freq`` of
``D/2`` of them (a model's scaled RoPE: ``linear``, ``llama3``, YaRN): the kernels only read
the table, so nothing else changes. :func:`rotation_tables` builds the four tensors a kernel
reads for one setting.
The kernels load the two halves of a head vector separately, so ``rotate_half`` is free:
``R x = [a cos − b sin, b cos + a sin]`` for halves ``[a, b]``, and a score is two ``D/2``-wide
products into one accumulator (:func:`_rotate`).
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .caches import LRUCache
from .launch import Launcher, kept_launcher
from .rope import frequencies

_TABLES = LRUCache()     # (head_dim, base or Frequencies, speed, group, device) -> table
_OFFSETS = LRUCache()    # (head_dim, base or Frequencies, offset, device) -> vector


def _frequency_key(base, inv_freq):
    """What the tables are keyed by: ``base`` (its default frequencies) or the frequencies
    themselves (a :class:`rerope.rope.Frequencies`, hashable)."""
    return float(base) if inv_freq is None else inv_freq


def rope_table(n, head_dim, base, speed, device, inv_freq=None, group=None):
    """``(capacity, D)`` float32: row ``p`` is ``[cos(a(p)·θ) | sin(a(p)·θ)]`` with the angle
    ``a(p) = speed·p``, or ``a(p) = speed·p + ⌊p/group⌋`` with ``group`` (Self-Extend).

    ``capacity >= n + 256`` is a multiple of 4096, so a kernel may read whole tiles of rows
    past ``n`` without masks. The table grows as longer sequences come and is shared by every
    call with the same ``(head_dim, base or inv_freq, speed, group, device)``; ``θ`` is
    :func:`rerope.rope.frequencies` (``inv_freq``: :class:`rerope.rope.Frequencies` or
    ``None``). Computed in float64, stored in float32.
    """
    key = (head_dim, _frequency_key(base, inv_freq), float(speed), group, str(device))
    table = _TABLES.get(key)
    if table is None or table.shape[0] < n + 256:
        capacity = -(-(n + 256) // 4096) * 4096
        rows = torch.arange(capacity, dtype=torch.float64, device=device)
        positions = rows * float(speed)
        if group is not None:
            positions = positions + torch.div(rows, group, rounding_mode="floor")
        angles = (positions[:, None]
                  * frequencies(head_dim, base, inv_freq, device=device)[None, :])
        table = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.float32).contiguous()
        _TABLES[key] = table
    return table


def rotation_offset(head_dim, base, offset, device, inv_freq=None):
    """``(D,)`` float32 ``[cos(offset·θ) | sin(offset·θ)]``: a query rotation shared by all rows
    (``θ`` as in :func:`rope_table`)."""
    key = (head_dim, _frequency_key(base, inv_freq), float(offset), str(device))
    vector = _OFFSETS.get(key)
    if vector is None:
        angles = float(offset) * frequencies(head_dim, base, inv_freq, device=device)
        vector = torch.cat((angles.cos(), angles.sin())).to(torch.float32).contiguous()
        _OFFSETS[key] = vector
    return vector


@dataclass(frozen=True)
class Rotation:
    """How one product rotates its operands: keys by ``R(a(j))``, queries by
    ``R(a(i) + offset)``, with ``a(p) = speed·p`` (plus ``⌊p/group⌋`` where ``group`` is set:
    Self-Extend)."""

    speed: float
    offset: float
    group: int = None

    def __repr__(self):       # ReRoPE's and Leaky's products print as before
        grouped = "" if self.group is None else f", group={self.group!r}"
        return f"Rotation(speed={self.speed!r}, offset={self.offset!r}{grouped})"

    @property
    def rotates_keys(self):
        return self.speed != 0 or self.group is not None

    @property
    def rotates_queries(self):
        return self.speed != 0 or self.offset != 0


def rotation_plan(window, leaky=None, rotated=False, group=None):
    """``(inside, outside)``: the :class:`Rotation` of each product (table in the module doc);
    ``group``: Self-Extend's group size (dividing ``window``; not with ``leaky``)."""
    c = 1.0 if rotated else 0.0
    inside = Rotation(speed=1.0 - c, offset=0.0)
    if group is not None:
        outside = Rotation(speed=-c, offset=float(window - window // group), group=int(group))
    elif leaky is None:
        outside = Rotation(speed=-c, offset=float(window))
    else:
        outside = Rotation(speed=1.0 / leaky - c, offset=window * (leaky - 1.0) / leaky)
    return inside, outside


@dataclass(frozen=True)
class RotationTables:
    """What a kernel reads to rotate one setting's products (:func:`rotation_tables`).

    ``tables``: ``(inside table, inside offset, outside table, outside offset)``, each product's
    :func:`rope_table` (its :func:`rotation_offset` in the table's place when the product turns
    no key) and :func:`rotation_offset`. ``flags``: the kernels' compile-time switches,
    ``TURN_IN`` / ``TURN_OUT`` (the product turns keys: its speed is not 0) and ``SHIFT_IN`` /
    ``SHIFT_OUT`` (its query offset is not 0).
    """

    tables: tuple
    flags: dict


def rotation_tables(n_keys, head_dim, window, leaky, rotated, device, base=10000.0,
                    inv_freq=None, group=None):
    """The :class:`RotationTables` of (Leaky) ReRoPE or Self-Extend (``group``) with ``window``
    over ``n_keys`` keys, for raw or ``rotated`` inputs (speeds and offsets of
    :func:`rotation_plan`), with the frequencies of ``base`` or ``inv_freq``
    (:class:`rerope.rope.Frequencies` or ``None``). The tensors are the shared cached tables:
    building this costs a few dictionary look-ups."""
    inside, outside = rotation_plan(window, leaky, rotated, group)
    tables = []
    for rotation in (inside, outside):
        offset = rotation_offset(head_dim, base, rotation.offset, device, inv_freq)
        table = (rope_table(n_keys, head_dim, base, rotation.speed, device, inv_freq,
                            rotation.group) if rotation.rotates_keys else offset)
        tables += [table, offset]
    flags = dict(TURN_IN=inside.rotates_keys, SHIFT_IN=inside.offset != 0,
                 TURN_OUT=outside.rotates_keys, SHIFT_OUT=outside.offset != 0)
    return RotationTables(tables=tuple(tables), flags=flags)


def logn_factor(logn_len):
    """The kernels' log-n argument: ``1 / log2(logn_len)`` (0 turns the scaling off).

    A query at position ``i`` is scaled by ``max(1, log2(i + 1) · factor)``, which is
    ``max(1, log(i + 1) / log(logn_len))``.
    """
    return 0.0 if logn_len is None else 1.0 / math.log2(logn_len)


# --- in-kernel helpers ------------------------------------------------------------------------


@triton.jit
def _rotate(x_a, x_b, cos, sin):
    """``R x`` for the halves ``[x_a, x_b]`` of head vectors:
    ``[a cos − b sin, b cos + a sin]``."""
    return x_a * cos - x_b * sin, x_b * cos + x_a * sin


@triton.jit
def _unrotate(x_a, x_b, cos, sin):
    """``R⁻¹ x = Rᵀ x``: the chain rule through :func:`_rotate` (gradients back to the
    inputs)."""
    return x_a * cos + x_b * sin, x_b * cos - x_a * sin


@triton.jit
def _table_rows(Table, positions, HALF: tl.constexpr):
    """``(cos, sin)`` of ``speed · p · θ`` from :func:`rope_table` for ``positions`` × the
    ``D/2`` frequencies (the table is long enough for whole tiles: no masks)."""
    row = Table + positions.to(tl.int64)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return tl.load(row), tl.load(row + HALF)


@triton.jit
def _angles(Table, positions, Offset, TURN: tl.constexpr, SHIFT: tl.constexpr,
            SHIFT_SIGN: tl.constexpr, HALF: tl.constexpr):
    """``(cos, sin)`` of ``(speed · p ± offset) · θ`` for ``positions`` × the ``D/2``
    frequencies.

    ``TURN``: a table row (the speed is not 0); ``SHIFT``: the offset, added (``SHIFT_SIGN`` 1)
    or subtracted (-1), with the angle-addition formulas. At least one of the two is on.
    """
    if SHIFT:
        freqs = tl.arange(0, HALF)
        cos_o = tl.load(Offset + freqs)[None, :]
        sin_o = tl.load(Offset + HALF + freqs)[None, :] * SHIFT_SIGN
    if TURN:
        cos_p, sin_p = _table_rows(Table, positions, HALF)
        if SHIFT:
            return cos_p * cos_o - sin_p * sin_o, sin_p * cos_o + cos_p * sin_o
        else:
            return cos_p, sin_p
    else:
        zero = tl.zeros([positions.shape[0], HALF], tl.float32)
        return zero + cos_o, zero + sin_o


@triton.jit
def _turn_keys_kernel(K, Out, Table, sk, n_heads, n_k, HEAD_DIM: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Grid ``(B · Hkv, cdiv(Nk, BLOCK))``: rows ``j`` of one key head turned by
    ``R(speed · j)`` from ``Table``, in fp32, rounded once to ``Out``'s dtype (``Out``
    contiguous; ``sk``: ``K``'s four strides)."""
    batch = tl.program_id(0) // n_heads
    head = tl.program_id(0) % n_heads
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    half = tl.arange(0, HEAD_DIM // 2)[None, :]
    keep = rows[:, None] < n_k
    src = (K + batch.to(tl.int64) * sk[0] + head.to(tl.int64) * sk[1]
           + rows.to(tl.int64)[:, None] * sk[2])
    a = tl.load(src + half * sk[3], mask=keep, other=0.0)
    b = tl.load(src + (half + HEAD_DIM // 2) * sk[3], mask=keep, other=0.0)
    cos, sin = _table_rows(Table, rows, HEAD_DIM // 2)
    a32, b32 = _rotate(a.to(tl.float32), b.to(tl.float32), cos, sin)
    dst = Out + (tl.program_id(0).to(tl.int64) * n_k + rows.to(tl.int64)[:, None]) * HEAD_DIM
    tl.store(dst + half, a32.to(a.dtype), mask=keep)
    tl.store(dst + HEAD_DIM // 2 + half, b32.to(b.dtype), mask=keep)


def turn_keys(k, table):
    """``R(speed · j) k_j`` for every key (``table`` from :func:`rope_table`):
    ``(B, Hkv, Nk, D)``, contiguous, in ``k``'s dtype — exactly the tiles a kernel would turn in
    registers.

    The forward launcher turns keys this way for long sequences (see
    :func:`rerope.attention.preturn_keys`): one pass over ``k``, instead of turning every key
    tile again for every query block that reads it. It runs :func:`turn_operands`, which gives
    the same keys and writes both products' from one read where both turn them (Leaky ReRoPE,
    Self-Extend from raw inputs).
    """
    batch, heads, n_k, head_dim = k.shape
    out = torch.empty((batch, heads, n_k, head_dim), dtype=k.dtype, device=k.device)
    _turn_keys_kernel[(batch * heads, triton.cdiv(n_k, 64))](
        k, out, table, k.stride(), heads, n_k, HEAD_DIM=head_dim, BLOCK=64)
    return out


@triton.jit
def _logn_scale(positions, logn_factor):
    """Per-query log-n scale ``max(1, log2(i + 1) · logn_factor)`` (fp32)."""
    return tl.maximum(tl.math.log2(positions.to(tl.float32) + 1.0) * logn_factor, 1.0)


# --- pre-turned operands for the backward -----------------------------------------------------


@triton.jit
def _turn_factors(positions, turn, logn_factor, FLAGS: tl.constexpr, LOGN: tl.constexpr,
                  HALF: tl.constexpr):
    """What :func:`_turn_operand` multiplies one product's operand by at ``positions``, which
    every head of a batch row shares: the log-n scale ``(BLOCK, 1)`` and the ``(cos, sin)``
    of ``R(speed · p + offset)``, ``(BLOCK, HALF)`` (``turn``: the product's table and
    offset; ``FLAGS``: its ``(TURN, SHIFT)``). A factor that is off stays 1 (cos) or 0 and is
    not read by :func:`_turned`."""
    scale = tl.full([positions.shape[0], 1], 1.0, tl.float32)
    cos = tl.full([positions.shape[0], HALF], 1.0, tl.float32)
    sin = tl.zeros([positions.shape[0], HALF], tl.float32)
    if LOGN:
        scale = _logn_scale(positions, logn_factor)[:, None]
    if FLAGS[0] or FLAGS[1]:
        cos, sin = _angles(turn[0], positions, turn[1], FLAGS[0], FLAGS[1], 1, HALF)
    return scale, cos, sin


@triton.jit
def _turned(a, b, scale, cos, sin, FLAGS: tl.constexpr, LOGN: tl.constexpr):
    """The halves ``a, b`` (input dtype) scaled by log-n and turned with the factors of
    :func:`_turn_factors`, in fp32, rounded once."""
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    if LOGN:
        a32, b32 = a32 * scale, b32 * scale
    if FLAGS[0] or FLAGS[1]:
        a32, b32 = _rotate(a32, b32, cos, sin)
    return a32.to(a.dtype), b32.to(b.dtype)


@triton.jit
def _turn_operand(a, b, positions, turn, logn_factor, FLAGS: tl.constexpr, LOGN: tl.constexpr,
                  HALF: tl.constexpr):
    """One product's operand from the halves ``a, b`` (input dtype): scaled by log-n, turned by
    ``R(speed · p + offset)`` (``turn``: its table and offset; ``FLAGS``: ``(TURN, SHIFT)``),
    in fp32, rounded once — the arithmetic of :func:`rerope.forward._operand` (offset sign 1),
    so the result is the tile a kernel turns in registers, bit for bit."""
    scale, cos, sin = _turn_factors(positions, turn, logn_factor, FLAGS, LOGN, HALF)
    return _turned(a, b, scale, cos, sin, FLAGS, LOGN)


@triton.jit
def _turn_operands_kernel(X, Out1, Out2, Tables, sx, n_heads, n_rows, first_position,
                          logn_factor, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                          HEADS: tl.constexpr, LOGN: tl.constexpr, FIRST: tl.constexpr,
                          SECOND: tl.constexpr):
    """Grid ``(B · H / HEADS, cdiv(N, BLOCK))``: rows of ``HEADS`` heads of ``X`` (at positions
    ``first_position + row``; ``sx``: its four strides) read once, turned for each product that
    needs it and stored to ``Out1`` / ``Out2`` (contiguous ``(B, H, N, D)``). ``FIRST`` /
    ``SECOND``: ``None`` for a product not written, else its ``(TURN, SHIFT)``; ``Tables``:
    ``(table, offset)`` of each. A program reads each product's table rows once for all its
    heads (they share the positions): per head, the table rows are twice the bytes of ``X``'s
    in fp16."""
    batch = tl.program_id(0) // (n_heads // HEADS)
    head0 = tl.program_id(0) % (n_heads // HEADS) * HEADS
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    positions = first_position + rows
    half = tl.arange(0, HEAD_DIM // 2)[None, :]
    keep = rows[:, None] < n_rows
    if FIRST is not None:
        f1 = _turn_factors(positions, (Tables[0], Tables[1]), logn_factor, FIRST, LOGN,
                           HEAD_DIM // 2)
    if SECOND is not None:
        f2 = _turn_factors(positions, (Tables[2], Tables[3]), logn_factor, SECOND, LOGN,
                           HEAD_DIM // 2)
    for i in tl.static_range(HEADS):
        head = head0 + i
        src = (X + batch.to(tl.int64) * sx[0] + head.to(tl.int64) * sx[1]
               + rows.to(tl.int64)[:, None] * sx[2])
        a = tl.load(src + half * sx[3], mask=keep, other=0.0)
        b = tl.load(src + (half + HEAD_DIM // 2) * sx[3], mask=keep, other=0.0)
        dst = (((batch * n_heads + head).to(tl.int64) * n_rows + rows.to(tl.int64)[:, None])
               * HEAD_DIM + half)
        if FIRST is not None:
            a1, b1 = _turned(a, b, f1[0], f1[1], f1[2], FIRST, LOGN)
            tl.store(Out1 + dst, a1, mask=keep)
            tl.store(Out1 + dst + HEAD_DIM // 2, b1, mask=keep)
        if SECOND is not None:
            a2, b2 = _turned(a, b, f2[0], f2[1], f2[2], SECOND, LOGN)
            tl.store(Out2 + dst, a2, mask=keep)
            tl.store(Out2 + dst + HEAD_DIM // 2, b2, mask=keep)


def turn_operands(x, inside, outside, first_position=0, logn_factor=0.0, launchers=None):
    """Both products' operands from one read of ``x`` (``(B, H, N, D)``, any strides).

    ``inside`` / ``outside``: ``(table, offset, turn, shift)`` of a product — its
    :func:`rope_table` (read where ``turn``) and :func:`rotation_offset` vector (read where
    ``shift``) — or ``None`` for a product whose operand is not needed (``x`` is returned). Row
    ``r`` sits at position ``first_position + r`` and is scaled by log-n (``logn_factor`` from
    :func:`logn_factor`, 0: off), then turned by ``R(speed · p + offset)``. Returns
    ``(x1, x2)``: a new contiguous tensor in ``x``'s dtype for a product that changes its
    operand, ``x`` itself for one that does not (nothing is launched when neither does).
    Queries: ``first_position = Nk - Nq`` and both switches; keys: ``shift`` off,
    ``logn_factor`` 0 (then a product's result equals :func:`turn_keys`).

    The backward launcher uses it (:func:`rerope.attention.preturn_backward`): the two
    backward kernels then read each product's operands as stored instead of turning every tile
    of the other axis again in every program that reads it.

    ``launchers``: a plan's dict of bound launches (:attr:`rerope.attention.PlanState.
    launchers`; the plan's call signature fixes ``x``'s shape, strides and alignment): the
    launch is kept there, bound (:class:`rerope.launch.Launcher`), so a repeated call skips
    Triton's Python launch path; ``None``: launched through ``kernel[grid]``.
    """
    return kept_turn(x, inside, outside, first_position, logn_factor, launchers)(x)


def kept_turn(x, inside, outside, first_position=0, logn_factor=0.0, launchers=None):
    """:func:`turn_operands` kept for ``x``'s call signature (shape, strides, dtype, device):
    ``turn(x) -> (x1, x2)`` for later tensors of that signature, with all but the outputs'
    allocation and the launch done once. Where ``launchers`` holds this launch bound (the
    plan's first call ran it), the launch takes the bound path with the tables, strides and
    scalars fixed (:meth:`rerope.launch.Launcher.fixed`). ``x`` itself is not kept."""
    writes, launch = _turn_launch(x, inside, outside, first_position, logn_factor, launchers)
    shape, dtype, device = x.shape, x.dtype, x.device

    def turn(x):
        outs = [torch.empty(shape, dtype=dtype, device=device) if write else x
                for write in writes]
        if launch is not None:
            launch(x, *outs)
        return outs[0], outs[1]

    return turn


def turn_tiling(heads):
    """``(rows, heads)`` a program of :func:`turn_operands` turns: 64 rows of one head. The
    kernel also turns several heads a program (``HEADS`` dividing ``heads``: they share the
    table rows, read once); on an H100 no tiling beat this one by more than 1 % for ``k``
    (``perf/NOTES.md`` v23), so it stays the default."""
    return 64, 1


def _turn_launch(x, inside, outside, first_position, logn_factor, launchers):
    """``(writes, launch)`` of :func:`turn_operands`: which of the two outputs it writes, and
    ``launch(x, out1, out2)`` (``None`` when it writes neither; an output not written is passed
    as ``x``, unread), its other arguments bound once (:meth:`rerope.launch.Launcher.fixed`
    where ``launchers`` keeps the launch)."""
    batch, heads, n_rows, head_dim = x.shape
    logn = logn_factor != 0.0
    writes = [p is not None and (logn or p[2] or p[3]) for p in (inside, outside)]
    if not any(writes):
        return writes, None
    (tab1, off1, turn1, shift1), (tab2, off2, turn2, shift2) = (   # None: placeholders
        p if p is not None else (*other[:2], False, False)
        for p, other in ((inside, outside), (outside, inside)))
    block, group = turn_tiling(heads)
    grid = (batch * heads // group, triton.cdiv(n_rows, block))
    constexprs = dict(HEAD_DIM=head_dim, BLOCK=block, HEADS=group, LOGN=logn,
                      FIRST=(turn1, shift1) if writes[0] else None,
                      SECOND=(turn2, shift2) if writes[1] else None)
    tail = ((tab1, off1, tab2, off2), x.stride(), heads, n_rows, first_position, logn_factor)
    if launchers is None:
        return writes, lambda *xs: _turn_operands_kernel[grid](*xs, *tail, **constexprs)
    launcher = kept_launcher(launchers, ("turn operands", grid), constexprs,
                             lambda: Launcher(_turn_operands_kernel, grid, **constexprs))
    return writes, launcher.fixed(*tail)
