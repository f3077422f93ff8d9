"""Triton code of the fused quantize-and-permute and its launchers
``quantize_permute_triton`` (map given) and ``quantize_permute_mask_triton`` (map built
in the launch), the CUDA kernels of ``qmoe::quantize_permute`` and
``qmoe::quantize_permute_mask``.

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

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.kernels.permute import (
    assert_probs_not_nan,
    permute_rows_triton,
    scatter_programs,
    zero_fill_rows,
    zero_rows,
    zero_unwritten_rows,
)
from qmoe.ops.kernels.permute_mask import map_token, next_rows, routes_at, unwritten_range
from qmoe.ops.kernels.row_id_map import block_counts, mask_rows_triton
from qmoe.ops.launch import (
    assert_options,
    fill_count,
    mask_operand,
    num_slots,
    pdl_default,
    pdl_options,
    unit_stride,
)
from qmoe.ops.tuning import (
    MASK_QUANT_STEPS,
    MASK_QUANT_TILE,
    QUANT_PERMUTE_KB,
    QUANT_PERMUTE_WARPS,
    QuantizePermuteTiling,
    count_chunk,
    fused_map_tiling,
    quantize_permute_columns,
    reg_routes_flag,
    small_map,
    tail_programs,
)
from qmoe.tensors import layouts
from qmoe.tensors.kernels.quantize import SCALE_GIVEN, quantize_tile
from qmoe.tensors.layouts import EPS, SCALE_MODES, emax_elem, fp8_fields, scale_dtype
from qmoe.tensors.recipes import fp8_max
from qmoe.tensors.tuning import PER_TENSOR_BLOCK

#: no overrides: the defaults (frozen, so one instance serves every call)
_DEFAULTS = QuantizePermuteTiling()


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
                               SCALE_MODE != SCALE_GIVEN, HAS_P)
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
    if SCALE_MODE != SCALE_GIVEN:
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
                      pp_ptr, pid_g * STEPS + i == 0, SCALE_MODE != SCALE_GIVEN, HAS_P)


# ------------------------------------------------------------------------- launchers


def _outputs(x, n, block_size, fp8_dtype, scale_mode, scale, probs, poison):
    """``(q [N, H] uint8, scale out, pp [N] or empty, BS, NB)`` of the fused kernels,
    allocated (``poison``: filled with 0xFF bytes first, so a row a kernel misses shows)."""
    given = scale_mode == "given"
    bs = PER_TENSOR_BLOCK if given else block_size  # per-tensor: the block is the tile width
    nb = cdiv(x.shape[1], bs)
    q = torch.empty((n, x.shape[1]), dtype=torch.uint8, device=x.device)
    if given:
        s_out = scale.float().reshape(()).clone()
    else:
        s_out = torch.empty((n, nb), dtype=scale_dtype(scale_mode), device=x.device)
    pp = (torch.empty((n,), dtype=probs.dtype, device=x.device) if probs is not None
          else torch.empty(0, dtype=x.dtype, device=x.device))
    if poison:
        for buf in (q, pp) if given else (q, s_out, pp):
            buf.view(torch.uint8).fill_(0xFF)
    return q, s_out, pp, bs, nb


def _consts(h, on_cuda, fp8_dtype, scale_mode, bs, nb, tile, steps) -> dict:
    """The quantizing constexprs of the fused kernels for rows of ``h`` elements (``on_cuda``:
    the hardware fp8 cast), and the column tiling: ``tile`` row elements a step, ``steps``
    steps a program (0: the whole row, so a token's map row is read or built once); a tile
    or steps not given (None) is ``tuning.quantize_permute_columns``'s."""
    tile, steps = quantize_permute_columns(h, tile, steps)
    groups = max(1, min(tile // bs, next_pow2(nb)))
    mb, bias = fp8_fields(fp8_dtype)
    return dict(FP8_MAX=fp8_max(fp8_dtype), EMAX_ELEM=emax_elem(fp8_dtype), EPS=EPS,
                SCALE_MODE=(layouts.SCALE_GIVEN if scale_mode == "given"
                            else SCALE_MODES[scale_mode]),
                MB=mb, BIAS=bias, HW_CAST=on_cuda, BS=bs,
                GROUPS=groups, STEPS=steps or cdiv(nb, groups))


def _column_programs(nb: int, consts: dict) -> int:
    """The grid's column programs a row: ``GROUPS * STEPS`` scale blocks each."""
    return cdiv(nb, consts["GROUPS"] * consts["STEPS"])


def quantize_permute_triton(x, rid, probs, n, block_size, fp8_dtype, scale_mode, scale,
                            fill=None, tiling: QuantizePermuteTiling | None = None, *,
                            poison=False):
    """``(qdata [N, H] fp8, scale [N, NB] or [], permuted_probs [N] or empty)`` of ``x [T,
    H]`` quantized (``block_size``, ``fp8_dtype``, ``scale_mode``; ``scale``: the given
    per-tensor scale) and moved to the rows of ``rid`` in one launch. ``fill``: as
    ``permute_rows_triton``'s (zero the unwritten rows in the same launch). ``tiling``
    overrides ``tile``, ``steps``, ``kb`` and ``num_warps`` (``QuantizePermuteTiling``).
    ``poison`` (tests) fills the outputs with 0xFF bytes first, so a row the kernel misses
    shows. No host sync."""
    o = tiling or _DEFAULTS
    t, h = x.shape
    q, s_out, pp, bs, nb = _outputs(x, n, block_size, fp8_dtype, scale_mode, scale, probs,
                                    poison)
    if n == 0:
        return q.view(fp8_dtype), s_out, pp
    if h == 0:  # no columns: empty bits and scale rows, nothing to quantize; probs move
        if probs is not None:
            permute_rows_triton(x, rid, n, probs=probs, probs_out=pp, fill=fill)
        return q.view(fp8_dtype), s_out, pp
    x, probs, rid = unit_stride(x), unit_stride(probs), rid.contiguous()
    fill = fill.contiguous() if fill is not None else None
    given, has_p, has_f = scale_mode == "given", probs is not None, fill is not None
    written = fill if has_f else torch.zeros(n, dtype=torch.int8, device=x.device)
    consts = _consts(x.shape[1], x.is_cuda, fp8_dtype, scale_mode, bs, nb, o.tile, o.steps)
    progs, r, z = scatter_programs(t, n, fill)
    if progs:
        launch(quantize_permute_kernel, (progs, _column_programs(nb, consts)),
            x, q, s_out, rid, probs if has_p else x, pp if has_p else written, written,
            fill if has_f else written, t, n, h, nb, num_slots(rid), r, z, x.stride(0),
            probs.stride(0) if has_p else 0, HAS_P=has_p, HAS_FILL=has_f,
            KB=o.kb or QUANT_PERMUTE_KB, num_warps=o.num_warps or QUANT_PERMUTE_WARPS,
            **assert_options(), **consts,  # assert_probs_not_nan
        )
    if not has_f:
        zero_unwritten_rows(q, written, pp if has_p else None, None if given else s_out)
    return q.view(fp8_dtype), s_out, pp


def quantize_permute_mask_triton(x, mask, n, align_size, probs, block_size, fp8_dtype,
                                 scale_mode, scale, tiling: QuantizePermuteTiling | None = None,
                                 *, poison=False):
    """``(q, scale, permuted_probs, row_id_map [T, 2E+1] int32)`` of ``x [T, H]`` by
    ``mask [T, E]`` with the map built in the fused launch: as
    ``make_row_id_map`` then ``quantize_permute_triton``, bit for bit (which is what it
    runs when T, H or E is zero: nothing to quantize, or no routes). ``tiling``: as
    ``FusedMaskTiling`` for the map's launches; ``tile`` defaults to ``MASK_QUANT_TILE`` at
    every H (a token's map work is done once a program, so splitting a row over programs
    repeats it), ``steps`` to ``MASK_QUANT_STEPS``. No host sync."""
    o = tiling or _DEFAULTS
    t, h = x.shape
    e = mask.shape[1]
    if 0 in (t, h, e):
        fill = mask.new_empty((fill_count(mask, False, align_size), 2), dtype=torch.int32)
        rid = mask_rows_triton(mask, n, align_size, fill)
        return (*quantize_permute_triton(x, rid, probs, n, block_size, fp8_dtype, scale_mode,
                                         scale, fill, poison=poison), rid)
    q, s_out, pp, bs, nb = _outputs(x, n, block_size, fp8_dtype, scale_mode, scale, probs,
                                    poison)
    rid = torch.empty((t, 2 * e + 1), dtype=torch.int32, device=mask.device)
    m = mask_operand(mask)
    x, probs = unit_stride(x), unit_stride(probs)
    has_p = probs is not None
    grid, z, small, bt, map_warps, pdl, options = _mask_quant_plan(
        t, h, e, n, align_size, m.element_size(), has_p, x.is_cuda, fp8_dtype, scale_mode,
        bs, nb, o, (pdl_default(x) if o.pdl is None else o.pdl))
    before, total = (None, None) if small else block_counts(m, bt, map_warps, pdl)
    launch(quantize_permute_mask_kernel, grid,
        x, q, s_out, m, before, total, rid, probs, pp if has_p else None, t, n, h, nb, e,
        max(align_size, 1), z, x.stride(0), m.stride(0), probs.stride(0) if has_p else None,
        **options,
    )
    return q.view(fp8_dtype), s_out, pp, rid


@functools.lru_cache(maxsize=1024)
def _mask_quant_plan(t, h, e, n, align_size, m_size, has_p, on_cuda, fp8_dtype, scale_mode,
                     bs, nb, o, pdl_ok):
    """``(grid, Z, SMALL, count block, count warps, PDL, launch options)`` of
    ``quantize_permute_mask_kernel`` for these sizes, dtypes and overrides ``o``
    (``pdl_ok``: PDL allowed here): pure in its arguments, so kept per process (no data;
    the options read-only)."""
    d = fused_map_tiling(t, e)
    bt, map_warps = o.block_t or d.block_t, o.map_warps or d.num_warps
    small = o.one_launch if o.one_launch is not None else small_map(t, e, m_size)
    pdl = not small and pdl_ok
    ranges = e if align_size > 1 else 0
    z = tail_programs(n)
    be = next_pow2(e)
    nw = o.num_warps or QUANT_PERMUTE_WARPS
    steps = MASK_QUANT_STEPS if o.steps is None else o.steps
    consts = _consts(h, on_cuda, fp8_dtype, scale_mode, bs, nb, o.tile or MASK_QUANT_TILE,
                     steps)
    options = MappingProxyType(dict(
        HAS_P=has_p, SMALL=small, BLOCK_T=bt, BLOCK_E=be,
        CHUNK_T=count_chunk(t, be, nw), KB=o.kb or QUANT_PERMUTE_KB,
        REG_ROUTES=reg_routes_flag(be, o.reg_routes), PDL=pdl, num_warps=nw,
        **pdl_options(pdl), **assert_options(), **consts,  # assert_probs_not_nan
    ))
    return (t + ranges + z, _column_programs(nb, consts)), z, small, bt, map_warps, pdl, options
