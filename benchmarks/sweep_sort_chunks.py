"""Sweep the one-launch chunk sort (``sort_chunks_triton``): columns a tile x row tiles a
program x warps, forward and inverse (the backward), next to the op's gather path
(``chunk_source_rows`` + ``gather_rows``). CUDA-graph medians, % of copy bandwidth.

    python benchmarks/sweep_sort_chunks.py [--out F] [--configs dsv3,qwen3]
        [--block-h 1024,4096,8192] [--steps 1,4] [--warps 4,8] [--random-sizes] [--scales]
        [--fp8]

``--scales`` times only the sort of FP8 scale rows (``run_scales``); ``--fp8`` FP8 rows
with their scale rows, in one launch or two (``run_fp8``). Chunks: E of them
(an EP rank's received chunks, one per expert), N = T*K rows; sizes N/E each, or with
``--random-sizes`` a random split of N (zero-size chunks included). Bytes: N rows read
and N rows written. Every variant's output is checked bit-exact against the gather path's
before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth_gbs,
    env_info,
    int_list,
    variant_recorder,
    write_json,
)

from qmoe.ops.backend import gather_rows  # noqa: E402
from qmoe.ops.sort_chunks import chunk_source_rows, sort_chunks_triton  # noqa: E402


def run_config(name, copy_bw, block_hs, steps_list, warps, random_sizes) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    if random_sizes:
        cuts = torch.sort(torch.randint(0, n + 1, (e - 1,))).values
        sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])).cuda()
    else:
        sizes = torch.full((e,), n // e, device="cuda")
    order = torch.randperm(e, device="cuda")
    nbytes = 2 * n * h * 2
    ref = gather_rows(y, chunk_source_rows(sizes, order, n))
    rows = []
    record = variant_recorder(rows, name, nbytes, copy_bw, 40)

    record("op path (source rows + gather)",
           lambda: gather_rows(y, chunk_source_rows(sizes, order, n)))
    out = torch.empty_like(y)
    for bh in block_hs:
        for st in steps_list:
            for nw in warps:
                kw = dict(block_h=bh, steps=st, num_warps=nw, out=out)
                got, _ = sort_chunks_triton(y, sizes, order, **kw)
                assert torch.equal(got, ref), (name, bh, st, nw)
                back, _ = sort_chunks_triton(got, sizes, order, inverse=True, check=False,
                                             block_h=bh, steps=st, num_warps=nw)
                assert torch.equal(back, y), (name, bh, st, nw, "inverse")
                record(f"bh {bh} steps {st} warps {nw}",
                       lambda kw=kw: sort_chunks_triton(y, sizes, order, **kw))
                record(f"  inverse bh {bh} steps {st} warps {nw}",
                       lambda bh=bh, st=st, nw=nw: sort_chunks_triton(
                           ref, sizes, order, inverse=True, check=False, block_h=bh,
                           steps=st, num_warps=nw, out=out))
    record("launcher's default tiling", lambda: sort_chunks_triton(y, sizes, order, out=out))
    return rows


def run_scales(name, copy_bw) -> list[dict]:
    """The sort of FP8 scale rows (blockwise fp32 1x128, MX e8m0 1x32: 16-224 bytes a row),
    the case ``MAX_SCAN_ELEMENTS`` cuts tiles for (docs/benchmarks.md, "FP8 rows: int32
    words, the scan cut, side rows"): the gather path, the kernel in byte lanes with uncut
    tiles, and with the int32 words and the cut tiles each alone and together."""
    import qmoe

    t, h, e, k = CONFIGS[name]
    n = t * k
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    sizes = torch.full((e,), n // e, device="cuda")
    order = torch.randperm(e, device="cuda")
    rows = []
    for rname, recipe in (("blockwise", qmoe.Blockwise()), ("mx", qmoe.MXFP8())):
        sc = qmoe.quantize(y, recipe).raw_scale
        nbytes = 2 * sc.numel() * sc.element_size()
        record = variant_recorder(rows, name, nbytes, copy_bw, 40)
        ref = gather_rows(sc, chunk_source_rows(sizes, order, n))
        record(f"{rname} scales: gather path", lambda sc=sc: gather_rows(
            sc, chunk_source_rows(sizes, order, n)))
        out = torch.empty_like(sc)
        for words, max_scan in ((False, 1 << 30), (True, 1 << 30), (False, None), (True, None)):
            kw = dict(words=words, max_scan=max_scan, out=out)
            assert torch.equal(sort_chunks_triton(sc, sizes, order, **kw)[0], ref)
            label = ("words" if words else "bytes") + (", cut" if max_scan is None else "")
            record(f"{rname} scales: kernel, {label}",
                   lambda sc=sc, kw=kw: sort_chunks_triton(sc, sizes, order, **kw))
    return rows


def run_fp8(name, copy_bw, steps_list) -> list[dict]:
    """The sort of FP8 rows (uint8 bits) with their scale rows as side rows, per recipe:
    two launches (bits, then scales) against one launch, bytes or int32 words, ``steps``
    row tiles a program, the side tiles in the rows' layout (``side_wide``), byte side
    rows as int32 words (``side_words``, MX), and the launcher's default. Bytes: bits and
    scale rows, read once, written once. Results: docs/benchmarks.md, "FP8 rows: int32
    words, the scan cut, side rows" (which also gives side rows in a column program of
    their own: 10-35 points slower, so the kernel has no such form)."""
    import qmoe

    t, h, e, k = CONFIGS[name]
    n = t * k
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    sizes = torch.full((e,), n // e, device="cuda")
    order = torch.randperm(e, device="cuda")
    src = chunk_source_rows(sizes, order, n)
    rows = []
    for rname, recipe in (("blockwise", qmoe.Blockwise()), ("mx", qmoe.MXFP8()),
                          ("pertensor", qmoe.PerTensor())):
        q = qmoe.quantize(y, recipe)
        bits = q.qdata.view(torch.uint8)
        sc = q.raw_scale if q.raw_scale.dim() == 2 else None
        nbytes = 2 * (bits.numel() + (sc.numel() * sc.element_size() if sc is not None else 0))
        record = variant_recorder(rows, name, nbytes, copy_bw, 40)
        ref = gather_rows(bits, src)
        out = torch.empty_like(bits)
        if sc is not None:
            ref_s = gather_rows(sc, src)
            so = torch.empty_like(sc)
            record(f"{rname}: two launches", lambda bits=bits, sc=sc, out=out, so=so: (
                sort_chunks_triton(bits, sizes, order, out=out),
                sort_chunks_triton(sc, sizes, order, out=so)))
        # (words, steps, side_wide, side_words); None: the launcher's rule. (True, None,
        # None, None) is its default; side_wide=True only where there are side rows,
        # side_words only where they are bytes (MX)
        variants = [(w, st, False, False) for w in (False, True) for st in steps_list]
        variants.append((True, None, None, None))
        if sc is not None:
            extra = [None] if sc.element_size() != 1 else []  # (MX: in the next list)
            variants += [(True, st, True, False) for st in steps_list + extra]
        if sc is not None and sc.element_size() == 1:
            variants += [(True, None, wide, sw) for wide in (False, True, None)
                         for sw in (False, True)]
        for words, st, wide, sw in variants:
            kw = dict(words=words, steps=st, side_wide=wide, out=out)
            if sw is not None:
                kw.update(side_words=sw)
            if sc is not None:
                so.fill_(float("nan") if so.is_floating_point() else 0xFF)
                kw.update(side=sc, side_out=so)
            out.fill_(0xFF)
            got, _ = sort_chunks_triton(bits, sizes, order, **kw)
            assert torch.equal(got, ref), (name, rname, words, st, wide, sw)
            if sc is not None:
                assert torch.equal(so, ref_s), (name, rname, words, st, wide, sw, "side")
            if st is None and wide is None and sw is None:
                label = "default"
            elif st is None and sc is not None and sc.element_size() == 1:
                label = (f"default steps, side {'words' if sw else 'bytes'}"
                         + {False: ", narrow", True: ", wide", None: ""}[wide])
            else:
                label = ("default steps" if st is None
                         else f"{'words' if words else 'bytes'}, steps {st}")
                label += ", side wide" if wide else ", side narrow" if sc is not None else ""
            record(f"{rname}: one launch, {label}",
                   lambda bits=bits, kw=kw: sort_chunks_triton(bits, sizes, order, **kw))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss,small")
    ap.add_argument("--block-h", default="1024,4096,8192")
    ap.add_argument("--steps", default="1,4")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--random-sizes", action="store_true")
    ap.add_argument("--scales", action="store_true",
                    help="only the FP8 scale rows' sort: gather path vs kernel variants")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 rows with their scale rows: two launches vs one (run_fp8)")
    a = ap.parse_args()
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):
        if a.scales:
            rows += run_scales(name, copy_bw)
            continue
        if a.fp8:
            rows += run_fp8(name, copy_bw, int_list(a.steps))
            continue
        rows += run_config(name, copy_bw, int_list(a.block_h), int_list(a.steps), int_list(a.warps),
                           a.random_sizes)
    write_json(a.out, {"bench": "sweep_sort_chunks", "env": env_info(),
                       "copy_bw_gbs": round(copy_bw, 1), "args": vars(a), "results": rows})


if __name__ == "__main__":
    main()
