"""Triton code for token permutation (launchers in ``qmoe/ops/backend.py``).

Glossary: T tokens, H hidden, S slots per token in the row_id_map, N output rows,
P columns of the probs tensor (E for a mask map, K for an index map), R row ranges in
``fill`` (the rows no route writes), Z programs sharing the last of them.

row_id_map layout (``qmoe/ops/row_id_map.py``): ``int32 [T, 2*S + 1]``; for token t the
first ``n = map[t, 2S]`` entries are its output rows and ``map[t, S:S+n]`` the probs
columns that weight them. Programs cover one token (or one block of rows) and one
``BLOCK_H`` chunk of the hidden dim; row offsets are int64, so N*H may pass 2**31.
"""

import triton
import triton.language as tl

from qmoe.tensors._kernels.quantize import fp8_bits_to_fp32


@triton.jit
def zero_fill_rows(
    g,  # index of this program among the launch's fill programs, [0, R - 1 + Z)
    fill_ptr,  # (R, 2) int32: row ranges [lo, hi) no route writes (row_id_map.py)
    R,
    Z,  # programs sharing the last range (the tail, which may be long)
    N,
    out_ptr,  # (N, H) rows to zero (any dtype), contiguous
    H,
    cols,  # this program's columns of a row (any shape), and their mask
    cmask,
    side_ptr,  # (N, NS) side rows to zero alike (if HAS_SIDE), contiguous
    NS,
    scols,  # side columns this program zeroes (any shape), and their mask
    smask,
    pp_ptr,  # (N,) permuted probs to zero (if HAS_P and first)
    first,  # this program owns the row's probs
    HAS_SIDE: tl.constexpr,
    HAS_P: tl.constexpr,
):
    """Zero the output rows no route writes, inside the scatter launch: ranges 0..R-2 (a
    padded map's padding, shorter than the alignment) take one program each, the last
    range is split over Z programs. Rows are kept inside [0, N) whatever ``fill`` says."""
    if g < R - 1:
        lo = tl.load(fill_ptr + 2 * g).to(tl.int32)
        hi = tl.load(fill_ptr + 2 * g + 1).to(tl.int32)
    else:
        lo, hi = _tail_share(tl.load(fill_ptr + 2 * (R - 1)).to(tl.int32),
                             tl.load(fill_ptr + 2 * (R - 1) + 1).to(tl.int32), g - (R - 1), Z)
    zero_rows(lo, hi, N, out_ptr, H, cols, cmask, side_ptr, NS, scols, smask, pp_ptr, first,
              HAS_SIDE, HAS_P)


@triton.jit
def _tail_share(t_lo, t_hi, j, Z):
    """Rows ``[lo, hi)`` of the tail range ``[t_lo, t_hi)`` that share ``j`` of ``Z`` zeroes."""
    t_lo = tl.maximum(t_lo, 0)
    per = (t_hi - t_lo + Z - 1) // Z
    lo = t_lo + j * per
    return lo, tl.minimum(t_hi, lo + per)


@triton.jit
def zero_rows(lo, hi, N, out_ptr, H, cols, cmask, side_ptr, NS, scols, smask, pp_ptr, first,
              HAS_SIDE: tl.constexpr, HAS_P: tl.constexpr):
    """Zero rows ``[lo, hi)`` (kept inside ``[0, N)``) of ``out`` over ``cols``, and
    alike of ``side`` and ``pp`` (arguments as in ``zero_fill_rows``)."""
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, N)
    zero = tl.zeros(cols.shape, dtype=out_ptr.dtype.element_ty)
    lo64 = lo.to(tl.int64)
    for i in range(0, hi - lo):
        r64 = lo64 + i
        tl.store(out_ptr + r64 * H + cols, zero, mask=cmask)
        if HAS_SIDE:
            tl.store(side_ptr + r64 * NS + scols,
                     tl.zeros(scols.shape, dtype=side_ptr.dtype.element_ty), mask=smask)
        if HAS_P:
            tl.store(pp_ptr + r64, tl.zeros((), dtype=pp_ptr.dtype.element_ty), mask=first)


@triton.jit
def permute_scatter_kernel(
    inp_ptr,  # (T, H) any dtype, row stride stride_in
    out_ptr,  # (N, H) same dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) float weights, row stride stride_w (read only if HAS_W)
    written_ptr,  # (N,) int8, zero-initialized: 1 for every row written (if not HAS_FILL)
    fill_ptr,  # (R, 2) int32 row ranges no route writes (if HAS_FILL)
    p_ptr,  # (T, P) float probs, row stride stride_p (read only if HAS_P)
    pp_ptr,  # (N,) probs dtype out: the permuted probs (written only if HAS_P)
    side_ptr,  # (T, NS) side rows moved with the data, e.g. block scales (if HAS_SIDE)
    side_out_ptr,  # (N, NS) side rows out, contiguous (written only if HAS_SIDE)
    T,
    N,
    H,
    S,
    NS,
    R,
    Z,
    stride_in,
    stride_w,
    stride_p,
    stride_side,
    HAS_W: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    HAS_FILL: tl.constexpr,
    KB: tl.constexpr,  # routes written per step (their rows are loaded together)
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= NS when HAS_SIDE
):
    """Programs ``t < T``: read token t's row once; write it (times its weight, if HAS_W)
    to each of its rows, and (if HAS_P) its probs, (if HAS_SIDE) its side row, to the same
    rows of ``pp`` and ``side_out``. With HAS_FILL, programs ``t >= T`` zero the rows no
    route writes (``zero_fill_rows``); without it, rows written are flagged in ``written``
    for ``zero_rows_kernel``."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    if pid >= T:  # fill programs (the grid holds only the T token programs without fill)
        if HAS_FILL:
            sc = tl.arange(0, BLOCK_S)
            first = tl.program_id(1) == 0
            ns_here = tl.where(first, NS, 0)  # side rows: the first column block's job
            zero_fill_rows(pid - T, fill_ptr, R, Z, N, out_ptr, H, cols, hmask, side_out_ptr,
                           NS, sc, sc < ns_here, pp_ptr, first, HAS_SIDE, HAS_P)
    else:
        t = pid.to(tl.int64)
        x = tl.load(inp_ptr + t * stride_in + cols, mask=hmask)
        _scatter_token(t, x, out_ptr, map_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                       side_out_ptr, N, S, NS, H, cols, hmask, stride_w, stride_p,
                       stride_side, HAS_W, HAS_P, HAS_SIDE, not HAS_FILL, KB, BLOCK_H, BLOCK_S)


@triton.jit
def _scatter_token(t, x, out_ptr, map_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                   side_out_ptr, N, S, NS, H, cols, hmask, stride_w, stride_p, stride_side,
                   HAS_W: tl.constexpr, HAS_P: tl.constexpr, HAS_SIDE: tl.constexpr,
                   FLAGS: tl.constexpr, KB: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """Token t's share of ``permute_scatter_kernel``: ``x`` is its row over ``cols``
    (loaded by the caller; other arguments as there; FLAGS: mark the rows written in
    ``written``)."""
    mrow = map_ptr + t * (2 * S + 1)
    # The row (loaded by the caller), the count and the first KB slots load together: the
    # first stores wait for one memory round trip, not two (most tokens have <= KB routes).
    n = tl.minimum(tl.load(mrow + 2 * S), S)  # a count past S never reads past the row
    d0 = tl.load(mrow + tl.arange(0, KB), mask=tl.arange(0, KB) < S, other=-1)
    for s0 in range(0, n, KB):
        sl = s0 + tl.arange(0, KB)
        if s0 == 0:
            d = d0.to(tl.int64)
        else:
            d = tl.load(mrow + sl, mask=sl < n, other=-1).to(tl.int64)
        smask = (sl < n) & (d >= 0) & (d < N)  # a row outside [0, N) is never written
        if HAS_W or HAS_P:
            c = tl.load(mrow + S + sl, mask=smask, other=0)
        else:
            c = tl.zeros((KB,), dtype=tl.int32)
        store_routes(t, x, d, c, smask, out_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                     side_out_ptr, NS, H, cols, hmask, stride_w, stride_p, stride_side, HAS_W,
                     HAS_P, HAS_SIDE, FLAGS, KB, BLOCK_H, BLOCK_S)


@triton.jit
def assert_probs_not_nan(pv):
    """The permute kernels' probs check: a device-side assert that the probs of the routes
    they move hold no NaN (compiled in only when launched with ``debug=True``, as
    ``check_routes``); it replaces a pass over all of ``probs`` and its assert launch."""
    tl.device_assert(pv == pv, "qmoe permute: probs holds NaN (a routed entry); fix the "
                     "router upstream")


@triton.jit
def store_routes(t, x, d, c, smask, out_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                 side_out_ptr, NS, H, cols, hmask, stride_w, stride_p, stride_side,
                 HAS_W: tl.constexpr, HAS_P: tl.constexpr, HAS_SIDE: tl.constexpr,
                 FLAGS: tl.constexpr, KB: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Write token t's row ``x`` (over ``cols``) to the KB output rows ``d`` (int64) where
    ``smask``, with its weight / probs from column ``c`` of its weights / probs row, its
    side row, and (FLAGS) the rows' ``written`` flags (arguments as in
    ``permute_scatter_kernel``)."""
    if HAS_W:
        w = tl.load(w_ptr + t * stride_w + c, mask=smask, other=0.0).to(tl.float32)
        y = (x.to(tl.float32)[None, :] * w[:, None]).to(out_ptr.dtype.element_ty)
    else:
        y = tl.broadcast_to(x[None, :], (KB, BLOCK_H))
    tl.store(out_ptr + d[:, None] * H + cols[None, :], y, mask=smask[:, None] & hmask[None, :])
    if tl.program_id(1) == 0:
        if FLAGS:
            tl.store(written_ptr + d, tl.full((KB,), 1, dtype=tl.int8), mask=smask)
        if HAS_P:
            pv = tl.load(p_ptr + t * stride_p + c, mask=smask, other=0.0)
            assert_probs_not_nan(pv)
            tl.store(pp_ptr + d, pv, mask=smask)
        if HAS_SIDE:
            sc = tl.arange(0, BLOCK_S)
            scm = sc < NS
            sv = tl.load(side_ptr + t * stride_side + sc, mask=scm)
            tl.store(side_out_ptr + d[:, None] * NS + sc[None, :],
                     tl.broadcast_to(sv[None, :], (KB, BLOCK_S)),
                     mask=smask[:, None] & scm[None, :])


@triton.jit
def zero_rows_kernel(
    out_ptr,  # (N, H), contiguous
    written_ptr,  # (N,) int8: 1 where some token wrote the row
    pp_ptr,  # (N,) permuted probs (zeroed alike only if HAS_P)
    side_ptr,  # (N, NS) side rows (zeroed alike only if HAS_SIDE)
    N,
    H,
    NS,
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Zero the rows nothing was written to (padding, and rows past the routed count).
    A block of rows that are all written costs one small load."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    w = tl.load(written_ptr + rows, mask=rmask, other=1)
    todo = rmask & (w == 0)
    if tl.max(todo.to(tl.int32), axis=0) > 0:
        if HAS_P:
            tl.store(pp_ptr + rows, tl.zeros((BLOCK_R,), dtype=pp_ptr.dtype.element_ty), mask=todo)
        if HAS_SIDE:
            sc = tl.arange(0, BLOCK_S)
            tl.store(side_ptr + rows.to(tl.int64)[:, None] * NS + sc[None, :],
                     tl.zeros((BLOCK_R, BLOCK_S), dtype=side_ptr.dtype.element_ty),
                     mask=todo[:, None] & (sc < NS)[None, :])
        zero = tl.zeros((BLOCK_R, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
            tl.store(out_ptr + offs, zero, mask=todo[:, None] & (cols < H)[None, :])


@triton.jit
def _route(mrow, S, s, n, w_row_ptr, P, HAS_W: tl.constexpr):
    """Route s of a token: ``(row, weight, bad weight column)``; weight 1.0 without HAS_W.
    ``s`` is clamped into ``[0, max(n, 1))``, so a load past the last route, or for a token
    with none, stays inside the map row (the launcher skips maps with S = 0). The bf16/fp16/
    fp32 merge loads route s + 1 this way while route s's row is in flight, so each route
    costs one memory round trip, not two (the map entry, then the row)."""
    sc = tl.maximum(tl.minimum(s, n - 1), 0)
    d = tl.load(mrow + sc).to(tl.int64)
    w, cbad = _route_weight(mrow, S, sc, w_row_ptr, P, HAS_W)
    return d, w, cbad


@triton.jit
def _route_weight(mrow, S, s, w_row_ptr, P, HAS_W: tl.constexpr):
    """Route s's weight ``w_row_ptr[map[S + s]]`` (fp32) and 1 if that column is outside
    ``[0, P)`` (then a column inside is read instead: the weights row holds at least one
    column even when P = 0); ``(1.0, 0)`` without HAS_W."""
    if HAS_W:
        c = tl.load(mrow + S + s)
        return (tl.load(w_row_ptr + tl.minimum(tl.maximum(c, 0), tl.maximum(P - 1, 0))).to(
                tl.float32),
                ((c < 0) | (c >= P)).to(tl.int32))
    else:
        return 1.0, 0


@triton.jit
def _checked_row(d, N_IN, hmask, bad, BLOCK_H: tl.constexpr):
    """A route's input row kept inside ``[0, N_IN)``: ``(row, load mask, bad)``. An
    out-of-range row becomes row 0 with an empty mask (it adds zero), and sets ``bad`` (the
    merge kernels' ``(1,)`` int32 problem flag)."""
    inr = (d >= 0) & (d < N_IN)
    dv = tl.zeros((BLOCK_H,), dtype=tl.int64) + d
    lmask = hmask & (dv >= 0) & (dv < N_IN)
    return tl.where(inr, d, 0), lmask, bad | (~inr).to(tl.int32)


@triton.jit
def _merge_add(acc, x, w, cbad, bad, HAS_W: tl.constexpr):
    """``acc + x * w`` (``acc + x`` without HAS_W); a NaN weight or a weight column outside
    the probs (``cbad``) sets ``bad``."""
    if HAS_W:
        return acc + x * w, bad | (w != w).to(tl.int32) | cbad
    else:
        return acc + x, bad


@triton.jit
def check_routes(bad):
    """The merge kernels' input check: a device-side assert that ``bad`` ((1,) int32, set
    by ``_checked_row`` / ``_merge_add``) is 0. Compiled in only when the kernel is launched
    with ``debug=True`` (the launchers pass ``backend.assert_options()``); it fails as
    ``torch._assert_async`` does, surfacing at the next synchronization."""
    tl.device_assert(bad == 0, "qmoe merge: row_id_map points past the rows of inp, or "
                     "merging_probs holds NaN or fewer columns than the map's slots; pass "
                     "the permute's output with the row_id_map built for it, and finite "
                     "probs of the routing's shape")


@triton.jit
def unpermute_gather_kernel(
    inp_ptr,  # (N, H) any float dtype, contiguous
    out_ptr,  # (T, H) output dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) merging weights, row stride stride_w (read only if HAS_W)
    H,
    S,
    N_IN,
    stride_w,
    P,  # columns of the weights (a route's column >= P is an error; w_ptr holds >= 1)
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVICT: tl.constexpr,  # cache hint of the row loads and the store ("" or "evict_first")
    PAIRS: tl.constexpr,  # two routes a step (else one)
):
    """out[t] = sum over t's rows of inp[row] (* weight), accumulated in fp32 in row order.
    A row outside ``[0, N_IN)`` is never read (it adds zero and fails ``check_routes``), nor
    a weight column outside ``[0, P)``. With PAIRS two routes' rows are in flight a step (loaded
    together, then added in order) and the next two routes' map entries load meanwhile;
    without, one route a step with the next one's map entry loading meanwhile."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = tl.zeros((1,), dtype=tl.int32) + (n < 0).to(tl.int32)  # (1,): any problem seen
    wrow = w_ptr + t * stride_w
    if PAIRS:
        acc, bad = _merge_pairs(inp_ptr, mrow, wrow, n, S, P, H, N_IN, cols, hmask, acc, bad,
                                HAS_W, BLOCK_H, EVICT)
    else:
        d_next, w_next, c_next = _route(mrow, S, 0, n, wrow, P, HAS_W)
        for s in range(0, n):
            d, w, cbad = d_next, w_next, c_next
            d_next, w_next, c_next = _route(mrow, S, s + 1, n, wrow, P, HAS_W)
            d, lmask, bad = _checked_row(d, N_IN, hmask, bad, BLOCK_H)
            x = tl.load(inp_ptr + d * H + cols, mask=lmask, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)
            acc, bad = _merge_add(acc, x, w, cbad, bad, HAS_W)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask,
             eviction_policy=EVICT)
    check_routes(bad)


@triton.jit
def _merge_pairs(inp_ptr, mrow, wrow, n, S, P, H, N_IN, cols, hmask, acc, bad,
                 HAS_W: tl.constexpr, BLOCK_H: tl.constexpr, EVICT: tl.constexpr):
    """``(acc, bad)`` after adding a token's n routes two a step (``unpermute_gather_kernel``'s
    PAIRS loop; arguments as there, ``mrow`` / ``wrow`` its map and weights rows)."""
    da, wa, ca = _route(mrow, S, 0, n, wrow, P, HAS_W)
    db, wb, cb = _route(mrow, S, 1, n, wrow, P, HAS_W)
    for s in range(0, n, 2):
        d0, w0, c0 = da, wa, ca
        d1, w1, c1 = db, wb, cb
        da, wa, ca = _route(mrow, S, s + 2, n, wrow, P, HAS_W)
        db, wb, cb = _route(mrow, S, s + 3, n, wrow, P, HAS_W)
        d0, m0, bad = _checked_row(d0, N_IN, hmask, bad, BLOCK_H)
        d1, m1, bad = _checked_row(d1, N_IN, hmask, bad, BLOCK_H)
        # (BLOCK_H,): route s + 1 exists (a vector: the interpreter takes vector masks only;
        # past the last route, _route repeats route n - 1, which is never added twice)
        two = (cols * 0 + s + 1) < n
        x0 = tl.load(inp_ptr + d0 * H + cols, mask=m0, other=0.0,
                     eviction_policy=EVICT).to(tl.float32)
        x1 = tl.load(inp_ptr + d1 * H + cols, mask=m1 & two, other=0.0,
                     eviction_policy=EVICT).to(tl.float32)
        acc, bad = _merge_add(acc, x0, w0, c0, bad, HAS_W)
        acc1, bad = _merge_add(acc, x1, w1, c1, bad, HAS_W)
        acc = tl.where(two, acc1, acc)
    return acc, bad


@triton.jit
def gather_rows_kernel(
    inp_ptr,  # (R_in, H) any dtype, row stride stride_in
    out_ptr,  # (R, H) same dtype, contiguous
    src_ptr,  # (R,) int64 source row of each output row
    R,
    H,
    stride_in,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[r] = inp[src[r]]: each row read once and written once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < R
    src = tl.load(src_ptr + rows, mask=rmask, other=0)
    m = rmask[:, None] & (cols < H)[None, :]
    x = tl.load(inp_ptr + src[:, None] * stride_in + cols[None, :], mask=m)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], x, mask=m)


@triton.jit
def unpermute_fp8_kernel(
    q_ptr,  # (N, H) uint8: fp8 bits of the permuted rows, contiguous
    s_ptr,  # LAYOUT 0: () fp32; 1: (N, NB) fp32 block scales; 2: (N, NB) uint8 e8m0 bits
    out_ptr,  # (T, H) output dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) merging weights, row stride stride_w (read only if HAS_W)
    H,
    S,
    N_IN,
    NB,
    stride_w,
    P,  # columns of the weights (a route's column >= P is an error; w_ptr holds >= 1)
    LAYOUT: tl.constexpr,
    BS: tl.constexpr,  # scale block along H (LAYOUT 1 and 2)
    MB: tl.constexpr,
    BIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVICT: tl.constexpr,  # cache hint of the fp8 row loads and the store ("" or "evict_first")
):
    """The merge of quantized rows: each row is dequantized in registers (fp8 value times
    its block's scale, fp32) and summed in fp32 in row order, as ``unpermute_gather_kernel``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = tl.zeros((1,), dtype=tl.int32) + (n < 0).to(tl.int32)  # (1,): any problem seen
    if LAYOUT == 0:
        st = tl.load(s_ptr)
    wrow = w_ptr + t * stride_w
    # No load-ahead of the next route here: on the H200 it makes this kernel slower (MXFP8
    # merge at qwen3: 78% of copy without, 60% with), while the bf16 merge gains from it
    # (docs/benchmarks.md, "FP8 merge (`fp8_merge_tile`; no load-ahead)").
    for s in range(0, n):
        d, lmask, bad = _checked_row(tl.load(mrow + s).to(tl.int64), N_IN, hmask, bad, BLOCK_H)
        b = tl.load(q_ptr + d * H + cols, mask=lmask, other=0, eviction_policy=EVICT)
        v = fp8_bits_to_fp32(b, MB, BIAS, HW_CAST)
        if LAYOUT == 0:
            x = v * st
        else:
            # Unmasked, with the block index clamped into the row (d is a row of inp, or 0,
            # and the launcher guarantees a row 0): a thread's columns then share one load;
            # masked by column, the sm_90 build issued one load per column for fp32 scales.
            sidx = d * NB + tl.minimum(cols // BS, NB - 1)
            if LAYOUT == 1:
                sc = tl.load(s_ptr + sidx)
            else:
                sb = tl.load(s_ptr + sidx).to(tl.int32)
                sc = (sb << 23).to(tl.float32, bitcast=True)
                sc = tl.where(sb == 0, 5.877471754111438e-39, sc)  # 2**-127
                nan = tl.full(sc.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
                sc = tl.where(sb == 255, nan, sc)
            x = v * sc
        w, cbad = _route_weight(mrow, S, s, wrow, P, HAS_W)
        acc, bad = _merge_add(acc, x, w, cbad, bad, HAS_W)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask,
             eviction_policy=EVICT)
    check_routes(bad)
