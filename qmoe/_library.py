"""Registration of qmoe's ``qmoe::`` ops through ``torch.library.Library``.

``torch.library.custom_op`` wraps every call in Python (about 17 us per call on a CPU
core); a plain ``define`` + ``impl`` costs about 2 us, which matters for small MoE
batches where launch overhead dominates. ``define`` keeps custom_op's decorator shape:
the returned object takes ``register_fake`` and ``register_autograd`` and is callable.

``_LIB`` is the namespace's registration handle, written once at import (the ops
themselves keep no state).

Each op's implementation runs with the current CUDA device set to its first tensor
argument's device: Triton launches on the current device and stream, not on the tensors'
device, so without this an op on ``cuda:1`` called while ``cuda:0`` is current would launch
on the wrong GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_LIB = torch.library.Library("qmoe", "DEF")


class Op:
    """A defined ``qmoe::`` op: ``fn`` is its default kernel (the torch path), which a CUDA
    kernel may call for the cases it leaves to torch.

    Calling the ``Op`` runs ``torch.ops.qmoe.<name>``, except in the one case where the
    dispatcher would only pass the call through to the CUDA kernel: an eager call on plain
    CUDA tensors that needs no gradient, with no mode, transform, tracer or profiler active
    (``direct_call_ok``). That case calls the CUDA kernel directly, skipping the dispatcher
    and the Python autograd layer of ``torch.library`` (most of a small call's host time)."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.qualname = f"qmoe::{name}"
        self.fn = fn
        self.cuda: Callable | None = None
        self.packet = getattr(torch.ops.qmoe, name)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_cuda(self, fn: Callable) -> Callable:
        """Register ``fn`` as the op's CUDA kernel (the Triton path; run on its first
        tensor's device): the dispatcher then picks CUDA or the default kernel, so an op
        body never asks which device it is on."""
        self.cuda = on_input_device(fn)
        _LIB.impl(self.name, self.cuda, "CUDA")
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        torch.library.register_autograd(
            self.qualname, backward, setup_context=setup_context, lib=_LIB
        )

    @property
    def default(self) -> torch._ops.OpOverload:
        """The op's overload (``torch.ops.qmoe.<name>.default``), e.g. for
        ``register_passthrough``."""
        return getattr(torch.ops.qmoe, self.name).default

    def __call__(self, *args):
        if self.cuda is not None and direct_call_ok(args):
            return self.cuda(*args)
        return self.packet(*args)


def direct_call_ok(args: tuple) -> bool:
    """Whether a call with ``args`` may go straight to an op's CUDA kernel: not traced
    (compile, export), its first tensor a CUDA tensor, every tensor a plain
    ``torch.Tensor`` (no subclass, no fake tensor) needing no gradient here, and no
    dispatch or function mode, functorch transform or profiler active (the profiler keeps
    the op's name in its trace through the dispatcher). Then the dispatcher's path would
    reach the same kernel with the same arguments and attach nothing to the outputs."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    cuda = None
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor or (grad and a.requires_grad):
                return False
            if cuda is None:
                cuda = a.is_cuda
    return bool(cuda) and not (
        torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._autograd._profiler_enabled()
    )


def on_input_device(fn: Callable) -> Callable:
    """``fn`` run with the current CUDA device set to the device of its first tensor
    argument when that is another CUDA device (a no-op check otherwise)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.is_cuda and a.get_device() != torch.cuda.current_device():
                    with torch.cuda.device(a.device):
                        return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)

    return run


def define(schema: str) -> Callable[[Callable], Op]:
    """Decorator: define ``qmoe::<schema>`` with the function as its default kernel
    (``CompositeExplicitAutograd``: the torch path, run on its first tensor argument's
    device by ``on_input_device``). ``Op.register_cuda`` adds the Triton kernel for CUDA
    tensors; ``qmoe._C`` (``csrc/``) registers C++ kernels on the CPU key for the ops it
    has (``qmoe.backends()``)."""

    def deco(fn: Callable) -> Op:
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, on_input_device(fn), "CompositeExplicitAutograd")
        return Op(name, fn)

    return deco
