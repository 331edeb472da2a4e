"""The public ops: launchers, autograd, ``rerope_attention`` and ``rerope``.

``rerope_attention`` takes the five tensors (see :mod:`rerope.rope`); ``rerope`` takes ``q, k,
v`` as a model holds them, raw or already rotated, and rotates inside the kernels
(:mod:`rerope.rotary`). Both run the same three kernels (forward, dK/dV, dQ) and are
differentiable. On a GPU every kernel is autotuned over :func:`rerope.configs.launch_configs`;
under the CPU interpreter one fixed configuration runs (:mod:`rerope.runtime`).

Each op has two doors to the same launchers. Eagerly, a ``torch.autograd.Function`` where a
gradient is needed and the kernels themselves where none is: the lightest paths from Python to
the kernels (short sequences are bound by host time). Under ``torch.compile``, ops registered
with ``torch.library`` (``torch.ops.rerope.*``, with fake implementations), which the compiler
treats as opaque instead of tracing into Triton, inside a traced autograd Function
(:class:`_TracedFused`) that gives their gradient; in eager mode they would cost about 90 µs
more per forward call (``perf/NOTES.md``). Both doors keep a plan per call signature
(:func:`_cached_plan`, :func:`_op_plan`), so a repeated call, eager or from a compiled graph, is
a lookup plus the plan's kept, bound launches.
"""

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import triton

from . import configs, hopper
from ._validate import (Frequencies, as_frequencies, check_flag, check_head_dim,
                        check_logn_overflow, check_qkv, check_rope_settings, check_sm_scale,
                        check_window)
from .backward import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from .decode import MAX_QUERIES, rerope_decode
from .forward import _rerope_fwd_kernel
from .online_softmax import LOG2E, natural_lse
from .caches import CACHE_SIZE, LRUCache
from .launch import (Launcher, PlanCache, _capability, _ensure_scratch_allocator,
                     _tma_layout_ok, kept_launcher, signature)
from .rotary import kept_turn, logn_factor, rotation_tables, turn_operands
from .runtime import INTERPRET, prepare_for_device

_KERNELS = {"fwd": _rerope_fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}


@functools.lru_cache(maxsize=CACHE_SIZE)
def _autotuned(kernel, head_dim, capability, elem_bytes, fused, autotune=True):
    """The kernel wrapped in ``triton.autotune`` over the configs that fit this GPU (for the
    five-tensor or the fused-rotation form: ``fused``; all candidates, or the first alone).

    The window is not part of the key: it moves work between regions, not the best tile shape.
    """
    return triton.autotune(
        configs=configs.launch_configs(kernel, head_dim, capability, elem_bytes, fused,
                                       autotune),
        key=["n_q", "n_k", "HEAD_DIM", "CAUSAL", "LOGN"],
    )(_KERNELS[kernel])


GRID_Y_MAX = 65535            # CUDA's limit on a grid's second axis (the first: 2**31 - 1)


def heads_first(n_k, programs=1, config=None):
    """Whether the forward and backward kernels' grids run batch · heads along their first axis
    (``(B·H, blocks)``) rather than blocks (``(blocks, B·H)``), for a call with ``n_k`` keys
    (an int, ``k.shape[2]``): up to ``config.heads_first_max_keys`` (:class:`rerope.Config`,
    default the active one), and whatever the length when ``programs`` (``B·H``, the most of
    any of the call's kernels) is more than the second axis can hold (:data:`GRID_Y_MAX`).

    The GPU starts programs in grid order, first axis fastest. Causal blocks differ in length
    (each kernel starts its longest first), and blocks first starts the last heads' longest
    blocks last, a tail the whole GPU waits for: heads first starts every head's longest block
    before any head's second, and the short ones fill the last wave. But then all heads' K and V
    are read at once, which overflows the L2 cache at long sequences, where the tail is a small
    share anyway. The threshold's measurements are in ``perf/NOTES.md`` (grid order).
    """
    config = config or configs.current()
    return n_k <= config.heads_first_max_keys or programs > GRID_Y_MAX


# --- a plan's state: its decisions and kept launches ------------------------------------------


@dataclass(eq=False)
class BackwardState:
    """What a plan keeps for its backward per layout of ``dout`` (the one argument of the
    backward its key does not fix), filled by the first backward call with that layout.

    ``tma``: whether the backward kernels read tiles through TMA (:func:`_use_tma`; ``None``:
    not decided yet). ``calls``: the fused form's kept backward (:func:`_backward_call`) per
    pre-turn choice (:func:`preturn_backward`'s answer, or the caller's ``preturn``).
    ``launchers``: the backward's bound launches (:func:`_bound`)."""

    tma: Optional[bool] = None
    calls: dict = field(default_factory=dict)
    launchers: dict = field(default_factory=dict)


@dataclass(eq=False)
class PlanState:
    """What a plan decides and keeps on its first calls, for its later ones: the plan's key
    (the call signature: shapes, strides, dtype, device, alignment; and its
    :class:`rerope.Config`) fixes every input of each decision, so each is made once.

    ``heads_first``: the kernels' grid order (:func:`heads_first`). ``preturn_keys``: whether
    the fused forward turns keys once first (:func:`preturn_keys`). ``preturn_backward``:
    whether the fused backward runs on pre-turned operands where some differ from the inputs
    (:func:`preturn_backward`). ``tma``: whether the forward reads tiles through TMA
    (:func:`_use_tma`). ``None``: not decided yet. ``forward_calls``: the fused form's kept
    forward (:func:`_forward_call`) per pre-turn choice. ``backward``: a
    :class:`BackwardState` per layout of ``dout`` (:func:`rerope.launch.signature`).
    ``launchers``: the forward's bound launches, per launch site and constexprs
    (:func:`_bound`, :func:`rerope.launch.kept_launcher`). ``gluon``: the forward through
    the Gluon kernels where they run it, else ``False`` (:func:`_gluon_plan`)."""

    heads_first: Optional[bool] = None
    preturn_keys: Optional[bool] = None
    preturn_backward: Optional[bool] = None
    tma: Optional[bool] = None
    gluon: object = None     # a callable (see _gluon_plan) or False
    forward_calls: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)
    launchers: dict = field(default_factory=dict)

    def backward_of(self, dout):
        """The :class:`BackwardState` for ``dout``'s layout (a new one the first time)."""
        key = signature(dout)
        kept = self.backward.get(key)
        if kept is None:
            kept = self.backward[key] = BackwardState()
        return kept

    def kept_launchers(self):
        """Every :class:`rerope.launch.Launcher` kept: the forward's and the backward's."""
        return [*self.launchers.values(),
                *(launcher for kept in self.backward.values()
                  for launcher in kept.launchers.values())]


def _decided(state, name, decide):
    """``decide()``, made once per plan: kept in ``state``'s field ``name`` (a
    :class:`PlanState` or :class:`BackwardState`; ``None`` there: not decided yet); made on
    every call without a ``state``."""
    if state is None:
        return decide()
    value = getattr(state, name)
    if value is None:
        value = decide()
        setattr(state, name, value)
    return value


def _launch(kernel, blocks_of, rows, programs, args, launchers=None, autotune=True,
            **constexprs):
    """Launch ``kernel`` over ``(cdiv(rows, meta[blocks_of]), programs)``, or ``(programs,
    cdiv(rows, meta[blocks_of]))`` with the constexpr ``HEADS_FIRST`` (:func:`heads_first`).

    On a GPU the kernel is autotuned (:func:`_autotuned`) on its first call per key, and the
    compiled winner is then bound to a :class:`rerope.launch.Launcher`, kept per exact
    argument list (:func:`_bound`), so a repeated call skips Triton's ~70 µs Python launch path.
    """
    def grid(blocks):
        return (programs, blocks) if constexprs["HEADS_FIRST"] else (blocks, programs)

    def make():
        if INTERPRET:
            config = configs.INTERPRETER_CONFIG
            return Launcher(_KERNELS[kernel], grid(triton.cdiv(rows, config[blocks_of])),
                            **constexprs, **config)
        if constexprs["TMA"]:
            _ensure_scratch_allocator()
        tuned = _autotuned(kernel, constexprs["HEAD_DIM"], _capability(args[0].device),
                           args[0].element_size(), constexprs["INSIDE_FLAGS"] is not None
                           and not constexprs.get("PRETURNED", False), autotune)
        return Launcher(tuned, lambda meta: grid(triton.cdiv(rows, meta[blocks_of])),
                        **constexprs)

    launcher = _bound((kernel, rows, programs, autotune), args, constexprs, make, launchers)
    launcher(*args)
    return launcher


_LAUNCHERS = LRUCache()


def _bound(where, args, constexprs, make, launchers=None):
    """The :class:`rerope.launch.Launcher` of a launch; ``make()`` builds a new one.

    ``launchers``: a plan's dict of bound launches (:attr:`PlanState.launchers`,
    :attr:`BackwardState.launchers`), whose call signature already fixes every argument of the
    launch (shapes, strides, alignment; outputs and scratch are fresh contiguous tensors):
    kept there per ``where`` (kernel and grid) and constexprs, a short key. Without one, kept
    in :data:`_LAUNCHERS` per exact argument list: integers by value, tensors by dtype and
    pointer alignment (what Triton specialises a compiled kernel on)."""
    if launchers is not None:
        return kept_launcher(launchers, where, constexprs, make)
    key = (where, tuple(constexprs.items()), tuple(map(_arg_key, args)))
    launcher = _LAUNCHERS.get(key)
    return launcher if launcher is not None else _LAUNCHERS.put(key, make())


def _arg_key(arg):
    """What Triton specialises a compiled kernel on for one argument: a tensor's dtype and
    pointer alignment (also inside a tuple), any other value itself."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, tuple):
        return tuple(map(_arg_key, arg))
    return arg


def _strides(*tensors):
    """Each tensor's strides, one tuple per tensor (the kernels index them)."""
    return [t.stride() for t in tensors]


def _use_tma(mode, *tensors):
    """Whether the kernels read tiles through TMA tensor descriptors (``mode``:
    :attr:`rerope.Config.tma`)."""
    if mode == "off":
        return False
    t = tensors[0]
    if mode != "on" and (INTERPRET or not configs.tma_pays(
            _capability(t.device), t.element_size(), t.shape[-1])):
        return False
    # the cheap checks first: this runs per call
    return all(_tma_layout_ok(t) for t in tensors)


# --- how the kernels read q and k -------------------------------------------------------------


@dataclass(frozen=True)
class Operands:
    """What the kernels need to know about their operands, beyond the tensors.

    ``fused=False``: the five-tensor form (``q1, q2, k1, k2`` given). ``fused=True``: ``q, k``
    as a model holds them; ``tables`` are ``(inside table, inside offset, outside table,
    outside offset)`` from :mod:`rerope.rotary` and ``flags`` its switches ``TURN_IN``,
    ``SHIFT_IN``, ``TURN_OUT``, ``SHIFT_OUT``.
    """

    fused: bool
    tables: tuple
    flags: dict
    logn_factor: float = 0.0

    def constexprs(self, *turn_keys):
        """The kernels' flag groups: ``INSIDE_FLAGS`` / ``OUTSIDE_FLAGS`` ``None`` (five
        tensors) or the product's ``(TURN, SHIFT)``, plus ``TURN_KEYS`` where ``turn_keys``
        (the forward's: whether it turns each product's key tiles) is given."""
        if not self.fused:
            return dict(LOGN=False, INSIDE_FLAGS=None, OUTSIDE_FLAGS=None)
        f = self.flags
        inside, outside = (f["TURN_IN"], f["SHIFT_IN"]), (f["TURN_OUT"], f["SHIFT_OUT"])
        if turn_keys:
            inside, outside = (*inside, turn_keys[0]), (*outside, turn_keys[1])
        return dict(LOGN=self.logn_factor != 0.0, INSIDE_FLAGS=inside, OUTSIDE_FLAGS=outside)


_NO_ROTATION = dict(TURN_IN=False, SHIFT_IN=False, TURN_OUT=False, SHIFT_OUT=False)


def _five_tensors(placeholder):
    return Operands(fused=False, tables=(placeholder,) * 4, flags=_NO_ROTATION)


_OPERANDS = LRUCache()


def _rotations(n_k, head_dim, base, window, leaky, logn_len, rotated, device, inv_freq=None,
               group=None):
    """The :class:`Operands` of the fused form, cached per setting (the tables themselves are
    shared by every setting with the same speed and frequencies:
    :func:`rerope.rotary.rotation_tables`). ``inv_freq``: ``None`` (``base``'s frequencies) or
    :class:`rerope.rope.Frequencies`; ``group``: Self-Extend's group size or ``None``."""
    key = (n_k, head_dim, base, window, leaky, logn_len, rotated, device, inv_freq, group)
    operands = _OPERANDS.get(key)
    if operands is None:
        rotation = rotation_tables(n_k, head_dim, window, leaky, rotated, device, base,
                                   inv_freq, group)
        operands = _OPERANDS[key] = Operands(fused=True, tables=rotation.tables,
                                             flags=rotation.flags,
                                             logn_factor=logn_factor(logn_len))
    return operands


# --- launchers --------------------------------------------------------------------------------

PRETURN_BLOCK_M = 128        # the forward's largest query block (configs.py)


def preturn_keys(n_k, n_q=PRETURN_BLOCK_M + 1, q_per_kv=1, config=None):
    """Whether the fused forward turns a product's keys once, before the kernel, rather than
    every key tile in every query block that reads it (:func:`rerope.rotary.turn_keys`), for
    ``n_k`` keys, ``n_q`` queries and ``q_per_kv`` query heads per key head (``config``:
    :class:`rerope.Config`, default the active one).

    Pre-turning costs one more launch and one pass over ``k`` (``Hkv`` heads: small under
    grouped-query attention); turning in registers costs elementwise work and a trip of the
    turned tile through shared memory per (query block, key tile) of that product — most of
    the key axis for rotated inputs, whose outside product turns keys. From
    ``config.preturn_min_keys`` keys on, and only where a key tile would be turned at least
    twice in registers, by the ``q_per_kv · cdiv(Nq, 128)`` programs that read it (a chunk of at
    most 128 queries without grouped-query attention reads each key once: the extra pass would
    be pure cost). The threshold's measurements are in ``perf/NOTES.md`` (pre-turned keys).
    """
    config = config or configs.current()
    return n_k >= config.preturn_min_keys and q_per_kv * -(-n_q // PRETURN_BLOCK_M) >= 2


def _preturned_shapes(q, k, operands, outside=True):
    """Which of ``q1, q2, k1, k2`` the pre-turned backward writes (the others are ``q`` or
    ``k`` as given; the outside product's only where it has a tile, ``outside``), and the
    extra memory that takes, in bytes."""
    logn = operands.logn_factor != 0.0
    f = operands.flags
    writes = (logn or f["TURN_IN"] or f["SHIFT_IN"],
              outside and (logn or f["TURN_OUT"] or f["SHIFT_OUT"]),
              f["TURN_IN"], outside and f["TURN_OUT"])
    extra = q.element_size() * (q.numel() * (writes[0] + writes[1])
                                + k.numel() * (writes[2] + writes[3]))
    return writes, extra


@functools.lru_cache(maxsize=CACHE_SIZE)
def _device_memory(device):
    return torch.cuda.get_device_properties(device).total_memory


def preturn_memory_limit(device, config=None):
    """The most extra bytes :func:`preturn_backward` spends: ``config.preturn_bwd_max_bytes``
    (``REROPE_PRETURN_BWD_MAX_BYTES``), or where that is ``None`` a sixteenth of the GPU's
    memory (H200: 8.8 GB; a 16 GB T4: 1 GB; 2 GiB under the interpreter)."""
    limit = (config or configs.current()).preturn_bwd_max_bytes
    if limit is not None:
        return limit
    return 2 ** 31 if INTERPRET else _device_memory(torch.device(device)) // 16


def preturn_backward(n_k, extra_bytes, device, config=None):
    """Whether the fused backward runs on pre-turned operands (:func:`rerope.rotary.
    turn_operands`: one pass over ``q`` and one over ``k`` write each product's operands that
    differ from the inputs) rather than turning tiles in registers inside its two kernels.

    In registers, the dK/dV kernel turns every query tile it walks, in every key block, and the
    dQ kernel every key tile in every query block; pre-turned, both kernels read the operands as
    the five-tensor backward does, and turn only their gradients back, once per program, in the
    store that adds the two products' parts. The price is memory, held during the backward
    only: ``extra_bytes`` — per product that changes an operand one tensor like ``q``
    (``B·Hq·Nq·D`` elements of its dtype) and, where it turns keys, one like ``k``
    (``B·Hkv·Nk·D``). Raw ReRoPE inputs: two like ``q`` and one like ``k``; rotated: one of
    each; Leaky from raw inputs, or log-n, up to two of each (B=1, H=32, N=8192, fp16: 100 MB
    raw and 67 MB rotated at D=64, twice that at D=128).

    Pre-turns from ``config.preturn_bwd_min_keys`` keys on (:class:`rerope.Config`, default
    the active one), while ``extra_bytes`` is within :func:`preturn_memory_limit`; the
    threshold's measurements are in ``perf/NOTES.md`` (pre-turned backward).
    """
    config = config or configs.current()
    return (n_k >= config.preturn_bwd_min_keys
            and extra_bytes <= preturn_memory_limit(device, config))


def rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale, operands=None, preturn=None,
                   state=None, config=None):
    """Run the forward kernel; returns ``(out, lse)`` (``lse`` in log2 units, ``(B·Hq, Nq)``).

    ``operands=None``: the five-tensor form. Otherwise ``q1 is q2`` is ``q``, ``k1 is k2`` is
    ``k`` and ``operands`` (:class:`Operands`) says how they are rotated; ``preturn`` whether
    the products that turn keys get them turned once first (``None``: :func:`preturn_keys`).
    ``state``: the plan's :class:`PlanState` (its decisions, kept calls and bound launches;
    ``None``: all decided on this call), made for ``config`` (the plan's
    :class:`rerope.Config`; default the active one).
    """
    fused = operands is not None
    if state is not None and fused:       # the plan fixes the shapes and the Config, so the
        call = state.forward_calls.get(   # decisions below: its kept call
            state.preturn_keys if preturn is None else preturn)
        if call is not None:
            return call(q1, q2, k1, k2, v)
    config = config or configs.current()
    gluon = _decided(state, "gluon", lambda: _gluon_plan(
        q1, q2, k1, k2, v, window, causal, sm_scale, config, operands,
        None if state is None else state.launchers))
    if gluon:                             # the Gluon forward on Hopper (rerope.hopper)
        return gluon(q1, q2, k1, k2, v)
    batch, n_heads, n_q, head_dim = q1.shape
    n_k = k1.shape[2]
    first = _decided(state, "heads_first", lambda: heads_first(n_k, batch * n_heads, config))
    pre = preturn if preturn is not None else _decided(
        state, "preturn_keys", lambda: preturn_keys(n_k, n_q, n_heads // k1.shape[1], config))
    launchers = None if state is None else state.launchers
    out = torch.empty(q1.shape, dtype=q1.dtype, device=q1.device)
    lse = torch.empty(batch * n_heads, n_q, dtype=torch.float32, device=q1.device)
    keys = k1                                   # as given (the plan's layout)
    operands = operands or _five_tensors(lse)
    turn_keys_in, turn_keys_out = operands.flags["TURN_IN"], operands.flags["TURN_OUT"]
    turn_tables = (None, None)
    if (turn_keys_in or turn_keys_out) and pre:
        turn_tables = (operands.tables[0] if turn_keys_in else None,
                       operands.tables[2] if turn_keys_out and _has_outside(n_k, window)
                       else None)
        k1, k2 = _turned_keys(k1, k2, *turn_tables, launchers)
        turn_keys_in = turn_keys_out = False
    args = [q1, q2, k1, k2, v, out, lse, operands.tables, *_strides(q1, q2, k1, k2, v, out),
            n_heads, n_heads // k1.shape[1], n_q, n_k, window, sm_scale * LOG2E,
            operands.logn_factor]
    launcher = _launch(
        "fwd", "BLOCK_M", n_q, batch * n_heads, launchers=launchers, args=args,
        autotune=config.autotune,
        HEAD_DIM=head_dim, CAUSAL=causal,
        TMA=_decided(state, "tma", lambda: _use_tma(config.tma, q1, q2, k1, k2, v)),
        HEADS_FIRST=first, **operands.constexprs(turn_keys_in, turn_keys_out))
    if state is not None and fused:
        state.forward_calls[pre] = _forward_call(launcher, out, lse, keys, turn_tables,
                                                 tuple(args[7:]), launchers)
    return out, lse


def _gluon_plan(q1, q2, k1, k2, v, window, causal, sm_scale, config, operands, launchers):
    """The forward through the Gluon kernels where :func:`rerope.hopper.plan` says they run
    it (else ``False``): its :class:`rerope.hopper.Forward` for the five-tensor form; for the
    fused form (``operands``) a call that first turns each product's keys once (the
    pre-turned backward's pass, :func:`_operand_turns`) and runs the kernel, which turns the
    queries (:func:`rerope.hopper.query_turn`); with ``config.gluon_turn_queries`` off the
    pass turns the queries too and the five-tensor kernel runs. The turn is kept for the
    first call's layout, bound, as the backward keeps its own."""
    if operands is None:
        return hopper.plan(q1, q2, k1, k2, v, window, causal, sm_scale, config)
    outside = _has_outside(k1.shape[2], window)
    in_kernel = config.gluon_turn_queries
    q_turns = _turn_specs(operands, 0, outside)[0]
    forward = hopper.plan(q1, q2, k1, k2, v, window, causal, sm_scale, config,
                          q_turn=(hopper.query_turn(q_turns[0], q_turns[1], q_turns[3])
                                  if in_kernel else None))
    if not forward:
        return forward
    kept = []

    def call(q, _q, k, _k, v):
        if kept:
            return forward(*kept[0](q, k), v)
        turned = _operand_turns(operands, 0, outside, launchers, queries=not in_kernel)(q, k)
        if launchers is not None:           # for the plan's later calls: kept, bound
            kept.append(_operand_turns(operands, 0, outside, launchers, (q, k),
                                       queries=not in_kernel))
        return forward(*turned, v)

    return call


def _has_outside(n_k, window):
    """Whether any (query, key) pair is ``window`` or more positions apart, i.e. the outside
    product has a tile: ``Nk > w`` (queries are the last ``Nq`` of the ``Nk`` positions, so the
    farthest pair is ``Nk - 1`` apart, causal or not). Where it has none, its operands are
    never read, and pre-turning them would be wasted work."""
    return n_k > window


def _key_products(table_in, table_out):
    """The two products' key turns for :func:`rerope.rotary.turn_operands`: a product's
    ``(table, offset, turn, shift)`` where its table is given, ``None`` where its keys stay as
    they are (keys have no offset: the table stands in for it, unread)."""
    return tuple(None if table is None else (table, table, True, False)
                 for table in (table_in, table_out))


def _turned_keys(k1, k2, table_in, table_out, launchers=None):
    """``k1, k2`` (the fused form's one ``k``) with each product's keys turned once where its
    table is given (``None``: that product's keys as they are): one read of ``k`` for both
    products (Self-Extend and Leaky ReRoPE turn the keys of both), each turned key equal to
    :func:`rerope.rotary.turn_keys`'. ``launchers``: the plan's (a bound launch)."""
    if table_in is None and table_out is None:
        return k1, k2
    return turn_operands(k1, *_key_products(table_in, table_out), launchers=launchers)


def _forward_call(launcher, out, lse, keys, turn_tables, tail, launchers):
    """A fused-form plan's forward after its first call: everything the call signature fixes
    (the launcher, the strides, tables and scalars after the seven tensors, whether keys are
    pre-turned, the outputs' shapes, dtype and device: those of the first call's ``out`` and
    ``lse``) is kept, and a call allocates its outputs and launches. The key turn, where there
    is one, is kept for the layout of ``keys`` (the first call's ``k``, not kept alive;
    :func:`rerope.rotary.kept_turn`), its launch bound in the plan's ``launchers``."""
    launch = launcher.fixed(*tail)
    turn = (None if turn_tables == (None, None) else
            kept_turn(keys, *_key_products(*turn_tables), launchers=launchers))
    out_shape, lse_shape, dtype, device = out.shape, lse.shape, out.dtype, out.device
    del out, lse, keys                    # (not kept alive by the call)

    def call(q1, q2, k1, k2, v):
        out = torch.empty(out_shape, dtype=dtype, device=device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        if turn is not None:
            k1, k2 = turn(k1)
        launch(q1, q2, k1, k2, v, out, lse)
        return out, lse

    return call


def rerope_backward(dout, q1, q2, k1, k2, v, out, lse, window, causal, sm_scale, operands=None,
                    preturn=None, state=None, config=None):
    """Run the three backward kernels: ``(dq1, dq2, dk1, dk2, dv)`` in the five-tensor form,
    ``(dq, dk, dv)`` with ``operands`` (see :func:`rerope_forward`).

    With ``operands``, ``preturn`` says whether the kernels read pre-turned operands (extra
    memory, see :func:`preturn_backward`; ``None``: that function decides) or turn tiles in
    registers (``False``; also where no product changes an operand). Both give ``dq, dk, dv``
    of the input dtype, contiguous, equal within rounding (``dq`` bit for bit where both run
    one dot per score, D = 16). ``state``: the forward's plan's :class:`PlanState`; the
    backward keeps its own :class:`BackwardState` there per layout of ``dout``, the one
    argument the plan does not fix. ``config``: the plan's :class:`rerope.Config` (default
    the active one).
    """
    fused = operands is not None
    kept = None if state is None else state.backward_of(dout)
    if kept is not None and fused:            # the fused form's plan: its kept call
        call = kept.calls.get(state.preturn_backward if preturn is None else preturn)
        if call is not None:
            return call(dout, q1, k1, v, out, lse)
    config = config or configs.current()
    launchers = None if kept is None else kept.launchers
    batch, n_heads, n_q, head_dim = q1.shape
    n_kv_heads, n_k = k1.shape[1], k1.shape[2]
    q_per_kv = n_heads // n_kv_heads
    first = _decided(state, "heads_first", lambda: heads_first(n_k, batch * n_heads, config))
    delta = torch.empty_like(lse)
    args = (out, dout, delta, *_strides(out, dout), n_heads, n_q)
    grid = (batch * n_heads, triton.cdiv(n_q, configs.DELTA_BLOCK_M))
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=configs.DELTA_BLOCK_M)
    delta_launcher = _bound(("delta", grid), args, constexprs,
                            lambda: Launcher(_bwd_delta_kernel, grid, **constexprs), launchers)
    delta_launcher(*args)
    operands = operands or _five_tensors(lse)
    constexprs = dict(operands.constexprs(), PRETURNED=False)
    turn = None
    if fused:
        outside = _has_outside(n_k, window)
        writes, extra = _preturned_shapes(q1, k1, operands, outside)
        preturn = preturn if preturn is not None else _decided(
            state, "preturn_backward", lambda: preturn_backward(n_k, extra, q1.device, config))
        if any(writes) and preturn:
            # the five-tensor kernels on each product's operands, gradients turned back
            q_in, k_in = q1, k1
            q1, q2, k1, k2 = _operand_turns(operands, n_k - n_q, outside, launchers)(q1, k1)
            if launchers is not None:       # for the plan's later calls: kept, bound
                turn = _operand_turns(operands, n_k - n_q, outside, launchers, (q_in, k_in))
            constexprs.update(PRETURNED=True)
    grads = 1 if fused else 2
    dq = [torch.empty(q1.shape, dtype=q1.dtype, device=q1.device) for _ in range(grads)]
    dk = [torch.empty(k1.shape, dtype=k1.dtype, device=k1.device) for _ in range(grads)]
    dv = torch.empty(k1.shape, dtype=k1.dtype, device=k1.device)
    strides = _strides(q1, q2, k1, k2, v, dout)
    common = dict(HEAD_DIM=head_dim, CAUSAL=causal,
                  TMA=_decided(kept, "tma", lambda: _use_tma(config.tma, q1, q2, k1, k2, v,
                                                             dout)),
                  HEADS_FIRST=first, **constexprs)
    dkdv_args = [q1, q2, k1, k2, v, dout, lse, delta, dk[0], dk[-1], dv, operands.tables,
                 *strides, n_heads, q_per_kv, n_q, n_k, window, sm_scale * LOG2E,
                 sm_scale, operands.logn_factor]
    dkdv = _launch("dkdv", "BLOCK_N", n_k, batch * n_kv_heads, launchers=launchers,
                   autotune=config.autotune,
                   args=dkdv_args, **common)
    dq_args = [q1, q2, k1, k2, v, dout, lse, delta, dq[0], dq[-1], operands.tables, *strides,
               n_heads, q_per_kv, n_q, n_k, window, sm_scale * LOG2E, sm_scale,
               operands.logn_factor]
    dq_launcher = _launch("dq", "BLOCK_M", n_q, batch * n_heads, launchers=launchers,
                          autotune=config.autotune,
                          args=dq_args, **common)
    if kept is not None and fused:
        kept.calls[preturn] = _backward_call(
            (delta_launcher, args[3:]), turn, (dkdv, tuple(dkdv_args[11:])),
            (dq_launcher, tuple(dq_args[10:])), dq[0], dk[0])
    return (dq[0], dk[0], dv) if fused else (dq[0], dq[1], dk[0], dk[1], dv)


def _operand_turns(operands, first_query, outside=True, launchers=None, like=None,
                   queries=True):
    """``turn(q, k) -> (q1, q2, k1, k2)``: each product's operands turned once (extra tensors,
    :func:`rerope.rotary.turn_operands`) for the pre-turned backward; the outside product's
    only where it has a tile (``outside``, :func:`_has_outside`: else ``q``, ``k``, unread).
    ``launchers``: the plan's (bound launches). ``like``: ``(q, k)`` of the plan's call
    signature, for a turn kept for that layout (:func:`rerope.rotary.kept_turn`: build it
    after the plan's first turn, whose launches it then takes bound). ``queries=False``: the
    keys only, ``q`` returned as both products' (the Gluon kernel turns it,
    ``Config.gluon_turn_queries``)."""
    q_turns, k_turns = _turn_specs(operands, first_query, outside)
    if not queries:                 # no product writes: turn_operands returns q, q unlaunched
        q_turns = (None, None, first_query, 0.0)
    if like is not None:
        turn_q = kept_turn(like[0], *q_turns, launchers=launchers)
        turn_k = kept_turn(like[1], *k_turns, launchers=launchers)
        return lambda q, k: (*turn_q(q), *turn_k(k))
    return lambda q, k: (*turn_operands(q, *q_turns, launchers=launchers),
                         *turn_operands(k, *k_turns, launchers=launchers))


def _turn_specs(operands, first_query, outside):
    """``(q_turns, k_turns)``: the arguments after the tensor of
    :func:`rerope.rotary.turn_operands` for ``q`` (each product's ``(table, offset, turn,
    shift)``, the first query's position, the log-n factor) and for ``k`` (no shift, no
    log-n); the outside product's ``None`` where it has no tile (``outside``)."""
    tab_in, off_in, tab_out, off_out = operands.tables
    f = operands.flags
    q_turns = ((tab_in, off_in, f["TURN_IN"], f["SHIFT_IN"]),
               (tab_out, off_out, f["TURN_OUT"], f["SHIFT_OUT"]) if outside else None,
               first_query, operands.logn_factor)
    k_turns = ((tab_in, off_in, f["TURN_IN"], False),
               (tab_out, off_out, f["TURN_OUT"], False) if outside else None)
    return q_turns, k_turns


def _backward_call(delta, turn, dkdv, dq, dq_first, dk_first):
    """A fused-form plan's backward after its first call (as :func:`_forward_call`): each of
    ``delta, dkdv, dq`` is a launcher and the arguments after its tensors; ``turn`` pre-turns
    the operands (:func:`_operand_turns`) or is ``None``; the gradients take the shapes,
    dtype and device of the first call's (``dq_first``, ``dk_first``)."""
    delta_launch, dkdv_launch, dq_launch = (launcher.fixed(*tail) for launcher, tail in
                                            (delta, dkdv, dq))
    q_shape, k_shape, dtype, device = (dq_first.shape, dk_first.shape, dq_first.dtype,
                                       dq_first.device)
    del dq_first, dk_first                # (not kept alive by the call)

    def call(dout, q, k, v, out, lse):
        grad_delta = torch.empty_like(lse)
        delta_launch(out, dout, grad_delta)
        q1, q2, k1, k2 = (q, q, k, k) if turn is None else turn(q, k)
        dq = torch.empty(q_shape, dtype=dtype, device=device)
        dk = torch.empty(k_shape, dtype=dtype, device=device)
        dv = torch.empty(k_shape, dtype=dtype, device=device)
        dkdv_launch(q1, q2, k1, k2, v, dout, lse, grad_delta, dk, dk, dv)
        dq_launch(q1, q2, k1, k2, v, dout, lse, grad_delta, dq, dq)
        return dq, dk, dv

    return call


# --- the ops, registered with torch.library ---------------------------------------------------


@dataclass(frozen=True)
class OpPlan:
    """A custom op's real call, planned once per call signature (:func:`_op_plan`): the
    configuration it was planned under, the rotation operands (``None`` for the five-tensor
    form), and what its first calls decide and keep (:class:`PlanState`): ``state`` for the
    forward, ``backward_states`` for the backward per layout of ``out`` and ``lse``
    (:func:`_op_backward_state`)."""

    config: configs.Config
    operands: Optional[Operands]
    state: PlanState = field(default_factory=PlanState)
    backward_states: dict = field(default_factory=dict)


def _make_five_op_plan(config, window, causal, sm_scale):
    return OpPlan(config, None)


def _make_fused_op_plan(config, n_k, head_dim, device, window, causal, sm_scale, base, leaky,
                        logn_len, rotated, inv_freq, group):
    return OpPlan(config, _rotations(n_k, head_dim, base, window, leaky, logn_len, rotated,
                                     device, _op_frequencies(inv_freq), group))


def _op_plan(make, tensors, settings):
    """The :class:`_OpPlan` of a custom op's real call: a compiled graph (or anything else that
    calls ``torch.ops.rerope.*``) runs the ops' implementations, and from its second call with
    a signature (:func:`rerope.launch.signature` of ``tensors``, and the op's settings) each is
    a lookup plus the plan's kept, bound launches, as in eager mode. The ops' arguments come
    checked from the public functions, so no check runs here. ``make(config, *settings)`` for
    the five-tensor form, ``make(config, Nk, D, device, *settings)`` for the fused one, with
    the active :class:`rerope.Config` (part of the key)."""
    q, k = tensors[0], tensors[-1]
    config = configs.current()
    try:
        key = (make, signature(*tensors), _settings_key(settings), config)
        plan = PLANS.get(key)
    except (AttributeError, TypeError, RuntimeError):   # no data pointer, unhashable settings
        key, plan = None, None
    if plan is None:
        plan = (make(config, *settings) if make is _make_five_op_plan
                else make(config, k.shape[2], q.shape[-1], q.device, *settings))
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _op_backward_state(plan, out, lse):
    """The :class:`PlanState` of an op plan's backward: per layout of ``out`` and ``lse`` too
    (in eager mode they are the forward's own fresh outputs; an op's caller may pass any);
    ``None`` where they have no layout to key on (no data pointer)."""
    try:
        key = signature(out, lse)
    except (AttributeError, RuntimeError):
        return None
    state = plan.backward_states.get(key)
    if state is None:
        state = plan.backward_states[key] = PlanState()
    return state


# The ops are defined with the plain ``torch.library.Library`` API, not ``custom_op``: a
# compiled graph calls them on every step, and ``custom_op``'s Python layers around the
# implementation (its autograd kernel, redispatch, the aliasing check, a Dynamo-disabled
# wrapper) cost more host time than the implementation's own plan lookup and launch
# (perf/compile_graph.md, "host time per call"). The ops themselves are not differentiable
# (a fallthrough at the Autograd key: their outputs carry no gradient, at no cost per call);
# ``rerope`` and ``rerope_attention`` get their gradient, eagerly from the autograd Functions
# further down, compiled from the traced ``torch.autograd.Function``s below, which Dynamo
# records and AOTAutograd splits into the forward op and the backward op.
_LIB = torch.library.Library("rerope", "FRAGMENT")


def _define(schema, implementation, fake):
    """Define ``rerope::<schema>`` with one implementation for every device (the kernels' own
    device checks come from the public functions), a fake, and no gradient; returns the op's
    overload."""
    name = schema.split("(")[0]
    _LIB.define(schema)
    _LIB.impl(name, implementation, "CompositeExplicitAutograd")
    _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"rerope::{name}", fake, lib=_LIB)
    return getattr(torch.ops.rerope, name).default


def _five_fwd_impl(q1, q2, k1, k2, v, window, causal, sm_scale):
    plan = _op_plan(_make_five_op_plan, (q1, q2, k1, k2, v), (window, causal, sm_scale))
    return rerope_forward(q1, q2, k1, k2, v, window, causal, sm_scale, state=plan.state,
                          config=plan.config)


def _five_bwd_impl(dout, q1, q2, k1, k2, v, out, lse, window, causal, sm_scale):
    plan = _op_plan(_make_five_op_plan, (q1, q2, k1, k2, v), (window, causal, sm_scale))
    return list(rerope_backward(dout, q1, q2, k1, k2, v, out, lse, window, causal,
                                sm_scale, state=_op_backward_state(plan, out, lse),
                                config=plan.config))


def _op_frequencies(inv_freq):
    """The custom ops take ``inv_freq`` as a list of floats (checked by their caller)."""
    return None if inv_freq is None else Frequencies(inv_freq)


def _fused_op_settings(window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq,
                       group):
    return (window, causal, sm_scale, base, leaky, logn_len, rotated,
            None if inv_freq is None else tuple(inv_freq), group)   # a list cannot be a key


def _fused_fwd_impl(q, k, v, window, causal, sm_scale, base, leaky, logn_len, rotated,
                    inv_freq=None, group=None):
    plan = _op_plan(_make_fused_op_plan, (q, k, v), _fused_op_settings(
        window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq, group))
    return rerope_forward(q, q, k, k, v, window, causal, sm_scale, plan.operands,
                          state=plan.state, config=plan.config)


def _fused_bwd_impl(dout, q, k, v, out, lse, window, causal, sm_scale, base, leaky, logn_len,
                    rotated, inv_freq=None, group=None):
    plan = _op_plan(_make_fused_op_plan, (q, k, v), _fused_op_settings(
        window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq, group))
    return list(rerope_backward(dout, q, q, k, k, v, out, lse, window, causal,
                                sm_scale, plan.operands,
                                state=_op_backward_state(plan, out, lse),
                                config=plan.config))


def _contiguous_like(t):
    """What the kernels return for an output or a gradient: a fresh contiguous tensor of ``t``'s
    shape (not ``empty_like``, which copies ``t``'s strides: a fused-QKV view's would be
    wrong)."""
    return t.new_empty(t.shape)


def _fake_fwd(q, *args, **kwargs):
    b, h, n, _ = q.shape
    return _contiguous_like(q), q.new_empty((b * h, n), dtype=torch.float32)


def _fake_bwd(dout, *args, **kwargs):
    """The gradients of the op's input tensors (those before ``out``: ``dout`` and its
    forward's inputs, then ``out, lse``)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)][:-2]
    return [_contiguous_like(t) for t in tensors]


_FIVE_TAIL = "SymInt window, bool causal, float sm_scale"
_FUSED_TAIL = (_FIVE_TAIL + ", float base, float? leaky, float? logn_len, bool rotated, "
               "float[]? inv_freq=None, SymInt? group=None")
_five_fwd = _define("rerope_attention_fwd(Tensor q1, Tensor q2, Tensor k1, Tensor k2, "
                    f"Tensor v, {_FIVE_TAIL}) -> (Tensor, Tensor)", _five_fwd_impl, _fake_fwd)
_five_bwd = _define("rerope_attention_bwd(Tensor dout, Tensor q1, Tensor q2, Tensor k1, "
                    f"Tensor k2, Tensor v, Tensor out, Tensor lse, {_FIVE_TAIL}) -> Tensor[]",
                    _five_bwd_impl, _fake_bwd)
_fused_fwd = _define(f"rerope_fwd(Tensor q, Tensor k, Tensor v, {_FUSED_TAIL}) -> "
                     "(Tensor, Tensor)", _fused_fwd_impl, _fake_fwd)
_fused_bwd = _define("rerope_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                     f"Tensor lse, {_FUSED_TAIL}) -> Tensor[]", _fused_bwd_impl, _fake_bwd)


def _traced_forward(ctx, forward_op, settings, tensors):
    """The forward of a traced Function (:class:`_TracedFused`, :class:`_TracedFive`): the
    forward op, and what its backward op needs saved (``lse`` has no gradient)."""
    out, lse = forward_op(*tensors, *settings)
    ctx.save_for_backward(*tensors, out, lse)
    ctx.settings = settings
    ctx.mark_non_differentiable(lse)
    return out, lse


class _TracedFused(torch.autograd.Function):
    """What a compiled graph records for ``rerope``: the forward op on ``q, k, v``, and the
    backward op as their gradient. Dynamo traces the Function and AOTAutograd splits it: the
    compiled forward calls ``rerope::rerope_fwd``, the compiled backward ``rerope::rerope_bwd``;
    nothing of the Function runs per step. ``settings``: the ops' arguments after the
    tensors."""

    @staticmethod
    def forward(ctx, settings, q, k, v):
        return _traced_forward(ctx, _fused_fwd, settings, (q, k, v))

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (None, *_fused_bwd(dout, *ctx.saved_tensors, *ctx.settings))


class _TracedFive(torch.autograd.Function):
    """:class:`_TracedFused` for ``rerope_attention`` (``rerope::rerope_attention_fwd`` and
    ``_bwd``)."""

    @staticmethod
    def forward(ctx, settings, q1, q2, k1, k2, v):
        return _traced_forward(ctx, _five_fwd, settings, (q1, q2, k1, k2, v))

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (None, *_five_bwd(dout, *ctx.saved_tensors, *ctx.settings))


def _first_order_only(backward):
    """Run a backward without building a graph; where a graph was asked for
    (``create_graph=True``: a gradient penalty, say), return gradients whose own backward
    raises.

    ``torch.autograd.function.once_differentiable`` does this only when the upstream gradient
    requires grad; when it does not (``(g ** 2).sum()`` of ``g = grad(out.sum(), q,
    create_graph=True)``), it returns detached gradients and the penalty's gradient is silently
    dropped. Here the error is attached whenever grad mode is on.
    """
    def wrapper(ctx, *grad_outputs):
        if not torch.is_grad_enabled():       # the usual backward (no create_graph)
            return backward(ctx, *grad_outputs)
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        error = torch._C._functions.DelayedError(
            b"kernels: the ReRoPE backward is not differentiable (no double backward, e.g. "
            b"for gradient penalties); use rerope.reference for higher-order gradients",
            len(grads))
        tensors = [g.detach().requires_grad_() if g is not None else None for g in grads]
        return error(*tensors)

    return wrapper


class _FiveTensorAttention(torch.autograd.Function):
    """Eager autograd for the five-tensor op (see the module docstring); ``plan``: the call's
    :class:`FivePlan` (settings, configuration and kept state)."""

    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, plan, return_lse=False):
        out, lse = rerope_forward(q1, q2, k1, k2, v, plan.window, plan.causal, plan.scale,
                                  state=plan.state, config=plan.config)
        ctx.save_for_backward(q1, q2, k1, k2, v, out, lse)
        ctx.plan = plan
        return _with_lse(ctx, out, lse, return_lse)

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, *_lse_grad):
        *tensors, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grads = rerope_backward(dout, *tensors, out, lse, plan.window, plan.causal, plan.scale,
                                state=plan.state, config=plan.config)
        return (*grads, None, None)


class _FusedAttention(torch.autograd.Function):
    """Eager autograd for the fused-rotation op (see the module docstring); ``plan``: the
    call's :class:`FusedPlan` (settings, configuration, operands and kept state)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, return_lse=False):
        out, lse = rerope_forward(q, q, k, k, v, plan.window, plan.causal, plan.scale,
                                  plan.operands, state=plan.state, config=plan.config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return _with_lse(ctx, out, lse, return_lse)

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, *_lse_grad):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grads = rerope_backward(dout, q, q, k, k, v, out, lse, plan.window, plan.causal,
                                plan.scale, plan.operands, state=plan.state,
                                config=plan.config)
        return (*grads, None, None)


def _lse_of(out, lse2):
    """The public log-sum-exp: natural-log units (:func:`rerope.online_softmax.natural_lse`),
    ``(B, Hq, Nq)`` from the kernels' ``(B·Hq, Nq)`` log2 one."""
    return natural_lse(lse2).view(out.shape[:3])


def _with_lse(ctx, out, lse2, return_lse):
    """An autograd Function's result: ``out``, or ``(out, lse)`` with ``lse`` marked not
    differentiable (its gradient is never formed: the backward ignores it)."""
    if not return_lse:
        return out
    lse = _lse_of(out, lse2)
    ctx.mark_non_differentiable(lse)
    return out, lse


def _direct_apply(function):
    """``function.apply`` without its Python wrapper, where that wrapper does nothing for our
    calls: it binds default arguments (only for a ``setup_context`` function, which ours are
    not) and unwraps functorch's dead wrappers before calling the C++ ``apply`` (a few µs per
    call on the H200's host). Under functorch transforms (``torch.func``) it takes the
    wrapper's path; where this torch has no such C++ method, it is ``function.apply``."""
    try:
        c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
        transforms_active = torch._C._are_functorch_transforms_active
    except (AttributeError, KeyError, TypeError):
        return function.apply

    def apply(*args):
        if transforms_active():
            return function.apply(*args)
        return c_apply(*args)

    return apply


_apply_five, _apply_fused = _direct_apply(_FiveTensorAttention), _direct_apply(_FusedAttention)


# --- the public ops: checked and planned once per call signature ------------------------------

PLANS = PlanCache()
"""The plans of ``rerope``, ``rerope_attention`` and their ``torch.library`` ops (a
:class:`rerope.launch.PlanCache`: ``len(PLANS)``, ``PLANS.built``, ``PLANS.clear()``)."""


def plan_launchers(plan):
    """Every :class:`rerope.launch.Launcher` a plan of :data:`PLANS` keeps: its forward's and
    backward's (:meth:`PlanState.kept_launchers`; an op plan's backward's per layout of ``out``
    and ``lse`` too)."""
    states = [plan.state, *getattr(plan, "backward_states", {}).values()]
    return [launcher for state in states for launcher in state.kept_launchers()]


def _settings_key(settings):
    """A tuple of settings as a cache key: with their types, so that ``1``, ``1.0`` and
    ``True`` (which hash alike) never share a plan that checked only one of them."""
    return settings, tuple(map(type, settings))


def _needs_grad(*tensors):
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return True
    return False


def _cached_plan(make, tensors, settings, compiling=False):
    """The plan of a call: from :data:`PLANS` when this signature was seen under the active
    :class:`rerope.Config`, else ``make(config, *tensors, *settings)`` (which checks every
    argument and raises on bad ones), stored. Arguments that cannot form a key (not tensors,
    unhashable settings) always go to ``make``, whose checks then say what is wrong; so does
    tracing under ``torch.compile`` (the compiled graph keeps the result, and fake tensors have
    no data pointer): ``compiling``, the caller's ``torch.compiler.is_compiling()``. Such a
    traced plan has no ``config``: its graph calls the ``torch.library`` ops, which plan their
    launches when they run (:func:`_op_plan`; the compiler cannot trace a ``ContextVar``)."""
    if compiling:
        return make(None, *tensors, *settings)
    config = configs.current()
    try:
        key = (make, signature(*tensors), _settings_key(settings), _needs_grad(*tensors),
               config)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):
        return make(config, *tensors, *settings)
    return plan if plan is not None else PLANS.put(key, make(config, *tensors, *settings))


@dataclass(frozen=True)
class FivePlan:
    """A checked ``rerope.rerope_attention`` call: its settings, the configuration it was
    planned under, and what its first calls decide and keep (``state``, a
    :class:`PlanState`: decisions, bound launches)."""

    config: Optional[configs.Config]      # None when traced by torch.compile
    window: int         # at most N: any window >= N means the same
    causal: bool
    scale: float
    grad: bool          # whether the call needs a gradient (part of the plan's key)
    lift: bool          # bf16 under the interpreter: computed in fp32 (rerope.runtime)
    state: Optional[PlanState] = None     # None when traced (see _plan_state)


def _plan_state(config):
    """A new plan's :class:`PlanState`; ``None`` for a plan traced by ``torch.compile``
    (``config`` ``None``), whose graph calls the ops, which keep their own (:class:`OpPlan`):
    the compiler cannot trace building one."""
    return None if config is None else PlanState()


def _plan_five(config, q1, q2, k1, k2, v, window, causal, sm_scale):
    check_qkv({"q1": q1, "q2": q2}, {"k1": k1, "k2": k2, "v": v})
    check_head_dim(q1.shape[-1])
    check_window(window)
    check_flag("causal", causal)
    check_sm_scale(sm_scale)
    scale = q1.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    # the kernels' int32 index arithmetic never sees a huge window
    return FivePlan(config, min(int(window), q1.shape[2]), causal, scale,
                    _needs_grad(q1, q2, k1, k2, v), _lifted(q1), _plan_state(config))


def rerope_attention(q1, q2, k1, k2, v, window, causal=True, sm_scale=None, return_lse=False):
    """Fused ReRoPE attention from the five tensors of :func:`rerope.rope.rerope_inputs`;
    differentiable in all five.

    Score ``(i, j)`` is ``sm_scale · q1_i · k1_j`` where ``|i − j| < window``, else
    ``sm_scale · q2_i · k2_j``; with ``causal`` keys ``j > i`` are masked; softmax over ``j``;
    times ``v``. Queries and keys share the positions ``0 … N - 1`` (one length ``N``; for
    fewer queries than keys, use :func:`rerope`).

    Grouped-query and multi-query attention: ``k1, k2, v`` may have fewer heads than ``q1,
    q2`` (``Hq`` a multiple of ``Hkv``); query head ``h`` attends key/value head
    ``h // (Hq / Hkv)``, by indexing: K/V are never repeated in memory.

    Args:
        q1: ``(B, Hq, N, D)``, the queries of the product inside the window (ReRoPE: RoPE at
            their positions ``i``); fp16, bf16 or fp32, ``D`` in 16, 32, 64, 128, 256.
        q2: ``(B, Hq, N, D)``, the queries of the product outside the window (ReRoPE: RoPE at
            ``window``), ``q1``'s dtype and device.
        k1: ``(B, Hkv, N, D)``, the keys inside the window (ReRoPE: RoPE at their positions
            ``j``), ``q1``'s dtype and device.
        k2: ``(B, Hkv, N, D)``, the keys outside the window (ReRoPE: not rotated), ``q1``'s
            dtype and device.
        v: ``(B, Hkv, N, D)``, the values, ``q1``'s dtype and device.
        window: int ``>= 1``; ``window >= N`` gives plain RoPE attention (``q2, k2`` unread).
        causal: bool, mask keys after the query (``j > i``).
        sm_scale: float, the score scale; ``1/sqrt(D)`` when ``None``. Between about
            1.2e-38 and 1.1e26 (``ValueError`` otherwise: the scaled fp32 scores must
            stay finite; :func:`rerope._validate.check_sm_scale`).
        return_lse: bool; also return the log-sum-exp of each row's scaled scores.

    Returns:
        ``(B, Hq, N, D)``, the attention output, in the inputs' dtype and on their device;
        differentiable in ``q1, q2, k1, k2, v``. With ``return_lse``, ``(out, lse)``:
        ``lse`` ``(B, Hq, N)`` float32, ``log Σ_j exp(s_ij)`` over the row's unmasked scaled
        scores (natural log, as FlashAttention's), not differentiable.

    Any ``N >= 1``; any strides. fp32 runs its dot products as 3xTF32 (near-fp32 accuracy).
    CUDA tensors, or CPU tensors under Triton's CPU interpreter (:mod:`rerope.runtime`).
    Arguments out of range raise ``TypeError`` or ``ValueError`` naming the argument.

    Threads and non-finite inputs: as :func:`rerope.rerope` says.
    """
    check_flag("return_lse", return_lse)
    tensors, settings = (q1, q2, k1, k2, v), (window, causal, sm_scale)
    compiling = torch.compiler.is_compiling()
    plan = _cached_plan(_plan_five, tensors, settings, compiling)
    if compiling:
        (q1, q2, k1, k2, v), restore = prepare_for_device(*tensors)
        out, lse = _TracedFive.apply((plan.window, plan.causal, plan.scale), q1, q2, k1, k2, v)
        return (restore(out), _lse_of(out, lse)) if return_lse else restore(out)
    dtype = q1.dtype
    if plan.lift:
        q1, q2, k1, k2, v = (t.float() for t in tensors)
    if plan.grad:
        result = _apply_five(q1, q2, k1, k2, v, plan, return_lse)
    else:                               # no gradient: no autograd node either
        out, lse = rerope_forward(q1, q2, k1, k2, v, plan.window, plan.causal, plan.scale,
                                  state=plan.state, config=plan.config)
        result = (out, _lse_of(out, lse)) if return_lse else out
    return _lowered(result, dtype, plan.lift)


def _lowered(result, dtype, lift):
    """``out`` or ``(out, lse)`` with ``out`` back in the caller's dtype where the call ran
    on fp32 copies (``lift``); the log-sum-exp stays float32."""
    if not lift:
        return result
    if isinstance(result, tuple):
        return result[0].to(dtype), result[1]
    return result.to(dtype)


@dataclass(frozen=True)
class FusedPlan:
    """A checked ``rerope.rerope`` call: its settings, the configuration it was planned under,
    its rotation operands (tables and flags) and what its first calls decide and keep
    (``state``, a :class:`PlanState`: decisions, kept calls, bound launches)."""

    config: Optional[configs.Config]      # None when traced by torch.compile
    window: int         # at most Nk: any window >= Nk means the same
    causal: bool
    scale: float
    rope: tuple         # (base, leaky, logn_len, rotated, inv_freq, group), checked
    operands: Optional[Operands]          # None when traced (the op makes its own)
    grad: bool          # whether the call needs a gradient (part of the plan's key)
    lift: bool          # bf16 under the interpreter: computed in fp32 (rerope.runtime)
    state: Optional[PlanState] = None     # None when traced (see _plan_state)


def _plan_fused(config, q, k, v, window, causal, sm_scale, base, leaky, logn_len, rotated,
                inv_freq, group):
    check_qkv({"q": q}, {"k": k, "v": v}, fewer_queries=True)
    window, scale, rope, operands = fused_settings(
        q, k.shape[2], window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq,
        group, build_operands=config is not None)
    return FusedPlan(config, window, causal, scale, rope, operands, _needs_grad(q, k, v),
                     _lifted(q), _plan_state(config))


def fused_settings(q, n_k, window, causal, sm_scale, base, leaky, logn_len, rotated,
                   inv_freq, group, build_operands=True):
    """Check the settings of a fused-form call (``rerope``'s arguments after ``q, k, v``;
    ``q``: a query tensor, for its head dim, dtype and device, ``n_k``: the most keys a
    sequence has) and return ``(window, scale, rope, operands)``: the window clamped to
    ``n_k``, the score scale, the checked position settings ``(base, leaky, logn_len,
    rotated, inv_freq, group)`` and the :class:`Operands` (rotation tables with rows for
    ``n_k`` positions; None when ``build_operands`` is false). Shared by :func:`rerope` and
    :func:`rerope.rerope_varlen`."""
    check_head_dim(q.shape[-1])
    inv_freq = check_rope_settings(window, base, leaky, logn_len, rotated, inv_freq,
                                   q.shape[-1], group)
    check_logn_overflow(logn_len, n_k, q.dtype)
    check_flag("causal", causal)
    if group is not None and not causal:
        raise ValueError("group (Self-Extend) needs causal=True: its grouped positions are "
                         "defined for keys at or before the query only")
    check_sm_scale(sm_scale)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    window = min(int(window), n_k)     # as in rerope_attention: >= Nk means plain RoPE
    rope = (float(base), None if leaky is None else float(leaky),
            None if logn_len is None else float(logn_len), rotated, inv_freq,
            None if group is None else int(group))
    # traced (build_operands False): the graph calls the op, which finds its operands when it
    # runs (_op_plan); building them here would put the tables' arithmetic into the graph and
    # have Dynamo guard on (and replay writes to) the module's caches
    operands = None if not build_operands else _rotations(
        n_k, q.shape[-1], rope[0], window, *rope[1:4], q.device, inv_freq, rope[5])
    return window, scale, rope, operands


def _lifted(q):
    """Whether a call runs on fp32 copies (bf16 under the interpreter, see
    :func:`rerope.runtime.prepare_for_device`); raises ``ValueError`` for tensors on a device
    the kernels cannot run on here. Decided once per plan: its signature fixes dtype and
    device."""
    prepare_for_device(q[..., :0])
    return INTERPRET and q.dtype == torch.bfloat16


def _decode_step(q, k, v, causal):
    """Whether a ``rerope`` call is a decode step: causal, at most ``MAX_QUERIES`` queries,
    no gradient needed. Looked at before anything is checked: ``rerope_decode`` checks it."""
    return (causal is True and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor) and q.dim() == 4 and q.shape[2] <= MAX_QUERIES
            and not _needs_grad(q, k, v))


def rerope(q, k, v, window, causal=True, sm_scale=None, base=10000.0, leaky=None, logn_len=None,
           rotated=False, inv_freq=None, group=None, return_lse=False):
    """(Leaky) ReRoPE or Self-Extend attention from ``q, k, v`` as a model holds them, rotation
    in the kernels; differentiable in ``q, k, v``.

    Grouped-query and multi-query attention: ``k, v`` may have fewer heads than ``q`` (``Hq``
    a multiple of ``Hkv``); query head ``h`` attends key/value head ``h // (Hq / Hkv)`` (e.g.
    with 6 query heads and 2 key/value heads, heads 0, 1, 2 attend head 0). This is done by
    indexing: K/V are never repeated in memory.

    The queries are the last ``Nq`` of the ``Nk`` positions (``Nq <= Nk``: a whole sequence, or
    the last chunk of one in chunked prefill): query ``n`` sits at position
    ``i = Nk - Nq + n``, key ``j`` at ``j``, and every relative position ``i - j`` (and
    log-n's and Self-Extend's absolute positions) follows from that. With ``causal`` the mask
    is aligned to the bottom right corner of the score matrix: query ``n`` attends keys
    ``j <= Nk - Nq + n``. For ``Nq = 2``, ``Nk = 5`` (1 = attended, 0 = masked)::

        1 1 1 1 0
        1 1 1 1 1

    Args:
        q: ``(B, Hq, Nq, D)`` queries at positions ``Nk - Nq … Nk - 1``; fp16, bf16 or fp32,
            ``D`` in 16, 32, 64, 128, 256. Raw, or RoPE-rotated at those positions
            (``rotated``).
        k: ``(B, Hkv, Nk, D)`` keys at positions ``0 … Nk - 1``, ``Nk >= Nq``, ``q``'s dtype
            and device; raw or rotated like ``q``.
        v: ``(B, Hkv, Nk, D)`` values, ``q``'s dtype and device.
        window: int ``>= 1``: pairs closer than ``window`` get ordinary RoPE, the rest relative
            position ``window`` (ReRoPE), ``window + (i - j - window) / leaky`` (Leaky) or
            ``⌊i/group⌋ - ⌊j/group⌋ + window - window/group`` (Self-Extend). ``window >= Nk``
            gives plain RoPE attention.
        causal: bool, mask keys after the query (``j > i``, aligned as above). Without it,
            future keys beyond the window get position ``+window``, like the far past.
        sm_scale: float, the score scale; ``1/sqrt(D)`` when ``None``. Between about
            1.2e-38 and 1.1e26 (``ValueError`` otherwise: the scaled fp32 scores must
            stay finite; :func:`rerope._validate.check_sm_scale`).
        base: float ``> 1``, the RoPE base (Llama ``rotate_half`` convention: halves, not
            interleaved pairs).
        leaky: ``None`` for ReRoPE, or the Leaky ReRoPE factor, a float ``> 1``.
        logn_len: ``None``, or a training length ``> 1``: queries are scaled by
            ``max(1, log(i + 1) / log(logn_len))`` at their position ``i``.
        rotated: bool. ``False``: raw ``q, k``. ``True``: ``q, k`` already carry RoPE at their
            positions, as a Hugging Face model and its KV cache hold them.
        inv_freq: ``None`` (the frequencies ``base ** (-2t / D)``), or RoPE's ``D/2`` angular
            frequencies as a 1-D floating-point tensor ``(D/2,)`` (any device) or a sequence of
            positive finite floats: a model's own (Llama 3's ``llama3``, ``linear`` or YaRN
            scaling change only these). ``base`` must then stay at its default (``ValueError``
            otherwise). A tensor is read on every call (for a GPU tensor a host sync); a
            :class:`rerope.rope.Frequencies` built once skips every conversion. An attention
            factor (YaRN's ``attention_scaling``) is not applied here: it is in rotated inputs
            already.
        group: ``None``, or Self-Extend's group size ``G``, an int ``>= 1`` that divides
            ``window`` (``ValueError`` otherwise: the grouped query position
            ``⌊i/G⌋ + window − window/G`` of Jin et al. 2024 then is the same in prefill and
            decode); ``causal`` only; not with ``leaky``. ``G = 1`` is plain RoPE. Positions
            are absolute (``⌊i/G⌋`` depends on ``i`` itself, not only on ``i - j``): key ``j``
            of ``k`` sits at position ``j``. Same kernels and speed as ReRoPE: the grouped
            angles are rows of the rotation table (:mod:`rerope.rotary`).
        return_lse: bool; also return the log-sum-exp of each row's scaled scores (to merge
            partial attentions: chunked or cascade attention).

    Returns:
        ``(B, Hq, Nq, D)``, the attention output, in ``q``'s dtype and on its device;
        differentiable in ``q, k, v``. With ``return_lse``, ``(out, lse)``: ``lse`` ``(B, Hq,
        Nq)`` float32, ``log Σ_j exp(s_ij)`` over the row's unmasked scaled scores ``s_ij``
        (natural log, as FlashAttention's), not differentiable.

    Any strides. CUDA tensors, or CPU tensors under Triton's CPU interpreter
    (:mod:`rerope.runtime`). No rotated copy of ``q`` or ``k`` is ever written: each kernel
    rotates tiles in registers (:mod:`rerope.rotary`). Arguments out of range raise
    ``TypeError`` or ``ValueError`` naming the argument.

    A decode step — ``causal``, at most ``rerope.decode.MAX_QUERIES`` (16) queries, no gradient
    needed (grad mode off, or no input requires grad) — goes to the split-KV kernel of
    :func:`rerope.rerope_decode` (which checks and plans it), which spreads the keys over the
    whole GPU; the prefill kernels would give each query head a single program.

    Threads: the op may be called from several threads at once (its plans are shared safely,
    :mod:`rerope.launch`); under the CPU interpreter, which is not thread-safe, the package's
    launches run one at a time (``rerope.runtime.INTERPRETER_LOCK``); on a GPU nothing is
    serialised (calls on one stream run in its order). Non-finite inputs: an ``inf`` or ``NaN``
    in a row of ``v`` spreads within a tile: every query row of a tile that reads that key's
    tile comes out NaN, also rows that give the key no weight (masked by ``causal``), where the
    exact answer is finite (the kernels multiply whole tiles of probabilities by whole tiles of
    ``v``, and ``0 * inf`` is NaN).
    """
    check_flag("return_lse", return_lse)
    if _decode_step(q, k, v, causal):     # split-KV (chapter 8), checked and planned there
        try:
            return rerope_decode(q, k, v, window, sm_scale=sm_scale, base=base, leaky=leaky,
                                 logn_len=logn_len, rotated=rotated, inv_freq=inv_freq,
                                 group=group, return_lse=return_lse)
        except (TypeError, ValueError):   # a bad argument: say so in this function's words
            _plan_fused(None, q, k, v, window, causal, sm_scale, base, leaky, logn_len,
                        rotated, as_frequencies(inv_freq), group)
            raise
    inv_freq = as_frequencies(inv_freq)   # read per call (never by identity): D/2 floats
    tensors = (q, k, v)
    settings = (window, causal, sm_scale, base, leaky, logn_len, rotated, inv_freq, group)
    compiling = torch.compiler.is_compiling()
    plan = _cached_plan(_plan_fused, tensors, settings, compiling)
    if compiling:
        (q, k, v), restore = prepare_for_device(q, k, v)
        *rope, inv_freq, group = plan.rope
        settings = (plan.window, plan.causal, plan.scale, *rope,
                    None if inv_freq is None else list(inv_freq), group)
        out, lse = _TracedFused.apply(settings, q, k, v)
        return (restore(out), _lse_of(out, lse)) if return_lse else restore(out)
    dtype = q.dtype
    if plan.lift:
        q, k, v = q.float(), k.float(), v.float()
    if plan.grad:
        result = _apply_fused(q, k, v, plan, return_lse)
    else:                               # no gradient: no autograd node either
        out, lse = rerope_forward(q, q, k, k, v, plan.window, plan.causal, plan.scale,
                                  plan.operands, state=plan.state, config=plan.config)
        result = (out, _lse_of(out, lse)) if return_lse else out
    return _lowered(result, dtype, plan.lift)
