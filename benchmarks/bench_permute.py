"""Permutation ops: medians and % of measured copy bandwidth, next to plain PyTorch.

    python benchmarks/bench_permute.py [--out results.json] [--configs dsv3,small]

Bytes counted: read each input row once, write each output row once (bf16), plus the
routing map, probs and row_id_map reads. "graph" times replay the call from a CUDA graph
(GPU time; the % uses it), "eager" is the plain Python call. num_out_tokens is passed
(T*K), so nothing syncs with the host. The plain-PyTorch path is argsort + index_select
for permute and index_add_ (fp32) for the merge.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    copy_bandwidth_gbs,
    env_info,
    graph_median_ms,
    median_ms,
    write_json,
)

import qmoe  # noqa: E402
from qmoe.ops.sort_chunks import sort_chunks_triton  # noqa: E402

CONFIGS = {  # name: (T, H, E, K)
    "dsv3": (4096, 7168, 256, 8),
    "qwen3": (16384, 4096, 128, 8),
    "mixtral": (8192, 4096, 8, 2),
    "gptoss": (8192, 2880, 128, 4),
    "qwen3next": (16384, 2048, 512, 10),
    "small": (256, 4096, 64, 8),
    "tiny": (64, 256, 8, 2),  # CPU smoke run only
    # sweeps only: a mask just past the one-launch size (the three-launch form at small T)
    "mid": (1024, 4096, 64, 8),
}
SWEEP_ONLY = ("tiny", "mid")
FP8_RECIPES = {
    "blockwise128": qmoe.Blockwise(),
    "mxfp8": qmoe.MXFP8(),
    "pertensor": qmoe.PerTensor(),
}


def torch_permute(x, ids, n):
    t, k = ids.shape
    order = torch.argsort(ids.reshape(-1), stable=True)[:n]
    return x.index_select(0, order // k), order


def torch_unpermute(y, order, w_flat, t, k):
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, order // k, y.float() * w_flat[order, None])
    return acc.to(y.dtype)


def use_swept_map_tiling(path: str) -> None:
    """Replace ``map_tiling`` by the best tiling per (T, E) that ``sweep_map.py`` found."""
    import json

    from qmoe.ops import row_id_map as R

    with open(path) as f:
        swept = json.load(f)["results"]
    best = {(r["T"], r["E"]): R.MapTiling(*(r["best_map"][f] for f in R.MapTiling._fields))
            for r in swept}
    default = R.map_tiling
    R.map_tiling = lambda t, e: best.get((t, e)) or default(t, e)
    print("map tilings:", best, file=sys.stderr)


def same_bytes_copy_ms(nbytes: int, dev: str = "cuda") -> float | None:
    """A ``copy_`` of ``nbytes / 2`` bytes, timed as the cases are (CUDA-graph median): the
    ceiling an op moving ``nbytes`` in one launch could reach, graph launch included."""
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    return graph_median_ms(lambda: dst.copy_(src))


def run_config(name: str, copy_bw: float, dev: str = "cuda", ops: str = "",
               ceiling: bool = False) -> list[dict]:
    rows = []
    t, h, e, k = CONFIGS[name]
    n = t * k
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].contiguous()
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev)
    probs_k = probs.gather(1, ids)
    y = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    g = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    _, rid = qmoe.moe_permute(x, mask, n)
    sizes = torch.full((e,), n // e, device=dev)
    chunk_order = torch.randperm(e, device=dev)
    _, order = torch_permute(x, ids, n)
    row_bytes = h * 2
    map_bytes = mask.numel() + rid.numel() * 4
    # an index map: the int64 ids read, its [T, 2K+1] int32 map written (not the [T, 2E+1]
    # mask map's size, which would count about 1.5% too many bytes at dsv3)
    index_bytes = ids.numel() * 8 + t * (2 * k + 1) * 4
    move = (t + n) * row_bytes
    cases = {
        "permute(mask)": (lambda: qmoe.moe_permute(x, mask, n), move + map_bytes),
        "permute(index)": (lambda: qmoe.moe_permute(x, ids, n, map_type="index"),
                           move + index_bytes),
        # with num_experts: qmoe::permute_index (the map built in the scatter launch where
        # fused_index_wins), else the sorting map as above
        "permute(index, num_experts)": (
            lambda: qmoe.moe_permute(x, ids, n, map_type="index", num_experts=e),
            move + index_bytes),
        "permute_with_probs(mask)": (lambda: qmoe.moe_permute_with_probs(x, probs, mask, n),
                                     move + map_bytes + probs.numel() * 4),
        "make_row_id_map(mask)": (
            lambda: torch.ops.qmoe.make_row_id_map(mask, n, False, 1), map_bytes),
        "permute rows only": (lambda: torch.ops.qmoe.permute(x, rid, None, n), move),
        # Merges count rows only: a token reads the count and its K slots of its map row
        # (a few sectors), not the whole [2E+1] row (counting the whole map would overstate
        # qwen3next's merge by 9%).
        "unpermute(merging_probs)": (lambda: qmoe.moe_unpermute(y, rid, probs), move),
        "unpermute(no probs)": (lambda: qmoe.moe_unpermute(y, rid), move),
        "permute backward": (lambda: torch.ops.qmoe.unpermute(y, rid, None), move),
        "unpermute backward(probs)": (
            lambda: torch.ops.qmoe.unpermute_backward(g, rid, probs, y, n),
            move + n * row_bytes),
        "sort_chunks": (lambda: qmoe.moe_sort_chunks_by_index(y, sizes, chunk_order),
                        2 * n * row_bytes),
        "torch: argsort+index_select": (lambda: torch_permute(x, ids, n), move),
        "torch: index_add merge": (
            lambda: torch_unpermute(y, order, probs_k.reshape(-1), t, k), move),
    }
    # FP8 rows: qdata bytes plus scale bytes per row, moved by the same kernels.
    for rname, recipe in FP8_RECIPES.items():
        q = qmoe.quantize(x, recipe)
        qy = qmoe.quantize(y, recipe)
        per_row = h + (q.raw_scale[0].numel() * q.raw_scale.element_size() if q.raw_scale.dim()
                       else 0)
        qmove = (t + n) * per_row
        cases[f"fp8 {rname}: permute(mask)"] = (
            lambda q=q: qmoe.moe_permute(q, mask, n), qmove + map_bytes)
        cases[f"fp8 {rname}: permute rows only"] = (
            lambda q=q: torch.ops.qmoe.permute(q, rid, None, n), qmove)
        cases[f"fp8 {rname}: sort_chunks"] = (
            lambda qy=qy: qmoe.moe_sort_chunks_by_index(qy, sizes, chunk_order),
            2 * n * per_row)
        if q.raw_scale.dim():  # the op moves the scale rows as side rows of the bits (one
            # launch on CUDA); this case sorts them apart, two launches, for reference
            cases[f"fp8 {rname}: sort_chunks, two launches"] = (
                lambda qy=qy: (
                    torch.ops.qmoe.sort_chunks(qy.qdata.view(torch.uint8), sizes, chunk_order,
                                               None),
                    torch.ops.qmoe.sort_chunks(qy.raw_scale, sizes, chunk_order, None)),
                2 * n * per_row)
        cases[f"fp8 {rname}: unpermute(merging_probs)"] = (
            lambda qy=qy: qmoe.moe_unpermute(qy, rid, probs), n * per_row + t * row_bytes)
        # Fused quantize-and-permute (issue 9): read T*H bf16, write N rows of fp8 + scales;
        # next to it the two steps it replaces (quantize, then permute the fp8 rows).
        fused_bytes = t * row_bytes + n * per_row + map_bytes
        cases[f"fused {rname}: quantize+permute(mask)"] = (
            lambda recipe=recipe: qmoe.moe_permute(x, mask, n, quantize=recipe), fused_bytes)
        cases[f"fused {rname}: quantize then permute"] = (
            lambda recipe=recipe: qmoe.moe_permute(qmoe.quantize(x, recipe), mask, n),
            fused_bytes)
    # Megatron's main path through autograd, forward and backward: permute with probs, the
    # probs applied to the rows (where the experts would run), unpermute without probs.
    # Bytes: the four permutation passes (forward permute and merge, their backward
    # merge and permute) move (T + N) rows each; the multiply reads and writes N rows
    # forward and reads 4N / writes N rows backward (its grads of the rows and of pp).
    xg, pg = x.detach().requires_grad_(), probs.detach().requires_grad_()

    def megatron_fwd_bwd():
        out, pp, rid_ = qmoe.moe_permute_with_probs(xg, pg, mask, n)
        qmoe.moe_unpermute(out * pp[:, None].to(out.dtype), rid_).backward(g)

    cases["megatron path: permute_with_probs, unpermute, fwd+bwd"] = (
        megatron_fwd_bwd, 4 * move + 7 * n * row_bytes)
    if dev == "cuda":  # the chunk sort's backward: the same kernel's inverse movement
        cases["sort_chunks backward"] = (
            lambda: sort_chunks_triton(y, sizes, chunk_order, inverse=True, check=False),
            2 * n * row_bytes)
    keep = [o for o in ops.split(",") if o]
    for case, (fn, nbytes) in cases.items():
        if keep and not any(o in case for o in keep):
            continue
        ms_eager = median_ms(fn)
        try:
            ms = graph_median_ms(fn) or ms_eager
        except RuntimeError as err:  # a case that does not capture: its eager time, said so
            print(f"{name} {case}: CUDA-graph capture failed ({err}); eager time only",
                  file=sys.stderr)
            ms = ms_eager
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append({"config": name, "T": t, "H": h, "E": e, "K": k, "op": case,
                     "bytes": nbytes, "graph_ms": round(ms, 4),
                     "eager_ms": round(ms_eager, 4), "GB/s": round(gbs, 1),
                     "pct_copy_bw": round(100 * gbs / copy_bw, 1)})
        if ceiling and dev == "cuda":
            cms = same_bytes_copy_ms(nbytes)
            rows[-1].update(same_bytes_copy_ms=round(cms, 4),
                            pct_same_bytes_copy=round(100 * cms / ms, 1))
        print(f"{name:>9} {case:>28}: graph {ms:8.4f} ms {100 * gbs / copy_bw:5.1f}% "
              f"of copy; eager {ms_eager * 1e3:9.1f} us"
              + (f"; same-bytes copy {rows[-1]['same_bytes_copy_ms']:.4f} ms = "
                 f"op at {rows[-1]['pct_same_bytes_copy']:.1f}% of it"
                 if "same_bytes_copy_ms" in rows[-1] else ""),
              file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in SWEEP_ONLY))
    p.add_argument("--ops", default="",
                   help="comma-separated substrings: time only the cases whose name holds one")
    p.add_argument("--cpu-smoke", action="store_true", help="run the 'tiny' config on CPU")
    p.add_argument("--map-tiling", default=None,
                   help="sweep_map.py JSON: build mask maps with each config's best tiling "
                        "instead of map_tiling()'s choice")
    p.add_argument("--ceiling", action="store_true",
                   help="also time a copy of each case's bytes the same way (graph replay)")
    a = p.parse_args()
    if a.map_tiling:
        use_swept_map_tiling(a.map_tiling)
    if a.cpu_smoke:
        rows = run_config("tiny", copy_bandwidth_gbs(1 << 26), "cpu")
        write_json(a.out, {"bench": "permute", "env": env_info(), "copy_GB/s": 0,
                           "results": rows})
        return
    if not torch.cuda.is_available():
        print("bench_permute: CUDA not available (use --cpu-smoke for a CPU smoke run)")
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):  # written after each config: a cut-off run keeps the rest
        rows += run_config(name, copy_bw, ops=a.ops, ceiling=a.ceiling)
        torch.cuda.empty_cache()
        write_json(a.out, {"bench": "permute", "env": env_info(),
                           "copy_GB/s": round(copy_bw, 1), "results": rows})


if __name__ == "__main__":
    main()
