"""The oldest versions the kernels run on, and a clear error when the installed ones are older.

Measured (2026-12, CPU machine: the cross-compile of ``tests/test_compile.py`` for sm_75/80/89/90
and the interpreter tests; ``make test-floor`` is the CI job that keeps the floor tested):

* **Triton >= 3.4** (shipped with torch 2.8). Triton 3.2 and 3.3 compile no kernel of this
  package (``AttributeError: module 'triton.language' has no attribute
  'make_tensor_descriptor'``: Triton's dependency scan looks the name up even where the TMA
  branch is not taken); spelled so that the scan skips it, 3.3 still fails the T4 (sm_75)
  backward kernels (``LLVM ERROR: Unsupported rounding mode for conversion``) and its
  interpreter cannot invert a boolean mask (``'InterpreterBuilder' object has no attribute
  'get_int1_ty'``). 3.4.0 and 3.5.1 pass everything.
* **Under the CPU interpreter only: Triton >= 3.7, or numpy < 2.4.** Triton 3.6 and older
  convert a loop bound to a Python int in a way numpy 2.4 refuses (``TypeError: only
  0-dimensional arrays can be converted to Python scalars``), so every kernel fails; compiled
  kernels on a GPU do not care about numpy. A requirement line cannot say "numpy < 2.4 when
  triton < 3.7", hence the check here.

:func:`check` runs from :mod:`rerope.runtime` when ``rerope`` is imported, so an unsupported
setup fails at ``import rerope`` with one message naming what was found, what is needed and
what to do, instead of an error from deep inside Triton at the first kernel call.
"""

import re

TRITON_MIN = (3, 4)                 # requirements.txt says triton>=3.4 (tests/test_versions.py)
TORCH_FOR_TRITON_MIN = "2.8"        # the torch release that ships Triton 3.4
INTERPRETER_NUMPY_FIXED = (3, 7)    # Triton from which the interpreter works with numpy >= 2.4
NUMPY_BREAKS_OLD_INTERPRETER = (2, 4)

COLAB_HINT = ("On Colab: choose the latest runtime version (Runtime > Change runtime type), or "
              "run `%pip install -U torch` in a cell and then Runtime > Restart session.")


class UnsupportedVersionError(ImportError):
    """The installed Triton (or, under the interpreter, numpy) is older than the kernels need."""


def parse_version(text):
    """``(major, minor)`` from a version string such as ``3.4.0``, ``3.5.0+git7416ffcb`` or
    ``2.3.0rc1``; ``None`` when it does not start with two numbers."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", str(text))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _dotted(version):
    return ".".join(map(str, version))


def problems(triton_version, numpy_version, interpret, torch_version="unknown"):
    """Why these versions cannot run the kernels: a list of messages, empty when they can.

    ``triton_version`` is ``None`` when Triton is not installed; ``interpret`` is whether the
    kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``).
    """
    need = _dotted(TRITON_MIN)
    if triton_version is None:
        return [f"rerope needs Triton >= {need}, and no Triton is installed (torch "
                f"{torch_version}). Install it: pip install 'triton>={need}'"]
    found = parse_version(triton_version)
    if found is None:       # a build with an odd version string: let it try
        return []
    if found < TRITON_MIN:
        return [f"rerope needs Triton >= {need}, found Triton {triton_version} (with torch "
                f"{torch_version}); older Triton cannot compile or run its kernels. Upgrade: pip "
                f"install -U 'torch>={TORCH_FOR_TRITON_MIN}' (it brings a matching Triton; on a "
                f"CPU-only machine: pip install -U 'triton>={need}'). {COLAB_HINT}"]
    numpy_found = parse_version(numpy_version)
    if (interpret and found < INTERPRETER_NUMPY_FIXED and numpy_found is not None
            and numpy_found >= NUMPY_BREAKS_OLD_INTERPRETER):
        fixed, breaks = _dotted(INTERPRETER_NUMPY_FIXED), _dotted(NUMPY_BREAKS_OLD_INTERPRETER)
        return [f"rerope under Triton's CPU interpreter (TRITON_INTERPRET=1, the mode used "
                f"when there is no CUDA device) needs Triton >= {fixed} with numpy >= {breaks}; found Triton "
                f"{triton_version} with numpy {numpy_version}, where every kernel fails "
                f"('only 0-dimensional arrays can be converted to Python scalars'). Fix one: "
                f"pip install -U 'triton>={fixed}', or pip install 'numpy<{breaks}'"]
    return []


def installed_versions():
    """``(triton, numpy, torch)`` version strings; triton is ``None`` when not installed.

    Imports Triton: call it only after ``TRITON_INTERPRET`` is settled (``rerope.runtime``)."""
    import importlib.util

    import numpy
    import torch

    if importlib.util.find_spec("triton") is None:
        return None, numpy.__version__, torch.__version__
    import triton   # a Triton that is there but fails to import raises its own error

    return getattr(triton, "__version__", "unknown"), numpy.__version__, torch.__version__


def check(interpret):
    """Raise :class:`UnsupportedVersionError` when the installed versions cannot run the
    kernels (see :func:`problems`)."""
    triton_version, numpy_version, torch_version = installed_versions()
    found = problems(triton_version, numpy_version, interpret, torch_version)
    if found:
        raise UnsupportedVersionError(" ".join(found))
