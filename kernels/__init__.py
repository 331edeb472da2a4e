"""ReRoPE attention in Triton: fused forward and backward kernels, references and helpers.

Read in the order the book teaches:

1. :mod:`kernels.rope`            RoPE, ReRoPE, Leaky ReRoPE; the five tensors (chapter 1)
2. :mod:`kernels.reference`       the naive two-matrix method, the tests' oracle (chapter 2)
3. :mod:`kernels.online_softmax`  the online-softmax recurrence, plain attention in Triton (3)
4. :mod:`kernels.regions`         outside / band / inside tiles, shared by every kernel (4)
5. :mod:`kernels.rotary`          RoPE turned in registers: speeds, offsets, the cos/sin table (7)
6. :mod:`kernels.forward`         the ReRoPE forward kernel, five tensors or q, k (4, 7)
7. :mod:`kernels.backward`        the three backward kernels (5, 7)
8. :mod:`kernels.configs`         launch configurations, pruned by shared memory (6)
   :mod:`kernels.launch`          plans per call signature, launches bound to compiled kernels (9)
9. :mod:`kernels.attention`       launchers, autograd, the public ops (each planned once per call
                                  signature)
10. :mod:`kernels.bench`          the benchmark, ``python -m kernels.bench`` (6)
11. :mod:`kernels.decode`         split-KV decoding against a KV cache (8);
    :mod:`kernels.bench_decode`   its benchmark
12. :mod:`kernels.exercises`      the checkers of the book's Triton exercises

:mod:`kernels.hf` (``import kernels.hf``, not loaded by ``import kernels``): ReRoPE in a Hugging
Face transformers model, ``kernels.hf.enable_rerope(model, window)`` (chapter 9).

With no CUDA device, importing ``kernels`` switches Triton to its CPU interpreter
(``TRITON_INTERPRET=1``, see :mod:`kernels.runtime`), so the same code runs on CPU tensors.
"""

from . import runtime  # noqa: F401  (first: decides compiled vs interpreted before any @triton.jit)
from . import reference, rope  # noqa: E402
from .attention import rerope, rerope_attention  # noqa: E402
from .decode import rerope_decode  # noqa: E402

__all__ = ["rerope", "rerope_attention", "rerope_decode", "reference", "rope", "source"]


def source(obj):
    """The source code of a function, class or ``@triton.jit`` kernel of this package.

    The book prints the package's real code with it, so a page can never drift from what runs.
    """
    import inspect

    return inspect.getsource(getattr(obj, "fn", obj))
