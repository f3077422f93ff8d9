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


@pytest.fixture
def kdevice():
    dev = kernel_device()
    if dev is None:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 to run Triton kernels")
    return dev


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
