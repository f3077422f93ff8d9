"""Direct launches of compiled Triton kernels: ``launch(kernel, grid, *args, **options)``
is ``kernel[grid](*args, **options)`` at a fraction of its host cost.

Triton's ``JITFunction.run`` re-derives the compiled kernel on every call: it binds the
arguments, reads its knobs, turns the specialization into a string key and looks it up,
then builds launch metadata (``python -m benchmarks profile small``: an empty kernel of 24
arguments costs tens of microseconds, most of a small eager MoE call). ``launch`` keys its
own cache by what decides Triton's choice of compiled kernel, computed cheaply:

* the kernel, the current device and the launch options (``num_warps``, the kernel's
  compile-time constants, ``debug``, ``launch_pdl``, ...), all passed as keywords;
* per positional argument the same facts Triton specializes on: a tensor's dtype and
  whether its address is 16-byte aligned (and that it is on the GPU); an int's width and
  whether it equals 1 or is a multiple of 16; a bool's value; for floats only their type;
  None as is.

Equal keys mean Triton would pick the same compiled kernel, so a hit calls that kernel's
launcher directly (``CompiledKernel.run``, as ``JITFunction.run`` does at its end), with
tensors passed as their addresses (the launcher would otherwise call ``data_ptr`` and ask
the driver about each address again); a miss
goes through ``kernel[grid]`` (compiling if needed) and keeps the ``CompiledKernel`` it
returns. The cache holds compiled kernels and compile-time constants only, never data:
it is immutable per key once written, like Triton's own cache. Launch hooks (a profiler
such as proton) are called as Triton calls them; the interpreter (``TRITON_INTERPRET=1``)
takes Triton's path.

Call shape: runtime arguments positionally, in the kernel's parameter order, then its
``tl.constexpr`` parameters and the launch options as keywords. The cache serves kernels
whose first argument is a CUDA tensor (all of qmoe's); anything else takes Triton's path.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs

#: torch.cuda.current_device less its lazy-init check, for callers holding a CUDA tensor
#: (CUDA is initialized), where torch has CUDA
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_CACHE: dict = {}  # key -> _Compiled, written once per key (compiled kernels, no data)


class _Compiled:
    """A compiled kernel's launcher and what each launch passes besides the runtime
    arguments (``tail``: the constexpr parameters' values, in parameter order)."""

    __slots__ = ("kernel", "run", "function", "packed_metadata", "tail", "get_stream")

    def __init__(self, kernel, tail: tuple, get_stream) -> None:
        self.kernel = kernel
        self.run = kernel.run
        self.function = kernel.function
        self.packed_metadata = kernel.packed_metadata
        self.tail = tail
        self.get_stream = get_stream


_TENSOR = torch.Tensor


def _specs(args: tuple) -> tuple:
    """What Triton specializes each argument on, or finer (equal specs: the same compiled
    kernel): an int's remainder modulo 16 when it lies in ``(1, 2**31)`` (an i32, not 1),
    else its equality to 1, remainder and width; None as is; a tensor's dtype, address
    modulo 16 and whether it is on a GPU (a CPU tensor misses the cache and gets Triton's
    own error); floats by type alone (Triton does not specialize them); anything else
    (bools) by class and value (``True`` would equal the int key 1). One comprehension,
    the common kinds tested first: this runs on every launch."""
    return tuple([(a & 15 if 1 < a < 0x80000000 else
                   (a == 1, a & 15, -0x80000000 <= a < 0x80000000, a >= 1 << 63))
                  if a.__class__ is int else a if a is None
                  else (a.dtype, a.data_ptr() & 15, a.is_cuda) if isinstance(a, _TENSOR)
                  else float if a.__class__ is float else (a.__class__, a)
                  for a in args])


def _values(args: tuple) -> list:
    """The arguments as the compiled launcher takes them, tensors as their addresses: an
    int skips the launcher's ``data_ptr`` call and its driver check of the address
    (``cuPointerGetAttribute``), which the cache key's ``is_cuda`` stands in for."""
    return [a.data_ptr() if isinstance(a, _TENSOR) else a for a in args]


def _hook(h):
    """A launch hook, or None for none (Triton's knobs hold an empty ``HookChain`` when no
    profiler has added one: calling it would cost a Python call per launch)."""
    return None if h is None or getattr(h, "calls", None) == [] else h


def launch(kernel, grid: tuple, *args, **options) -> None:
    """``kernel[grid](*args, **options)`` through the compiled-kernel cache (module doc).
    ``grid``: a tuple of 1 to 3 ints; ``args``: the kernel's runtime parameters in order;
    ``options``: its constexpr parameters and launch options, as keywords."""
    first = args[0] if args else None
    if (not isinstance(kernel, triton.runtime.JITFunction)  # the interpreter
            or not isinstance(first, torch.Tensor) or not first.is_cuda):
        kernel[grid](*args, **options)  # (a launch on CPU tensors: a harness's recording)
        return
    device = current_device()
    key = (kernel, device, tuple(options.items()), _specs(args))
    c = _CACHE.get(key)
    if c is None:
        if any(p.is_constexpr for p in kernel.params[:len(args)]):
            raise TypeError(f"qmoe launch of {kernel.fn.__name__}: pass tl.constexpr "
                            "parameters as keywords (the cache keys them by value)")
        compiled = kernel[grid](*args, **options)
        names = kernel.arg_names[len(args):]
        defaults = {p.name: p.default for p in kernel.params}
        tail = tuple(options[n] if n in options else defaults[n] for n in names)
        from triton.runtime.driver import driver

        _CACHE[key] = _Compiled(compiled, tail, driver.active.get_current_stream)
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = c.get_stream(device)
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    # a launch hook (a profiler) gets the metadata Triton's own launch would give it
    meta = None if enter is None else c.kernel.launch_metadata(grid, stream, *args, *c.tail)
    c.run(grid[0], g1, g2, stream, c.function, c.packed_metadata, meta, enter, leave,
          *_values(args), *c.tail)
