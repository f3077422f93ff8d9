"""Argument checks shared by the public ops: metadata checks are free; value checks on
device tensors either ride on a host sync the call makes anyway, or become
``torch._assert_async`` so the sync-free paths stay sync-free."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch

from qmoe.ops.launch import ID_LIMIT  # noqa: F401 - re-exported: the public ops' bound
from qmoe.tensors.base import QuantizedTensor
from qmoe.tensors.layouts import HP_DTYPES
from qmoe.tensors.quantize import check_block_args, check_op_dtypes, check_scale_tensor

#: inp's dtypes: the high-precision ones (the rows the ops move unquantized)
FLOATS = HP_DTYPES
#: probs and merging_probs: also fp64 (Megatron's ``moe_router_dtype="fp64"`` routers);
#: kernels read them as fp32 for the merge, permuted probs keep the probs' dtype
PROBS_DTYPES = (*FLOATS, torch.float64)
#: Index maps' ids, ``split_sizes`` and ``sorted_index``: signed integers
SIGNED_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
#: Integer masks, ``tokens_per_expert`` and a tensor ``num_out_tokens``: any integer
INT_DTYPES = (*SIGNED_INT_DTYPES, torch.uint8)


def as_int(fn: str, name: str, v):
    """``v`` as an int (or SymInt): Python ints, and integer scalars of other types
    (``numpy.int64``) through ``__index__``; bools and everything else are a TypeError."""
    if isinstance(v, bool):
        raise TypeError(f"{fn}: {name} must be an int, got bool {v!r}")
    if isinstance(v, (int, torch.SymInt)):  # (no operator.index: it would specialize a SymInt)
        return v
    if hasattr(type(v), "__index__"):
        try:
            return operator.index(v)
        except TypeError:  # e.g. a numpy array of one element
            pass
    raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__} {v!r}")


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _raise_at_trace_time(cls: type, msg: str) -> None:
    """Run by Dynamo at trace time (marked constant below): raise ``cls(msg)`` from there,
    which Dynamo reports as ``InternalTorchDynamoError: <cls>: <msg>``, chained to
    ours, where an exception raised in traced code reads ``Unsupported: Observed
    exception`` under ``fullgraph=True`` and shows ours only in its debug context. The
    same with graph breaks allowed: a raise in traced code after this call returned (a
    graph break, then a resumed frame) ended in a bare ``AssertionError`` on torch 2.11."""
    raise cls(msg)


# torch._dynamo.assume_constant_result without importing torch._dynamo at import time
_raise_at_trace_time._dynamo_marked_constant = True


def raise_error(exc: Exception):
    """Raise ``exc`` so that the user reads its message first, eager or compiled: while
    Dynamo traces, the trace-time raise above (``fullgraph`` or not); otherwise (eager,
    non-strict export) a plain ``raise``."""
    if torch.compiler.is_dynamo_compiling():
        _raise_at_trace_time(type(exc), str(exc))
    raise exc


def user_errors(fn):
    """Decorator of a public function: its argument refusals (``ValueError``,
    ``TypeError``) reach the user through ``raise_error``, so that under
    ``fullgraph=True`` qmoe's message is the first line of Dynamo's error. In eager mode
    the same exception propagates unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            raise_error(e)

    return wrapper


def check_tensor(fn: str, name: str, x, *, ndim: int | None = None, dtypes=None, fix: str = ""):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{fn}: {name} must be a dense tensor, got layout {x.layout}; pass "
                        f"{name}.to_dense()")
    if ndim is not None and x.dim() != ndim:
        hint = f"; {fix}" if fix else ""
        raise ValueError(f"{fn}: {name} must be {ndim}-d, got shape {tuple(x.shape)}{hint}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{fn}: {name} must have dtype in ({names}), got {x.dtype}")


#: Loaders of the dispatch rules for other libraries' tensor types, by the top-level
#: module that defines the type: ``check_input`` calls the loader on the first eager call
#: with such an ``inp``. Written at import by the layer that owns the rules
#: (``qmoe.interop`` registers ``"torchao"``), so this layer imports none of them.
FOREIGN_RULES: dict[str, Callable[[], None]] = {}


def register_foreign_rules(module: str, load: Callable[[], None]) -> None:
    """Have ``load()`` run before a tensor of a type from top-level module ``module``
    first reaches a public op in eager mode (under compile, import the rules first)."""
    FOREIGN_RULES[module] = load


def check_input(fn: str, inp) -> None:
    check_tensor(fn, "inp", inp, ndim=2, dtypes=FLOATS, fix="pass tokens as [T, H]")
    load = FOREIGN_RULES.get(type(inp).__module__.partition(".")[0])
    if load is not None and not is_compiling():
        load()
    # Non-strict export only: torch 2.11 also reports is_exporting() while Dynamo traces
    # a torch.compile'd function, which handles quantized inputs fine.
    if (isinstance(inp, QuantizedTensor) and torch.compiler.is_exporting()
            and not torch.compiler.is_dynamo_compiling()):
        raise NotImplementedError(
            f"{fn}: torch.export of a quantized inp ({type(inp).__name__}) is not supported: "
            "torch's pre-dispatch export tracing does not run the tensor subclass's dispatch "
            "rule for custom ops (the op returns NotImplemented). Export the high-precision "
            "path (dequantize() before the op), or use torch.compile, which handles it"
        )


def check_same_device(fn: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{fn}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                f"move it with .to({str(ref.device)!r})"
            )


#: How to turn ``[T, K]`` expert ids into what a mask-only call takes.
MASK_FROM_IDS = ("build a [T, E] bool mask from [T, K] ids with torch.zeros(T, E, "
                 "dtype=torch.bool, device=ids.device).scatter_(1, ids, True)")


def check_routing_map(fn: str, inp: torch.Tensor, routing_map, map_type: str,
                      index_fix: str = "pass map_type='index' (and num_experts=E)") -> None:
    """Type, shape and device of ``routing_map``; a mask's values (``check_mask_values``).
    ``index_fix``: what to do instead when a mask holds expert ids."""
    if map_type not in ("mask", "index"):
        raise ValueError(f"{fn}: map_type must be 'mask' or 'index', got {map_type!r}")
    dtypes = (torch.bool, *INT_DTYPES) if map_type == "mask" else SIGNED_INT_DTYPES
    shape = "[T, E]" if map_type == "mask" else "[T, K]"
    check_tensor(fn, "routing_map", routing_map, ndim=2, dtypes=dtypes, fix=f"expected {shape}")
    if routing_map.shape[0] != inp.shape[0]:
        raise ValueError(
            f"{fn}: routing_map has {routing_map.shape[0]} rows but inp has {inp.shape[0]} "
            "tokens; they must match (T)"
        )
    check_same_device(fn, "inp", inp, routing_map=routing_map)
    if map_type == "mask":
        check_mask_values(fn, routing_map, index_fix)


def check_mask_values(fn: str, routing_map: torch.Tensor, index_fix: str) -> None:
    """A mask holds only 0 and 1: an integer map of other values is almost surely
    ``[T, K]`` expert ids, which read as a mask would route tokens to the wrong experts.
    Bool masks need no check; integer ones take one ``aminmax`` (sync-free on CUDA and
    under compile, ``check_values``)."""
    if routing_map.dtype != torch.bool:
        check_range(fn, routing_map, 0, 2,
                    "routing_map is read as a [T, E] mask (map_type='mask') but holds values "
                    f"other than 0 and 1; if it holds [T, K] expert ids, {index_fix}")


def check_not_quantized(fn: str, name: str, t) -> None:
    if isinstance(t, QuantizedTensor):
        raise TypeError(
            f"{fn}: {name} is a {type(t).__name__}; only inp may be quantized, pass "
            f"{name} in high precision ({name}.dequantize())"
        )


def check_probs(fn: str, name: str, probs, t: int, p: int, ref: torch.Tensor, cols: str) -> None:
    """Type, shape and device of ``probs`` ``[T, p]``. Its values are not read here: only
    the probs of kept routes matter (``check_kept_probs``)."""
    if probs is None:
        return
    check_not_quantized(fn, name, probs)
    check_tensor(fn, name, probs, ndim=2, dtypes=PROBS_DTYPES)
    if tuple(probs.shape) != (t, p):
        raise ValueError(f"{fn}: {name} must be [T, {cols}] = [{t}, {p}], got {tuple(probs.shape)}")
    check_same_device(fn, "inp", ref, **{name: probs})


def check_no_nan(fn: str, name: str, probs: torch.Tensor) -> None:
    """NaN weights would spread silently through the merge: reject them (sync-free on
    CUDA and under compile, where the failure surfaces at the next synchronization)."""
    if probs.numel():
        check_values(fn, (probs == probs).all(), f"{name} holds NaN; fix the router upstream")


def check_kept_probs(fn: str, name: str, permuted_probs: torch.Tensor) -> None:
    """No NaN among the probs of the routes a permute kept: its ``[N]`` permuted probs
    hold exactly those (zero on rows no route fills). Unrouted and dropped entries of
    ``probs`` may hold anything (TransformerEngine's tests give unrouted tokens 0/0 = NaN).
    The CUDA kernels check the same entries as they move them (a device assert)."""
    # (no branch on numel: under compile N may be a data-dependent size)
    check_values(fn, (permuted_probs == permuted_probs).all(),
                 f"{name} holds NaN at a kept route; fix the router upstream")


def check_num_out_tokens(fn: str, num_out_tokens) -> int | None:
    """None or -1 mean 'all routed rows' (counted with one host sync); ints >= 0 size N.
    A 0-d integer tensor (``tokens_per_expert.sum()``, as TransformerEngine takes) is read
    with ``.item()``: a host sync for a CUDA tensor, and a graph break under torch.compile
    unless ``torch._dynamo.config.capture_scalar_outputs``, which makes it a data-dependent
    size (it must then be >= 0: no -1 branch, checked when the graph runs). Integer scalars
    of other types (``numpy.int64``) count as ints."""
    if num_out_tokens is None:
        return None
    if isinstance(num_out_tokens, torch.Tensor):
        if num_out_tokens.dim() != 0 or num_out_tokens.dtype not in INT_DTYPES:
            raise TypeError(
                f"{fn}: num_out_tokens as a tensor must be 0-d integer, got "
                f"{num_out_tokens.dtype} {tuple(num_out_tokens.shape)}; pass an int"
            )
        # a host sync; under torch.compile a graph break, unless capture_scalar_outputs
        # makes it an unbacked SymInt
        num_out_tokens = num_out_tokens.item()
        if is_compiling():  # (a SymInt may not look like one to isinstance under Dynamo)
            # a data-dependent size: no branch on -1 (a guard fullgraph cannot take); the
            # count of routed rows it stands for is >= 0, checked when the graph runs
            # (a message without closure variables: torch 2.11's Dynamo refuses those)
            torch._check(num_out_tokens >= 0, lambda: (
                "qmoe: num_out_tokens as a tensor must be >= 0 under torch.compile (a row "
                "count such as tokens_per_expert.sum()); pass None for all routed rows"))
            return num_out_tokens
    num_out_tokens = as_int(fn, "num_out_tokens (or None)", num_out_tokens)
    if num_out_tokens == -1:
        return None
    if num_out_tokens < 0:
        raise ValueError(
            f"{fn}: num_out_tokens must be None (all routed rows), -1 (the same) or >= 0, "
            f"got {num_out_tokens}"
        )
    # plain ints only: on a SymInt the compare would become a guard narrowing T, which
    # torch.export with a named Dim refuses (the C++ and map kernels check at run time)
    # (under Dynamo a SymInt passes isinstance(int): is_compiling keeps the guard out)
    if isinstance(num_out_tokens, int) and not is_compiling() and num_out_tokens > ID_LIMIT:
        raise ValueError(f"{fn}: num_out_tokens must be < 2**31 (row_id_map rows are int32), "
                         f"got {num_out_tokens}")
    return num_out_tokens


def check_values(fn: str, cond: torch.Tensor, msg: str) -> None:
    """A value check without a host sync on CUDA or under compile (``_assert_async``);
    a plain ``ValueError`` on CPU tensors in eager mode."""
    if cond.device.type == "cpu" and not is_compiling():
        if not bool(cond):
            raise ValueError(f"{fn}: {msg}")
    else:
        torch._assert_async(cond, f"{fn}: {msg}")


def check_range(fn: str, values: torch.Tensor, lo: int, hi: int, msg: str) -> None:
    """``check_values`` that every entry of integer ``values`` is in ``[lo, hi)`` (none:
    passes), from one ``aminmax``. The extremes compare in int64: in an int8 / int16
    tensor's own dtype the bounds would wrap (int16(E) = -1 past 32767)."""
    if values.numel() == 0:
        return
    vmin, vmax = torch.aminmax(values)
    check_values(fn, (vmin.long() >= lo) & (vmax.long() < hi), msg)


def check_quantize_args(op, x, block_size, fp8_dtype, scale_mode, scale) -> None:
    """The fused quantize-permute ops' quantizing arguments (``qmoe::quantize_permute``,
    ``qmoe::quantize_permute_mask``; the public functions build them from a checked
    recipe), in the real ops and their fakes alike."""
    if x.dim() != 2:
        raise ValueError(f"qmoe::{op}: x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if scale_mode != "given":
        check_block_args(x, block_size, fp8_dtype, scale_mode, op)
        if scale is not None:
            raise ValueError(f"qmoe::{op}: scale is only taken with scale_mode='given', got "
                             f"scale_mode={scale_mode!r}; drop scale")
        return
    check_op_dtypes(op, x, fp8_dtype)
    if scale is None:
        raise ValueError(f"qmoe::{op}: scale_mode='given' needs a one-element scale tensor, "
                         "got None")
    check_scale_tensor(f"qmoe::{op}", "scale", scale, "x", x)
