"""ReRoPE attention in Triton: fused forward and backward kernels, references and helpers.

Read in the order the book teaches:

1. :mod:`rerope.rope`            RoPE, ReRoPE, Leaky ReRoPE; the five tensors (chapter 1)
2. :mod:`rerope.reference`       the naive two-matrix method, the tests' oracle (chapter 2)
3. :mod:`rerope.online_softmax`  the online-softmax recurrence, plain attention in Triton (3)
4. :mod:`rerope.regions`         outside / band / inside tiles, shared by every kernel (4)
5. :mod:`rerope.rotary`          RoPE turned in registers: speeds, offsets, the cos/sin table (7)
6. :mod:`rerope.forward`         the ReRoPE forward kernel, five tensors or q, k (4, 7)
7. :mod:`rerope.backward`        the three backward kernels (5, 7)
8. :mod:`rerope.configs`         launch configurations, pruned by shared memory (6)
   :mod:`rerope.launch`          plans per call signature, launches bound to compiled kernels (9)
   :mod:`rerope.caches`          the one bound (``CACHE_SIZE``) and LRU cache of every cache
9. :mod:`rerope.attention`       launchers, autograd, the public ops (each planned once per call
                                 signature)
10. :mod:`rerope.decode`         split-KV decoding against a KV cache (8)
    :mod:`rerope.varlen`         packed variable-length prefill (FlashAttention's varlen
                                 layout, paged keys), thin kernels over the same per-program
                                 work
11. :mod:`rerope.exercises`      the checkers of the book's Triton exercises

:mod:`rerope.teach` holds the chapters' teaching kernels, one module per stage (three
regions, backward, fused rotation, split decode): short, checked against the kernels above.

The benchmarks are not part of the package: ``python -m benchmarks.attention`` and
``python -m benchmarks.decode`` from a checkout (chapters 6 and 8).

:mod:`rerope.hf` (``import rerope.hf``, not loaded by ``import rerope``): ReRoPE in a Hugging
Face transformers model, ``rerope.hf.enable_rerope(model, window)`` (chapter 10).

With no CUDA device, ``rerope``'s kernels run in Triton's CPU interpreter, so the same code runs
on CPU tensors: it is chosen for this package's kernels only, ``os.environ`` is left as it was
(see :mod:`rerope.runtime`).

Configuration is data: a frozen :class:`rerope.Config` read once at import from the
environment variables ``REROPE_AUTOTUNE``, ``REROPE_TMA``, ``REROPE_DECODE_CONFIG`` and
``REROPE_PRETURN_BWD_MAX_BYTES`` (checked), ``rerope.config()`` the active one,
``rerope.using_config(...)`` another for a block of code; plans are keyed by it.
"""

from . import runtime  # noqa: F401  (first: decides compiled vs interpreted before any @triton.jit)

with runtime.kernels_decorated():   # the kernels' @triton.jit run here (interpreted without CUDA)
    from . import reference, rope
    from .attention import rerope, rerope_attention
    from .decode import rerope_decode
    from .varlen import rerope_varlen
    from .configs import Config, current as config, using as using_config

__version__ = "0.1.0"

__all__ = ["rerope", "rerope_attention", "rerope_decode", "rerope_varlen", "Config", "config",
           "using_config", "reference", "rope", "source"]


def source(obj):
    """The source code of a function, class or ``@triton.jit`` kernel of this package.

    The book prints the package's real code with it, so a page can never drift from what runs.

    Args:
        obj: a function, method, class or module; or a ``@triton.jit`` kernel, whose Python
            function ``obj.fn`` is read.

    Returns:
        str, the source text as :func:`inspect.getsource` gives it (indented as in its file).
    """
    import inspect

    return inspect.getsource(getattr(obj, "fn", obj))
