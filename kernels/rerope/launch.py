"""Launching a kernel cheaply, and the plan caches every public op keeps.

Host time, not GPU time, bounds short calls and decode steps: Triton's ``kernel[grid](*args)``
spends ~70 µs of Python per launch on the H200's host (binding the arguments to the signature,
computing the specialisation key, looking the compiled kernel up; ``triton.autotune`` adds its
own layer). The ops here pay that once per *call signature* instead:

* **A plan per call signature.** :func:`signature` describes a call by what decides every
  derived quantity: each tensor's shape, strides, dtype, device and 16-byte pointer alignment
  (what Triton specialises a compiled kernel on), plus the op's settings. A bounded
  :class:`rerope.caches.LRUCache` maps it to the op's plan (kernels, grids, constexprs, tables,
  scratch shapes: everything that does not depend on the data), built — and checked — on the
  first call. A later call with the same signature is one dictionary lookup.
* **A bound launch.** :class:`Launcher` launches through ``kernel[grid]`` the first time and
  keeps the compiled kernel it returns (for an autotuned kernel, the winner's); later calls hand
  the arguments straight to that kernel's launcher (``CompiledKernel.run``), a few µs. This is
  only valid for calls Triton would map to the same compiled kernel, which is what the plan key
  guarantees: integer arguments are the same numbers (they come from the same shapes), pointer
  alignment is part of the key. :meth:`Launcher.fixed` binds the arguments a plan keeps for
  good (its tables, strides, scalars) once: the plan's tensors among them go to Triton's
  launcher as device addresses.

Under the CPU interpreter there is no compiled kernel: :class:`Launcher` calls ``kernel[grid]``
every time (the plans still save the checks), holding ``rerope.runtime.INTERPRETER_LOCK``: the
interpreter is not thread-safe, and every launch of the package's ops passes through here (the
one other launch, ``decode.chunk_map``, takes the lock itself; the book's exercise checkers
launch readers' kernels without it).

Threads: a :class:`PlanCache` is a ``dict`` whose single operations are atomic; two threads that
miss at once both build the same plan and one wins, and a :class:`Launcher` bound twice binds
the same compiled kernel; a plan is only filled in (its kept launches) on its first calls, where
a race keeps the same launches twice. Threads may share the plans and the ops.

What every op asks of the GPU before it launches lives here too, so that the ops import it from
one place below them: the compute capability (:func:`_capability`), whether a tensor's layout
suits TMA tensor descriptors (:func:`_tma_layout_ok`), and the scratch allocator that
descriptors built inside a kernel need (:func:`_ensure_scratch_allocator`).
"""

import functools
import inspect

import torch
import triton

from .caches import CACHE_SIZE, LRUCache
from .runtime import INTERPRET, INTERPRETER_LOCK


def signature(*tensors):
    """The part of a call's key that the tensors give: per tensor ``(shape, strides, dtype,
    device, pointer 16-byte aligned)``. ``None`` entries stay ``None``."""
    return tuple([None if t is None else
                  (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                  for t in tensors])


class PlanCache(LRUCache):
    """The :class:`rerope.caches.LRUCache` of an op's plans, counting the plans it was given
    (``built``, since the last :meth:`clear`): a test or a measurement sees a plan made, or a
    call served from one, without reading the entries."""

    def __init__(self, size=CACHE_SIZE):
        super().__init__(size)
        self.built = 0

    def put(self, key, value):
        self.built += 1
        return super().put(key, value)

    __setitem__ = put

    def clear(self):
        """Drop every plan; ``built`` counts from 0 again."""
        super().clear()
        self.built = 0


class Launcher:
    """One kernel launch, bound to its compiled kernel after the first call.

    ``kernel``: a ``@triton.jit`` function or a ``triton.autotune`` wrapper of one. ``grid``: a
    tuple, or a function of the chosen configuration's meta-parameters (as for
    ``kernel[grid]``). ``constexprs``: the compile-time arguments, fixed for the launcher's
    life. Calling it with the runtime arguments (positional, in the kernel's order) launches on
    the current stream.
    """

    def __init__(self, kernel, grid, **constexprs):
        self.kernel = kernel
        self.grid = grid
        self.constexprs = constexprs
        self._compiled = None
        self._tried = False        # whether binding was attempted (once)

    def __call__(self, *args):
        compiled = self._compiled
        if compiled is None or not _no_launch_hooks():
            return self._slow_launch(args)
        compiled.run(*self._grid3, self._stream(self._device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *self._tail)

    def _slow_launch(self, args):
        """``kernel[grid](...)``; the first time on a GPU, also bind the compiled kernel."""
        if INTERPRET:              # the interpreter is not thread-safe: one launch at a time
            grid = self.grid(self.constexprs) if callable(self.grid) else self.grid
            with INTERPRETER_LOCK:
                self.kernel[grid](*args, **self.constexprs)
            return
        compiled = self.kernel[self.grid](*args, **self.constexprs)
        if not self._tried and not torch.cuda.is_current_stream_capturing():
            self._tried = True
            meta = dict(self.constexprs)
            best = getattr(self.kernel, "best_config", None)    # an autotuned kernel's winner
            if best is not None:
                meta.update(best.kwargs)
            self._bind(compiled, args, meta)

    def _bind(self, compiled, args, meta):
        """Keep ``compiled`` for direct launches, unless launch hooks are set (profilers, e.g.
        Proton) or this Triton's compiled kernel does not look as expected: then every call
        takes the normal path."""
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        jit = self.kernel
        while not isinstance(jit, JITFunction):                 # autotune -> heuristics -> jit
            jit = jit.fn
        names = list(jit.arg_names)
        if (not _no_launch_hooks() or len(args) > len(names)
                or not all(hasattr(compiled, a)
                           for a in ("run", "function", "packed_metadata"))):
            return
        defaults = {n: p.default for n, p in inspect.signature(jit.fn).parameters.items()}
        tail = []
        for name in names[len(args):]:       # the constexprs, in the kernel's order
            if name in meta:
                tail.append(meta[name])
            elif defaults.get(name, inspect.Parameter.empty) is not inspect.Parameter.empty:
                tail.append(defaults[name])
            else:    # an argument we cannot place: stay on the slow path
                return
        grid = self.grid(meta) if callable(self.grid) else self.grid
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self._tail = tuple(tail)
        self._stream = driver.active.get_current_stream
        first = getattr(args[0], "base", args[0])    # a tensor, or a TMA descriptor's tensor
        self._device = first.device.index     # the plan's tensors all live on one device
        compiled.run                          # load the module now (not inside a graph capture)
        self._compiled = compiled

    def fixed(self, *fixed):
        """``call(*args)``: ``self(*args, *fixed)``, for arguments the caller keeps for the
        launcher's life (a plan's tables, strides and scalars). Where the launcher is bound, the
        fixed tensors go to the compiled kernel's launcher as their device addresses (Triton's
        launcher takes an int for a pointer as it is, and skips the attribute call and the
        driver's pointer query a tensor costs); ``call`` holds the tensors, so those addresses
        stay valid. Otherwise, and whenever launch hooks are set, it is ``self(*args,
        *fixed)``."""
        if self._compiled is None:
            return lambda *args: self(*args, *fixed)
        compiled, grid, stream, device = self._compiled, self._grid3, self._stream, self._device
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        tail = tuple(map(_address, fixed)) + self._tail

        def call(*args):
            if not _no_launch_hooks():
                return self(*args, *fixed)
            run(*grid, stream(device), function, metadata, None, None, None, *args, *tail)

        call.fixed = fixed          # the tensors whose addresses ``tail`` holds
        return call

    @property
    def bound(self):
        """Whether later calls skip Triton's Python launch path."""
        return self._compiled is not None


def _address(arg):
    """A fixed argument as the compiled launcher takes it: a tensor (also inside a tuple, such
    as a kernel's tables) as its device address."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if isinstance(arg, tuple):
        return tuple(map(_address, arg))
    return arg


def kept_launcher(launchers, where, constexprs, make):
    """The :class:`Launcher` a plan keeps in its dict of bound launches ``launchers`` (e.g.
    :attr:`rerope.attention.PlanState.launchers`) for the launch ``where`` (kernel and grid)
    with ``constexprs``; ``make()`` builds it on the first call. The plan's call signature
    fixes every other argument of the launch, so this short key is enough."""
    key = (where, tuple(constexprs.items()))
    launcher = launchers.get(key)
    if launcher is None:
        launcher = launchers[key] = make()
    return launcher


# --- what a launch asks of the GPU ------------------------------------------------------------


@functools.lru_cache(maxsize=CACHE_SIZE)
def _capability(device):
    return torch.cuda.get_device_capability(device)


def _tma_layout_ok(t):
    """TMA needs a 16-byte aligned start, unit column stride and a 16-byte aligned row stride
    (always: the descriptor uses it even for one row); batch and head strides matter only where
    there is more than one batch or head."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(-2) * size % 16 == 0
            and all(s * size % 16 == 0 for s, n in zip(t.stride()[:2], t.shape[:2]) if n > 1))


def _torch_scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator():
    """Descriptors built inside a kernel live in a small global scratch buffer that Triton asks
    an allocator for: give it torch's, unless the caller installed one."""
    from triton.runtime import _allocation
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)


# --- launch hooks -----------------------------------------------------------------------------

try:
    from triton.knobs import runtime as _runtime_knobs
except ImportError:              # an older Triton: keep to its own launch path
    _runtime_knobs = None


def _unset(hook):
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def _no_launch_hooks():
    """Whether Triton has no launch hooks installed (``None``, or an empty ``HookChain`` from
    Triton 3.5 on): a direct launch then skips nothing that ``kernel[grid]`` would run. Read
    per launch (a profiler may install one at any time), so kept to two attribute reads."""
    return (_runtime_knobs is not None and _unset(_runtime_knobs.launch_enter_hook)
            and _unset(_runtime_knobs.launch_exit_hook))
