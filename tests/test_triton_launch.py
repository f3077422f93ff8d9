"""``qmoe._triton.launch``: a cached direct launch gives what ``kernel[grid](...)`` gives,
for every specialization Triton distinguishes (ints equal to 1 or multiples of 16,
misaligned tensor views, dtypes, None), and keys the cache by specialization, not by call.
On CPU the interpreter takes Triton's own path (covered by every kernel test there)."""

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
