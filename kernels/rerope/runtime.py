"""Where the kernels run: a CUDA GPU, or Triton's CPU interpreter.

Triton decides at ``@triton.jit`` time (module import) whether a kernel is compiled or
interpreted, from the environment variable ``TRITON_INTERPRET``; a launch does not read it again
(Triton 3.4 to 3.9). When the variable is unset and torch sees no CUDA device, ``rerope``
chooses the interpreter for its own kernels only: it sets ``TRITON_INTERPRET=1`` while Triton
and the package's kernel modules are imported (:func:`kernels_decorated`) and restores the
environment afterwards, so ``os.environ`` is left as it was: child processes and the caller's
own ``@triton.jit`` kernels are not switched. On a laptop or a CI box the very same kernels then
run on CPU tensors through the interpreter (slowly, with one fixed launch configuration). Set
``TRITON_INTERPRET=0`` or ``1`` yourself before importing ``rerope`` (and Triton) to force
either mode, and to get your own kernels interpreted too (the book's setup cell does).

One thing is shared with the whole process: Triton's own helpers (``tl.sum``, ``tl.cdiv``, ...)
are decorated when ``triton`` is first imported. ``import rerope`` on a machine without CUDA
therefore imports Triton inside that window; a Triton imported earlier in compiled mode cannot
serve interpreted kernels, and ``import rerope`` then says so (:class:`InterpreterModeError`).

Threads: Triton's interpreter is not thread-safe (it patches ``triton.language`` for the
duration of a launch), so under it every launch of the package's kernels holds one lock
(:data:`INTERPRETER_LOCK`, see :func:`launching`); the plans themselves are safe to share. On a
GPU launches take no lock.

Two interpreter facts shape the launchers: bf16 arithmetic is wrong under the interpreter (numpy
has no bf16), so bf16 inputs are computed in fp32 there and cast back; and the interpreter runs
on CPU tensors, the compiled kernels on CUDA tensors.

It also checks the installed versions (:func:`rerope._compat.check`): Triton >= 3.4, and under
the interpreter Triton >= 3.7 or numpy < 2.4; anything older fails here with an ``ImportError``
that names what was found and what is needed.
"""

import contextlib
import os
import sys
import threading

import torch

from . import _compat

# The interpreter by this package's own choice (no CUDA, TRITON_INTERPRET unset): set only while
# the kernels are decorated (kernels_decorated), never left in os.environ.
CHOSEN = "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()
INTERPRET = (CHOSEN
             or os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))


class InterpreterModeError(ImportError):
    """Triton was imported in compiled mode before ``rerope`` chose its interpreter."""


@contextlib.contextmanager
def kernels_decorated():
    """The window in which the package's modules run their ``@triton.jit`` decorators: with
    ``TRITON_INTERPRET=1`` where this package chose the interpreter (:data:`CHOSEN`), the
    environment restored on the way out; otherwise nothing changes."""
    if not CHOSEN or "TRITON_INTERPRET" in os.environ:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRITON_INTERPRET", None)


def _check_triton_mode():
    """Under the interpreter, Triton's own ``@jit`` helpers must be interpreted too (a compiled
    ``tl.cdiv`` cannot be called from an interpreted kernel: "Cannot call @triton.jit'd outside
    of the scope of a kernel" at the first launch). They are fixed when ``triton`` is first
    imported."""
    import triton.language as tl
    if INTERPRET and type(tl.standard.cdiv).__name__ == "JITFunction":
        raise InterpreterModeError(
            "rerope runs Triton's CPU interpreter here (no CUDA device), but Triton was "
            "imported before rerope with TRITON_INTERPRET unset, so its own helpers (tl.sum, "
            "tl.cdiv, ...) are compiled-mode and cannot run in the interpreter. Import rerope "
            "before triton, or set TRITON_INTERPRET=1 before importing triton.")


with kernels_decorated():
    # Too old a Triton (or, under the interpreter, Triton < 3.7 with numpy >= 2.4) fails here,
    # at `import rerope`, with a message that names the versions (see rerope._compat).
    _compat.check(INTERPRET)
    _check_triton_mode()
    if CHOSEN and "triton.experimental.gluon" not in sys.modules:
        try:   # imported by Triton at the first launch otherwise, where its import asserts
            import triton.experimental.gluon  # noqa: F401  (that TRITON_INTERPRET is set)
        except ImportError:
            pass

# Triton's interpreter is not thread-safe: under it, every launch of the package holds this lock
# (re-entrant: a launch inside a held section, e.g. decode's counter reset, may take it again).
INTERPRETER_LOCK = threading.RLock()


def launching():
    """The context a launch of the package's kernels runs in: :data:`INTERPRETER_LOCK` under the
    interpreter, nothing on a GPU."""
    return INTERPRETER_LOCK if INTERPRET else contextlib.nullcontext()


def dot_precision(dtype):
    """``tl.dot`` input precision: ``"tf32x3"`` for fp32 inputs, else the default.

    3xTF32 splits each fp32 operand into a TF32 high part and a TF32 remainder and runs three
    tensor-core products: close to fp32 accuracy at tensor-core speed. Plain ``"ieee"`` fp32
    lowers ``tl.dot`` to FMA loops, which take minutes to compile on sm_90 (measured: ~60 s per
    kernel and configuration in a cross-compile, against ~22 s for tf32x3, ~10 s for tf32).
    The interpreter computes fp32 dots exactly in numpy whatever this says.
    """
    return "tf32x3" if dtype == torch.float32 else "tf32"


def prepare_for_device(*tensors):
    """Check the tensors can run here; under the interpreter, lift bf16 to fp32.

    Returns ``(tensors, restore)`` where ``restore(t)`` casts a result back to the input dtype.
    """
    dtype, device = tensors[0].dtype, tensors[0].device
    if INTERPRET and device.type != "cpu":
        raise ValueError(f"inputs are on {device}, but the kernels run in Triton's CPU "
                         "interpreter (TRITON_INTERPRET=1): pass CPU tensors")
    if not INTERPRET and device.type != "cuda":
        raise ValueError(f"inputs are on {device}; the Triton kernels need CUDA tensors "
                         "(or run with TRITON_INTERPRET=1 for the CPU interpreter)")
    if INTERPRET and dtype == torch.bfloat16:
        return tuple(t.float() for t in tensors), lambda t: t.to(dtype)
    return tensors, lambda t: t
