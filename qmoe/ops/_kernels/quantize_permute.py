"""Triton code for the fused quantize-and-permute (launcher: ``qmoe/ops/quantize_permute.py``).

Glossary: T tokens, H hidden, S map slots per token, N output rows, P probs columns,
BS the scale block along H, NB = ceil(H / BS) blocks per row, GROUPS blocks per step,
STEPS steps per program, R row ranges in ``fill`` (rows no route writes), Z programs
sharing the last one.

A program takes STEPS chunks of ``GROUPS * BS`` columns of one token's high-precision row
in turn, each chunk loaded at its step: issuing chunk i + 1's load before chunk i's stores
gave wrong bits on an H100 with Triton 3.6 (blockwise, H = 7168) while the interpreter agreed
(docs/benchmarks.md, "Column steps and tiles (`_consts`)"). It reads
each chunk once, quantizes it with the same code as ``qmoe.quantize`` (``quantize_tile``: one
scale per block, or a given per-tensor scale) and writes the fp8 bits and the scale blocks
to every output row of the token's routes; the token's map row is read (or built) once per
program. fp8 goes through ``uint8`` so the interpreter runs it.

``quantize_permute_mask_kernel`` takes a ``[T, E]`` mask instead of a map (E experts, A
the padding alignment): each token program builds its own map row first, as
``permute_mask_kernel`` does, and the programs past T zero the unwritten rows from the
experts' totals.
"""

import triton
import triton.language as tl

from qmoe.ops._kernels.permute import assert_probs_not_nan, zero_fill_rows, zero_rows
from qmoe.ops._kernels.permute_mask import map_token, next_rows, routes_at, unwritten_range
from qmoe.tensors._kernels.quantize import quantize_tile


@triton.jit
def quantize_permute_kernel(
    x_ptr,  # (T, H) fp32 / bf16 / fp16, row stride stride_x
    q_ptr,  # (N, H) uint8 out: fp8 bits of the permuted rows, contiguous
    s_ptr,  # (N, NB) fp32 or uint8 (e8m0) out; () fp32 in for SCALE_GIVEN
    map_ptr,  # (T, 2S+1) int32 row_id_map
    p_ptr,  # (T, P) float probs, row stride stride_p (read only if HAS_P)
    pp_ptr,  # (N,) probs dtype out: permuted probs (written only if HAS_P)
    written_ptr,  # (N,) int8, zero-initialized: 1 for every row written (if not HAS_FILL)
    fill_ptr,  # (R, 2) int32 row ranges no route writes (if HAS_FILL)
    T,
    N,
    H,
    NB,
    S,
    R,
    Z,
    stride_x,
    stride_p,
    FP8_MAX: tl.constexpr,
    EMAX_ELEM: tl.constexpr,
    EPS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MB: tl.constexpr,
    BIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_FILL: tl.constexpr,
    BS: tl.constexpr,
    GROUPS: tl.constexpr,
    STEPS: tl.constexpr,
    KB: tl.constexpr,  # routes stored together
):
    """Grid ``(T [+ R - 1 + Z with HAS_FILL], cdiv(NB, GROUPS * STEPS))``: programs
    ``t < T`` quantize and scatter token t's columns; with HAS_FILL, programs ``t >= T``
    zero the rows no route writes (bits, scale blocks, probs)."""
    pid = tl.program_id(0)
    pid_g = tl.program_id(1)
    if pid >= T:  # fill programs (the grid holds only the T token programs without fill)
        if HAS_FILL:
            for i in tl.static_range(STEPS):
                blocks, cols = chunk_at(pid_g * STEPS + i, BS, GROUPS)
                zero_fill_rows(pid - T, fill_ptr, R, Z, N, q_ptr, H, cols, cols < H, s_ptr, NB,
                               blocks, blocks < NB, pp_ptr, pid_g * STEPS + i == 0,
                               SCALE_MODE != 3, HAS_P)
    else:
        t = pid.to(tl.int64)
        x_row = x_ptr + t * stride_x
        x = load_chunk(x_row, pid_g * STEPS, H, BS, GROUPS)
        mrow = map_ptr + t * (2 * S + 1)
        sl0 = tl.arange(0, KB)
        d0 = tl.load(mrow + sl0, mask=sl0 < S, other=-1)  # loads with the row, not after it
        n = tl.minimum(tl.load(mrow + 2 * S), S)
        for i in tl.static_range(STEPS):
            c = pid_g * STEPS + i
            if i > 0:  # (the first chunk's load went out before the map work)
                x = load_chunk(x_row, c, H, BS, GROUPS)
            _quantize_scatter_chunk(
                t, x, c, d0, n, mrow, q_ptr, s_ptr, p_ptr, pp_ptr, written_ptr, N, H,
                NB, S, stride_p, FP8_MAX, EMAX_ELEM, EPS, SCALE_MODE, MB, BIAS, HW_CAST,
                HAS_P, not HAS_FILL, KB, BS, GROUPS)


@triton.jit
def chunk_at(c, BS: tl.constexpr, GROUPS: tl.constexpr):
    """``(blocks (GROUPS,), cols (GROUPS, BS))``: the scale blocks and row columns of a
    row's chunk ``c`` (``GROUPS * BS`` columns)."""
    blocks = c * GROUPS + tl.arange(0, GROUPS)
    return blocks, blocks[:, None] * BS + tl.arange(0, BS)[None, :]


@triton.jit
def load_chunk(x_row, c, H, BS: tl.constexpr, GROUPS: tl.constexpr):
    """``(1, GROUPS, BS)``: chunk ``c`` of the row at ``x_row`` (zero past H)."""
    _, cols = chunk_at(c, BS, GROUPS)
    return tl.load(x_row + cols[None, :, :], mask=(cols < H)[None, :, :], other=0.0)


@triton.jit
def _quantize_scatter_chunk(
    t, x, c, d0, n, mrow, q_ptr, s_ptr, p_ptr, pp_ptr, written_ptr, N, H, NB, S, stride_p,
    FP8_MAX: tl.constexpr, EMAX_ELEM: tl.constexpr, EPS: tl.constexpr,
    SCALE_MODE: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, HW_CAST: tl.constexpr,
    HAS_P: tl.constexpr, FLAGS: tl.constexpr, KB: tl.constexpr, BS: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Token t's chunk ``c``, ``x`` ``(1, GROUPS, BS)`` (loaded by the caller), quantized
    and stored at the rows of its map row ``mrow`` (``d0``: its first KB slots, ``n``: its
    route count; FLAGS: mark the rows in ``written``, on chunk 0 only)."""
    blocks, cols = chunk_at(c, BS, GROUPS)
    q, stored = quantize_tile(x, s_ptr, FP8_MAX, EMAX_ELEM, EPS, SCALE_MODE,
                              MB, BIAS, HW_CAST)
    sl0 = tl.arange(0, KB)
    for s0 in range(0, n, KB):  # KB routes an iteration, stored together
        sl = s0 + sl0
        if s0 == 0:
            d = d0
        else:
            d = tl.load(mrow + sl, mask=sl < n, other=-1)
        keep = (sl < n) & (d >= 0) & (d < N)  # a row outside [0, N) is never written
        if HAS_P:
            e = tl.load(mrow + S + sl, mask=keep, other=0)
        else:
            e = tl.zeros((KB,), dtype=tl.int32)
        _store_quantized(t, q, stored, d.to(tl.int64), e, keep, q_ptr, s_ptr, p_ptr, pp_ptr,
                         written_ptr, H, NB, stride_p, blocks, cols, c == 0, SCALE_MODE, HAS_P,
                         FLAGS, KB, BS, GROUPS)


@triton.jit
def _store_quantized(t, q, stored, d, col, keep, q_ptr, s_ptr, p_ptr, pp_ptr, written_ptr, H, NB,
                     stride_p, blocks, cols, first, SCALE_MODE: tl.constexpr,
                     HAS_P: tl.constexpr, FLAGS: tl.constexpr, KB: tl.constexpr,
                     BS: tl.constexpr, GROUPS: tl.constexpr):
    """Store token t's quantized chunk ``q`` ``(1, GROUPS, BS)`` and its scale blocks
    ``stored`` to the KB rows ``d`` (int64) where ``keep``; if ``first`` (the row's first
    chunk), also its probs from columns ``col`` and (FLAGS) the rows' ``written`` flags."""
    mask = (cols < H)[None, :, :]  # (1, GROUPS, BS)
    smask = (blocks < NB)[None, :]  # (1, GROUPS)
    tl.store(q_ptr + d[:, None, None] * H + cols[None, :, :],
             tl.broadcast_to(q, (KB, GROUPS, BS)), mask=keep[:, None, None] & mask)
    if SCALE_MODE != 3:
        tl.store(s_ptr + d[:, None] * NB + blocks[None, :],
                 tl.broadcast_to(stored, (KB, GROUPS)), mask=keep[:, None] & smask)
    if first:
        if FLAGS:
            tl.store(written_ptr + d, tl.full((KB,), 1, dtype=tl.int8), mask=keep)
        if HAS_P:
            pv = tl.load(p_ptr + t * stride_p + col, mask=keep, other=0.0)
            assert_probs_not_nan(pv)
            tl.store(pp_ptr + d, pv, mask=keep)


@triton.jit
def quantize_permute_mask_kernel(
    x_ptr,  # (T, H) fp32 / bf16 / fp16, row stride stride_x
    q_ptr,  # (N, H) uint8 out: fp8 bits of the permuted rows, contiguous
    s_ptr,  # (N, NB) fp32 or uint8 (e8m0) out; () fp32 in for SCALE_GIVEN
    mask_ptr,  # (T, E) any integer dtype (bool as uint8), nonzero = routed, row stride stride_m
    before_ptr,  # (cdiv(T, BLOCK_T), E) int32: tokens of earlier blocks (unless SMALL)
    total_ptr,  # (E,) int32: tokens per expert (unless SMALL)
    map_ptr,  # (T, 2E+1) int32 out: the row_id_map
    p_ptr,  # (T, E) float probs, row stride stride_p (read only if HAS_P)
    pp_ptr,  # (N,) probs dtype out: permuted probs (written only if HAS_P)
    T,
    N,
    H,
    NB,
    E,
    A,
    Z,
    stride_x,
    stride_m,
    stride_p,
    FP8_MAX: tl.constexpr,
    EMAX_ELEM: tl.constexpr,
    EPS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MB: tl.constexpr,
    BIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
    HAS_P: tl.constexpr,
    SMALL: tl.constexpr,  # count the whole mask in every program (no count/scan launches)
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
    BS: tl.constexpr,
    GROUPS: tl.constexpr,
    STEPS: tl.constexpr,
    KB: tl.constexpr,
    REG_ROUTES: tl.constexpr,  # scatter to the rows held in registers (else: read back)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the scan (not SMALL)
):
    """Grid ``(T + R - 1 + Z, cdiv(NB, GROUPS * STEPS))``, R as in ``permute_mask_kernel``:
    programs ``t < T`` build token t's map row, then quantize and scatter its columns;
    the others zero the rows no route writes (bits, scale blocks, probs)."""
    pid = tl.program_id(0)
    pid_g = tl.program_id(1)
    if pid < T:
        t = pid.to(tl.int64)
        x_row = x_ptr + t * stride_x
        x = load_chunk(x_row, pid_g * STEPS, H, BS, GROUPS)  # in flight during the map work
        if PDL:  # the scan's counts are read from here on
            tl.extra.cuda.gdc_wait()
        run = next_rows(pid, mask_ptr, before_ptr, total_ptr, T, E, A, stride_m, SMALL,
                        BLOCK_T, BLOCK_E, CHUNK_T)
        keep, slot, n, _ = map_token(pid, run, mask_ptr, map_ptr, T, N, E, stride_m, BLOCK_E)
        mrow = map_ptr + t * (2 * E + 1)
        if not REG_ROUTES:  # the rows are read back from the stored map row
            tl.debug_barrier()
            sl0 = tl.arange(0, KB)
            d0 = tl.load(mrow + sl0, mask=sl0 < E, other=-1)
            n = tl.minimum(tl.load(mrow + 2 * E), E)
        for i in tl.static_range(STEPS):
            c = pid_g * STEPS + i
            if i > 0:  # (the first chunk's load went out before the map work)
                x = load_chunk(x_row, c, H, BS, GROUPS)
            if REG_ROUTES:  # the rows come from registers
                blocks, cols = chunk_at(c, BS, GROUPS)
                q, stored = quantize_tile(x, s_ptr, FP8_MAX, EMAX_ELEM, EPS,
                                          SCALE_MODE, MB, BIAS, HW_CAST)
                for s0 in range(0, n, KB):
                    d, e, keep_k = routes_at(keep, slot, run, s0, n, BLOCK_E, KB)
                    _store_quantized(t, q, stored, d, e, keep_k, q_ptr, s_ptr, p_ptr, pp_ptr,
                                     None, H, NB, stride_p, blocks, cols, c == 0, SCALE_MODE,
                                     HAS_P, False, KB, BS, GROUPS)
            else:
                _quantize_scatter_chunk(
                    t, x, c, d0, n, mrow, q_ptr, s_ptr, p_ptr, pp_ptr, None, N, H, NB, E,
                    stride_p, FP8_MAX, EMAX_ELEM, EPS, SCALE_MODE, MB, BIAS, HW_CAST, HAS_P,
                    False, KB, BS, GROUPS)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        lo, hi = unwritten_range(pid - T, mask_ptr, total_ptr, T, N, E, A, Z, stride_m, SMALL,
                                 BLOCK_E, CHUNK_T)
        for i in tl.static_range(STEPS):
            blocks, cols = chunk_at(pid_g * STEPS + i, BS, GROUPS)
            zero_rows(lo, hi, N, q_ptr, H, cols, cols < H, s_ptr, NB, blocks, blocks < NB,
                      pp_ptr, pid_g * STEPS + i == 0, SCALE_MODE != 3, HAS_P)
