"""Shared test helpers: the tolerance table, seeded inputs, and kernel-vs-reference checks.

One source of truth for accuracy: :data:`TOLERANCES`. Every comparison of the fused kernel
against a reference (float64; float32 for the largest GPU case) goes through
:func:`close_problems`, which applies three criteria per tensor, all relative to the reference
so that outputs and gradients of any magnitude share one table:

* elementwise ``|actual - ref| <= atol * scale + rtol * |ref|``, where ``scale`` is the tensor's
  largest reference entry ``max|ref|`` (so ``atol`` is relative to the tensor's magnitude),
* ``||actual - ref|| / ||ref|| <= rel_norm`` (Frobenius norms),
* ``actual`` finite everywhere (no NaN/inf: unwritten or poisoned memory shows as NaN).

When several tensors of one case are compared (output and five gradients), ``scale`` is at
least ``FLOOR`` times the largest ``max|ref|`` among them: a gradient that is exactly zero in
the reference (``dq1`` when ``N = 1``: a softmax over one key has zero gradient) or tiny by
cancellation is judged at that level instead of demanding bit-exact zeros.

Tolerances were set from measured errors: at least 2x the worst case seen and about 10x the
median (see :data:`MEASURED`); they are tight enough that a swapped ``q1``/``q2`` or a window
off by one fails (``tests/test_attention.py::test_tolerances_catch_wrong_region``).

Inputs: every test draws fresh random inputs from its own ``torch.Generator`` seeded by the
test's node id (fixture ``gen``), so a failure reproduces exactly while cases differ. The seed
is part of every failure message.
"""

import contextlib
import json
import os
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

# The tests' own @triton.jit kernels (and the readers' kernels the exercise checkers run) are
# interpreted without CUDA too: the tests choose it for the whole process (rerope itself leaves
# os.environ alone, see rerope.runtime).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:   # first: rerope.runtime picks Triton's mode (interpreter without CUDA) before triton loads
    import rerope as _kernels  # noqa: F401
except Exception:  # a broken package is reported by the tests that use it, not here
    pass

# --- tolerances: the one table -------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    atol: float       # absolute, in units of max|reference| of the tensor compared
    rtol: float       # relative to |reference|, per element
    rel_norm: float   # ||actual - reference|| / ||reference||


# Keys: (where the kernel ran, dtype). "interpreter": Triton's CPU interpreter against a float64
# reference (bf16 is computed in fp32 there, so only input/output rounding shows). "gpu": the
# compiled kernels against a float64 (small shapes) or float32 (N = 8192) reference on the GPU;
# there bf16 really is bf16 (P and dS are rounded to bf16 before their products).
TOLERANCES = {
    ("interpreter", torch.float32): Tolerance(atol=2e-5, rtol=1e-5, rel_norm=2e-5),
    ("interpreter", torch.float16): Tolerance(atol=3e-3, rtol=3e-3, rel_norm=2e-3),
    ("interpreter", torch.bfloat16): Tolerance(atol=2e-2, rtol=2e-2, rel_norm=1e-2),
    ("gpu", torch.float32): Tolerance(atol=2e-5, rtol=1e-5, rel_norm=2e-5),
    ("gpu", torch.float16): Tolerance(atol=5e-3, rtol=5e-3, rel_norm=2e-3),
    ("gpu", torch.bfloat16): Tolerance(atol=3e-2, rtol=3e-2, rel_norm=1.5e-2),
}

# Where the table comes from: the largest error over every tensor (out, dq1, dq2, dk1, dk2, dv)
# of every case, as judged above ("scaled" = max|err| / scale). Interpreter: this suite's CPU
# cases with three seeds (KERNEL_TEST_SEED=0,1,2; KERNEL_ERROR_LOG, below); medians are 2e-7
# (fp32) and 3.5e-4 (fp16); the fp32 worst is the tiniest case (N = 2), where a gradient is a
# small difference of larger terms, the fp16 worst has sm_scale = 1 (large scores). H200: the
# N = 8192 cases of tests/test_gpu.py (perf/runs/gpu_tests.json); a torch emulation of the
# kernel's roundings (P and dS rounded to the input dtype before their products) predicted them
# (fp16 6e-4 / 3e-4, bf16 5e-3 / 3e-3) and shows no growth from N = 77 to N = 8192. The GPU
# fp32 row (3xTF32 dot products there) is not measured yet: same as the interpreter's for now.
MEASURED = {
    ("interpreter", torch.float32): {"scaled": 6.1e-6, "rel_norm": 4.6e-6},
    ("interpreter", torch.float16): {"scaled": 1.3e-3, "rel_norm": 8.5e-4},
    ("interpreter", torch.bfloat16): {"scaled": 3.3e-3, "rel_norm": 1.7e-3},
    ("gpu", torch.float16): {"scaled": 6.1e-4, "rel_norm": 3.1e-4},
    ("gpu", torch.bfloat16): {"scaled": 4.6e-3, "rel_norm": 2.5e-3},
}


# the least scale for atol, as a fraction of the largest max|ref| among a case's tensors
FLOOR = 1e-2


def where_kernels_run():
    """``"interpreter"`` (CPU, TRITON_INTERPRET=1) or ``"gpu"``."""
    from rerope.runtime import INTERPRET

    return "interpreter" if INTERPRET else "gpu"


@contextlib.contextmanager
def true_float32():
    """Matmuls in true float32 inside (no TF32): a float32 reference on a GPU."""
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def kernel_device():
    """Where the kernels' inputs must live: CPU tensors for the interpreter, else CUDA."""
    return "cpu" if where_kernels_run() == "interpreter" else "cuda"


def tolerance(dtype, where=None):
    return TOLERANCES[(where or where_kernels_run(), dtype)]


# --- comparing ------------------------------------------------------------------------------

GRAD_NAMES = ("dq1", "dq2", "dk1", "dk2", "dv")


def error_stats(actual, expected):
    """Max abs error, that error over max|ref| ("scaled"), and the relative Frobenius error."""
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    err = (a - e).abs()
    ref_max = e.abs().max().item() if e.numel() else 0.0
    max_abs = err.max().item() if e.numel() else 0.0
    ref_norm = e.norm().item()
    return {
        "max_abs": max_abs,
        "ref_max": ref_max,
        "scaled": max_abs / ref_max if ref_max > 0 else max_abs,
        "rel_norm": err.norm().item() / ref_norm if ref_norm > 0 else err.norm().item(),
    }


def close_problems(name, actual, expected, tol, floor=0.0):
    """Why ``actual`` is not close to ``expected`` under ``tol`` (empty list: it is).

    ``floor``: the least ``scale`` for ``atol``; the relative-norm test is skipped when the
    reference's largest entry is below it (see the module docstring)."""
    if actual.shape != expected.shape:
        return [f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"]
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    problems = []
    bad = ~torch.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        problems.append(f"{name}: {int(bad.sum())} non-finite entries (first at {first}: "
                        f"{a[first].item()})")
        return problems
    stats = error_stats(a, e)
    err = (a - e).abs()
    allowed = tol.atol * max(stats["ref_max"], floor) + tol.rtol * e.abs()
    over = err > allowed
    if over.any():
        worst = tuple(int(i) for i in torch.unravel_index((err - allowed).argmax(), err.shape))
        problems.append(
            f"{name}: {int(over.sum())}/{err.numel()} entries beyond atol={tol.atol:g}·max|ref| + "
            f"rtol={tol.rtol:g}·|ref|; worst at {worst}: got {a[worst].item():.6g}, want "
            f"{e[worst].item():.6g}; max|err|={stats['max_abs']:.3g}, "
            f"max|ref|={stats['ref_max']:.3g}")
    if stats["rel_norm"] > tol.rel_norm and stats["ref_max"] >= floor:
        problems.append(f"{name}: relative norm error {stats['rel_norm']:.3g} > {tol.rel_norm:g}")
    return problems


def results_problems(got, want, tol, names=None):
    """``close_problems`` for several named tensors of one case (dicts), with the shared floor."""
    names = names or list(want)
    floor = FLOOR * max(want[name].detach().abs().max().item() if want[name].numel() else 0.0
                        for name in names)
    return [p for name in names for p in close_problems(name, got[name], want[name], tol, floor)]


# --- inputs ---------------------------------------------------------------------------------


@pytest.fixture
def gen(request):
    """A ``torch.Generator`` seeded from the test's node id: reproducible, different per case.

    Set ``KERNEL_TEST_SEED`` to an integer to draw a different (still reproducible) set."""
    seed = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("KERNEL_TEST_SEED", 0))
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, dtype=torch.float64, device="cpu"):
    """Standard normal numbers drawn on the CPU from ``gen`` (so CPU and GPU runs agree)."""
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def raw_inputs(gen, batch, hq, hkv, n, d, dtype, device=None):
    """Random raw ``q, k, v`` leaves (for ``rerope``), on the kernels' device by default."""
    device = device or kernel_device()
    return [randn(gen, batch, h, n, d, dtype=dtype, device=device).requires_grad_()
            for h in (hq, hkv, hkv)]


def _place(values, layout):
    """Put ``(B, H, N, D)`` ``values`` into memory laid out as ``layout``; return a leaf view.

    * ``contiguous``: a plain tensor.
    * ``transposed``: a transposed view of a contiguous ``(B, N, H, D)`` tensor.
    * ``poisoned``: a strided view (every other element along D, rows offset) of a larger
      NaN-filled buffer: a kernel that reads anything but its own elements sees NaN.
    """
    b, h, n, d = values.shape
    if layout == "contiguous":
        placed = values.clone()
    elif layout == "transposed":
        placed = values.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "poisoned":
        pad = 3
        buffer = torch.full((b, h + 1, n + 2 * pad, 2 * d + 1), float("nan"), dtype=values.dtype,
                            device=values.device)
        placed = buffer[:, 1:, pad:pad + n, 1::2][..., :d]
        placed.copy_(values)
        assert not placed.is_contiguous()
    else:
        raise ValueError(layout)
    return placed


# layout "mixed": every tensor its own layout, so a kernel that uses one tensor's strides for
# another fails (order: q1, q2, k1, k2, v, dout)
MIXED = ("contiguous", "transposed", "poisoned", "transposed", "contiguous", "poisoned")


def make_inputs(gen, batch, hq, hkv, n, d, dtype, device=None, layout="contiguous"):
    """Random ``q1, q2, k1, k2, v`` (leaf tensors requiring grad) and an upstream gradient,
    laid out in memory as ``layout`` (see :func:`_place`; ``"mixed"``: :data:`MIXED`), on the
    kernels' device by default."""
    device = device or kernel_device()
    layouts = MIXED if layout == "mixed" else (layout,) * 6
    shapes = [(batch, hq, n, d)] * 2 + [(batch, hkv, n, d)] * 3
    tensors = [_place(randn(gen, *shape, dtype=dtype, device=device), where).requires_grad_()
               for shape, where in zip(shapes, layouts)]
    dout = _place(randn(gen, batch, hq, n, d, dtype=dtype, device=device), layouts[5])
    return tensors, dout


def window_contrast_inputs(gen, batch, hq, hkv, n, d, dtype, strong, contrast=6.0,
                           sm_scale=None, device=None):
    """Inputs where the two products differ a lot, so one misplaced pair shows.

    ``strong="outside"``: ``q2 · k2`` is about ``+contrast`` (after ``sm_scale``) for every pair
    and ``q1 · k1`` about 0, so each row attends almost only to its keys outside the window;
    ``strong="inside"``: the reverse. A kernel that puts ``i - j = w`` inside (or ``w - 1``
    outside) then moves almost all of a row's weight: errors of order ``|v|``.
    """
    scale = d ** -0.5 if sm_scale is None else sm_scale
    c = (contrast / scale) ** 0.5
    direction = randn(gen, d)
    direction = direction / direction.norm()

    def aligned(shape):
        return c * direction + 0.7 * randn(gen, *shape)

    q_shape, k_shape = (batch, hq, n, d), (batch, hkv, n, d)
    weak = [randn(gen, *q_shape), randn(gen, *k_shape)]
    strong_pair = [aligned(q_shape), aligned(k_shape)]
    (q1, k1), (q2, k2) = (weak, strong_pair) if strong == "outside" else (strong_pair, weak)
    v = randn(gen, *k_shape)
    device = device or kernel_device()
    tensors = [t.to(dtype).to(device).requires_grad_() for t in (q1, q2, k1, k2, v)]
    dout = randn(gen, *q_shape, dtype=dtype, device=device)
    return tensors, dout


# --- launch configurations -----------------------------------------------------------------------


def all_launch_configs(kernel, head_dim, capability, elem_bytes=2, launch_configs=None,
                       fused=False):
    """``configs.launch_configs`` (or the given function) with autotuning on: all fitting
    configurations (of the five-tensor form, or the fused one: ``fused``), whatever
    ``REROPE_AUTOTUNE`` says."""
    from rerope import configs

    with configs.using(autotune=True):
        return (launch_configs or configs.launch_configs)(kernel, head_dim, capability,
                                                          elem_bytes, fused)


# --- the shared grid of cases -----------------------------------------------------------------

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    n: int
    window: int
    causal: bool = True
    dtype: torch.dtype = F32
    d: int = 32
    batch: int = 1
    hq: int = 1
    hkv: int = 1
    layout: str = "contiguous"
    sm_scale: float = None

    def id(self):
        parts = [f"N{self.n}", f"w{self.window}", "causal" if self.causal else "full",
                 str(self.dtype).replace("torch.", ""), f"D{self.d}"]
        if (self.batch, self.hq, self.hkv) != (1, 1, 1):
            parts.append(f"B{self.batch}H{self.hq}kv{self.hkv}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.sm_scale is not None:
            parts.append(f"scale{self.sm_scale}")
        return "-".join(parts)


# The grid of tests/test_attention.py (CPU) and tests/test_gpu.py (the same cases on a GPU).
# With 16 × 16 tiles (interpreter) the schedule's cut points (rerope.regions) cross a tile edge
# as w mod 16 runs through 14, 15, 0, 1, 2, 3: each residue appears causal (window below the
# diagonal) and not (above it too). w = 1 makes every diagonal tile a band tile; w >= N is
# plain RoPE.
CASES = [
    # window boundaries against the tile grid
    Case(50, 14), Case(77, 15, dtype=F16), Case(77, 16), Case(50, 17, dtype=F16),
    Case(50, 18), Case(77, 35, dtype=F16),
    Case(77, 30, causal=False, dtype=F16), Case(50, 31, causal=False), Case(50, 16, causal=False,
    dtype=F16), Case(77, 33, causal=False), Case(50, 2, causal=False, dtype=F16),
    Case(77, 19, causal=False),
    Case(77, 76, dtype=F16),                      # only the pair (76, 0) is outside
    # window 1: only the diagonal is inside
    Case(77, 1), Case(77, 1, causal=False, dtype=F16),
    # window >= N: plain RoPE attention, q2/k2 never used
    Case(77, 77, dtype=F16), Case(77, 500, causal=False),
    # odd and tiny N
    Case(1, 1), Case(1, 4, causal=False, dtype=F16), Case(2, 1, causal=False),
    Case(17, 3, dtype=F16), Case(130, 40, dtype=F16),
    # head dims (32 above)
    Case(40, 9, d=16, dtype=F16), Case(40, 9, d=64, causal=False),
    Case(40, 9, d=128), Case(40, 9, d=128, causal=False, dtype=F16),
    Case(40, 20, d=256, dtype=F16), Case(40, 20, d=256, causal=False),
    # grouped-query attention, batch (shorter: the interpreter's cost grows with B·H)
    Case(40, 12, hq=4, hkv=2, dtype=F16), Case(24, 5, hq=4, hkv=1, causal=False),
    Case(24, 12, hq=4, hkv=1, d=64, dtype=F16),
    Case(24, 7, batch=2, hq=2, hkv=1), Case(24, 7, batch=2, hq=2, hkv=2, causal=False, dtype=F16),
    # arbitrary strides: transposed views of (B, N, H, D) tensors, and a layout per tensor
    Case(40, 10, hq=2, hkv=2, layout="transposed", dtype=F16),
    Case(24, 10, batch=2, hq=4, hkv=2, layout="transposed", causal=False),
    Case(40, 10, batch=2, hq=2, hkv=2, layout="mixed", dtype=F16),
    # explicit sm_scale
    Case(40, 11, sm_scale=0.3, d=64), Case(40, 11, sm_scale=1.0, d=16, causal=False, dtype=F16),
]


# --- rerope.rerope's grid: q, k, v, the rotation inside the kernels ------------------------------
# (tests/test_attention.py, test_backward.py, test_rotary.py, test_launch.py and test_gpu.py judge
# it against ``rerope.reference.rerope_from_relative_positions``, the float64 oracle that scores
# every pair straight from ReRoPE's relative position; chunked prefill puts ``Nq`` queries at the
# last positions of ``Nk`` keys)

# what ``rerope.rerope``'s cases compare: the output and the gradients of q, k, v
NAMES = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class FusedCase:
    n_q: int
    n_k: int
    window: int
    rotated: bool = False
    causal: bool = True
    dtype: torch.dtype = F32
    d: int = 32
    batch: int = 1
    hq: int = 1
    hkv: int = 1
    leaky: float = None
    logn_len: float = None
    layout: str = "contiguous"

    def id(self):
        parts = [f"Nq{self.n_q}", f"Nk{self.n_k}", f"w{self.window}",
                 "rotated" if self.rotated else "raw", "causal" if self.causal else "full",
                 str(self.dtype).replace("torch.", ""), f"D{self.d}"]
        if (self.batch, self.hq, self.hkv) != (1, 1, 1):
            parts.append(f"B{self.batch}H{self.hq}kv{self.hkv}")
        if self.leaky is not None:
            parts.append(f"leaky{self.leaky}")
        if self.logn_len is not None:
            parts.append(f"logn{self.logn_len}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts)


def C(n_q, n_k=None, window=9, **kw):
    """A :class:`FusedCase`; ``Nk = Nq`` unless given."""
    return FusedCase(n_q, n_q if n_k is None else n_k, window, **kw)


FUSED_CASES = [
    # both conventions, causal and not, windows against the 16-wide tile grid
    C(50, window=14), C(50, window=14, rotated=True), C(77, window=17, causal=False, dtype=F16),
    C(77, window=17, causal=False, rotated=True, dtype=F16), C(50, window=16, rotated=True),
    C(77, window=31, causal=False), C(50, window=33, rotated=True, causal=False, dtype=F16),
    # window 1 (only the diagonal inside) and window >= N (plain RoPE)
    C(40, window=1, rotated=True), C(40, window=1, causal=False, dtype=F16),
    C(40, window=40), C(40, window=500, rotated=True, causal=False),
    # chunked prefill: 1, 7, 33 queries at the end of 100 keys, both conventions
    C(1, 100, 13), C(1, 100, 13, rotated=True), C(7, 100, 13), C(7, 100, 13, rotated=True,
    dtype=F16), C(33, 100, 13, rotated=True), C(33, 100, 40, causal=False),
    C(33, 100, 13, causal=False, rotated=True, dtype=F16), C(17, 60, 70, rotated=True),
    # Leaky ReRoPE and log-n, both conventions
    C(50, window=9, leaky=4.0), C(50, window=9, leaky=16.0, rotated=True, dtype=F16),
    C(50, window=9, logn_len=8.0), C(40, window=9, logn_len=5.0, rotated=True, causal=False),
    C(33, 70, 9, leaky=3.0, logn_len=8.0, rotated=True), C(33, 70, 9, leaky=3.0, logn_len=8.0),
    # head dims: 16 (halves below tl.dot's minimum: joined), 64, 128
    C(40, window=7, d=16), C(40, window=7, d=16, rotated=True, causal=False, dtype=F16),
    C(40, window=9, d=64, dtype=F16), C(33, 50, 9, d=128, rotated=True, dtype=F16),
    # grouped-query attention and batch
    C(24, window=7, hq=4, hkv=1, rotated=True), C(24, 40, 7, batch=2, hq=4, hkv=2, dtype=F16),
    # layouts: transposed views of (B, N, H, D) buffers, and poisoned strided views
    C(40, window=10, hq=2, hkv=2, layout="transposed", rotated=True, dtype=F16),
    C(24, 40, 10, batch=2, hq=2, hkv=1, layout="poisoned"),
    # bf16 (computed in fp32 by the interpreter; real bf16 on a GPU)
    C(40, window=9, dtype=BF16, rotated=True),
]


def fused_inputs(gen, case, device=None):
    """Leaf ``q, k, v`` in ``case.layout`` and an upstream gradient, on the kernels' device."""
    device = device or kernel_device()
    shapes = [(case.batch, case.hq, case.n_q, case.d), (case.batch, case.hkv, case.n_k, case.d),
              (case.batch, case.hkv, case.n_k, case.d)]
    leaves = [_place(randn(gen, *s, dtype=case.dtype, device=device), case.layout)
              .requires_grad_() for s in shapes]
    dout = randn(gen, *shapes[0], dtype=case.dtype, device=device)
    return leaves, dout


def fused_settings(case):
    """A :class:`FusedCase`'s keyword arguments for ``rerope.rerope`` and the oracle."""
    return dict(causal=case.causal, leaky=case.leaky, logn_len=case.logn_len,
                rotated=case.rotated)


def fused_results(leaves, dout, window, **kw):
    """``rerope.rerope`` (rotation inside the kernels): ``out, dq, dk, dv``, under poison."""
    import rerope

    for t in leaves:
        t.grad = None
    with poisoned_empty():
        out = rerope.rerope(*leaves, window, **kw)
        out.backward(dout)
    return {"out": out.detach(), **{n: t.grad for n, t in zip(NAMES[1:], leaves)}}


def oracle_results(leaves, dout, window, **kw):
    """The float64 relative-position oracle on copies of ``leaves``: ``out, dq, dk, dv``."""
    from rerope import reference

    ref = [t.detach().double().requires_grad_() for t in leaves]
    out = reference.rerope_from_relative_positions(*ref, window, **kw)
    out.backward(dout.double())
    return {"out": out.detach(), **{n: t.grad for n, t in zip(NAMES[1:], ref)}}


def raw_leaves(gen, b, hq, hkv, n, d, dtype, n_queries=None):
    """Random ``q, k, v`` leaves on the kernels' device; ``q`` has ``n_queries`` rows."""
    device = kernel_device()
    shapes = [(b, hq, n_queries or n, d), (b, hkv, n, d), (b, hkv, n, d)]
    return [randn(gen, *shape, dtype=dtype, device=device).requires_grad_() for shape in shapes]


# --- running kernel and reference -------------------------------------------------------------


@contextlib.contextmanager
def poisoned_empty():
    """Make ``torch.empty``/``empty_like`` return NaN-filled memory (ints: their max value).

    The kernels allocate every output (out, lse, delta, all five gradients) with ``torch.empty``;
    under this context an element a kernel forgets to write stays NaN and fails the check.
    """
    import torch.utils.deterministic as det

    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    # warn_only: only the filling is wanted, not errors from ops without a deterministic version
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was[2]
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def kernel_results(tensors, dout, window, causal=True, sm_scale=None):
    """Fused kernel: output and the five gradients (``.grad`` of the leaves), under poison."""
    import rerope

    for t in tensors:
        t.grad = None
    with poisoned_empty():
        out = rerope.rerope_attention(*tensors, window, causal=causal, sm_scale=sm_scale)
        out.backward(dout)
    return {"out": out.detach(), **{g: t.grad for g, t in zip(GRAD_NAMES, tensors)}}


def reference_results(tensors, dout, window, causal=True, sm_scale=None, dtype=torch.float64,
                      head_chunk=None):
    """The naive reference in ``dtype`` (float64 on CPU) on copies of the same inputs.

    ``head_chunk``: run the query heads in groups of this size (K/V heads follow) to bound
    memory at large N.
    """
    from rerope import reference

    q1, q2, k1, k2, v = (t.detach().to(dtype) for t in tensors)
    do = dout.detach().to(dtype)
    hq, hkv = q1.shape[1], k1.shape[1]
    group = hq // hkv
    chunk = head_chunk or hq
    chunk = max(group, chunk // group * group)
    results = {name: [] for name in ("out",) + GRAD_NAMES}
    dk = [torch.zeros_like(t) for t in (k1, k2, v)]
    for lo in range(0, hq, chunk):
        hi = min(lo + chunk, hq)
        klo, khi = lo // group, hi // group
        leaves = [q1[:, lo:hi].clone().requires_grad_(), q2[:, lo:hi].clone().requires_grad_(),
                  *(t[:, klo:khi].clone().requires_grad_() for t in (k1, k2, v))]
        out = reference.rerope_attention(*leaves, window, causal=causal, sm_scale=sm_scale)
        out.backward(do[:, lo:hi])
        results["out"].append(out.detach())
        results["dq1"].append(leaves[0].grad)
        results["dq2"].append(leaves[1].grad)
        for acc, leaf in zip(dk, leaves[2:]):
            acc[:, klo:khi] += leaf.grad
        del out, leaves
    merged = {name: torch.cat(parts, dim=1) for name, parts in results.items() if parts}
    merged.update(dk1=dk[0], dk2=dk[1], dv=dk[2])
    return merged


def describe(gen, **case):
    seed = gen.initial_seed() if gen is not None else None
    return f"case {case}, generator seed {seed}"


def check_kernel_against_reference(tensors, dout, window, causal=True, sm_scale=None, tol=None,
                                   context="", names=("out",) + GRAD_NAMES):
    """Run both; assert output and all gradients close (and finite). Returns the error stats."""
    got = kernel_results(tensors, dout, window, causal, sm_scale)
    want = reference_results(tensors, dout, window, causal, sm_scale)
    tol = tol or tolerance(tensors[0].dtype)
    assert got["out"].dtype == tensors[0].dtype
    stats = {name: error_stats(got[name], want[name]) for name in names}
    log_errors(tensors[0].dtype, stats)
    problems = results_problems(got, want, tol, names)
    assert not problems, (context + "\n" if context else "") + "\n".join(problems)
    return stats


def log_errors(dtype, stats, where=None):
    """Append measured errors to the JSON-lines file named by ``KERNEL_ERROR_LOG``, if set
    (how :data:`MEASURED` was obtained: run the suite with it, then take maxima per dtype)."""
    path = os.environ.get("KERNEL_ERROR_LOG")
    if path:
        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                  "where": where or where_kernels_run(), "dtype": str(dtype).replace("torch.", ""),
                  "errors": stats}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


# --- cross-compiling in a child process --------------------------------------------------------


def cross_compile(tmp_path, script, timeout=600):
    """Run ``script`` (Python source that compiles kernels with ``triton.compile`` for NVIDIA
    targets, no GPU needed) in a child process with the compiler rather than the interpreter
    (this process's mode is fixed at import), ``rerope`` importable from this checkout.
    Skips where this Triton has no NVIDIA backend; fails with the child's stderr if it
    fails. Returns the child's stdout lines."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no NVIDIA backend")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "cross_compile.py"
    path.write_text(script, encoding="utf-8")
    search = [os.path.join(root, "kernels"), root] + [  # then this process's (make test-floor
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]   # puts a Triton there)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join(search)}
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


# --- the book's table of contents, read by the one reader tools/execute_notebooks.py has ---------

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from execute_notebooks import toc_pages  # noqa: E402,F401


# --- slow background work -------------------------------------------------------------------------

_STARTED = []


def pytest_collection_finish(session):
    """Let a test module start slow background work as soon as the selected tests are known
    (``start_background_work(items)``: tests/test_compile.py's cross-compiles), so that it
    overlaps the tests that run before it; ``stop_background_work`` runs at the end.

    Not in a pytest-xdist worker: every worker collects every test, and each would start the
    same work; there the module's own fixture starts it in the one worker that runs it."""
    if hasattr(session.config, "workerinput"):
        return
    by_module = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "start_background_work"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        module.start_background_work(items)
        _STARTED.append(module)


def pytest_sessionfinish(session):
    for module in _STARTED:
        module.stop_background_work()


# Test modules import these helpers as ``rerope_testing``: the repo root has a conftest.py of its
# own, so ``import conftest`` may find that one depending on pytest's import mode.
sys.modules["rerope_testing"] = sys.modules[__name__]
