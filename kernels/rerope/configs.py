"""Launch configurations: block sizes, warps and pipeline stages per kernel and GPU.

On a GPU each kernel is autotuned over the candidates below that fit the GPU's shared memory
(:func:`launch_configs`); under the CPU interpreter one small fixed configuration is used
(``INTERPRETER_CONFIG``: small blocks, so that short test sequences still cross every region).
``tests/test_compile.py`` compiles every configuration for sm_75, sm_80, sm_89 and sm_90 and
checks the shared memory the compiler reports against the estimate used for pruning.

The package's environment variables are read here, once, at import, into one frozen
:class:`Config` (``rerope.config()``; change it for a block with ``rerope.using_config``); a
bad value fails ``import rerope`` with a ``ValueError`` that names the variable, the value
found and the values accepted. Every plan is made for, and keyed by, the active ``Config``.
"""

import contextlib
import contextvars
import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import triton

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BOOLEANS = "0/1, true/false, yes/no, on/off"


def _bad(name, value, accepted):
    return ValueError(f"environment variable {name}={value!r} is not valid: accepted values "
                      f"are {accepted}")


def _switch(name, value, default, extra=()):
    """A boolean (``_BOOLEANS``, any case) or one of the words ``extra``; unset or empty:
    ``default``. Returns True, False or the word."""
    word = (value or "").strip().lower()
    if not word:
        return default
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    if word in extra:
        return word
    raise _bad(name, value, " or ".join([_BOOLEANS, *extra]) + " (any case)")


def _byte_count(name, value):
    """A whole number of bytes >= 0, written ``2147483648``, ``2_000_000_000`` or ``2e9``;
    unset or empty: ``None``."""
    text = (value or "").strip()
    if not text:
        return None
    try:
        number = float(text.replace("_", ""))
    except ValueError:
        number = -1.0
    if not (0 <= number < 2**63 and number == int(number)):
        raise _bad(name, value, "a whole number of bytes >= 0 (e.g. 2147483648 or 2e9)")
    return int(number)


def _decode_config(name, value):
    """Four positive integers ``BLOCK_N,num_warps,num_stages,programs per SM``
    (``BLOCK_N`` >= 16 and ``num_warps`` powers of two); unset or empty: ``None``."""
    text = (value or "").strip()
    if not text:
        return None
    accepted = ("four integers BLOCK_N,num_warps,num_stages,programs_per_SM, e.g. "
                "64,4,3,2 (BLOCK_N >= 16 and num_warps powers of two, the others >= 1)")
    try:
        fields = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise _bad(name, value, accepted) from None
    if len(fields) != 4:
        raise _bad(name, value, accepted)
    block_n, warps, stages, per_sm = fields
    power_of_two = lambda n: n > 0 and n & (n - 1) == 0    # noqa: E731
    if not (block_n >= 16 and power_of_two(block_n) and power_of_two(warps)
            and stages >= 1 and per_sm >= 1):
        raise _bad(name, value, accepted)
    return fields


VARIABLES = ("REROPE_AUTOTUNE", "REROPE_TMA", "REROPE_DECODE_CONFIG",
             "REROPE_PRETURN_BWD_MAX_BYTES", "REROPE_GLUON")
# Variables of earlier versions: set, they warn that they are no longer read.
RETIRED = {"REROPE_FUSED_MERGE": "the decode merge is always its own launch"}


@dataclass(frozen=True)
class Config:
    """The package's configuration: one frozen value, read from the environment once.

    Every plan is made for one ``Config`` and keyed by it, so a change takes effect at the next
    call, never half-way through one. Change it for a block of code with :func:`using`
    (``rerope.using_config``); read the active one with :func:`current` (``rerope.config``).

    Environment variables (read at import; a bad value fails ``import rerope`` with a
    ``ValueError`` naming the variable, the value found and the values accepted):

    * ``autotune`` (``REROPE_AUTOTUNE``, a boolean, default on): autotune each kernel over its
      candidates on a GPU; off, the first fitting candidate only (one compilation per kernel).
    * ``tma`` (``REROPE_TMA``: ``auto``, the default, or a boolean): ``"auto"`` uses tensor
      descriptors where they are known to pay (Hopper or newer, fp16/bf16, D <= 128, a layout
      TMA accepts); ``"on"`` wherever the layout allows (also under the interpreter: the tests
      run both load paths on CPU); ``"off"`` never.
    * ``decode_config`` (``REROPE_DECODE_CONFIG``, unset by default): ``(BLOCK_N,
      num_warps, num_stages, programs_per_SM)`` for the decode kernel (under the
      interpreter its ``BLOCK_N``), or None.
    * ``preturn_bwd_max_bytes`` (``REROPE_PRETURN_BWD_MAX_BYTES``, unset by default): the most
      extra bytes the pre-turned backward may spend, or None (a sixteenth of the GPU's memory).
    * ``gluon`` (``REROPE_GLUON``, a boolean, default on): on an sm_90 GPU with Triton 3.6, run
      the forward of ``rerope_attention`` and ``rerope`` with the warp-specialised Gluon kernels
      where they apply (:mod:`rerope.hopper`); off, the Triton kernels everywhere.

    The thresholds below have no environment variable; they were measured on an H200
    (``perf/NOTES.md``) and are fields so that tests and measurements can move them:

    * ``preturn_min_keys``: from this many keys on, the forward pre-turns the keys.
    * ``preturn_bwd_min_keys``: from this many keys on, the backward pre-turns its operands.
    * ``heads_first_max_keys``: up to this many keys, the kernels' grids put heads first.
    * ``gluon_min_keys``: the Gluon forward runs from this many keys on; ``None``: per head dim,
      as measured (:data:`rerope.hopper.MIN_KEYS`: below, it is no faster than Triton).
    * ``gluon_turn_queries`` (default on): ``rerope``'s Gluon forward turns the queries in the
      kernel (``rerope.hopper.query_turn``) instead of writing turned copies of ``q`` first
      (0.3–2 % faster at 8k on an H100, ``perf/NOTES.md`` v23); off: both by a pass.

    Booleans are ``0/1, true/false, yes/no, on/off`` in any case; an empty value counts as
    unset. Changing the environment after ``import rerope`` changes nothing.
    """
    autotune: bool = True
    tma: str = "auto"
    decode_config: Optional[tuple] = None
    preturn_bwd_max_bytes: Optional[int] = None
    preturn_min_keys: int = 2048
    preturn_bwd_min_keys: int = 4096
    heads_first_max_keys: int = 4096
    gluon: bool = True
    gluon_min_keys: Optional[int] = None
    gluon_turn_queries: bool = True

    def __post_init__(self):
        if self.tma not in ("auto", "on", "off"):
            raise ValueError(f"Config.tma must be 'auto', 'on' or 'off', got {self.tma!r}")
        for name in ("gluon", "gluon_turn_queries"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("preturn_min_keys", "preturn_bwd_min_keys", "heads_first_max_keys",
                     "gluon_min_keys"):
            value = getattr(self, name)
            if name == "gluon_min_keys" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Config.{name} must be an int >= 0, got {value!r}")

    @classmethod
    def from_environment(cls, environ=os.environ):
        """Read and check the variables (``ValueError`` naming the first bad one)."""
        get = environ.get
        for name in environ:           # a misspelt name would otherwise be ignored silently
            if not name.startswith("REROPE_") or name in VARIABLES:
                continue
            if name in RETIRED:
                warnings.warn(f"environment variable {name} is no longer read by "
                              f"rerope: {RETIRED[name]}", stacklevel=2)
                continue
            near = difflib.get_close_matches(name, VARIABLES, 1, 0.85)
            if near:
                warnings.warn(f"environment variable {name} is not read by rerope: did you "
                              f"mean {near[0]}? (it reads {', '.join(VARIABLES)})",
                              stacklevel=2)
        tma = _switch("REROPE_TMA", get("REROPE_TMA"), "auto", ("auto",))
        return cls(
            autotune=_switch("REROPE_AUTOTUNE", get("REROPE_AUTOTUNE"), True),
            tma={True: "on", False: "off"}.get(tma, tma),
            decode_config=_decode_config("REROPE_DECODE_CONFIG", get("REROPE_DECODE_CONFIG")),
            preturn_bwd_max_bytes=_byte_count("REROPE_PRETURN_BWD_MAX_BYTES",
                                              get("REROPE_PRETURN_BWD_MAX_BYTES")),
            gluon=_switch("REROPE_GLUON", get("REROPE_GLUON"), True))


_CURRENT = contextvars.ContextVar("rerope_config", default=Config.from_environment())


def current():
    """The active :class:`Config` (``rerope.config()``)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(config=None, **changes):
    """Run a block of code under another configuration (``rerope.using_config``).

    Args:
        config: a :class:`Config` to start from (default: the active one).
        **changes: fields to replace, e.g. ``using(tma="off", autotune=False)``.

    Yields:
        the :class:`Config` in force inside the block. It is set for the current thread or
        task only (a :class:`contextvars.ContextVar`); plans made inside are keyed by it.
    """
    base = current() if config is None else config
    if not isinstance(base, Config):
        raise TypeError(f"config must be a rerope.Config, got {type(base).__name__}")
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise TypeError(f"using_config() got unknown field(s) {unknown}: Config has "
                        f"{[f.name for f in dataclasses.fields(Config)]}")
    token = _CURRENT.set(dataclasses.replace(base, **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def tma_pays(capability, elem_bytes, head_dim):
    """The hardware/dtype half of ``TMA="auto"``: a Hopper-or-newer GPU, 16-bit inputs, D <= 128
    (the launcher also needs a layout TMA accepts)."""
    return capability[0] >= 9 and elem_bytes == 2 and head_dim <= 128

# Largest dynamic shared memory one block may use (bytes), by compute capability.
SHARED_MEMORY = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}

# (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M is the query tile, BLOCK_N the key tile.
# First: the configuration that won most often where measured (perf/NOTES.md);
# used alone when REROPE_AUTOTUNE=0.
_CANDIDATES = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)],
        256: [(64, 64, 8, 2), (64, 32, 4, 2)],
    },
    # the pre-turned backward of rerope.rerope reads like the five tensors: these lists too
    "dkdv": {   # one program per key block of BLOCK_N, walking query tiles of BLOCK_M
        64: [(64, 64, 4, 3), (64, 64, 4, 2), (32, 128, 4, 3), (64, 128, 8, 3)],
        128: [(64, 64, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
        256: [(32, 64, 8, 2), (16, 32, 4, 2)],
    },
    "dq": {     # one program per query block of BLOCK_M, walking key tiles of BLOCK_N
        64: [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
        128: [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)],
        256: [(64, 32, 8, 2), (32, 16, 4, 2)],
    },
}
# The fused-rotation form where its best differs: it holds the rotation's operands in
# registers too, so at D=128 the backward prefers thinner tiles (perf/NOTES.md).
_FUSED_CANDIDATES = {
    "dkdv": {128: [(32, 64, 4, 3), (32, 64, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2)]},
    "dq": {128: [(64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)]},
}
# Where no candidate fits (small GPUs, fp32, D=256): the first of these that fits, else the
# last.
_FALLBACKS = [(32, 32, 4, 2), (16, 16, 4, 1)]

INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}
DELTA_BLOCK_M = 64


def _head_dim_class(head_dim):
    return 64 if head_dim <= 64 else head_dim


def estimate_shared_memory(kernel, block_m, block_n, num_stages, head_dim, elem_bytes=2,
                           fused=False):
    """A conservative estimate of a configuration's shared memory (bytes).

    Every pass streams two tiles per pipeline stage: ``k, v`` (``BLOCK_N × D``) in the forward
    and dQ kernels, ``q, dO`` (``BLOCK_M × D``) in dK/dV. The blocks a program keeps
    (``q1, q2``; ``q1, q2, dO``; ``k1, k2, v``), one fp32 score tile for layout conversions and
    a few KB for barriers come on top. The fused-rotation form (``fused``) rotates each streamed
    ``k`` (or ``q`` in dK/dV) tile in registers and stages the result for the tensor cores: one
    more tile.
    """
    streamed_rows = block_m if kernel == "dkdv" else block_n
    if kernel == "dkdv":
        streamed = num_stages * 2 * block_m * head_dim * elem_bytes
        resident = 3 * block_n * head_dim * elem_bytes
    else:
        streamed = num_stages * 2 * block_n * head_dim * elem_bytes
        resident = (3 if kernel == "dq" else 2) * block_m * head_dim * elem_bytes
    if fused:
        resident += streamed_rows * head_dim * elem_bytes
    scratch = block_m * block_n * 4 + 4096       # a score tile, barriers and alignment
    total = streamed + resident + scratch
    # fp32 runs its dots as 3xTF32, which stages split copies of the operands: measured up to
    # 1.10x the above in the compile test; budget 1.25x
    return int(total * 1.25) if elem_bytes == 4 else total


def candidate_configs(kernel, head_dim, fused=False):
    """All candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a kernel and head dim
    (of the five-tensor form, or the fused-rotation one: ``fused``)."""
    head_dim = _head_dim_class(head_dim)
    found = _FUSED_CANDIDATES.get(kernel, {}).get(head_dim) if fused else None
    return list(found or _CANDIDATES[kernel][head_dim])


def launch_configs(kernel, head_dim, capability, elem_bytes=2, fused=False, autotune=None):
    """The ``triton.Config`` list to autotune on a GPU of ``capability`` (e.g. ``(9, 0)``).

    Candidates whose estimated shared memory exceeds the GPU's are pruned; if none is left, the
    first fallback that fits is used (the compile test proves the choice fits every GPU). With
    ``autotune`` off (default: the active :class:`Config`'s, ``REROPE_AUTOTUNE``) only the first
    fitting candidate is returned: one compilation per kernel (quicker first calls).
    """
    if autotune is None:
        autotune = current().autotune
    major, minor = capability
    limit = SHARED_MEMORY.get(10 * major + minor,
                              SHARED_MEMORY[75] if major < 8 else SHARED_MEMORY[86])

    def fits(c):
        return estimate_shared_memory(kernel, c[0], c[1], c[3], head_dim, elem_bytes,
                                      fused) <= limit

    chosen = ([c for c in candidate_configs(kernel, head_dim, fused) if fits(c)]
              or [next((c for c in _FALLBACKS if fits(c)), _FALLBACKS[-1])])
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in (chosen if autotune else chosen[:1])]
