"""Which implementation serves each device, and loading of the compiled CPU kernels.

``qmoe._C`` (built from csrc/ by ``pip install``) registers C++ kernels for the ``qmoe::``
ops on the CPU dispatch key; loading it is a ``dlopen``, never a compile. Without it (built
with ``QMOE_SKIP_CPP_BUILD=1``) CPU tensors use the vectorized torch implementations.
"""

from __future__ import annotations

import importlib.machinery
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _extension_path() -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_HERE, "_C" + suffix)
        if os.path.exists(path):
            return path
    return None


def load_cpp_kernels() -> bool:
    """Load qmoe._C if it was built; returns whether the C++ CPU kernels are in use."""
    path = _extension_path()
    if path is None:
        return False
    torch.ops.load_library(path)
    return True


def backends() -> dict[str, str]:
    """The implementation behind the ``qmoe::`` ops per device, e.g.
    ``{"cpu": "c++ (qmoe._C)", "cuda": "triton"}``."""
    cpu = "c++ (qmoe._C)" if cpp_loaded() else "torch (vectorized; built without csrc/)"
    cuda = "triton" if torch.cuda.is_available() else "triton (no CUDA device here)"
    return {"cpu": cpu, "cuda": cuda}


def cpp_loaded() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("qmoe::permute", "CPU")
