"""What every Triton launcher of qmoe.ops needs besides its tiling: operand layout
(``unit_stride``, ``mask_operand``), the row_id_map's slot count, and the launch options
of kernels with device asserts or programmatic dependent launches. Plain functions, no
state; the op modules and ``qmoe.ops.kernels`` import them from here."""

from __future__ import annotations

import functools

import torch
from triton import knobs

#: Index-map ids must be below this (the maps key experts on int32, with this value as the
#: "unrouted" sentinel); checked by the public ops for every id dtype, and by the one-launch
#: index map's device assert.
ID_LIMIT = torch.iinfo(torch.int32).max


def num_slots(row_id_map: torch.Tensor) -> int:
    """S of a ``row_id_map`` ``[T, 2*S + 1]`` (``qmoe.ops.row_id_map``): E for a mask map,
    K for an index map."""
    return (row_id_map.shape[1] - 1) // 2


def fill_count(routing_map: torch.Tensor, is_index: bool, align_size: int) -> int:
    """R, the rows of a map's ``fill`` (``qmoe.ops.row_id_map``): E + 1 for a padded mask
    map, else 1."""
    return routing_map.shape[1] + 1 if not is_index and align_size > 1 else 1


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` (or None) with unit stride along its last dim: the kernels step columns by 1
    and take only a row stride (a copy only for column-strided tensors, e.g. the
    transpose of a contiguous one)."""
    if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def mask_operand(routing_map: torch.Tensor) -> torch.Tensor:
    """The ``[T, E]`` mask as the Triton kernels read it: bool viewed as uint8, unit
    column stride."""
    m = routing_map.view(torch.uint8) if routing_map.dtype == torch.bool else routing_map
    return unit_stride(m)


def assert_options() -> dict[str, bool]:
    """Launch options of the kernels that check their inputs with ``tl.device_assert``
    (``check_routes``, ``assert_probs_not_nan``, the chunk sort's checks): ``debug=True``
    compiles the asserts in, ``sanitize_overflow=False`` keeps out the integer-overflow
    checks that debug would add, so the asserts are the only difference; Inductor launches
    its own kernels the same way. A new dict each call."""
    return {"debug": True, "sanitize_overflow": False}


def pdl_default(x: torch.Tensor) -> bool:
    """Whether the fused mask kernels on ``x``'s device launch as programmatic dependents
    of the scan (``block_counts(..., pdl=True)``): NVIDIA devices of compute capability 9
    (Hopper) or newer, with a Triton that has grid dependency control (``gdc_wait``, Triton
    >= 3.4) and a CUDA of at least 12.3 (programmatic edges in captured CUDA graphs); never
    on ROCm (which reports other capabilities through the same call) or under the
    interpreter."""
    if not x.is_cuda or knobs.runtime.interpret:  # (Triton's knob: read per call, cheaply)
        return False
    return _device_has_pdl(x.get_device())


@functools.cache
def _device_has_pdl(index: int) -> bool:
    """``pdl_default``'s answer for CUDA device ``index`` (fixed for the process: the
    device, torch's CUDA and Triton do not change)."""
    if torch.version.hip is not None or torch.version.cuda is None:
        return False
    if tuple(int(v) for v in torch.version.cuda.split(".")[:2]) < (12, 3):
        return False
    import triton.language as tl

    cuda = getattr(tl.extra, "cuda", None)
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and torch.cuda.get_device_capability(index)[0] >= 9)


def pdl_options(pdl: bool) -> dict[str, bool]:
    """Launch options of a kernel launched as a programmatic dependent when ``pdl``: only
    then is ``launch_pdl`` passed (Tritons before 3.4 do not know the option). A new dict
    each call."""
    return {"launch_pdl": True} if pdl else {}
