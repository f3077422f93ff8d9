"""Triton code of the weighted merge's backward in one pass (launcher:
``qmoe/ops/unpermute.py``, ``merge_backward_triton``).

Glossary: T tokens, H hidden, N permuted rows, S map slots a token, P weight columns
(E for a mask map, K for an index map), KB routes a step, BLOCK_H columns a tile,
BLOCK_P = next_pow2(P).

The merge ``out[t] = sum_k w[t, c_k] * x[row_k]`` has two gradients that read the same
rows: ``grad_x[row_k] = w[t, c_k] * g[t]`` and ``grad_w[t, c_k] = <g[t], x[row_k]>``. One
program per token computes both while it holds ``g[t]``'s tile: ``g`` is read once per KB
routes instead of once more by a separate scatter, and the weights' gradient row is written
whole (zeros off the routes, in the weights' dtype), so no zero fill and no cast launch.
"""

import triton
import triton.language as tl


@triton.jit
def merge_backward_kernel(
    g_ptr,  # (T, H) gradient of the merged output, contiguous
    x_ptr,  # (N, H) the merge's forward input, contiguous
    map_ptr,  # (T, 2S+1) int32 row_id_map
    w_ptr,  # (T, P) float merging weights, row stride stride_w
    gx_ptr,  # (N, H) g's dtype out: w * g[t] at each of t's rows
    written_ptr,  # (N,) int8, zero-initialized: 1 for every row written
    gw_ptr,  # (T, P) weights' dtype out, contiguous: <g[t], x[row]> at each route's column
    N,
    H,
    S,
    P,
    stride_w,
    KB: tl.constexpr,  # routes a step (their row tiles in flight together)
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid ``(T,)``. Dot products in fp32, per route each lane adding its columns tile by
    tile, then one sum across the lanes (a fixed order: deterministic)."""
    t = tl.program_id(0).to(tl.int64)
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)  # a count past S never reads past the row
    pc = tl.arange(0, BLOCK_P)
    gw_row = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for s0 in range(0, n, KB):
        sl = s0 + tl.arange(0, KB)
        d = tl.load(mrow + sl, mask=sl < n, other=-1).to(tl.int64)
        live = (sl < n) & (d >= 0) & (d < N)  # a row outside [0, N) is never touched
        c = tl.load(mrow + S + sl, mask=live, other=0)
        w = tl.load(w_ptr + t * stride_w + c, mask=live, other=0.0).to(tl.float32)
        acc = tl.zeros((KB, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            m = live[:, None] & hmask[None, :]
            g = tl.load(g_ptr + t * H + cols, mask=hmask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + d[:, None] * H + cols[None, :], mask=m, other=0.0)
            acc += g[None, :] * x.to(tl.float32)
            tl.store(gx_ptr + d[:, None] * H + cols[None, :],
                     (g[None, :] * w[:, None]).to(gx_ptr.dtype.element_ty), mask=m)
        tl.store(written_ptr + d, tl.full((KB,), 1, dtype=tl.int8), mask=live)
        dots = tl.sum(acc, axis=1)  # [KB]: each route's column gets its own dot
        hit = (pc[None, :] == c[:, None]) & live[:, None]
        gw_row += tl.sum(tl.where(hit, dots[:, None], 0.0), axis=0)
    tl.store(gw_ptr + t * P + pc, gw_row.to(gw_ptr.dtype.element_ty), mask=pc < P)
