"""Every Triton kernel compiles for the H100/H200 (sm_90) without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute but never runs
Triton's compiler, so a kernel can pass every CPU test and still fail to compile on the
GPU (a branch whose two sides give a variable different types, a constexpr misuse) or
take its GPU-only paths (``HW_CAST``: hardware fp8 conversions; ``PDL``: the grid
dependency waits of programmatic dependent launch) for the first time there.
This test drives the real launchers on small CPU tensors in a child process without the
interpreter, with ``JITFunction.run`` replaced by a recorder: each launch's argument
types, 16-divisibility and constexprs (``HW_CAST`` and ``PDL`` set as on an H200) are
captured, and each distinct one is compiled to sm_90 PTX and cubin with the ``ptxas``
that ships with Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import interpreted_kernels_off

ROOT = Path(__file__).resolve().parents[2]

_DTYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8",
    torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.bool: "i1",
}


def _spec(fn, args, kwargs):
    """(signature, constexprs, attrs, options) of one launch, as Triton would specialize it."""
    names = fn.arg_names
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = bound[name]
        if i in fn.constexprs or v is None:  # None arguments are constants, as in Triton
            consts[(i,)] = True if name in ("HW_CAST", "PDL") else v
            sig[name] = "constexpr"
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _DTYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # device allocations are 16-aligned
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0 and v != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return sig, consts, attrs, options


def _launches():
    """Run every launcher once on CPU tensors; return the recorded launches."""
    import triton.runtime.jit as jit

    import qmoe
    from qmoe.ops.fp8 import bits_of, scale_layout
    from qmoe.ops.kernels import permute as KP
    from qmoe.ops.kernels import sort_chunks as KS
    from qmoe.ops.kernels import unpermute as KU
    from qmoe.ops.kernels.permute_mask import permute_mask_triton
    from qmoe.ops.kernels.quantize_permute import (
        quantize_permute_mask_triton,
        quantize_permute_triton,
    )
    from qmoe.ops.kernels.row_id_map import index_rows_triton
    from qmoe.ops.row_id_map import make_row_id_map
    from qmoe.ops.tuning import (
        FusedMaskTiling,
        MaskMapTiling,
        QuantizePermuteTiling,
        SortChunksTiling,
    )
    from qmoe.tensors.kernels.quantize import quantize_rows_triton
    from tests.ops.helpers import mask_map_triton, routing

    seen = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((self, _spec(self, args, kwargs)))

    jit.JITFunction.run = record
    t, h, e, k = 40, 256, 16, 4
    _, mask = routing(t, e, k, "sentinels")
    x = torch.randn(t, h, dtype=torch.bfloat16)
    probs = torch.rand(t, e)
    n = int(mask.sum()) + 8
    for align in (1, 16):
        for one in (False, True):
            mask_map_triton(mask, n, align, MaskMapTiling(one_launch=one))
    mask_map_triton(mask, n, 1, MaskMapTiling(32, 8, 32))  # every row loaded up front
    ids, _ = routing(t, e, k, "sentinels")
    for dt in (torch.int64, torch.int32):
        index_rows_triton(ids.to(dt), n)
    rid, fill = make_row_id_map(mask, n, False, 1)
    side = torch.rand(t, 2)
    for f in (None, fill):
        for w in (None, probs):
            KP.permute_rows_triton(x, rid, n, w, fill=f)
        KP.permute_rows_triton(x, rid, n, probs=probs, probs_out=torch.empty(n), side=side,
                       side_out=torch.empty(n, 2), fill=f)
        KP.permute_rows_triton(x.view(torch.uint8), rid, n, fill=f)
    for align in (1, 16):  # the mask permute that builds its map in the scatter launch
        for one in (False, True):
            form = FusedMaskTiling(one_launch=one)
            permute_mask_triton(x, mask, n, align, tiling=form)
            permute_mask_triton(x.view(torch.uint8), mask, n, align, probs, side, form)
    permute_mask_triton(x.view(torch.uint8), mask, n, 1, tiling=FusedMaskTiling(tokens=4))
    from qmoe.ops.kernels.permute_index import permute_index_triton

    permute_index_triton(x, ids, n, e, probs[:, :k], side)
    permute_index_triton(x.view(torch.uint8), ids.to(torch.int32), n, e)
    y = torch.randn(n, h, dtype=torch.bfloat16)
    for w in (None, probs):
        KU.unpermute_rows_triton(y, rid, w)
    KU.unpermute_rows_triton(y.repeat(1, 5)[:, :1100], rid, probs)  # 512 columns
    y4 = y.repeat(1, 4096 // h + 1)[:, :4096]  # four routes a step in the merge backward
    from qmoe.ops.kernels.unpermute import merge_backward_triton

    merge_backward_triton(x, y, rid, probs)  # both merge gradients in one pass
    merge_backward_triton(torch.zeros(x.shape[0], 4096, dtype=x.dtype), y4, rid, probs)
    KS.gather_rows_triton(y, torch.arange(n))
    from qmoe.ops.kernels.sort_chunks import sort_chunks_triton

    sizes, order = torch.tensor([n // 2, n - n // 2]), torch.tensor([1, 0])
    sort_chunks_triton(y, sizes, order, torch.rand(n))
    sort_chunks_triton(y, sizes, order, torch.rand(n), inverse=True, check=False,
                       tiling=SortChunksTiling(steps=4))
    # short byte rows (FP8 scales) as int32 words, tiles cut for 300 chunks
    cs = torch.full((300,), 2)
    sort_chunks_triton(torch.zeros(600, 64, dtype=torch.uint8), cs, torch.randperm(300))
    sc = torch.rand(n, 3)  # block-scale side rows with the bits, one launch
    sort_chunks_triton(y.view(torch.uint8), sizes, order, torch.rand(n), sc,
                       side_out=torch.empty_like(sc))
    sort_chunks_triton(y.view(torch.uint8), sizes, order, torch.rand(n), sc,
                       side_out=torch.empty_like(sc), tiling=SortChunksTiling(words=False, steps=4))
    sort_chunks_triton(y.view(torch.uint8), sizes, order, None, sc,
                       side_out=torch.empty_like(sc), tiling=SortChunksTiling(side_wide=True))
    mx = torch.zeros(n, 8, dtype=torch.uint8)  # e8m0 side rows as int32 words
    sort_chunks_triton(y.view(torch.uint8), sizes, order, None, mx,
                       side_out=torch.empty_like(mx), tiling=SortChunksTiling(side_words=True))
    for recipe in (qmoe.PerTensor(), qmoe.Blockwise(), qmoe.MXFP8(),
                   qmoe.MXFP8(fp8_dtype=torch.float8_e5m2)):
        q = qmoe.quantize(y.float(), recipe)
        KU.unpermute_fp8_triton(bits_of(q), q.raw_scale, scale_layout(q), q.block_size or 0,
                             q.fp8_dtype, rid, probs, torch.bfloat16)
        qw = qmoe.quantize(y.float().repeat(1, 5)[:, :1152], recipe)  # evict_first tiles
        KU.unpermute_fp8_triton(bits_of(qw), qw.raw_scale, scale_layout(qw), qw.block_size or 0,
                             qw.fp8_dtype, rid, probs, torch.bfloat16)
    for bs, mode in ((128, "amax"), (128, "pow2"), (32, "mx_floor"), (32, "mx_rceil"),
                     (64, "amax"), (16, "amax")):  # (and Blockwise's other block sizes)
        quantize_rows_triton(x, bs, torch.float8_e4m3fn, mode)
        for f in (None, fill):
            quantize_permute_triton(x, rid, probs, n, bs, torch.float8_e4m3fn, mode, None, f)
        for align, one in ((1, False), (16, True)):
            quantize_permute_mask_triton(x, mask, n, align, probs, bs, torch.float8_e4m3fn, mode,
                                         None, QuantizePermuteTiling(one_launch=one))
    x7 = torch.randn(t, 7168, dtype=torch.bfloat16)  # the widest tiles (4096 columns)
    # qmoe.RowWise: one block over the row (8192 columns at H 7168)
    quantize_rows_triton(x7, 8192, torch.float8_e4m3fn, "amax")
    quantize_permute_triton(x7, rid, probs, n, 8192, torch.float8_e4m3fn, "amax", None, fill)
    quantize_permute_mask_triton(x7, mask, n, 1, probs, 8192, torch.float8_e4m3fn, "pow2", None)
    KP.permute_rows_triton(x7, rid, n, probs, fill=fill)
    permute_mask_triton(x7.view(torch.uint8), mask, n, 1, probs)
    KU.unpermute_rows_triton(torch.randn(n, 7168, dtype=torch.bfloat16), rid, probs)
    for bs, mode in ((128, "amax"), (32, "mx_floor"), (32, "mx_rceil")):
        quantize_permute_triton(x7, rid, probs, n, bs, torch.float8_e4m3fn, mode, None, fill)
        quantize_permute_mask_triton(x7, mask, n, 1, probs, bs, torch.float8_e4m3fn, mode, None)
        for tile in (4096, 1024):  # the whole row a program, in 2 or 7 steps (4096: the
            # mask kernel's default tiling at this H; the map-reading kernel's is one step)
            quantize_permute_triton(x7, rid, probs, n, bs, torch.float8_e4m3fn, mode, None,
                                    fill, QuantizePermuteTiling(tile, 0))
            quantize_permute_mask_triton(x7, mask, n, 1, probs, bs, torch.float8_e4m3fn, mode,
                                         None, QuantizePermuteTiling(tile, 0))
        # gpt-oss's H: the map-reading kernel's default, the whole row in three 1024-column
        # steps
        quantize_permute_triton(x7[:, :2880], rid, probs, n, bs, torch.float8_e4m3fn, mode,
                                None, fill)
    # the expert FFN's kernels: the weights' column quantize, the tail zeroing, the offsets
    # check, SwiGLU (plain, quantizing, backward) and the one-pass dequantize
    from qmoe.ops.kernels.grouped_mm import (
        check_offsets_triton,
        quantize_cols_triton,
        zero_tail_triton,
    )
    from qmoe.ops.kernels.swiglu import swiglu_backward_triton, swiglu_triton
    from qmoe.tensors.kernels.quantize import dequantize_rows_triton

    for wdt in (torch.bfloat16, torch.float32):
        quantize_cols_triton(torch.randn(2, 300, 96, dtype=wdt))
    zero_tail_triton(y, torch.tensor([3, n // 2], dtype=torch.int32))
    for e in (2, 2000):  # 1 warp and 4
        check_offsets_triton(torch.arange(e, dtype=torch.int32), e)
    for hdt in (torch.bfloat16, torch.float32):
        hh = torch.randn(t, 2 * h, dtype=hdt)
        swiglu_triton(hh)
        swiglu_backward_triton(torch.randn(t, h, dtype=hdt), hh)
    hh = torch.randn(t, 2 * h, dtype=torch.bfloat16)
    for bs, mode in ((256, "amax"), (128, "pow2"), (32, "mx_floor"), (32, "mx_rceil")):
        swiglu_triton(hh, (bs, torch.float8_e4m3fn, mode))
    swiglu_triton(torch.randn(t, 2 * 7168, dtype=torch.bfloat16),
                  (8192, torch.float8_e4m3fn, "amax"))  # RowWise at F 7168: 8 warps
    for recipe in (qmoe.PerTensor(), qmoe.Blockwise(), qmoe.MXFP8(), qmoe.RowWise(),
                   qmoe.Blockwise(fp8_dtype=torch.float8_e5m2)):
        q = qmoe.quantize(y.float(), recipe)
        bs = q.block_size or h
        s = q.scale_fp32().reshape(()) if q.block_size is None else q.scale_fp32()
        for odt in (torch.bfloat16, torch.float16, torch.float32):
            dequantize_rows_triton(q.qdata, s, bs, odt)
    quantize_rows_triton(x, 32, torch.float8_e5m2, "mx_rceil")
    given = torch.tensor(0.01)
    quantize_rows_triton(x, 512, torch.float8_e5m2, "given", given)
    quantize_permute_triton(x, rid, None, n, 0, torch.float8_e5m2, "given", given, fill)
    quantize_permute_mask_triton(x, mask, n, 1, None, 0, torch.float8_e5m2, "given", given)
    return seen


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures, done = [], set()
    for fn, (sig, consts, attrs, options) in _launches():
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())),
               tuple(sorted(options.items())))
        if key in done:
            continue
        done.add(key)
        try:
            triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=options)
        except Exception as exc:  # report every failing kernel, not just the first
            failures.append(f"{fn.__name__} {consts}: {type(exc).__name__}: {exc}")
    print(f"compiled {len(done)} kernel variants for sm_90")
    if failures:
        print("\n".join(failures))
        sys.exit(1)


def _has_ptxas() -> bool:
    try:
        import triton

        return (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists()
    except ImportError:
        return False


@pytest.mark.skipif(not _has_ptxas(), reason="Triton's NVIDIA backend (ptxas) not installed")
@pytest.mark.skipif(interpreted_kernels_off(), reason="QMOE_KERNEL_TESTS=0 (CI's second pass)")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", "from tests.ops.test_sm90_compile import main; "
                        "main()"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "kernel variants for sm_90" in r.stdout
