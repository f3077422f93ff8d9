"""Direct launches of compiled Triton kernels: ``launch(kernel, grid, *args, **options)``
is ``kernel[grid](*args, **options)`` at a fraction of its host cost.

Triton's ``JITFunction.run`` re-derives the compiled kernel on every call: it binds the
arguments, reads its knobs, turns the specialization into a string key and looks it up,
then builds launch metadata (``python -m benchmarks profile small``: an empty kernel of 24
arguments costs tens of microseconds, most of a small eager MoE call). ``launch`` keys its
own cache by what decides Triton's choice of compiled kernel, computed cheaply:

* the kernel (by id: its cache entry keeps it alive), the current device, the launch
  options (``num_warps``, the kernel's compile-time constants, ``debug``, ``launch_pdl``,
  ...), all passed as keywords, with their types (True, 1 and 1.0 compile apart), and
  Triton's knobs that change what it compiles (``knobs.runtime.debug``, an
  instrumentation mode);
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
whose first argument is a CUDA tensor (all of qmoe's); anything else takes Triton's path,
as does a call with a tensor off the GPU in any position (never cached: Triton checks each
address).

**The C launch** (``_fastlaunch.c``). After the first CUDA launch of the process, the hit
path above runs in C: the key (the same facts, read through the arguments' attributes),
the lookup and the kernel's parameters are made there and the compiled kernel goes
straight to ``cuLaunchKernelEx`` on the current stream, skipping the Python key, the
addresses and Triton's launcher (``python -m benchmarks profile small`` times both). It is
a plain CPython extension built with the system C compiler against Triton's bundled
``cuda.h`` at that first launch, as Triton builds its own launcher, and kept by source
hash in ``$XDG_CACHE_HOME/qmoe`` (else ``~/.cache/qmoe``, else ``qmoe-<uid>`` in the temp
directory; only a directory of this user's that no one else can write). Each compiled
kernel gets a native entry (its function, launch facts and one parameter type a runtime
argument, from the compiled signature). The Python path serves what the C launch does
not: a kernel with global or profile scratch, clusters, instrumentation or a parameter
type it does not pack; a call with a Triton launch hook, ``knobs.runtime.debug`` or an
instrumentation mode set, a tensor not on the GPU, or a grid it does not take; ROCm; a
machine where the build fails.
``use_fast(False)`` turns the C launch off (benchmarks, tests); ``fast_status()`` says
whether it is on and why not.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading

import torch
import triton
from triton import knobs

#: torch.cuda.current_device less its lazy-init check, for callers holding a CUDA tensor
#: (CUDA is initialized), where torch has CUDA
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_CACHE: dict = {}  # key -> _Compiled, written once per key (compiled kernels, no data)
#: the C launch's key -> native entry tuple, or None for a kernel it does not serve;
#: written once per key (compiled kernels' launch facts, no data)
_NATIVE: dict = {}
_fast = None  # the C launch function once loaded; None before the first CUDA launch or off
_fast_state = {"on": True, "loaded": False, "error": None}  # set once, by _load_fast
_BUILD_LOCK = threading.RLock()  # one build and load per process, whatever the threads


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


def _knob_state() -> tuple:
    """Triton's knobs that change what it compiles for one call (``debug``, an
    instrumentation mode): part of the Python key; the C launch serves only where both
    are off."""
    return knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None)


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
    fast = _fast
    if fast is None:
        launch_python(kernel, grid, args, options)
        return
    served = fast(_NATIVE, kernel, grid, args, options, current_device())
    if not served:  # False: no entry for this key yet (give it one); None: not served
        launch_python(kernel, grid, args, options, served is False)


def python_key(kernel, device: int, args: tuple, options: dict) -> tuple:
    """The Python path's cache key: the kernel by id (its cache entry keeps it alive), the
    device, the options with their types (True, 1 and 1.0 compile apart), the knobs that
    change what Triton compiles, each argument's ``_specs``."""
    return (id(kernel), device, tuple(options.items()), tuple(map(type, options.values())),
            _knob_state(), _specs(args))


def launch_python(kernel, grid: tuple, args: tuple, options: dict, register=False) -> None:
    """``launch``'s Python path (the C launch off, not built, or not serving this call):
    the cache key, then the compiled launcher; ``register``: give the C launch its entry
    for this call's key."""
    first = args[0] if args else None
    if (not isinstance(kernel, triton.runtime.JITFunction)  # the interpreter
            or not isinstance(first, torch.Tensor) or not first.is_cuda):
        kernel[grid](*args, **options)  # (a launch on CPU tensors: a harness's recording)
        return
    device = current_device()
    key = python_key(kernel, device, args, options)
    c = _CACHE.get(key)
    if c is None:
        if any(p.is_constexpr for p in kernel.params[:len(args)]):
            raise TypeError(f"qmoe launch of {kernel.fn.__name__}: pass tl.constexpr "
                            "parameters as keywords (the cache keys them by value)")
        if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args):
            kernel[grid](*args, **options)  # Triton checks each address; never cached
            return
        compiled = kernel[grid](*args, **options)
        names = kernel.arg_names[len(args):]
        defaults = {p.name: p.default for p in kernel.params}
        tail = tuple(options[n] if n in options else defaults[n] for n in names)
        from triton.runtime.driver import driver

        _CACHE[key] = c = _Compiled(compiled, tail, driver.active.get_current_stream)
        _load_fast()
        _register_fast(c, kernel, device, args, options)
        return
    if register:
        _register_fast(c, kernel, device, args, options)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = c.get_stream(device)
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    # a launch hook (a profiler) gets the metadata Triton's own launch would give it
    meta = None if enter is None else c.kernel.launch_metadata(grid, stream, *args, *c.tail)
    c.run(grid[0], g1, g2, stream, c.function, c.packed_metadata, meta, enter, leave,
          *_values(args), *c.tail)


# ------------------------------------------------------------------------- the C launch

#: Triton's scalar parameter types -> the C launch's codes (``_fastlaunch.c``)
_TYPE_CODES = {"i1": "i", "i32": "i", "i64": "l", "u1": "I", "u32": "I", "u64": "L",
               "i8": "b", "i16": "h", "u8": "B", "u16": "H", "fp32": "f", "f32": "f",
               "fp64": "d"}


def native_entry(compiled, kernel, nargs: int):
    """The C launch's entry for ``compiled`` (a ``CompiledKernel`` of ``kernel`` for
    ``nargs`` runtime arguments given positionally): ``(function, num_warps, num_ctas,
    shared bytes, PDL, cooperative, parameter codes, compiled)``, or None where the C launch
    does not serve it: another backend than CUDA, scratch memory, clusters, oversized shared
    memory, instrumentation, a parameter type it does not pack, a runtime parameter left to
    its default (the launch packs the given arguments only), metadata it does not know."""
    md = compiled.metadata
    src = getattr(compiled, "src", None)
    sig = getattr(src, "signature", None)
    target = getattr(md, "target", None)
    if (not isinstance(sig, dict) or getattr(target, "backend", None) != "cuda"
            or getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0)
            or getattr(md, "num_ctas", 1) != 1 or getattr(md, "instrumentation_mode", None)
            or not isinstance(getattr(md, "shared", None), int) or md.shared > 228 * 1024):
        return None
    consts = getattr(src, "constants", {}) or {}
    codes = []
    for i, name in enumerate(kernel.arg_names):
        t = sig.get(name, sig.get(i))
        if t == "constexpr" or name in consts or (i,) in consts or i in consts:
            code = "-"
        elif i >= nargs:  # a runtime parameter not passed: its default, which C lacks
            return None
        elif isinstance(t, str) and t.startswith("*"):
            code = "p"
        elif t in _TYPE_CODES:
            code = _TYPE_CODES[t]
        else:
            return None
        if i < nargs:
            codes.append(code)
    return (compiled.function, md.num_warps, 1, md.shared,
            bool(getattr(md, "launch_pdl", False)),
            bool(getattr(md, "launch_cooperative_grid", False)), "".join(codes).encode(),
            compiled)


def _register_fast(c: _Compiled, kernel, device: int, args: tuple, options: dict) -> None:
    """Give the C launch its entry for this call's key (once per key), for kernels compiled
    with Triton's compile-changing knobs off (the C key does not hold them)."""
    mod = _fast_state.get("module")
    if not _fast_state["loaded"] or not _fast_state["on"] or any(_knob_state()):
        return
    k = mod.key(kernel, device, args, options, True)
    if k is not None and k not in _NATIVE:
        _NATIVE[k] = native_entry(c.kernel, kernel, len(args))


def use_fast(on: bool) -> None:
    """Turn the C launch on (built now where CUDA is available and it is not yet) or off."""
    _fast_state["on"] = bool(on)
    if on and not _fast_state["loaded"] and torch.cuda.is_available():
        _load_fast()
    _refresh_fast()


def _refresh_fast() -> None:
    """``_fast`` from ``_fast_state``: the loaded module's launch while on, else None (one
    global read on every launch, where the state dict would take three)."""
    global _fast
    _fast = _fast_state["module"].launch if _fast_state["on"] and _fast_state["loaded"] else None


def fast_status() -> dict:
    """``{"on": bool, "loaded": bool, "error": str or None}``: whether the C launch serves
    launches, whether it was built and loaded, and why not where it failed."""
    return {k: _fast_state[k] for k in ("on", "loaded", "error")}


def _private_dir(d: str) -> bool:
    """Whether ``d`` is (made, if missing, as) a directory of this user's that no one else
    can write: a shared machine's other users must not place a library this process loads."""
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.stat(d)
    except OSError:
        return False
    import stat

    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and os.access(d, os.W_OK))


def _cache_dir() -> str:
    """Where the built C launch is kept: ``$XDG_CACHE_HOME/qmoe``, else ``~/.cache/qmoe``,
    else ``qmoe-<uid>`` under the temp directory: the first that is this user's alone."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (os.path.join(base, "qmoe"),
              os.path.join(tempfile.gettempdir(), f"qmoe-{os.getuid()}")):
        if _private_dir(d):
            return d
    raise OSError("no private writable cache directory for the C launch")


def build_fast():
    """``qmoe._fastlaunch``, built (or found by source hash) and imported once per process,
    initialized with torch's tensor type, its current-stream call, Triton's runtime and
    compilation knobs and the CUDA driver library. Raises where there is no C compiler, no
    ``cuda.h`` or the build fails."""
    with _BUILD_LOCK:
        mod = _fast_state.get("module")
        if mod is None:
            mod = _fast_state["module"] = _build_fast()
        return mod


def _build_fast():
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(here, "_fastlaunch.c")
    cuda_inc = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    py_inc = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    with open(src, "rb") as f:
        code = f.read()
    cuda_h = os.path.join(cuda_inc, "cuda.h")
    if not os.path.exists(cuda_h):
        raise OSError(f"no cuda.h at {cuda_h} (Triton's NVIDIA backend)")
    with open(cuda_h, "rb") as f:
        tag = hashlib.sha256(code + f.read() + suffix.encode() + sys.version.encode())
    cache = _cache_dir()
    path = os.path.join(cache, f"_fastlaunch_{tag.hexdigest()[:16]}{suffix}")
    if not os.path.exists(path):
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise OSError("no C compiler (cc, gcc or $CC) to build the C launch")
        fd, tmp = tempfile.mkstemp(dir=cache, prefix="_fastlaunch_", suffix=".tmp")
        os.close(fd)
        try:
            cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, src, f"-I{py_inc}",
                   f"-I{cuda_inc}", "-ldl"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise OSError(f"building the C launch failed: {' '.join(cmd)}\n"
                              f"{r.stderr[-2000:]}")
            os.replace(tmp, path)  # atomic: another process sees all of it or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    spec = importlib.util.spec_from_file_location("qmoe._fastlaunch", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
        lambda d: torch.cuda.current_stream(d).cuda_stream)  # (as Triton's driver takes it)
    mod.init(torch.Tensor, stream, knobs.runtime, knobs.compilation, "libcuda.so.1")
    return mod


def _load_fast() -> None:
    """Build and load the C launch once per process (at the first CUDA launch, while it is
    on); a failure is kept in ``fast_status()`` and launches stay on the Python path."""
    with _BUILD_LOCK:
        if _fast_state["loaded"] or _fast_state["error"] is not None or not _fast_state["on"]:
            return
        if torch.version.hip is not None:
            _fast_state["error"] = "ROCm: the C launch serves NVIDIA GPUs only"
            return
        try:
            build_fast()
        except Exception as e:  # (no compiler, no cuda.h, a failed build: the Python path)
            _fast_state["error"] = f"{type(e).__name__}: {e}"
            return
        _fast_state["loaded"] = True
        _refresh_fast()
