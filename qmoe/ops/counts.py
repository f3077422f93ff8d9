"""Per-expert row counts and grouped-GEMM offsets of a permuted output, on the device.

Glossary: T tokens, E experts, K top-k slots, N output rows (``num_out_tokens``).

A permute lays its output out expert-major: expert ``e``'s block starts where expert
``e - 1``'s ends, and holds its routes in token order (then, in the pad variant, zero rows
up to a multiple of ``align_size``). With a fixed ``num_out_tokens`` every route whose row
would be ``>= N`` is dropped, so the counts of the routing map (``mask.sum(0)``) overstate
the output once routes drop: the last experts lose rows, or all of them.

* ``tokens_per_expert(routing_map, num_out_tokens, ...)``: int32 ``[E]``, the rows of each
  expert's block in the ``[N, H]`` output, drops applied (and padding, with
  ``align_size``), so that their cumulative sum is where each block ends.
* ``expert_offsets(counts)``: int32 ``[E]``, that inclusive cumulative sum: the ``offs``
  of ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` (the end row of each
  group; they take int32 offsets only).

Both are a handful of small torch ops on the routing map's device: no host sync, no
data-dependent shape, and they trace under ``torch.compile(fullgraph=True)`` with a dynamic
T. Why the counts come from the routing map and not from ``row_id_map``: the map does not
say which expert a row belongs to for an index map (its probs column is the slot k), nor
whether it was padded, nor where the pad variant's last block ends (that needs N and
``align_size`` anyway). The routing map plus the permute's own ``num_out_tokens`` (and
``align_size``) determine the layout exactly, by the rule the permutes follow
(``qmoe.ops.row_id_map``): pass the same values as to the permute.
"""

from __future__ import annotations

import torch

from qmoe.ops import checks as C

__all__ = ["tokens_per_expert", "expert_offsets"]


def _bound(fn: str, num_out_tokens, device: torch.device):
    """N as None (no drops), an int / SymInt, or a 0-d int64 tensor (never read on the
    host: one on the CPU beside a CUDA map is a scalar operand of the device op, no copy;
    -1 means no drops, as for an int)."""
    if isinstance(num_out_tokens, torch.Tensor):
        if num_out_tokens.dim() != 0 or num_out_tokens.dtype not in C.INT_DTYPES:
            raise TypeError(
                f"{fn}: num_out_tokens as a tensor must be a 0-d integer tensor, got "
                f"{num_out_tokens.dtype} of shape {tuple(num_out_tokens.shape)}")
        if num_out_tokens.device.type != "cpu" and num_out_tokens.device != device:
            raise ValueError(
                f"{fn}: num_out_tokens is on {num_out_tokens.device} but routing_map is on "
                f"{device}; move it with .to({str(device)!r})")
        n = num_out_tokens.to(torch.int64)
        C.check_values(fn, n >= -1, "num_out_tokens must be >= -1 (-1: all routed rows)")
        return torch.where(n >= 0, n, torch.iinfo(torch.int64).max)
    # None / -1: no drops; ints (numpy ints too) >= 0; bools and floats are a TypeError
    return C.check_num_out_tokens(fn, num_out_tokens)


def _routed_counts(fn: str, routing_map, map_type: str, num_experts):
    """int32 ``[E]``: the routes of each expert, before drops and padding."""
    if map_type == "mask":
        C.check_tensor(fn, "routing_map", routing_map, ndim=2,
                       dtypes=(torch.bool, *C.INT_DTYPES), fix="expected a [T, E] mask")
        e = routing_map.shape[1]
        # (plain ints only: under compile a guard on a symbolic E would narrow it)
        if (num_experts is not None and not C.is_compiling() and isinstance(e, int)
                and num_experts != e):
            raise ValueError(f"{fn}: num_experts={num_experts} but the mask routing_map has "
                             f"{e} expert columns; drop num_experts or fix the map")
        C.check_mask_values(fn, routing_map, "pass map_type='index' and num_experts=E")
        return (routing_map != 0).sum(0, dtype=torch.int32)
    C.check_tensor(fn, "routing_map", routing_map, ndim=2, dtypes=C.INT_DTYPES,
                   fix="expected [T, K] expert ids")
    if num_experts is None:
        raise ValueError(f"{fn}: an index routing_map ([T, K] expert ids) needs "
                         "num_experts=E: the ids do not say how many experts there are")
    C.check_range(fn, routing_map, -1, num_experts,
                  f"routing_map ids must be >= -1 and < num_experts={num_experts}")
    ids = routing_map.reshape(-1).long()
    # -1 (not routed), and ids out of range (refused just above, asynchronously on CUDA
    # and under compile), count in a scratch bucket past the last expert
    bucket = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=routing_map.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket, dtype=torch.int32))
    return counts[:num_experts]


@C.user_errors
def tokens_per_expert(
    routing_map: torch.Tensor,
    num_out_tokens,
    *,
    map_type: str = "mask",
    num_experts: int | None = None,
    align_size: int = 1,
) -> torch.Tensor:
    """Rows of each expert's block in a permute's output: int32 ``[E]``, no host sync.

    Pass the routing map and the ``num_out_tokens`` (and ``align_size``) that the permute
    took: ``moe_permute(x, routing_map, num_out_tokens=N)``,
    ``moe_permute_with_probs(...)``, or the pad variant
    ``moe_permute_and_pad_with_probs(..., align_size, num_out_tokens=N)``. Expert ``e``'s
    block is ``[offs[e-1], offs[e])`` (``offs = expert_offsets(counts)``, ``offs[-1] = 0``):
    every kept row of expert ``e`` lies in it, and in the pad variant its padding rows too.

    * Drops: expert ``e``'s block in the undropped layout is ``[start_e, end_e)``; the
      output keeps ``[min(start_e, N), min(end_e, N))`` of it, so the count is
      ``min(end_e, N) - min(start_e, N)``: experts past N get 0, the one that N cuts the
      rows before N. Rows past ``offs[-1]`` (the unfilled tail of the buffer) belong to
      no expert.
    * Padding (``align_size > 1``, mask maps): each block is rounded up to a multiple of
      ``align_size`` (an expert without routes gets 0 rows, as the pad variant lays it
      out), then cut at N as above. Without drops the counts equal the pad variant's
      ``target_tokens_per_expert``; with drops those overshoot N and these do not. Every
      block is a multiple of ``align_size`` except the one N cuts when N is not a
      multiple of ``align_size`` (pick N a multiple for aligned grouped GEMMs).

    Args:
        routing_map: ``map_type="mask"``: ``[T, E]`` bool, or integer holding only 0 and
            1 (other values raise: a ``ValueError`` on CPU, an async device assert on
            CUDA and under torch.compile). ``map_type="index"``: ``[T, K]`` integer
            expert ids in ``[-1, num_experts)``, ``-1`` = not routed (others raise the
            same way).
        num_out_tokens: required, the permute's own: an int ``N >= 0`` (sync-free form;
            a SymInt such as ``x.shape[0] * k`` under torch.compile), ``None`` or ``-1``
            (the permute counted all routed rows: nothing dropped), or a 0-d integer
            tensor on the CPU or the map's device (read on the device, never on the host;
            ``-1`` there also means all routed rows).
        map_type: ``"mask"`` or ``"index"``, as given to the permute.
        num_experts: E. Required for an index map (the ids do not say E); with a mask it
            must equal the mask's column count when given.
        align_size: the pad variant's ``align_size`` (``>= 1``; 1 = no padding, the plain
            permutes). Mask maps only, as the pad variant takes masks only.

    Returns:
        ``int32 [E]`` on the routing map's device, ``>= 0``, summing to
        ``min(padded or routed total, N)``. With T = 0 or no routes, zeros.
    """
    fn = "tokens_per_expert"
    if map_type not in ("mask", "index"):
        raise ValueError(f"{fn}: map_type must be 'mask' or 'index', got {map_type!r}")
    if num_experts is not None:
        num_experts = C.as_int(fn, "num_experts (or None)", num_experts)
        if num_experts < 1:
            raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts}")
    align_size = C.as_int(fn, "align_size", align_size)
    if align_size < 1:
        raise ValueError(f"{fn}: align_size must be a positive int (1: no padding), got "
                         f"{align_size}")
    if map_type == "index" and align_size > 1:
        raise ValueError(f"{fn}: align_size > 1 is the pad variant's layout, which takes "
                         f"mask maps only; {C.MASK_FROM_IDS}")
    counts = _routed_counts(fn, routing_map, map_type, num_experts)
    n = _bound(fn, num_out_tokens, routing_map.device)
    e = counts.shape[0]
    if (align_size > 1 and isinstance(e, int) and isinstance(align_size, int)
            and align_size > C.ID_LIMIT // (e + 1)):
        raise ValueError(f"{fn}: align_size {align_size} could pad past 2**31 rows (the "
                         "pad variant refuses it too)")
    c = counts.long()  # int64 sums: padded totals may pass int32 before N cuts them
    if align_size > 1:
        c = (c + (align_size - 1)) // align_size * align_size
    end = torch.cumsum(c, 0)
    if isinstance(n, torch.Tensor):
        end = torch.minimum(end, n)
    elif n is not None:
        end = end.clamp(max=n)
    return torch.diff(end, prepend=end.new_zeros(1)).to(torch.int32)


@C.user_errors
def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """Grouped-GEMM offsets of per-expert row counts: int32 ``[E]``, no host sync.

    ``offs[e] = counts[0] + ... + counts[e]``, the end row of expert ``e``'s group: what
    ``torch.nn.functional.grouped_mm(rows, weights, offs=offs)`` and
    ``torch._grouped_mm`` take (int32 only; expert ``e`` multiplies rows
    ``[offs[e-1], offs[e])``, and output rows past ``offs[-1]`` are left unwritten).

    Args:
        counts: ``[E]`` integer counts, ``>= 0`` (not checked: that would cost a device
            reduction per call), e.g. from ``tokens_per_expert``, or the pad variant's
            ``target_tokens_per_expert`` when nothing drops. Their total must stay below
            2**31.

    Returns:
        ``int32 [E]`` on ``counts``' device, the inclusive cumulative sum.
    """
    fn = "expert_offsets"
    if isinstance(counts, torch.Tensor) and counts.dtype.is_floating_point:
        raise TypeError(f"{fn}: counts must hold integer counts, got {counts.dtype}; pass "
                        "counts.int() (or tokens_per_expert's output)")
    C.check_tensor(fn, "counts", counts, ndim=1, dtypes=C.INT_DTYPES,
                   fix="expected [E] per-expert counts")
    return torch.cumsum(counts, 0, dtype=torch.int32)
