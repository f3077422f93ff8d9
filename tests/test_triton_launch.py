"""``qmoe._triton.launch``: a cached direct launch gives what ``kernel[grid](...)`` gives,
for every specialization Triton distinguishes (ints equal to 1 or multiples of 16,
misaligned tensor views, dtypes, None), and keys the cache by specialization, not by call.
On CPU the interpreter takes Triton's own path (covered by every kernel test there). The C
launch (``_fastlaunch.c``): its key is at least as fine as Triton's specialization, its
parameters are packed as Triton packs them, its entries come from the compiled signature
(all checked on CPU), and on CUDA it gives what Triton's launch gives."""

import os
import struct

import pytest
import torch
import triton
import triton.language as tl

from qmoe import _triton
from qmoe._triton import launch
from tests.conftest import kernel_device


@triton.jit
def _axpy_kernel(
    x_ptr,  # (N,) any float dtype, unit stride
    y_ptr,  # (N,) as x, or None (then 0)
    out_ptr,  # (N * STEP,) fp32: out[i * STEP] = a * x[i] + y[i]
    n,
    step,
    a,  # fp32 scalar
    flag,  # bool: add 1 when set
    HAS_Y: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = a * tl.load(x_ptr + i, mask=m).to(tl.float32)
    if HAS_Y:
        v += tl.load(y_ptr + i, mask=m).to(tl.float32)
    if flag:
        v += 1.0
    tl.store(out_ptr + i * step, v, mask=m)


def _run(fn, x, y, n, step, a, flag, block):
    out = torch.full((max(n, 1) * step,), float("nan"), device=x.device)
    fn(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, n, step, a, flag,
       HAS_Y=y is not None, BLOCK=block)
    return out


def _direct(kernel, grid, *args, **options):
    kernel[grid](*args, **options)


DEV = kernel_device()
pytestmark = pytest.mark.skipif(DEV is None, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("n", [1, 16, 17, 1025])
@pytest.mark.parametrize("step", [1, 16, 3])
@pytest.mark.parametrize("offset", [0, 1])  # offset 1: an address not 16-byte aligned
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launch_matches_triton(n, step, offset, dtype):
    base = torch.randn(n + offset, device=DEV).to(dtype)
    x = base[offset:]
    for y in (None, torch.randn(n, device=DEV)):
        for flag in (False, True):
            a = float(torch.randn(()))
            got = _run(launch, x, y, n, step, a, flag, 128)
            want = _run(_direct, x, y, n, step, a, flag, 128)
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            # and the values themselves, against torch
            ref = a * x.float() + (y if y is not None else 0) + (1.0 if flag else 0.0)
            torch.testing.assert_close(got[::step][:n], ref, rtol=1e-6, atol=1e-6)


def test_keys_tell_bools_from_ints():
    """Triton compiles a bool argument as i1 and an int as i32 or i64: their keys differ
    even where the values compare equal (True == 1), while ints of one specialization
    (i32, same remainder modulo 16) share one."""
    for b, i in ((True, 17), (True, 1), (False, 16), (False, 0)):
        assert _triton._specs((b,)) != _triton._specs((i,))
    assert _triton._specs((17,)) == _triton._specs((33,))
    assert _triton._specs((16,)) != _triton._specs((2**31 + 16,))  # i32 / i64
    assert _triton._specs((1,)) != _triton._specs((17,))  # == 1 is a constant


@pytest.mark.skipif(DEV != "cuda", reason="the cache serves compiled kernels (CUDA)")
def test_cache_keys_by_specialization_not_by_call():
    x = torch.randn(64, device="cuda")
    before = len(_triton._CACHE)
    for _ in range(5):
        _run(launch, x, None, 64, 1, 2.0, False, 64)
    for n in (48, 80, 96):  # other multiples of 16: the same compiled kernel
        _run(launch, torch.randn(n, device="cuda"), None, n, 1, float(n), False, 64)
    assert len(_triton._CACHE) == before + 1
    _run(launch, x[1:], None, 63, 1, 2.0, False, 64)  # misaligned, n % 16 != 0
    assert len(_triton._CACHE) == before + 2


@pytest.mark.skipif(DEV != "cuda", reason="checked where the cache serves (CUDA)")
def test_constexpr_passed_positionally_is_refused():
    x = torch.randn(8, device="cuda")
    out = torch.empty(8, device="cuda")
    with pytest.raises(TypeError, match="as keywords"):
        launch(_axpy_kernel, (1,), x, None, out, 8, 1, 1.0, False, False, 8)


@pytest.mark.skipif(DEV != "cuda", reason="the cache serves compiled kernels (CUDA)")
def test_launch_hooks_are_called_from_the_cache():
    from triton import knobs

    x = torch.randn(40, device="cuda")
    _run(launch, x, None, 40, 1, 1.0, False, 64)  # compiled and cached
    seen = []

    def hook(meta):
        seen.append(meta.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _run(launch, x, None, 40, 1, 1.0, False, 64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_axpy_kernel"]


# ------------------------------------------------------------------------- the C launch

def _fast_module():
    try:
        return _triton.build_fast()
    except OSError as e:  # no C compiler here: the Python path serves
        pytest.skip(f"the C launch does not build here: {e}")


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on the GPU (the C launch reads ``is_cuda``)."""

    @property
    def is_cuda(self):
        return True

    @staticmethod
    def of(t):
        return t.as_subclass(_FakeCuda)


_POOL = [None, True, False, 0, 1, 2, 16, 17, 33, -1, -16, 2**31 - 1, 2**31, 2**31 + 16,
         -(2**31) - 1, 2**63, 2**63 + 1, 2**64 - 16, 0.5, 1.0]


def _triton_spec(a):
    """What Triton specializes an argument on: a tensor's dtype and 16-byte alignment; an
    int's type (i32, i64, u64), equality to 1 (a constant) and divisibility by 16; a bool's
    and a float's type; None."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None or isinstance(a, float):
        return type(a)
    kind = "i32" if -(2**31) <= a < 2**31 else "i64" if a < 2**63 else "u64"
    return (kind, a == 1, a % 16 == 0)


def test_c_key_is_at_least_as_fine_as_triton_specialization():
    """Two argument lists with one C key have one specialization in Triton's sense
    (``_triton_spec``): the C launch never serves a call with another specialization's
    kernel."""
    m = _fast_module()
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[8:], base.to(torch.bfloat16),
               base.to(torch.bfloat16)[8:]]
    pool = _POOL + tensors
    opts = {"BLOCK": 64, "HAS_Y": True}
    keys = {}
    for a in pool:
        for b in pool:
            args = (base, a, b)
            k = m.key("kernel", 0, args, opts, False)
            assert k is not None
            spec = tuple(map(_triton_spec, args))
            assert keys.setdefault(k, spec) == spec, (args, k)
    # and it does tell apart what Triton does: options, device, kernel, kinds, positions
    one = m.key("kernel", 0, (base, 1, None), opts, False)
    assert one != m.key("kernel", 0, (base, 17, None), opts, False)
    assert one != m.key("kernel", 0, (base, True, None), opts, False)
    assert one != m.key("kernel", 1, (base, 1, None), opts, False)
    assert one != m.key("other", 0, (base, 1, None), opts, False)
    assert one != m.key("kernel", 0, (base, 1, None), {**opts, "BLOCK": 128}, False)
    assert one != m.key("kernel", 0, (base, None, 1), opts, False)
    # option values compare equal across types (True == 1 == 1.0) but compile apart
    assert m.key("kernel", 0, (base,), {"A": True}, False) != m.key(
        "kernel", 0, (base,), {"A": 1}, False)
    assert m.key("kernel", 0, (base,), {"A": 1}, False) != m.key(
        "kernel", 0, (base,), {"A": 1.0}, False)
    assert m.key("kernel", 0, (base, 2**64), opts, False) is None  # past 64 bits: Python
    assert m.key("kernel", 0, (base, "s"), opts, False) is None
    # a tensor not on the GPU anywhere: no key (Triton's own launch checks its address)
    assert m.key("kernel", 0, (base,), opts, True) is None
    assert m.key("kernel", 0, (_FakeCuda.of(base), base), opts, True) is None
    assert m.key("kernel", 0, (_FakeCuda.of(base), 3), opts, True) is not None
    assert m.key("kernel", 0, (3, _FakeCuda.of(base)), opts, True) is None  # first: a tensor


def test_c_launch_packs_each_parameter_as_triton_does():
    """One 8-byte slot per kernel parameter, little-endian, the value in its low bytes:
    addresses, i32/i64/u64 ints, fp32 floats, bools as i32; constants ('-') skipped."""
    m = _fast_module()
    x = torch.zeros(4)
    slots = m.pack_params(b"pilLfi-bh", (x, -3, 2**40 + 5, 2**63 + 7, 1.5, True, None, -2, 300))
    le = lambda v, n: v.to_bytes(n, "little", signed=v < 0).ljust(8, b"\0")
    assert slots == [le(x.data_ptr(), 8), le(-3, 4), le(2**40 + 5, 8), le(2**63 + 7, 8),
                     struct.pack("<f", 1.5).ljust(8, b"\0"), le(1, 4), le(-2, 1), le(300, 2)]
    # an int given for an annotated float parameter is converted, as Triton's launcher does
    assert m.pack_params(b"fd", (3, 2**63 + 2048)) == [
        struct.pack("<f", 3.0).ljust(8, b"\0"), struct.pack("<d", float(2**63 + 2048))]
    with pytest.raises(ValueError, match="one type per argument"):
        m.pack_params(b"pi", (x,))


class _Target:
    backend = "cuda"


class _Meta:
    num_warps, num_ctas, shared = 4, 1, 1024
    global_scratch_size = profile_scratch_size = 0
    launch_pdl, launch_cooperative_grid = True, False
    target = _Target()


class _Src:
    def __init__(self, signature, constants=None):
        self.signature, self.constants = signature, constants or {}


class _CompiledStub:
    function = 1234

    def __init__(self, signature, constants=None, **meta):
        self.src = _Src(signature, constants)
        self.metadata = _Meta()
        for k, v in meta.items():
            setattr(self.metadata, k, v)


def test_native_entry_from_the_compiled_signature():
    sig = {"x_ptr": "*bf16", "y_ptr": "constexpr", "out_ptr": "*fp32", "n": "i32",
           "step": "i64", "a": "fp32", "flag": "i1", "HAS_Y": "constexpr", "BLOCK": "constexpr"}
    stub = _CompiledStub(sig)
    e = _triton.native_entry(stub, _axpy_kernel, 7)
    assert e == (1234, 4, 1, 1024, True, False, b"p-pilfi", stub)  # (keeps the kernel alive)
    # an int Triton made a constant (== 1) is not a parameter either
    e = _triton.native_entry(_CompiledStub({**sig, "step": "i32"}, {(4,): 1}), _axpy_kernel, 7)
    assert e[6] == b"p-pi-fi"
    class Hip:
        backend = "hip"

    for bad in (dict(global_scratch_size=8), dict(profile_scratch_size=8), dict(num_ctas=2),
                dict(shared=300 * 1024), dict(target=Hip()), dict(instrumentation_mode="fpsan")):
        assert _triton.native_entry(_CompiledStub(sig, **bad), _axpy_kernel, 7) is None
    assert _triton.native_entry(_CompiledStub({**sig, "a": "bf16"}), _axpy_kernel, 7) is None
    # a runtime parameter left to its default (not passed): the C launch would not pack it
    assert _triton.native_entry(_CompiledStub(sig), _axpy_kernel, 6) is None


@pytest.mark.skipif(DEV != "cuda", reason="the C launch serves CUDA launches")
@pytest.mark.parametrize("n", [1, 17, 1025])
def test_c_launch_matches_the_python_path(n):
    """With the C launch on, the same calls give what Triton's own launch gives, and the C
    launch is what served them (its table has the kernel's entries)."""
    _triton.use_fast(True)
    x = torch.randn(n + 1, device="cuda")[1:]
    y = torch.randn(n, device="cuda")
    for args in ((x, None), (x, y), (x[: n // 2 + 1], None)):
        m = args[0].numel()
        for flag in (False, True):
            want = _run(_direct, args[0], args[1], m, 3, 0.5, flag, 64)
            _run(launch, args[0], args[1], m, 3, 0.5, flag, 64)  # compiled, entry made
            got = _run(launch, args[0], args[1], m, 3, 0.5, flag, 64)  # the C launch
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    status = _triton.fast_status()
    assert status["loaded"], status
    served = [e for k, e in _triton._NATIVE.items() if k[0] == id(_axpy_kernel)]
    assert served and all(e is not None for e in served)


@pytest.mark.skipif(DEV != "cuda", reason="the C launch serves CUDA launches")
def test_c_launch_off_and_on():
    x = torch.randn(40, device="cuda")
    want = _run(_direct, x, None, 40, 1, 2.0, True, 64)
    try:
        _triton.use_fast(False)
        assert _triton._fast is None
        assert torch.equal(_run(launch, x, None, 40, 1, 2.0, True, 64), want)
    finally:
        _triton.use_fast(True)
    assert torch.equal(_run(launch, x, None, 40, 1, 2.0, True, 64), want)


def test_a_failed_build_leaves_the_python_path(monkeypatch):
    """Where the C launch does not build (no compiler, no cuda.h), the failure is kept in
    ``fast_status()`` and launches stay on the Python path."""
    monkeypatch.setattr(_triton, "_fast_state",
                        {"on": True, "loaded": False, "error": None})
    monkeypatch.setattr(_triton, "_fast", None)

    def no_compiler():
        raise OSError("no C compiler (cc, gcc or $CC) to build the C launch")

    monkeypatch.setattr(_triton, "build_fast", no_compiler)
    _triton._load_fast()
    assert _triton.fast_status() == {
        "on": True, "loaded": False,
        "error": "OSError: no C compiler (cc, gcc or $CC) to build the C launch"}
    assert _triton._fast is None
    _triton.use_fast(True)  # on, but nothing loaded: still the Python path
    assert _triton._fast is None


def test_cache_dir_falls_back_where_the_first_is_not_writable(monkeypatch, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "qmoe").write_text("a file where the directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(ro))
    monkeypatch.setattr(_triton.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    d = _triton._cache_dir()
    assert d.startswith(str(tmp_path / "tmp")) and os.access(d, os.W_OK)


_FAKE_DRIVER = r"""
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int ctx = 0;
CUresult cuCtxGetCurrent(CUcontext *c) {
  *c = ctx ? (CUcontext)0x1 : NULL;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  ctx = 1;
  printf("ctx %p\n", (void *)c);
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  *c = (CUcontext)(0x100 + (long)d);
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice *d, int o) { *d = o; return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult r, const char **s) { *s = "stand-in"; return CUDA_SUCCESS; }
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
  int n = atoi(getenv("QMOE_FAKE_NP"));
  printf("launch %p %u %u %u %u %u %u %u %p %u", (void *)f, c->gridDimX, c->gridDimY,
         c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes,
         (void *)c->hStream, c->numAttrs);
  for (unsigned i = 0; i < c->numAttrs; i++) printf(" a%d", (int)c->attrs[i].id);
  for (int i = 0; i < n; i++) { unsigned long long v; memcpy(&v, p[i], 8); printf(" %llx", v); }
  printf("\n");
  fflush(stdout);
  return getenv("QMOE_FAKE_FAIL") ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
"""

_FAKE_CHILD = r"""
import os, sys, torch
from triton import knobs
from qmoe import _triton
from tests.test_triton_launch import _FakeCuda
m = _triton.build_fast()
m.init(torch.Tensor, lambda d: 0xABC0 + d, knobs.runtime, knobs.compilation, sys.argv[1])
x = _FakeCuda.of(torch.zeros(64))
y = _FakeCuda.of(torch.zeros(64, dtype=torch.bfloat16)[3:])
kernel, table, opts = object(), {}, {"BLOCK": 64}
args = (x, y, 5, 2**40, 1.5, True, None)
def go(grid, a=args, o=opts):
    r = m.launch(table, kernel, grid, a, o, 1)
    print("result", r)
    sys.stdout.flush()
go((3, 2))  # no entry yet: False
table[m.key(kernel, 1, args, opts, True)] = (0x1234, 4, 1, 2048, True, False, b"ppilfi-", None)
os.environ["QMOE_FAKE_NP"] = "8"
go((3, 2))  # launched
go((7,))  # the context is current now: launched without setting it again
go((0, 5))  # nothing to launch, as Triton: True without a launch
go(())  # a grid it does not take: None
go((2**31,))
go((1, 65536))
go((3,), o={"BLOCK": 64.0})  # another option type: another key, no entry: False
hook = lambda *a: None
knobs.runtime.launch_enter_hook.add(hook)
go((3,))  # a launch hook: None
knobs.runtime.launch_enter_hook.remove(hook)
knobs.runtime.debug = True
go((3,))  # Triton's debug knob: None
knobs.runtime.debug = False
os.environ["QMOE_FAKE_FAIL"] = "1"
try:
    go((3,))
except RuntimeError as e:
    print("error", e)
"""


def test_c_launch_through_a_recording_driver(tmp_path):
    """The whole C launch on CPU, with a stand-in for libcuda that prints what it is given:
    the grid, block, shared memory, current stream and PDL attribute from the entry, each
    parameter's slot (then the two null scratch pointers), the context made current once,
    the calls it stands aside from (no entry, a grid it does not take, another option type,
    a launch hook, Triton's debug knob) and a driver error raised by name."""
    import subprocess
    import sys

    m = _fast_module()
    del m
    cuda_inc = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    src = tmp_path / "fake.c"
    src.write_text(_FAKE_DRIVER)
    lib = tmp_path / "libfakecuda.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src), f"-I{cuda_inc}"],
                   check=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("QMOE_FAKE_FAIL", None)
    out = subprocess.run([sys.executable, "-c", _FAKE_CHILD, str(lib)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    launches = [ln.split() for ln in lines if ln.startswith("launch")]
    results = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("result")]
    assert results == ["False", "True", "True", "True", "None", "None", "None", "False",
                       "None", "None"], lines
    assert [ln for ln in lines if ln.startswith("ctx")] == ["ctx 0x101"], lines  # device 1
    pdl = str(int(_cuda_attr("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION", cuda_inc)))
    for ln, grid in zip(launches, ((3, 2, 1), (7, 1, 1), (3, 1, 1))):
        f, gx, gy, gz, bx, by, bz, smem, stream, nattr, attr, *slots = ln[1:]
        assert (int(f, 16), (int(gx), int(gy), int(gz))) == (0x1234, grid)
        assert (int(bx), int(by), int(bz), int(smem)) == (128, 1, 1, 2048)
        assert (int(stream, 16), nattr, attr) == (0xABC1, "1", "a" + pdl)
        x_ptr, y_ptr = int(slots[0], 16), int(slots[1], 16)
        assert y_ptr % 16 == 6 and x_ptr % 16 == 0  # bf16 view at element 3
        assert [int(v, 16) for v in slots[2:]] == [
            5, 2**40, int.from_bytes(struct.pack("<f", 1.5), "little"), 1, 0, 0]
    assert len(launches) == 3  # the last: the stand-in's error, raised below
    assert "error qmoe._fastlaunch: cuLaunchKernelEx failed: stand-in" in out.stdout


def _cuda_attr(name: str, cuda_inc: str) -> int:
    """The value of enum member ``name`` in Triton's bundled cuda.h."""
    import re

    with open(os.path.join(cuda_inc, "cuda.h")) as f:
        text = f.read()
    return int(re.search(rf"\b{name}\s*=\s*(\d+)", text).group(1))
