"""Shared fixtures: fresh random inputs every run, with the seed printed for replay.

Set QMOE_SEED=<int> to replay a failing run. Kernel tests run on CUDA when present,
otherwise on CPU through the Triton interpreter (TRITON_INTERPRET=1, set by .ci/run).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests: a fixed example budget per test (CI time), fresh draws every run, and
# the falsifying example (with its data seed) printed on failure. `--hypothesis-profile
# qmoe-long` widens the search.
settings.register_profile(
    "qmoe-ci", max_examples=40, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("qmoe-long", parent=settings.get_profile("qmoe-ci"), max_examples=2000)
settings.load_profile("qmoe-ci")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    seed = int(os.environ.get("QMOE_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    print(f"[qmoe] seed={seed}  (replay: QMOE_SEED={seed} pytest '{request.node.nodeid}')")
    yield


def kernel_device() -> str | None:
    """Where Triton kernels can run: 'cuda', 'cpu' under the interpreter, or None."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


def interpreted_kernels_off() -> bool:
    """``QMOE_KERNEL_TESTS=0`` on a machine without CUDA: skip the tests that run Triton
    kernels (under the interpreter). CI sets it for its second pass (the C++ CPU path):
    those tests do not touch the CPU backend and already ran in the first."""
    return not torch.cuda.is_available() and os.environ.get("QMOE_KERNEL_TESTS") == "0"


def _version(mod) -> tuple[int, int]:
    return tuple(int(p) for p in mod.__version__.split(".")[:2])


def interpreter_mismatch() -> str | None:
    """Why the Triton interpreter cannot run our kernels here, or None. Tritons before 3.7
    turn a loaded scalar used as a loop bound into a Python int with ``int()`` on a
    1-element array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted
    to Python scalars"): every kernel with a data-dependent loop fails. Seen with Triton
    3.6.0 + numpy 2.4.6; numpy 2.3.5 and Triton 3.7.0-3.9 work."""
    import numpy
    import triton

    if _version(triton) < (3, 7) and _version(numpy) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__}: "
                "install numpy<2.4 (pip install 'numpy<2.4') or triton>=3.7")
    return None


@pytest.fixture
def kdevice():
    if interpreted_kernels_off():
        pytest.skip("Triton kernel tests off (QMOE_KERNEL_TESTS=0; they ran in CI's first pass)")
    dev = kernel_device()
    if dev is None:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 to run Triton kernels")
    if dev == "cpu" and (why := interpreter_mismatch()):
        pytest.fail(why, pytrace=False)
    return dev


@pytest.fixture
def interpreter_asserts(monkeypatch):
    """Run ``tl.device_assert`` under the interpreter. Its builder keeps fixed options with
    ``debug`` off, whatever the launch asks, so without this the kernels' device-side checks
    (``check_routes``, ``assert_probs_not_nan``, the chunk sort's; compiled in on CUDA through
    ``launch.assert_options()``) are skipped on CPU. Patches Triton's interpreter for this
    test only; a failed check raises InterpreterError."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        interpreter.InterpreterOptions(debug=True, sanitize_overflow=False))


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_empty():
    """``torch.empty`` / ``new_empty`` fill with NaN (floats) and the largest value
    (integers) for the test (torch's deterministic mode with ``fill_uninitialized_memory``;
    warn-only, so no op refuses): an output a launcher allocates and a kernel leaves
    unwritten shows, instead of passing on whatever the allocator held."""
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    torch.utils.deterministic.fill_uninitialized_memory = was[2]
