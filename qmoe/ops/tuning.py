"""Every launch tiling and size threshold of qmoe.ops' kernels, in one place.

The launchers (``qmoe.ops.kernels``: ``row_id_map``, ``permute``, ``permute_mask``,
``permute_index``, ``unpermute``, ``sort_chunks``, ``quantize_permute``) take their tiles
from here, and the ops the thresholds between their paths. A launcher takes the tensors
and an optional tiling object (``MaskMapTiling``, ``FusedMaskTiling``,
``PermuteIndexTiling``, ``QuantizePermuteTiling``, ``SortChunksTiling``,
``MergeBackwardTiling``): a field left ``None`` takes the default rule below, so sweeps and
tests override only what they vary. Each constant has one comment line: what it is
and the benchmark command that chose it, with its section of docs/benchmarks.md where one
measured it; each function's docstring gives its rule the same way. The quantize kernel's
tiling is in ``qmoe.tensors.tuning`` (qmoe.tensors does not import qmoe.ops). Plain Python:
no Triton, no state.

Glossary: T tokens, E experts, K slots per token, H hidden, N output rows, P weight
columns, C chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from qmoe._intmath import cdiv, next_pow2, prev_pow2
from qmoe.tensors.tuning import quantize_rows_tile

# ------------------------------------------------------------ scatter, gather, zeroing


def _block_h(h: int) -> int:
    return max(16, min(1024, next_pow2(max(h, 1))))


def scatter_tile(h: int, itemsize: int, weighted: bool) -> tuple[int, int, int]:
    """``(BLOCK_H, num_warps, KB)`` of the scatter kernel: up to 16 KiB of a row per
    program (2048 columns when weighted, whose math is fp32). Chosen by
    ``python -m benchmarks sweep permute`` on the H200 (docs/benchmarks.md, "Scatter tiles"):
    within 2 points of each config's best at dsv3, qwen3, mixtral and gptoss."""
    cap = 2048 if weighted else 16384 // itemsize
    bh = max(16, min(cap, next_pow2(max(h, 1))))
    nw = min(8 if itemsize > 1 else 4, max(1, bh * itemsize // 512))
    return bh, nw, 4 if weighted or itemsize == 1 else 8


def gather_tile(h: int, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_H, num_warps)`` of ``gather_rows_kernel`` (``h >= 1``): about 16
    KiB of rows a program, as the scatter kernel (``scatter_tile``), 8 warps."""
    bh = max(16, min(16384 // itemsize, next_pow2(h)))
    return max(1, 16384 // (bh * itemsize)), bh, 8


def zero_rows_tile(h: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_H, num_warps)`` of ``zero_rows_kernel``: 64 rows of up to 64
    columns a step, 4 warps."""
    return 64, min(_block_h(h), 64), 4


def tail_programs(n: int) -> int:
    """Z, the programs that share zeroing the tail of unwritten rows (about 64 rows each,
    at most 256 programs)."""
    return max(1, min(256, cdiv(n, 64)))


# ------------------------------------------------------------------- grouped_mm's FP8


def quantize_cols_tile(k: int, m: int) -> tuple[int, int, int]:
    """``(BLOCK_K, BLOCK_M, num_warps)`` of ``quantize_cols_kernel`` (the expert weights
    quantized per column, written transposed): 256 x 64 tiles (128-byte loads along M),
    8 warps, narrower (and 4 warps) for small K or M: ``python -m benchmarks sweep
    quantize --kinds cols`` (docs/benchmarks.md, "Expert GEMMs")."""
    bk, bm = max(16, min(256, next_pow2(k))), max(16, min(64, next_pow2(m)))
    return bk, bm, 8 if bk * bm >= 256 * 64 else 4


def zero_tail_tile(w: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_W, num_warps)`` of ``zero_tail_kernel``: 16 rows of up to 1024
    columns a step, 4 warps."""
    return 16, max(16, min(1024, next_pow2(w))), 4


def check_offsets_tile(e: int) -> tuple[int, int]:
    """``(BLOCK_E, num_warps)`` of ``check_offsets_kernel``: every offset in one program
    (E is at most a few thousand experts), 1 warp, 4 above 1024 experts. Untimed: the
    launch is host-bound."""
    return max(16, next_pow2(e)), 1 if e <= 1024 else 4


# ------------------------------------------------------------------------------ SwiGLU


def swiglu_tile(f: int, block_size: int | None) -> tuple[int, int, int, int]:
    """``(BLOCK_R, GROUPS, BS, num_warps)`` of ``swiglu_kernel`` over activations of ``f``
    columns: quantizing with blocks of ``block_size``, the quantize kernel's tile
    (``quantize_rows_tile``: whole blocks, about 4096 elements; 8 warps at blocks of 8192
    and wider); else 1024-column tiles of about 4096 elements, 4 warps."""
    if block_size is not None:
        block_r, groups, nw = quantize_rows_tile(block_size, cdiv(f, block_size))
        # a row of 8192+ (two fp32 halves live at once) spills at 4 warps (ptxas -v)
        return block_r, groups, block_size, max(nw, 8) if block_size >= 8192 else nw
    bs = max(16, min(1024, next_pow2(f)))
    return max(1, 4096 // bs), 1, bs, 4


def swiglu_backward_tile(f: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_F, num_warps)`` of ``swiglu_backward_kernel``: 512-column tiles of
    about 4096 elements, 4 warps."""
    bf = max(16, min(512, next_pow2(f)))
    return max(1, 4096 // bf), bf, 4


# ------------------------------------------------------------------------------ merges


def merge_tile(h: int, weighted: bool) -> tuple[int, int, str, bool]:
    """``(BLOCK_H, num_warps, eviction policy, PAIRS)`` of the bf16/fp16/fp32 merge kernel.
    Weighted, or at an H that is not a power of two up to 4096: 512 columns and one warp a
    program (fewer for H < 512), two routes a step, rows streamed through L2 evict-first.
    Unweighted at a power-of-two H up to 4096: one tile of H columns (8 warps at 4096), one
    route a step. Chosen by ``python -m benchmarks sweep gather`` on the H200
    (docs/benchmarks.md, "bf16 merge tiles (`merge_tile`)"), kernel alone, % of copy:
    weighted dsv3 92.5 (against 81.7 with 4096 columns, 8 warps, one route a step), qwen3
    94.2 (91.3), qwen3next 90.9 (87.3), mixtral 81.4 (77.1), gptoss 80.5 (68.6); unweighted
    the one tile is ahead at qwen3 99.1 vs 94.2, qwen3next 95.2 vs 93.4, mixtral 84.1 vs
    81.2."""
    if not weighted and _one_tile_fits(h):
        return *_one_tile(h), "", False
    return max(16, min(512, next_pow2(max(h, 1)))), 1, "evict_first", True


def fp8_merge_tile(h: int) -> tuple[int, int, str]:
    """``(BLOCK_H, num_warps, eviction policy)`` of the FP8 merge kernel. A power-of-two H
    up to 4096, or any H up to 1024, is one tile (8 warps at 4096); a larger H goes in
    1024-column tiles of 2 warps with the fp8 rows read evict-first. Chosen by
    ``python -m benchmarks sweep gather --quick --more`` on the H200 (docs/benchmarks.md, "FP8
    merge (`fp8_merge_tile`; no load-ahead)"), blockwise kernel alone, % of copy: 1024 / 2 /
    evict-first against one tile of 8 warps, dsv3 (H = 7168) 75.5 vs 66.9, gptoss (2880)
    65.4 vs 53.7; at H = 4096 and 2048 the one tile is ahead (qwen3 78.3 vs 75.2, qwen3next
    75.8 vs 72.8; mixtral, 68.6 vs 72.2, is the exception left alone); 512-column tiles
    lost 7-16 points."""
    if _one_tile_fits(h) or h <= 1024:
        return *_one_tile(h), ""
    return 1024, 2, "evict_first"


def _one_tile_fits(h: int) -> bool:
    """A merge row of H columns is one power-of-two tile of at most 4096 columns."""
    return h & (h - 1) == 0 and h <= 4096


def _one_tile(h: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of a merge program over a whole row of H columns (at least
    16 columns; a warp per 512, 1 to 8)."""
    bh = max(16, next_pow2(max(h, 1)))
    return bh, max(1, min(8, bh // 512))


def merge_backward_tile(h: int, p: int) -> tuple[int, int, int]:
    """``(KB, BLOCK_H, num_warps)`` of ``merge_backward_kernel`` (both gradients of the
    weighted merge, ``p`` weight columns): up to 1024 columns and 4 warps a program; four
    routes' rows a step from H = 4096 with 16 or more weight columns, else two. Chosen by
    ``python -m benchmarks sweep merge_backward`` on the H200 (docs/benchmarks.md, "Merge backward
    (`merge_backward_tile`)"), mask maps, % of copy, against a weighted scatter plus a
    weight-gradient kernel in parentheses: dsv3 85.3 (77.4), qwen3 88.6 (82.7), qwen3next
    86.0 (79.5), mixtral 81.7 (63.5), gptoss 79.8 (63.5). Four routes a step win at dsv3
    and qwen3 (K = 8) and lose 18 points at mixtral (K = 2). The host
    cannot tell K from a mask map without a sync, so E (its weight columns) stands in:
    mixtral has 8. An index map's columns are K itself (at H >= 4096, K >= 16 takes
    four)."""
    return (4 if h >= 4096 and p >= 16 else 2), min(1024, _block_h(h)), 4


#: Largest merge-backward input gradient (bytes) zeroed whole first (fill + merge; above: flag fill, merge, zeroing), a first estimate not yet swept: ``python -m benchmarks bench permute`` times the merge backward per config.
MERGE_BACKWARD_FILL_BYTES = 32 << 20


# -------------------------------------------------------------------------------- maps


class MapTiling(NamedTuple):
    """Launch shape of the mask-map kernels: ``block_t`` tokens per block (one program of
    the count and map passes, one row of per-expert counts), walked one token row at a
    time; ``num_warps`` of both passes; the map pass loads ``prefetch`` rows ahead."""

    block_t: int
    num_warps: int
    prefetch: int = 2


def map_tiling(t: int, e: int) -> MapTiling:
    """The tiling the launcher uses for a ``[T, E]`` mask: ``next_pow2(E) / 128`` warps
    (1 to 8: ~4 experts a thread from E = 65 to 1024, fewer below, more above), blocks of
    16 tokens (8 once ``next_pow2(E) > 128``) but at least ~512 blocks (down to 2 tokens),
    up to 8 rows loaded ahead. Chosen by ``python -m benchmarks sweep map`` on the H200
    (docs/benchmarks.md, "Mask map (`make_row_id_map`, `map_tiling`)"): the map pass is
    bound by the latency of each row's scan, so short blocks over many programs win until
    the per-block counts grow; more warps lose."""
    be = next_pow2(e)
    bt = max(2, min(16 if be <= 128 else 8, prev_pow2(t // 512)))
    return MapTiling(bt, max(1, min(8, be // 128)), min(8, bt))


def scan_tile(nblk: int, e: int) -> tuple[int, int]:
    """``(COLS, CHUNK_B)`` of ``block_scan_kernel`` over ``[NBLK, E]`` block counts: COLS
    experts a program (about 128 programs), CHUNK_B blocks a step (up to 4096 counts)."""
    cols = min(next_pow2(e), max(1, next_pow2(cdiv(e, 128))))
    return cols, max(1, min(next_pow2(nblk), 4096 // cols))


#: Largest mask in bytes (T * next_pow2(E) * itemsize) whose map takes one launch, every program counting all of it.
SMALL_MAP_BYTES = 1 << 15


def small_mask(m: torch.Tensor) -> bool:
    """Whether a mask (from ``mask_operand``) is small enough (``SMALL_MAP_BYTES``) for the
    one-launch forms, whose programs each count all of it."""
    return small_map(m.shape[0], m.shape[1], m.element_size())


def small_map(t: int, e: int, itemsize: int) -> bool:
    """``small_mask`` of a ``[T, E]`` mask of ``itemsize``-byte entries."""
    return t * next_pow2(e) * itemsize <= SMALL_MAP_BYTES


def small_map_walk(t: int, block_e: int, num_warps: int) -> tuple[int, int]:
    """``(CHUNK_T, num_warps)`` of ``mask_row_id_map_small_kernel``: its counting walk takes
    8192 mask entries a step (whole rows, at least one) over at least 4 warps (64 a
    thread)."""
    return max(1, min(next_pow2(t), 8192 // block_e)), max(4, num_warps)


#: Most T*K ids of an index map built in one launch without a sort (every program reads all of them).
SMALL_INDEX_ENTRIES = 1 << 13
#: Most ids that one-launch index map kernel reads in all (T*T*K).
SMALL_INDEX_READS = 1 << 21
#: Most slots K of that one-launch index map kernel (a [K, K] step packs each token's routes).
SMALL_INDEX_K = 64


def small_index_map(t: int, k: int) -> bool:
    """Whether a ``[T, K]`` index map is built by the one-launch kernel (on CUDA)."""
    return 0 < t * k <= SMALL_INDEX_ENTRIES and t * t * k <= SMALL_INDEX_READS and (
        k <= SMALL_INDEX_K)


def small_index_tile(t: int, k: int) -> tuple[int, int]:
    """``(CHUNK, num_warps)`` of ``index_row_id_map_small_kernel``: the (token, slot)
    entries compared a step with a token's K ids (about 8192 comparisons, at least 16
    entries), 4 warps."""
    return max(16, min(next_pow2(t * k), 8192 // next_pow2(k))), 4


# ------------------------------------------------------ fused mask and index permutes

#: Warps of the fused mask permute kernel: ``python -m benchmarks sweep permute_mask`` (docs/benchmarks.md, "Count blocks and warps (`FUSED_BLOCK_T`, `FUSED_WARPS`)").
FUSED_WARPS = 4
#: Tokens per count block of the fused mask permute: ``python -m benchmarks sweep permute_mask`` (docs/benchmarks.md, "Count blocks and warps (`FUSED_BLOCK_T`, `FUSED_WARPS`)").
FUSED_BLOCK_T = 16
#: Token rows a program of the fused mask permute kernel (docs/benchmarks.md, "Count blocks and warps (`FUSED_BLOCK_T`, `FUSED_WARPS`)").
FUSED_TOKENS = 1
#: Largest next_pow2(E) whose fused mask kernels keep each route's row in registers: ``python -m benchmarks sweep permute_mask --reg-routes 0,1`` (docs/benchmarks.md, "Routes from registers; the map in the quantize launch").
REG_ROUTES_MAX_E = 128


def fused_map_tiling(t: int, e: int) -> MapTiling:
    """The count pass's tiling for the fused kernel: ``map_tiling``'s warps, blocks of
    ``FUSED_BLOCK_T`` tokens (each token program sums the rows of its block before it)."""
    return map_tiling(t, e)._replace(block_t=FUSED_BLOCK_T)


def reg_routes_flag(block_e: int, override: bool | None = None) -> bool:
    """``REG_ROUTES`` of a fused mask kernel with ``next_pow2(E) = block_e`` (``override``
    wins when given)."""
    return override if override is not None else block_e <= REG_ROUTES_MAX_E


def count_chunk(t: int, block_e: int, num_warps: int) -> int:
    """Mask rows per step of a SMALL program's counting walk: about 2048 mask entries a
    warp and step."""
    return max(1, min(next_pow2(t), 2048 * num_warps // block_e))


#: Tokens per count block of the fused index permute (the mask's, timed as is): ``python -m benchmarks sweep permute_mask --rows bf16 --index`` (docs/benchmarks.md, "Index permute").
FUSED_INDEX_BLOCK_T = 16
#: Warps of the fused index permute kernel (the mask's, timed as is): ``python -m benchmarks sweep permute_mask --rows bf16 --index`` (docs/benchmarks.md, "Index permute").
FUSED_INDEX_WARPS = 4
#: Largest E at which the fused index permute beats the sorting map then the scatter: ``python -m benchmarks sweep permute_mask --rows bf16 --index`` (docs/benchmarks.md, "Index permute").
FUSED_INDEX_MAX_EXPERTS = 256
#: Largest K of the fused index permute (the timed configs reach qwen3next's 10; its programs compare their K ids with their block's earlier tokens', a cost growing as K squared).
FUSED_INDEX_MAX_K = 16


def fused_index_wins(t: int, k: int, num_experts: int) -> bool:
    """Whether a CUDA ``[T, K]`` index map of ``num_experts`` experts takes the fused
    kernel: not for maps small enough for the one-launch map kernel (two launches in all,
    not timed against the fused three), nor above ``FUSED_INDEX_MAX_EXPERTS`` (slower),
    nor above ``FUSED_INDEX_MAX_K`` (not timed)."""
    return (num_experts <= FUSED_INDEX_MAX_EXPERTS and k <= FUSED_INDEX_MAX_K
            and not small_index_map(t, k))


# -------------------------------------------------------------------------- chunk sort

#: Most chunks of the one-launch chunk sort (its programs hold the C sizes and the order in registers).
MAX_KERNEL_CHUNKS = 4096
#: Largest BLOCK_R * BLOCK_C of a chunk-sort tile (its per-row chunk scan): ``python -m benchmarks sweep sort_chunks --scales --configs qwen3next`` (docs/benchmarks.md, "FP8 rows: int32 words, the scan cut, side rows").
MAX_SCAN_ELEMENTS = 4096
#: Widest chunk-sort row tile whose side rows take tiles of its shape (SIDE_WIDE): ``python -m benchmarks sweep sort_chunks --fp8`` (docs/benchmarks.md, "FP8 rows: int32 words, the scan cut, side rows").
SIDE_WIDE_MAX_COLS = 512
#: Warps of the chunk sort kernel: ``python -m benchmarks sweep sort_chunks`` (docs/benchmarks.md, "Chunk sort").
SORT_CHUNKS_WARPS = 4


def sort_chunks_tile(t: int, width: int, itemsize: int, chunks: int, words: bool, *,
                     block_h: int | None = None, steps: int | None = None,
                     max_scan: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_H, STEPS)`` of ``sort_chunks_kernel`` over ``T`` rows of ``width``
    elements of ``itemsize`` bytes (int32 words when ``words``) and ``chunks`` chunks;
    ``block_h``, ``steps`` and ``max_scan`` override (the sweep).

    ~16 KiB of rows a tile (``block_h`` columns, up to 16 KiB of one row, as
    ``gather_tile``), one tile a program (``steps``); chosen by
    ``python -m benchmarks sweep sort_chunks`` on the H200 (docs/benchmarks.md, "Chunk sort"):
    within 3 points of the best of 16 tilings at dsv3, qwen3, qwen3next, mixtral and
    gptoss. Words (byte rows moved as int32) take 4 tiles a program where the chunk scan is
    long against the tile's rows (``BLOCK_C >= 64 * BLOCK_R``); ``sweep sort_chunks
    --fp8`` (docs/benchmarks.md, "FP8 rows: int32 words, the scan cut, side rows"), % of
    copy, 4 tiles against 1: qwen3next blockwise 66.8 vs 49.2, dsv3 within 1.3 points.
    ``max_scan`` (default ``MAX_SCAN_ELEMENTS``) cuts the tiles' rows so a program's
    per-row scan stays short, giving the cut rows up to 8 times the steps (one chunk table
    for all) as long as that leaves about 2048 programs or more."""
    if block_h is None:  # ~16 KiB a tile, as gather_rows
        block_h = max(16, min(16384 // itemsize, next_pow2(max(width, 1))))
    br = max(1, 16384 // (block_h * itemsize))
    block_c = next_pow2(chunks)
    if steps is None:  # words (FP8 bits) with a long chunk scan a row: 4 tiles a program
        steps = 4 if words and block_c >= 64 * br else 1
    max_scan = max_scan or MAX_SCAN_ELEMENTS
    if br * block_c > max_scan:  # short rows, many chunks: bound the per-row scan
        cap = max(1, max_scan // block_c)
        # the cut tiles in up to 8 times the steps a program (one chunk table for all), as
        # long as that leaves about 2048 programs or more
        steps *= max(1, min(8, br // cap, cdiv(t, cap * steps) // 2048))
        br = cap
    return br, block_h, steps


# -------------------------------------------------------------- fused quantize+permute

#: Routes a step (KB) of the fused quantize-permute kernels: ``python -m benchmarks sweep permute`` (docs/benchmarks.md, "Scatter tiles").
QUANT_PERMUTE_KB = 4
#: Warps of the fused quantize-permute kernels: ``python -m benchmarks sweep permute`` (docs/benchmarks.md, "Column steps and tiles (`_consts`)").
QUANT_PERMUTE_WARPS = 4
#: Row elements a step of the map-building fused quantize-permute, at every H: ``python -m benchmarks sweep permute_mask --rows "" --quant-tiles 1024,4096 --quant-steps 1,0`` (docs/benchmarks.md, "Column steps and tiles (`_consts`)").
MASK_QUANT_TILE = 4096
#: Steps a program of that kernel, 0 for the whole row: ``python -m benchmarks sweep permute_mask --rows "" --quant-tiles 1024,4096 --quant-steps 1,0`` (docs/benchmarks.md, "Column steps and tiles (`_consts`)").
MASK_QUANT_STEPS = 0
#: N / T from which a mask's fused quantize-permute builds its map in its own launch: ``python -m benchmarks sweep permute_mask --reg-routes 0,1 --quant-tiles 1024,4096`` (docs/benchmarks.md, "Routes from registers; the map in the quantize launch").
MASK_MAP_MIN_ROWS_PER_TOKEN = 6


def quantize_permute_columns(h: int, tile: int | None, steps: int | None) -> tuple[int, int]:
    """``(tile, steps)`` of the map-reading fused quantize-permute kernel where not given:
    ``tile`` row elements a step (``sweep permute``: 4096 at H >= 4096, else 1024),
    ``steps`` steps a program (0: the whole row, so a token's map row is read once; by
    default the whole row at H < 4096, else one step). Chosen by
    ``python -m benchmarks sweep permute_mask --rows "" --quant-tiles 1024,4096 --quant-steps 1,0``
    (docs/benchmarks.md, "Column steps and tiles (`_consts`)"): the whole row, except the
    map-reading kernel at H >= 4096, where one step a program is faster (H100, dsv3: 78.3
    vs 76.9% of copy)."""
    if tile is None:
        tile = 4096 if h >= 4096 else 1024
    if steps is None:
        steps = 0 if h < 4096 else 1
    return tile, steps


# ------------------------------------------------------------------- tiling objects


@dataclass(frozen=True)
class MaskMapTiling:
    """Overrides of ``kernels.row_id_map.mask_rows_triton``: ``block_t``, ``num_warps``,
    ``prefetch`` (``map_tiling``'s when None); ``one_launch`` forces the one-launch form on
    or off (default: ``small_mask``); ``pdl`` launches the scan and the map pass as
    programmatic dependents (off: ``python -m benchmarks sweep map --pdl 0,1``)."""

    block_t: int | None = None
    num_warps: int | None = None
    prefetch: int | None = None
    one_launch: bool | None = None
    pdl: bool = False


@dataclass(frozen=True)
class FusedMaskTiling:
    """Overrides of the fused mask permute (``kernels.permute_mask.permute_mask_triton``):
    ``block_t`` and ``map_warps`` of the count pass (``fused_map_tiling``'s), ``num_warps``
    (``FUSED_WARPS``), ``tokens`` a program (``FUSED_TOKENS``; must divide ``block_t``),
    ``reg_routes`` (``reg_routes_flag``), ``block_h`` (``scatter_tile``'s), ``one_launch``
    (``small_mask``), ``pdl`` (``launch.pdl_default``)."""

    block_t: int | None = None
    map_warps: int | None = None
    num_warps: int | None = None
    tokens: int | None = None
    reg_routes: bool | None = None
    block_h: int | None = None
    one_launch: bool | None = None
    pdl: bool | None = None


@dataclass(frozen=True)
class PermuteIndexTiling:
    """Overrides of the fused index permute (``kernels.permute_index``): ``block_t``
    tokens per count block (``FUSED_INDEX_BLOCK_T``), ``num_warps`` (``FUSED_INDEX_WARPS``),
    ``pdl`` (``launch.pdl_default``)."""

    block_t: int | None = None
    num_warps: int | None = None
    pdl: bool | None = None


@dataclass(frozen=True)
class QuantizePermuteTiling:
    """Overrides of the fused quantize-permute launchers (``kernels.quantize_permute``):
    ``tile`` row elements a step and ``steps`` a program (0: the whole row;
    ``quantize_permute_columns``, or ``MASK_QUANT_TILE`` / ``MASK_QUANT_STEPS`` for the
    map-building kernel), ``kb`` routes a step (``QUANT_PERMUTE_KB``), ``num_warps``
    (``QUANT_PERMUTE_WARPS``); the map-building kernel also takes ``block_t`` and
    ``map_warps`` of its count pass, ``one_launch``, ``reg_routes`` and ``pdl`` as
    ``FusedMaskTiling``."""

    tile: int | None = None
    steps: int | None = None
    kb: int | None = None
    num_warps: int | None = None
    block_t: int | None = None
    map_warps: int | None = None
    one_launch: bool | None = None
    reg_routes: bool | None = None
    pdl: bool | None = None


@dataclass(frozen=True)
class SortChunksTiling:
    """Overrides of the chunk sort (``kernels.sort_chunks.sort_chunks_triton``):
    ``block_h``, ``steps`` and ``max_scan`` (``sort_chunks_tile``'s), ``num_warps``
    (``SORT_CHUNKS_WARPS``); ``words``: byte rows move as int32 words where the layout
    allows; ``side_wide``: side rows take the rows' tile shape (default: row tiles of at
    most ``SIDE_WIDE_MAX_COLS`` columns); ``side_words``: byte side rows as int32 words."""

    block_h: int | None = None
    steps: int | None = None
    max_scan: int | None = None
    num_warps: int | None = None
    words: bool = True
    side_wide: bool | None = None
    side_words: bool = True


@dataclass(frozen=True)
class MergeBackwardTiling:
    """Overrides of the merge backward (``kernels.unpermute.merge_backward_triton``):
    ``kb`` routes a step, ``block_h`` columns a tile, ``num_warps``
    (``merge_backward_tile``'s)."""

    kb: int | None = None
    block_h: int | None = None
    num_warps: int | None = None
