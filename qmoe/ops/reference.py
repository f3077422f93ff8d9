"""Pure-torch reference of the permutation ops, written from the definitions alone.

Independent of qmoe's row_id_map and kernels: tests and benchmarks compare against it.
Glossary: T tokens, E experts, K top-k slots, H hidden, N output rows.

Routing is described by ``routes``: a list of ``(token, expert, slot)`` in output order
(expert-major, token-minor, then slot), before dropping. ``slot`` is the probs column:
the expert for a mask map, k for an index map.
"""

from __future__ import annotations

import torch


def routes_of(routing_map: torch.Tensor, map_type: str) -> list[tuple[int, int, int]]:
    """All routes ``(t, e, col)`` in expert-major, token-minor order."""
    rm = routing_map.cpu()
    out = []
    if map_type == "mask":
        t_idx, e_idx = (rm != 0).nonzero(as_tuple=True)
        for t, e in zip(t_idx.tolist(), e_idx.tolist()):
            out.append((t, e, e))
    else:
        for t in range(rm.shape[0]):
            for k in range(rm.shape[1]):
                e = int(rm[t, k])
                if e >= 0:
                    out.append((t, e, k))
    out.sort(key=lambda r: (r[1], r[0], r[2]))
    return out


def padded_positions(
    routes: list[tuple[int, int, int]], num_experts: int, align_size: int
) -> tuple[list[int], list[int]]:
    """Output row of each route when each expert's group is padded to ``align_size``;
    also the padded group sizes."""
    counts = [0] * num_experts
    for _, e, _ in routes:
        counts[e] += 1
    target = [-(-c // align_size) * align_size for c in counts]
    start = [sum(target[:e]) for e in range(num_experts)]
    seen = [0] * num_experts
    pos = []
    for _, e, _ in routes:
        pos.append(start[e] + seen[e])
        seen[e] += 1
    return pos, target


def permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    map_type: str = "mask",
    num_out_tokens: int | None = None,
    probs: torch.Tensor | None = None,
    align_size: int = 1,
):
    """Reference permute: ``(out [N, H], permuted_probs [N] or None, positions)``.

    ``positions[i]`` is the output row of ``routes_of(...)[i]``, or -1 when dropped.
    """
    routes = routes_of(routing_map, map_type)
    if align_size > 1:
        pos, target = padded_positions(routes, routing_map.shape[1], align_size)
        total = sum(target)
    else:
        pos = list(range(len(routes)))
        total = len(routes)
    n = total if num_out_tokens is None else num_out_tokens
    out = torch.zeros(n, inp.shape[1], dtype=inp.dtype)
    pp = None if probs is None else torch.zeros(n, dtype=probs.dtype)
    kept = []
    for (t, _e, col), p in zip(routes, pos):
        if p < n:
            out[p] = inp[t].cpu()
            if pp is not None:
                pp[p] = probs[t, col].cpu()
            kept.append(p)
        else:
            kept.append(-1)
    return out, pp, kept


def unpermute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    map_type: str = "mask",
    merging_probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    align_size: int = 1,
) -> torch.Tensor:
    """Reference merge in fp64: ``out[t] = sum over kept routes of inp[row] * prob``."""
    routes = routes_of(routing_map, map_type)
    _, _, kept = permute(
        inp.new_zeros(routing_map.shape[0], 1), routing_map, map_type, num_out_tokens,
        align_size=align_size,
    )
    t_count = routing_map.shape[0]
    out = torch.zeros(t_count, inp.shape[1], dtype=torch.float64)
    x = inp.double().cpu()
    for (t, _e, col), p in zip(routes, kept):
        if p >= 0:
            w = 1.0 if merging_probs is None else float(merging_probs[t, col])
            out[t] += x[p] * w
    return out


def sort_chunks(inp: torch.Tensor, split_sizes, sorted_index, probs=None):
    """Reference chunk sort: chunks of ``inp`` (split by ``split_sizes``) in the order
    ``sorted_index``; rows past ``sum(split_sizes)`` stay in place."""
    sizes = [int(s) for s in split_sizes]
    total = sum(sizes)
    chunks = torch.split(inp[:total], sizes)
    out = torch.cat([chunks[i] for i in sorted_index] + [inp[total:]])
    if probs is None:
        return out, None
    pch = torch.split(probs[:total], sizes)
    return out, torch.cat([pch[i] for i in sorted_index] + [probs[total:]])
