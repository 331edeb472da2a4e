"""Where the kernels run: a CUDA GPU, or Triton's CPU interpreter.

Triton decides at ``@triton.jit`` time (module import) whether a kernel is compiled or
interpreted, from the environment variable ``TRITON_INTERPRET``. This module is imported first by
``kernels/rerope/__init__.py`` and, when the variable is unset and torch sees no CUDA device, sets
``TRITON_INTERPRET=1``: on a laptop or a CI box the very same kernels then run on CPU tensors
through the interpreter (slowly, with one fixed launch configuration). Set ``TRITON_INTERPRET=0``
or ``1`` yourself before importing ``rerope`` to force either mode.

Two interpreter facts shape the launchers: bf16 arithmetic is wrong under the interpreter (numpy
has no bf16), so bf16 inputs are computed in fp32 there and cast back; and the interpreter runs
on CPU tensors, the compiled kernels on CUDA tensors.

It also checks the installed versions (:func:`rerope._compat.check`): Triton >= 3.4, and under
the interpreter Triton >= 3.7 or numpy < 2.4; anything older fails here with an ``ImportError``
that names what was found and what is needed.
"""

import os

import torch

from . import _compat

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Too old a Triton (or, under the interpreter, Triton < 3.7 with numpy >= 2.4) fails here, at
# `import rerope`, with a message that names the versions (see rerope._compat).
_compat.check(INTERPRET)


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
