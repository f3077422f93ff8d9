"""The ``QuantizedTensor`` base: fields, flatten/unflatten, op table, passthrough registry.

Dispatch rules, in order, for an aten or custom op that reaches ``__torch_dispatch__``
with a quantized argument:

1. **Op table.** ``Cls.implements(op)`` registers a per-class implementation (looked up
   along the MRO, so ops registered on ``QuantizedTensor`` serve every subclass).
   These keep ``qdata`` and ``scale`` consistent (row slicing, cat, view, ...).
2. **Passthrough registry.** ``register_passthrough(op, impl)`` registers an op that
   receives the quantized tensors intact: ``impl(func, args, kwargs)`` moves raw
   ``qdata``/``scale`` (usually through :meth:`QuantizedTensor.map_rows`) and rewraps.
   qmoe's permutation ops register here; so can any library's ops.
3. **Writes.** An op that writes into a quantized argument (in place or ``out=``) and is
   in neither table raises :class:`QuantizedDispatchError`, in every mode: the fallback
   would write into a dequantized temporary and leave the quantized tensor unchanged.
4. **Fallback.** Anything else dequantizes every quantized argument to its original
   dtype and runs in high precision, with a :class:`QuantizedFallbackWarning` naming the
   op (once per op, through Python's ``warnings`` registry). Inside
   :func:`strict_dispatch` the fallback raises instead.

There is no module-level mutable state here beyond the registries (the passthrough
registry, and each class's op table, filled at import and extended by ``implements``):
strict mode lives in a ``ContextVar`` (per thread / task), and warnings are
de-duplicated by the standard ``warnings`` machinery.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map

from qmoe.tensors.layouts import FP8_DTYPES, HP_DTYPES
from qmoe.tensors.serialization import set_state, validate

aten = torch.ops.aten

OpImpl = Callable[..., Any]


class QuantizedFallbackWarning(UserWarning):
    """An op had no quantized implementation and ran on dequantized inputs."""


class QuantizedDispatchError(NotImplementedError):
    """Raised when an op would write into a quantized tensor without a quantized
    implementation (any mode), and in strict mode when an op would fall back to
    dequantization."""


_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qmoe_strict_dispatch", default=False
)

# op -> impl(func, args, kwargs). The one registry this module keeps (see module docs).
_PASSTHROUGH: dict[Any, OpImpl] = {}


@contextlib.contextmanager
def strict_dispatch(enabled: bool = True) -> Iterator[None]:
    """Within this context an op that would dequantize-and-fall-back raises instead.

    Raises :class:`QuantizedDispatchError` (a ``NotImplementedError``) naming the op.
    The setting is per thread / asyncio task (a ``ContextVar``).
    """
    token = _STRICT.set(enabled)
    try:
        yield
    finally:
        _STRICT.reset(token)


def _op_key(op: Any) -> Any:
    """Registry key: an ``OpOverload`` as is; a packet (``torch.ops.ns.op``) by its default."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(
            f"register_passthrough: op must be a torch OpOverload such as "
            f"torch.ops.mylib.myop.default, got {type(op).__name__}"
        )
    return op


def register_passthrough(op: Any, impl: OpImpl | None = None):
    """Register ``op`` so that it receives quantized tensors intact.

    ``impl(func, args, kwargs)`` is called from ``__torch_dispatch__`` with the original
    arguments, quantized tensors included. It should move ``qdata`` and ``scale`` with
    ordinary ops on plain tensors (see :meth:`QuantizedTensor.map_rows`) and return
    rewrapped outputs. Because it only calls ops on the inner tensors it traces under
    ``torch.compile``. Usable as a decorator::

        @register_passthrough(torch.ops.mylib.gather_rows.default)
        def _(func, args, kwargs):
            x, index = args
            return x.map_rows(lambda t: func(t, index))

    Registering a second, different ``impl`` for the same op raises ``ValueError``;
    call :func:`unregister_passthrough` first.
    """
    key = _op_key(op)

    def deco(fn: OpImpl) -> OpImpl:
        if not callable(fn):
            raise TypeError("register_passthrough: impl must be callable(func, args, kwargs)")
        old = _PASSTHROUGH.get(key)
        if old is not None and old is not fn:
            fix = ("it is one of qmoe's own ops, whose rule stays" if key.namespace == "qmoe"
                   else "call unregister_passthrough(op) first")
            raise ValueError(
                f"register_passthrough: {key} already has a passthrough impl ({old!r}); {fix}"
            )
        _PASSTHROUGH[key] = fn
        return fn

    return deco if impl is None else deco(impl)


def unregister_passthrough(op: Any) -> None:
    """Remove ``op`` from the passthrough registry (no error if it is not there). Ops of
    the ``qmoe::`` namespace raise ``ValueError``: qmoe's own rules stay, since removing
    one would silently turn every later call with a quantized input, in any thread, into
    a dequantizing fallback."""
    key = _op_key(op)
    if key.namespace == "qmoe":
        raise ValueError(
            f"unregister_passthrough: {key} is one of qmoe's own ops and stays passthrough; "
            "to dequantize its input, call .dequantize() on it before the op"
        )
    _PASSTHROUGH.pop(key, None)


def passthrough_ops() -> tuple[Any, ...]:
    """The ops currently registered as passthrough, sorted by name."""
    return tuple(sorted(_PASSTHROUGH, key=str))


def _writes_quantized(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` writes into a quantized argument (in place, or as ``out=``): its
    schema marks the argument written (plain destinations of a quantized source are fine:
    the fallback writes into them for real)."""
    schema = func._schema
    if not schema.is_mutable:
        return False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if any(isinstance(t, QuantizedTensor) for t in (v if isinstance(v, (list, tuple))
                                                         else [v])):
            return True
    return False


def rebuild_quantized(cls: type, bits: torch.Tensor, fp8_dtype: torch.dtype,
                      raw_scale: torch.Tensor, attrs: tuple, requires_grad: bool):
    """The unpickler of ``QuantizedTensor.__reduce_ex__``. It is on the ``weights_only``
    allow-list, so it checks its arguments and returns a tensor that passed
    :meth:`QuantizedTensor.validate` (layout and scale values: a host read of the scale
    on CUDA)."""
    if not (isinstance(cls, type) and issubclass(cls, QuantizedTensor)):
        raise TypeError(f"rebuild_quantized: {cls!r} is not a qmoe quantized tensor type")
    if fp8_dtype not in FP8_DTYPES or not isinstance(bits, torch.Tensor) or (
            bits.dtype != torch.uint8) or not isinstance(raw_scale, torch.Tensor):
        raise TypeError("rebuild_quantized: expected uint8 bits, an fp8 dtype and a scale "
                        f"tensor, got {getattr(bits, 'dtype', type(bits))}, {fp8_dtype} and "
                        f"{type(raw_scale).__name__}")
    if not isinstance(attrs, tuple):
        raise TypeError(f"rebuild_quantized: attributes must be a tuple, got "
                        f"{type(attrs).__name__}")
    out = cls(bits.view(fp8_dtype), raw_scale, *attrs, requires_grad=bool(requires_grad))
    out.validate()
    return out


def e8m0_to_fp32(bits: torch.Tensor) -> torch.Tensor:
    """e8m0 scale bytes (``uint8``) as fp32: ``2 ** (b - 127)``; 0 is the subnormal
    ``2**-127``, 255 is NaN."""
    b = bits.to(torch.int32)
    s = torch.where(b == 0, 2.0**-127, (b << 23).view(torch.float32))
    return torch.where(b == 255, float("nan"), s)


def expand_block_scales(scale: torch.Tensor, h: int, block_size: int) -> torch.Tensor:
    """``[..., ceil(H / bs)]`` block scales broadcast to ``[..., H]``. A gather by block
    index rather than ``repeat_interleave(...)[..., :H]``: Inductor's CPU backend (torch
    2.13) miscomputes the partial last block of the latter."""
    cols = torch.arange(h, device=scale.device) // block_size
    return scale[..., cols]


def _dequantize_arg(x: Any) -> Any:
    return x._dequantize_raw() if isinstance(x, QuantizedTensor) else x


class QuantizedTensor(torch.Tensor):
    """Base of qmoe's FP8 tensor subclasses (a wrapper subclass: it owns no storage).

    A subclass declares its fields:

    * ``tensor_data_names``: inner tensors, ``("qdata", "scale")``. ``qdata`` is
      ``[..., H]`` fp8; ``scale`` is ``[]`` (per-tensor) or ``[..., ceil(H / block_size)]``.
    * ``tensor_attribute_names``: hashable constructor attributes (``orig_dtype``, ...).
    * ``block_size``: ``None`` for a per-tensor scale, else the 1 x ``block_size`` block
      along the last dim (a class constant or an instance attribute).

    The wrapper reports ``shape == qdata.shape`` and ``dtype == orig_dtype`` (the
    high-precision dtype it stands for), so autograd sees gradients in that dtype.
    """

    tensor_data_names: ClassVar[tuple[str, ...]] = ("qdata", "scale")
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("orig_dtype",)
    block_size: int | None = None
    qdata: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype

    _op_table: ClassVar[dict[Any, OpImpl]] = {}
    # The op tables of the class and its quantized bases, nearest first: each class's own
    # dict, made once in __init_subclass__ and filled in place by ``implements``, so the
    # chain never changes once the class exists (``_lookup`` walks it, not the MRO).
    _op_tables: ClassVar[tuple[dict[Any, OpImpl], ...]] = (_op_table,)
    # Names set once by the constructor (read-only afterwards; see __setattr__), and the
    # names a pickled state may not give a different value.
    _fields: ClassVar[frozenset[str]] = frozenset(("qdata", "scale", "orig_dtype"))
    _field_names: ClassVar[frozenset[str]] = _fields | {"block_size"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._op_table = {}
        cls._op_tables = tuple(k.__dict__["_op_table"] for k in cls.__mro__
                               if "_op_table" in k.__dict__)
        cls._fields = frozenset((*cls.tensor_data_names, *cls.tensor_attribute_names))
        cls._field_names = cls._fields | {"qdata", "scale", "block_size"}

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, *attrs: Any, requires_grad=False):
        if cls is QuantizedTensor:
            raise TypeError("QuantizedTensor is abstract; use Float8Tensor and friends")
        if len(attrs) != len(cls.tensor_attribute_names):
            raise TypeError(
                f"{cls.__name__}(qdata, scale, {', '.join(cls.tensor_attribute_names)}) "
                f"takes {len(cls.tensor_attribute_names)} attributes, got {len(attrs)}"
            )
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            qdata.shape,
            strides=qdata.stride(),  # the wrapper's layout is its data's (views, compile)
            dtype=attrs[0],
            device=qdata.device,
            requires_grad=requires_grad,
        )
        # the fields straight into the instance dict: __setattr__'s read-only guard is for
        # later writes (a Python call per field here, a fifth of a small quantize's host time)
        fields = self.__dict__
        fields["qdata"] = qdata
        fields[cls.tensor_data_names[1]] = cls._store_scale(scale)
        fields.update(zip(cls.tensor_attribute_names, attrs))
        self._check_layout()
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # fields are set in __new__
        super().__init__()

    # ------------------------------------------------------------------ layout
    @classmethod
    def expected_scale_shape(cls, shape: torch.Size, block_size: int | None) -> tuple[int, ...]:
        if block_size is None:
            return ()
        return (*shape[:-1], -(-shape[-1] // block_size))

    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    @classmethod
    def _store_scale(cls, scale: torch.Tensor) -> torch.Tensor:
        """The scale as the class stores it (MX keeps e8m0 bits as uint8)."""
        return scale

    @property
    def raw_scale(self) -> torch.Tensor:
        """The scale tensor as stored and moved by ops (``scale`` except for MX: uint8 bits)."""
        return getattr(self, self.tensor_data_names[1])

    def _check_layout(self) -> None:
        name = type(self).__name__
        q, s = self.qdata, self.raw_scale
        if q.dtype not in FP8_DTYPES:
            raise TypeError(f"{name}: qdata must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
        if q.dim() == 0:
            raise ValueError(f"{name}: qdata must have at least one dim [..., H], got a scalar")
        if s.dtype not in self.scale_dtypes:
            raise TypeError(f"{name}: scale must be {self.scale_dtypes[0]}, got {s.dtype}")
        if self.orig_dtype not in HP_DTYPES:
            raise TypeError(
                f"{name}: orig_dtype must be float32, bfloat16 or float16, got {self.orig_dtype}"
            )
        if s.device != q.device:
            raise ValueError(f"{name}: scale is on {s.device} but qdata is on {q.device}")
        want = self.expected_scale_shape(q.shape, self.block_size)
        if tuple(s.shape) != want:
            raise ValueError(
                f"{name}: scale shape {tuple(s.shape)} does not match qdata shape "
                f"{tuple(q.shape)}; expected {want}"
            )

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.qdata.dtype

    def _attrs(self) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in self.tensor_attribute_names)

    def same_layout(self, other: Any) -> bool:
        """True when ``other`` is the same class, fp8 dtype and attributes (same recipe)."""
        return (
            type(other) is type(self)
            and other.fp8_dtype == self.fp8_dtype
            and other._attrs() == self._attrs()
        )

    def _rewrap(self, qdata: torch.Tensor, raw_scale: torch.Tensor) -> QuantizedTensor:
        return type(self)(qdata, raw_scale, *self._attrs())

    def map_rows(
        self, fn: Callable[[torch.Tensor], torch.Tensor], scale_fn: Callable | None = None
    ) -> QuantizedTensor:
        """Apply a leading-dims transform to ``qdata`` and to block scales; rewrap.

        ``fn`` must leave the last dim alone (gather/permute/slice rows, view leading
        dims). It is applied to ``qdata`` ``[..., H]`` and, for block scales, to
        ``scale`` ``[..., ceil(H / block)]``; a per-tensor scale carries over unchanged.
        ``scale_fn`` overrides the transform used for the scale.
        """
        s = self.raw_scale
        q = fn(self.qdata)
        if self.block_size is None and not torch._C._is_alias_of(q, self.qdata):
            s = s.clone()  # new rows own their scale: a copy_ into them must not rescale self
        return self._rewrap(q, s if self.block_size is None else (scale_fn or fn)(s))

    # ---------------------------------------------------------- (de)quantize
    def scale_fp32(self) -> torch.Tensor:
        """The scale as fp32 values (same shape as ``scale``)."""
        return self.raw_scale.float()

    def _scale_full(self) -> torch.Tensor:
        """fp32 scale broadcastable against ``qdata`` (block scales expanded)."""
        s = self.scale_fp32()
        if self.block_size is None:
            return s
        return expand_block_scales(s, self.qdata.shape[-1], self.block_size)

    def _dequantize_raw(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.orig_dtype
        if self.qdata.is_cuda and self.qdata.dim() and dtype in HP_DTYPES:
            # one pass (``qmoe::dequantize_blocks``, defined with the quantize ops), the
            # same bits as the torch form below, which writes fp32 twice on the way
            q, s = self.qdata, self.scale_fp32()
            bs = self.block_size
            if bs is None:  # per tensor
                s, bs = s.reshape(()), max(q.shape[-1], 1)
            return torch.ops.qmoe.dequantize_blocks(q.view(torch.uint8), q.dtype, s, bs, dtype)
        out = self.qdata.float() * self._scale_full()
        return out.to(dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``qdata.float() * scale`` (block scales broadcast), in ``orig_dtype`` or ``dtype``.

        Differentiable: the gradient passes straight through to this tensor.
        """
        return _Dequantize.apply(self, dtype)

    # ------------------------------------------------------- tracing support
    def _stable_hash_for_caching(self) -> str:
        """Deterministic key for the AOTAutograd cache: class, attributes, inner metadata."""
        inner = [
            (n, t.dtype, tuple(t.shape), t.stride(), t.device.type)
            for n in self.tensor_data_names
            for t in [getattr(self, n)]
        ]
        key = repr((type(self).__qualname__, self._attrs(), inner))
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def __reduce_ex__(self, protocol: int):
        """Pickle as ``(class, qdata's uint8 bits, fp8 dtype, scale, attributes)`` plus the
        tensor's Python state (``_is_param`` of a Parameter, user attributes), through
        torch's ``_rebuild_from_type_v2``. torch 2.13 pickles fp8 storages for
        ``torch.save`` only: plain ``pickle`` (multiprocessing, Ray) writes them but cannot
        load them back ("UntypedStorage has no attribute dtype"), so the bits travel as
        uint8 (``torch.save`` keeps views and shared storage, as for any tensor).
        ``torch.load(weights_only=True)`` accepts ``rebuild_quantized``, and still loads
        files written by torch's own reduction. Every load ends in :meth:`validate`
        (``rebuild_quantized``, then :meth:`__setstate__`)."""
        fields = set(self.tensor_data_names) | set(self.tensor_attribute_names)
        state = {k: v for k, v in self.__dict__.items() if k not in fields}
        args = (type(self), self.qdata.view(torch.uint8), self.qdata.dtype, self.raw_scale,
                self._attrs(), self.requires_grad)
        return (torch._tensor._rebuild_from_type_v2,
                (rebuild_quantized, type(self), args, state))

    def validate(self) -> None:
        """Check the tensor as a load must leave it (layout, the wrapper against its
        ``qdata``, fp32 scale values); raise ``ValueError`` / ``TypeError``. The rules
        are ``qmoe.tensors.serialization.validate``'s. The value check reads the scale (a
        host sync on CUDA), so it runs at load time and in ``copy.deepcopy``, not in the
        constructor, which every op calls. Call it on tensors you build from outside
        data."""
        validate(self)

    def __setattr__(self, name: str, value: Any) -> None:
        """Fields are set once, by the constructor: a later write (``q.scale = s``, or
        torch's ``_rebuild_parameter_with_state`` applying a pickled state with setattr)
        would skip its checks. ``__class__`` and ``__dict__`` stay assignable:
        ``torch.utils.swap_tensors`` swaps them (``module.to`` with
        ``torch.__future__.set_swap_module_params_on_conversion(True)``)."""
        if name in self._field_names and (name in vars(self) or name not in self._fields):
            raise AttributeError(
                f"{type(self).__name__}.{name} is read-only (set by the constructor, "
                "whose checks a later write would skip); build a new tensor, or copy_ "
                "a tensor of the same recipe into this one")
        super().__setattr__(name, value)

    def __deepcopy__(self, memo: dict) -> QuantizedTensor:
        """torch's deepcopy (``clone()``, then a deep copy of ``__dict__``), then
        :meth:`validate`."""
        out = super().__deepcopy__(memo)
        out.validate()
        return out

    def __setstate__(self, state: Any) -> None:
        """Apply a pickled Python state, then :meth:`validate`
        (``qmoe.tensors.serialization.set_state``): torch's ``_rebuild_from_type_v2``
        calls this after building the tensor, for every load (``weights_only`` or not,
        plain ``pickle``, ``copy.copy``)."""
        set_state(self, state)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        return list(self.tensor_data_names), self._attrs()

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, attrs, outer_size, outer_stride):
        return cls(*(inner_tensors[n] for n in cls.tensor_data_names), *attrs)

    def __repr__(self) -> str:  # no tensor_contents: printing must not dequantize
        attrs = ", ".join(f"{n}={getattr(self, n)}" for n in self.tensor_attribute_names)
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, fp8_dtype={self.fp8_dtype}, "
            f"{attrs}, device={self.device},\n  qdata={self.qdata!r},\n  scale={self.scale!r})"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ------------------------------------------------------------- dispatch
    @classmethod
    def implements(cls, ops: Any) -> Callable[[OpImpl], OpImpl]:
        """Decorator: register ``impl(func, types, args, kwargs)`` for ``ops`` on ``cls``."""
        ops = ops if isinstance(ops, (list, tuple)) else [ops]

        def deco(fn: OpImpl) -> OpImpl:
            for op in ops:
                cls._op_table[op] = fn
            return fn

        return deco

    @classmethod
    def _lookup(cls, func: Any) -> OpImpl | None:
        for table in cls._op_tables:
            impl = table.get(func)
            if impl is not None:
                return impl
        return None

    @classmethod
    def _qmoe_eager_dispatch(cls, func, args: tuple):
        """What ``__torch_dispatch__`` answers for ``func(*args)`` with its passthrough rule,
        called by ``qmoe._library.Op`` for an eager ``qmoe::`` call that needs no gradient,
        without the dispatcher's layers in between. ``NotImplemented`` (the dispatcher then
        runs) where the dispatcher could answer otherwise: a quantized argument's class
        overrides ``__torch_dispatch__`` or defines ``__torch_function__``, or has ``func``
        in its op table; or ``func`` is outside the passthrough registry (its fallback and
        warning stay the dispatcher's)."""
        for a in args:
            if isinstance(a, QuantizedTensor):
                t = type(a)
                if (t.__torch_dispatch__.__func__ is not _BASE_DISPATCH
                        or t.__torch_function__ is not _NO_TORCH_FUNCTION
                        or t._lookup(func) is not None):
                    return NotImplemented
        impl = _PASSTHROUGH.get(func)
        return NotImplemented if impl is None else impl(func, args, {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = cls._lookup(func)
        if impl is not None:
            return impl(func, types, args, kwargs)
        impl = _PASSTHROUGH.get(func)
        if impl is not None:
            return impl(func, args, kwargs)
        if _writes_quantized(func, args, kwargs):
            raise QuantizedDispatchError(
                f"{func} writes into a {cls.__name__} and has no quantized implementation: "
                "the dequantizing fallback would modify a temporary copy and leave the "
                "quantized tensor unchanged; dequantize() first, or copy_ a tensor of the "
                "same recipe into it"
            )
        if _STRICT.get():
            raise QuantizedDispatchError(
                f"{func} has no quantized implementation for {cls.__name__} and strict "
                "dispatch is on; dequantize explicitly, or register the op with "
                "qmoe.register_passthrough"
            )
        warnings.warn(
            f"{func} has no quantized implementation for {cls.__name__}; running it on "
            "dequantized inputs in high precision (use qmoe.strict_dispatch() to raise)",
            QuantizedFallbackWarning,
            stacklevel=1,  # one location, so the warnings registry shows each op once
        )
        return func(*tree_map(_dequantize_arg, args), **tree_map(_dequantize_arg, kwargs))


_BASE_DISPATCH = QuantizedTensor.__torch_dispatch__.__func__
_NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


class _Dequantize(torch.autograd.Function):
    """``QuantizedTensor.dequantize``: straight-through gradient, in the input's dtype."""

    @staticmethod
    def forward(ctx, q, dtype):
        ctx.orig_dtype = q.dtype
        return q._dequantize_raw(dtype)

    @staticmethod
    def backward(ctx, grad):
        return plain_grad(grad).to(ctx.orig_dtype), None


def plain_grad(t: torch.Tensor) -> torch.Tensor:
    """A gradient in high precision. Eager only: under compile AOTAutograd guesses tangents
    of a subclass output to be that subclass, so Dynamo must not branch on the type."""
    if not torch.compiler.is_compiling() and isinstance(t, QuantizedTensor):
        return t._dequantize_raw()
    return t
