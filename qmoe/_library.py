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

from qmoe._triton import current_device

_LIB = torch.library.Library("qmoe", "DEF")


def _is_list(t) -> bool:
    """Whether a schema type is a list or an optional list."""
    return isinstance(t, torch.ListType) or (
        isinstance(t, torch.OptionalType) and isinstance(t.getElementType(), torch.ListType))


class Op:
    """A defined ``qmoe::`` op: ``fn`` is its default kernel (the torch path), which a CUDA
    kernel may call for the cases it leaves to torch.

    Calling the ``Op`` runs ``torch.ops.qmoe.<name>``, except for eager calls with every
    argument given or defaulted by the schema, no mode, transform, tracer or profiler
    active, and plain tensors or qmoe's quantized ones (``eager_route``), where the
    dispatcher's layers would only pass the call through:

    - no gradient needed: the CUDA kernel is called directly; on other devices an op with
      an autograd formula runs its kernel below autograd (skipping the dispatcher's
      Autograd kernel, which runs in Python even when no input needs a gradient);
    - a gradient needed: the op's ``autograd.Function`` (``register_autograd``: the one the
      dispatcher's Autograd key applies too) runs around the kernel, through autograd's
      C++ ``apply``, without the dispatcher's two passes through Python;
    - no gradient needed and a tensor subclass among the arguments that declares
      ``_qmoe_eager_dispatch`` (qmoe's quantized tensors), for an op of a plain schema:
      that hook gets the op's overload and the arguments, as ``__torch_dispatch__`` would
      after the dispatcher's layers (it returns ``NotImplemented`` to take the dispatcher
      after all: the subclass overrides the dispatch, or has no rule for the op).

    Traced, transformed, profiled calls, other subclasses and subclass calls that need a
    gradient keep the dispatcher, whose autograd applies the same Function; under Dynamo
    the call goes straight to ``torch.ops`` (the graph records the op). Most of a small
    call's host time is these layers."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.qualname = f"qmoe::{name}"
        self.fn = fn
        self.cuda: Callable | None = None
        self.packet = getattr(torch.ops.qmoe, name)
        self._overload = self.packet.default
        schema = self._overload._schema
        self._nargs = len(schema.arguments)
        # the trailing arguments' defaults, so that a call leaving them out takes the
        # direct paths too (which pass every argument positionally)
        self._defaults: tuple = ()
        for a in reversed(schema.arguments):
            if not a.has_default_value():
                break
            self._defaults = (a.default_value, *self._defaults)
        # The op's own autograd.Function takes every argument positionally and tensors
        # only as such: no keyword-only, mutated or list (optional list included)
        # arguments and no list returns (such ops keep torch.library's autograd).
        self._plain_schema = not any(
            a.kwarg_only or a.alias_info is not None or _is_list(a.type)
            for a in schema.arguments) and not any(_is_list(r.type) for r in schema.returns)
        self._function: type[torch.autograd.Function] | None = None
        self._apply: Callable | None = None  # its apply, direct path (``_c_apply``)

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
        """The op's autograd formula, as ``torch.library.register_autograd`` takes it. For a
        plain schema one ``autograd.Function`` (``_op_function``) serves both the
        dispatcher's Autograd key (``_autograd_kernel``: compiled graphs, traced and
        transformed calls) and ``Op``'s direct eager path; other schemas register through
        ``torch.library``."""
        if not self._plain_schema:
            torch.library.register_autograd(
                self.qualname, backward, setup_context=setup_context, lib=_LIB
            )
            return
        self._function = _op_function(self, backward, setup_context)
        self._apply = _c_apply(self._function)
        _LIB.impl(self.name, _autograd_kernel(self), "Autograd", with_keyset=True)

    @property
    def default(self) -> torch._ops.OpOverload:
        """The op's overload (``torch.ops.qmoe.<name>.default``), e.g. for
        ``register_passthrough``."""
        return self._overload

    def below_autograd(self, *args):
        """The op's kernel for ``args`` (all positional), past autograd: the CUDA kernel
        itself for CUDA tensors, else the dispatcher from below its autograd keys."""
        if self.cuda is not None and _first_is_cuda(args):
            return self.cuda(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return self._overload(*args)

    def redispatch(self, keyset, *args):
        """The op's kernel for ``args`` as the dispatcher's keys ``keyset`` of the call
        continue below autograd: where the only key left is CUDA (plain CUDA tensors: a
        compiled graph's calls), the CUDA kernel itself, skipping a round trip through
        the dispatcher; else the dispatcher from there."""
        below = keyset & _AFTER_AUTOGRAD
        if self.cuda is not None and below.raw_repr() == _PLAIN_CUDA:
            return self.cuda(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return self._overload.redispatch(below, *args)

    def __call__(self, *args):
        if torch.compiler.is_compiling():  # traced: the graph records the op (and Dynamo
            return self.packet(*args)  # guards nothing of the routing below)
        given = args
        if len(args) < self._nargs and len(args) >= self._nargs - len(self._defaults):
            args = (*args, *self._defaults[len(args) - self._nargs:])
        if len(args) != self._nargs:  # the dispatcher's schema error
            return self.packet(*given)
        route = eager_route(args)
        if route == NO_GRAD:
            if self.cuda is not None and _first_is_cuda(args):
                return self.cuda(*args)
            if self._function is not None:
                return self.below_autograd(*args)
        elif route == NEEDS_GRAD and self._apply is not None:
            return self._apply(*[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a
                                 for a in args], None)
        elif route == SUBCLASS and self._plain_schema:
            # the arguments as __torch_dispatch__ gets them: trailing defaults left out
            n = len(args)
            while n > self._nargs - len(self._defaults) and (
                    args[n - 1] is self._defaults[n - 1 - self._nargs]):
                n -= 1
            out = _subclass_call(self._overload, args[:n])
            if out is not NotImplemented:
                return out
        return self.packet(*given)


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# A plain CUDA tensor's keys below autograd as a kernel receives them: CUDA alone (the
# dispatcher leaves out keys whose kernel is a fallthrough, ADInplaceOrView for qmoe's ops)
_PLAIN_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA).raw_repr()
_any_requires_grad = torch._C._any_requires_grad


def _op_function(op: Op, backward: Callable, setup_context: Callable):
    """``op``'s autograd formula as an ``autograd.Function`` over its kernel:
    ``setup_context(ctx, inputs, output)`` after the kernel, ``backward(ctx, *grads)``
    returning one gradient per input, as ``torch.library.register_autograd`` runs them.
    ``apply(*args, keyset)``: ``keyset`` None is ``Op``'s direct eager path (the kernel
    through ``Op.below_autograd``); else the dispatcher's keys of the call, which
    ``_autograd_kernel`` passes, and the kernel is the op redispatched below autograd
    (``Op.redispatch``: where fake tensors, proxies and transforms are served). One class
    per op, made at import."""

    def forward(ctx, *args):
        keyset, args = args[-1], args[:-1]
        out = op.below_autograd(*args) if keyset is None else op.redispatch(keyset, *args)
        setup_context(ctx=ctx, inputs=args, output=out)
        return out

    def run_backward(ctx, *grads):
        needs = ctx.needs_input_grad  # the formula sees one entry per op input, not the keyset
        ctx.needs_input_grad = needs[:-1]
        try:
            g = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (*g, None) if isinstance(g, tuple) else (g, None)  # (none for the keyset)

    return type(f"Function_{op.name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(run_backward)})


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _c_apply(function: type[torch.autograd.Function]) -> Callable:
    """``function.apply`` less its Python wrapper, for ``Op``'s direct path
    (``NEEDS_GRAD``: no functorch transform active, which is all the wrapper checks for
    besides a ``setup_context`` our functions do not define): autograd's C++ ``apply``
    bound to the class. The caller unwraps dead functorch wrappers, as the wrapper does."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)


def _autograd_kernel(op: Op) -> Callable:
    """The dispatcher's Autograd kernel of ``op`` (a plain schema): the op's
    ``autograd.Function`` when grad mode is on and an input requires a gradient, else the
    op redispatched below autograd (``Op.redispatch``). The dispatcher leaves out trailing
    arguments equal to their defaults; ``setup_context`` gets them filled back in."""
    nargs, defaults = op._nargs, op._defaults

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and _any_requires_grad(*args):
            if len(args) < nargs:
                args = (*args, *defaults[len(args) - nargs:])
            return op._function.apply(*args, keyset)
        return op.redispatch(keyset, *args)

    return kernel


DISPATCHER, NO_GRAD, NEEDS_GRAD, SUBCLASS = 0, 1, 2, 3
_OPS: dict = {}  # op overload -> its Op, written once per op at import (``define``)


def direct(func):
    """The ``Op`` of a ``qmoe::`` op overload (its call takes ``Op``'s direct eager paths),
    or ``func`` itself for any other op: passthrough rules call their inner ops through
    it."""
    return _OPS.get(func, func)


_PARAMETER = torch.nn.Parameter  # exactly: no __torch_dispatch__ or __torch_function__ of its own


def _subclass_call(overload, args: tuple):
    """A ``SUBCLASS`` route's call: the first subclass argument's ``_qmoe_eager_dispatch``
    hook (``NotImplemented``: it has no rule for the op)."""
    for a in args:
        if isinstance(a, torch.Tensor) and getattr(type(a), "_qmoe_eager_dispatch", None):
            return type(a)._qmoe_eager_dispatch(overload, args)
    return NotImplemented


def _first_is_cuda(args: tuple) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.is_cuda
    return False


def eager_route(args: tuple) -> int:
    """How ``Op.__call__`` runs a call with ``args``: ``DISPATCHER`` when traced (compile,
    export), with no tensor argument, with a tensor that is neither a plain
    ``torch.Tensor`` nor a ``Parameter`` (which dispatches as one) and declares no
    ``_qmoe_eager_dispatch`` (a fake tensor, another library's subclass), or with a
    dispatch or function mode, a functorch transform or the profiler active (which keeps
    the op's name in its trace through the dispatcher); else ``NEEDS_GRAD`` when grad
    mode is on and an input requires a gradient (``DISPATCHER`` if a subclass with the
    hook is among them), ``SUBCLASS`` when one is among them, ``NO_GRAD`` otherwise. The
    direct paths then reach the same kernel with the same arguments and attach the same
    autograd formula."""
    if torch.compiler.is_compiling():
        return DISPATCHER
    grad = torch.is_grad_enabled()
    seen = needs = sub = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not _PARAMETER:
                if getattr(type(a), "_qmoe_eager_dispatch", None) is None:
                    return DISPATCHER
                sub = True
            seen = True
            needs = needs or (grad and a.requires_grad)
    if not seen or (
        torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._autograd._profiler_enabled()
    ):
        return DISPATCHER
    if sub:
        return DISPATCHER if needs else SUBCLASS
    return NEEDS_GRAD if needs else NO_GRAD


def direct_call_ok(args: tuple) -> bool:
    """Whether a call with ``args`` goes straight to an op's CUDA kernel: an eager
    ``NO_GRAD`` call (``eager_route``) whose first tensor is a CUDA tensor."""
    return eager_route(args) == NO_GRAD and _first_is_cuda(args)


def on_input_device(fn: Callable) -> Callable:
    """``fn`` run with the current CUDA device set to the device of its first tensor
    argument when that is another CUDA device (a no-op check otherwise)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.is_cuda and a.get_device() != current_device():
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
        op = Op(name, fn)
        _OPS[op.default] = op
        return op

    return deco
