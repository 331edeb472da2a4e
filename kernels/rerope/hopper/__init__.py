"""The Gluon forward on Hopper: where it runs, and its host side.

On an sm_90 GPU (H100, H200) with **Triton 3.6**, the forward of :func:`rerope.rerope_attention`
and of :func:`rerope.rerope` runs the warp-specialised Gluon kernels of
:mod:`rerope.hopper.kernels` instead of the Triton one wherever they apply (:func:`applies`):
causal, as many queries as keys, fp16/bf16, D 64 or 128, ``N`` a multiple of 128 and at least
:data:`MIN_KEYS`, contiguous ``(B, H, N, D)`` tensors. ``rerope`` (raw or rotated ``q, k``,
Leaky ReRoPE, log-n, Self-Extend) first turns each product's keys once
(:func:`rerope.rotary.turn_operands`, the pre-turned backward's pass), and the kernel turns the
queries, once per query tile as it loads them (:func:`query_turn`, ``Q_TURN``); with
``rerope.Config.gluon_turn_queries`` off the pass turns both and the five-tensor kernel runs.
Everywhere else, and with ``REROPE_GLUON=0`` (``rerope.using_config(gluon=False)``), the Triton
kernels run, as they always did. Its output and log-sum-exp are the Triton forward's (same math,
same units), so the backward is unchanged.

Gluon's API changed in every Triton release from 3.4 to 3.8; the kernels are written for 3.6's
(``gl.warp_specialize(functions_and_args, worker_num_warps, worker_num_regs)``,
``warpgroup_mma``, host ``TensorDescriptor``). :func:`available` checks once per process that
the installed Triton is a 3.6 release and that the module imports; with any other Triton the
kernels are never imported.
"""

import functools

import torch
import triton

from ..online_softmax import LOG2E
from ..runtime import INTERPRET

TRITON_SERIES = (3, 6)
"""The Triton release series whose Gluon API the kernels are written for."""

# (BLOCK_M, BLOCK_N, STAGES, CONSUMER_WARPS, SPLIT, PIPE, WALK, PINGPONG) per head dim: what
# measured best on Hopper (perf/NOTES.md v19-v21). WALK 2 is the lean walk
# (rerope_fwd_lean_kernel), 1 the band-twice walk in one loop (rerope_fwd_twice_pp_kernel).
CONFIGS = {64: (192, 128, 2, 4, 3, 0, 2, 0), 128: (128, 128, 2, 4, 2, 1, 1, 0)}
# From how many keys on the Gluon forward runs, per head dim (rerope.Config.gluon_min_keys
# overrides): below, it is no faster than the Triton forward. Measured on an H100 with the
# launch bound (book/data/gluon_h100.json, cuDNN / ReRoPE): D64 at 4k keys 0.84 both ways, at
# 8k 0.92-0.95 against 0.79-0.82; D128 at 2k 0.74-0.87 against 0.46-0.70, at 1k slower.
MIN_KEYS = {64: 8192, 128: 2048}
ROWS = 128
"""``N`` must be a multiple of this: no key tile or 64-row query tile straddles two heads."""


def _series(version):
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"3.6.0+git1234"``."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def available():
    """``(ok, why)``: whether the installed Triton has the Gluon API the kernels are written for
    (checked once per process; ``why`` says what is missing)."""
    series = _series(triton.__version__)
    if series != TRITON_SERIES:
        return False, (f"Triton {triton.__version__}: the Gluon forward is written for Triton "
                       f"{'.'.join(map(str, TRITON_SERIES))}.x")
    try:
        from . import kernels  # noqa: F401
    except Exception as error:    # an API that moved: any import error means "not here"
        return False, f"rerope.hopper.kernels does not import: {type(error).__name__}: {error}"
    return True, f"Triton {triton.__version__}"


def _device_is_hopper(device):
    return (device.type == "cuda" and not INTERPRET
            and torch.cuda.get_device_capability(device) == (9, 0))


def applies(q1, q2, k1, k2, v, causal, config):
    """Whether the Gluon forward runs this ``rerope_attention`` call, or this ``rerope`` call
    (``q1 is q2`` its ``q``, ``k1 is k2`` its ``k``), its arguments checked already; ``config``
    the active :class:`rerope.Config`. Decided once per plan."""
    if not (config.gluon and causal and _device_is_hopper(q1.device)):
        return False
    batch, heads, n, head_dim = q1.shape
    if q1.dtype not in (torch.float16, torch.bfloat16) or head_dim not in CONFIGS:
        return False
    min_keys = MIN_KEYS[head_dim] if config.gluon_min_keys is None else config.gluon_min_keys
    if (n % ROWS or n < min_keys or k1.shape[2] != n or not q1.numel()
            or batch * heads * n >= 2**31):  # TMA coordinates and row offsets are int32
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q1, q2, k1, k2, v)):
        return False
    return available()[0]


class Forward:
    """The Gluon forward of one plan (a ``rerope_attention`` call signature, whose shapes,
    dtype, window and scale it fixes): the kernel, its grid, constexprs and shared-memory
    layouts chosen once, and its launch bound after the first call
    (:class:`rerope.launch.Launcher`), so a call builds six tensor descriptors, allocates its
    outputs and launches. Calling it returns ``(out, lse)`` as
    :func:`rerope.attention.rerope_forward` does (``out`` ``(B, Hq, N, D)``; ``lse``
    ``(B·Hq, N)`` float32 in log2 units).

    Args:
        q1, q2: ``(B, Hq, N, D)`` contiguous, fp16 or bf16, on an sm_90 GPU (what
            :func:`applies` accepts).
        k1, k2, v: ``(B, Hkv, N, D)``, the same; ``Hq`` a multiple of ``Hkv``.
        window: int ``>= 1`` (at most ``N``: any larger window means the same).
        sm_scale: float, the score scale.
        head_config: the launch configuration (``CONFIGS[D]`` when ``None``).
        q_turn: ``None`` (``q1, q2`` are the two products' queries), or ``(flags, args)``:
            ``rerope``'s queries, turned in the kernel (:func:`query_turn`); a call then
            passes ``q`` as both ``q1`` and ``q2``.
    """

    def __init__(self, q1, k1, window, sm_scale, head_config=None, q_turn=None):
        from ..launch import Launcher
        from . import kernels

        batch, heads, n, head_dim = q1.shape
        block_m, block_n, stages, warps, split, pipe, walk, pingpong = (
            head_config or CONFIGS[head_dim])
        dtype = kernels._gl_dtype(q1.dtype)
        self.q_block = [block_m // split, head_dim]
        self.kv_block = [block_n, head_dim]
        self.q_layout = kernels.smem_layout(self.q_block, dtype)
        self.kv_layout = kernels.smem_layout(self.kv_block, dtype)
        self.lse_shape = (batch * heads, n)
        self.scalars = (n, min(int(window), n), sm_scale * LOG2E, heads // k1.shape[1])
        self.q_turn = None if q_turn is None else q_turn[1]
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=head_dim, STAGES=stages,
                          CONSUMER_WARPS=warps, STORE_LSE=True, SPLIT=split,
                          Q_TURN=None if q_turn is None else q_turn[0])
        if walk == 2:
            kernel = kernels.rerope_fwd_lean_kernel
        else:
            kernel = kernels.rerope_fwd_twice_pp_kernel
            constexprs.update(PIPE=pipe, PINGPONG=pingpong)
        self.launcher = Launcher(kernel, (triton.cdiv(n, block_m), batch * heads),
                                 num_warps=warps, **constexprs)

    def __call__(self, q1, q2, k1, k2, v):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        out = torch.empty_like(q1)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q1.device)
        d = q1.shape[-1]

        def query(t):
            return TensorDescriptor(t, (t.numel() // d, d), (d, 1), self.q_block, self.q_layout)

        q1_desc = query(q1)
        q2_desc = q1_desc if self.q_turn is not None else query(q2)   # q_turn: q2 is q1
        keys = [TensorDescriptor(t, (t.numel() // d, d), (d, 1), self.kv_block, self.kv_layout)
                for t in (k1, k2, v)]
        with torch.cuda.device(q1.device):
            self.launcher(q1_desc, q2_desc, *keys, query(out), lse, *self.scalars, self.q_turn)
        lse.mul_(LOG2E)        # the kernels store natural logs; the backward reads log2
        return out, lse


def plan(q1, q2, k1, k2, v, window, causal, sm_scale, config, q_turn=None):
    """The :class:`Forward` of a ``rerope_attention`` call (or, with ``q_turn``, a ``rerope``
    call whose queries the kernel turns) where :func:`applies` says the Gluon forward runs it,
    else ``False``: decided once per plan."""
    if not applies(q1, q2, k1, k2, v, causal, config):
        return False
    return Forward(q1, k1, window, sm_scale, q_turn=q_turn)


def query_turn(inside, outside, logn_factor=0.0):
    """:class:`Forward`'s ``q_turn`` for ``rerope``'s queries (as many as keys, so query row
    ``r`` sits at position ``r``): each product's ``(table, offset, turn, shift)`` as
    :func:`rerope.rotary.turn_operands` takes them (``outside``: ``None`` where no pair is
    ``window`` apart, its operand then never read) and the log-n factor (0: off). The kernel
    does :func:`rerope.rotary.turn_operands`' arithmetic on each query tile it loads, so
    ``rerope`` turns only the keys in a pass of their own."""
    outside = outside or (inside[0], inside[1], False, False)
    flags = (tuple(inside[2:]), tuple(outside[2:]), logn_factor != 0.0)
    return flags, (inside[0], inside[1], outside[0], outside[1], float(logn_factor))


def source(name):
    """The source text of ``name``, a top-level function of :mod:`rerope.hopper.kernels`, read
    from its file: the module itself imports only under the Triton it is written for, and the
    book prints its kernels everywhere.

    Args:
        name: str, e.g. ``"rerope_fwd_lean_kernel"``.

    Returns:
        str, the function's source with its decorator, as in the file.
    """
    import ast
    from pathlib import Path

    text = (Path(__file__).parent / "kernels.py").read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            return "\n".join(text.splitlines()[start - 1:node.end_lineno]) + "\n"
    raise ValueError(f"rerope.hopper.kernels has no top-level function {name!r}")
