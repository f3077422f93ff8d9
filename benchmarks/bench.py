"""The full suites: every permutation op, the quantize kernels, compiled against eager FP8
(``python -m benchmarks bench permute|quantize|compile_fp8``), and ``python -m benchmarks
table``, which renders their JSON as the Markdown tables of docs/benchmarks.md."""

from __future__ import annotations

import json
import sys
import time

import torch

import qmoe
from benchmarks.common import (
    CONFIGS,
    FP8_RECIPES,
    QUANTIZE_CONFIGS,
    SWEEP_ONLY,
    copy_bandwidth_gbs,
    env_info,
    graph_median_ms,
    host_us,
    kernel_breakdown,
    median_ms,
    write_json,
)
from qmoe.ops.grouped_mm import _quantize_last
from qmoe.ops.kernels.sort_chunks import sort_chunks_triton
from qmoe.tensors.quantize import quantize_reference

# --- bench permute ---------------------------------------------------------------------


def torch_permute(x, ids, n):
    t, k = ids.shape
    order = torch.argsort(ids.reshape(-1), stable=True)[:n]
    return x.index_select(0, order // k), order


def torch_unpermute(y, order, w_flat, t, k):
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, order // k, y.float() * w_flat[order, None])
    return acc.to(y.dtype)


def use_swept_map_tiling(path: str) -> None:
    """Replace the mask-map launcher's ``map_tiling`` (the name
    ``qmoe.ops.kernels.row_id_map`` reads it by) by the best tiling per (T, E) that
    ``sweep map`` found."""
    from qmoe.ops.kernels import row_id_map as K
    from qmoe.ops.tuning import MapTiling

    with open(path) as f:
        swept = json.load(f)["results"]
    best = {(r["T"], r["E"]): MapTiling(*(r["best_map"][f] for f in MapTiling._fields))
            for r in swept}
    default = K.map_tiling
    K.map_tiling = lambda t, e: best.get((t, e)) or default(t, e)
    print("map tilings:", best, file=sys.stderr)


def same_bytes_copy_ms(nbytes: int, dev: str = "cuda") -> float | None:
    """A ``copy_`` of ``nbytes / 2`` bytes, timed as the cases are (CUDA-graph median): the
    ceiling an op moving ``nbytes`` in one launch could reach, graph launch included."""
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    return graph_median_ms(lambda: dst.copy_(src))


def permute_config(name: str, copy_bw: float, dev: str = "cuda", ops: str = "",
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


def permute_args(p) -> None:
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in SWEEP_ONLY))
    p.add_argument("--ops", default="",
                   help="comma-separated substrings: time only the cases whose name holds one")
    p.add_argument("--cpu-smoke", action="store_true", help="run the 'tiny' config on CPU")
    p.add_argument("--map-tiling", default=None,
                   help="`sweep map` JSON: build mask maps with each config's best tiling "
                        "instead of map_tiling()'s choice")
    p.add_argument("--ceiling", action="store_true",
                   help="also time a copy of each case's bytes the same way (graph replay)")


def permute_main(a) -> None:
    """Permutation ops: medians and % of measured copy bandwidth, next to plain PyTorch.

        python -m benchmarks bench permute [--out results.json] [--configs dsv3,small]

    Bytes counted: read each input row once, write each output row once (bf16), plus the
    routing map, probs and row_id_map reads. "graph" times replay the call from a CUDA graph
    (GPU time; the % uses it), "eager" is the plain Python call. num_out_tokens is passed
    (T*K), so nothing syncs with the host. The plain-PyTorch path is argsort + index_select
    for permute and index_add_ (fp32) for the merge.
    """
    if a.map_tiling:
        use_swept_map_tiling(a.map_tiling)
    if a.cpu_smoke:
        rows = permute_config("tiny", copy_bandwidth_gbs(1 << 26), "cpu")
        write_json(a.out, {"bench": "permute", "env": env_info(), "copy_GB/s": 0,
                           "results": rows})
        return
    if not torch.cuda.is_available():
        print("bench permute: CUDA not available (use --cpu-smoke for a CPU smoke run)")
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):  # written after each config: a cut-off run keeps the rest
        rows += permute_config(name, copy_bw, ops=a.ops, ceiling=a.ceiling)
        torch.cuda.empty_cache()
        write_json(a.out, {"bench": "permute", "env": env_info(),
                           "copy_GB/s": round(copy_bw, 1), "results": rows})


# --- bench quantize --------------------------------------------------------------------

QUANTIZE_RECIPES = {
    "pertensor-e4m3": qmoe.PerTensor(),
    "pertensor-given-scale": qmoe.PerTensor(),
    "blockwise128-e4m3": qmoe.Blockwise(),
    "blockwise128-pow2": qmoe.Blockwise(power_of_two_scale=True),
    "mxfp8-e4m3": qmoe.MXFP8(),
    "mxfp8-e5m2": qmoe.MXFP8(torch.float8_e5m2),
}


def quantize_args(p) -> None:
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")


def quantize_main(a) -> None:
    """Quantize kernels: achieved bandwidth against the measured copy bandwidth.

        python -m benchmarks bench quantize [--out results.json] [--quick]

    Bytes counted per call: read T*H*2 (bf16), write T*H (fp8) plus the scales. Each
    recipe is timed three ways, all medians: ``qmoe.quantize`` called eagerly (includes the
    Python, autograd and launch overhead), the same call replayed from a CUDA graph (the GPU
    time alone: this is what the % of copy bandwidth uses), and the same math as eager
    torch ops (``quantize_reference`` on the same device). Without CUDA (or with
    ``--quick``) it runs one tiny config (256 x 1024).
    """
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    configs = {"tiny": (256, 1024)} if a.quick or dev == "cpu" else QUANTIZE_CONFIGS
    copy_bw = copy_bandwidth_gbs((1 << 30) if dev == "cuda" else (1 << 26))
    rows = []
    for cname, (t, h) in configs.items():
        x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
        for rname, recipe in QUANTIZE_RECIPES.items():
            kw = {}
            if rname == "pertensor-given-scale":
                kw["scale"] = (x.abs().amax().float() / 448.0).reshape(())
            q = qmoe.quantize(x, recipe, **kw)
            s = q.raw_scale
            nbytes = x.numel() * 2 + q.qdata.numel() + s.numel() * s.element_size()
            fn = lambda x=x, r=recipe, kw=kw: qmoe.quantize(x, r, **kw)
            ms_eager = median_ms(fn)
            ms = graph_median_ms(fn) or ms_eager
            ms_ref = median_ms(lambda x=x, r=recipe, kw=kw: quantize_reference(x, r, **kw))
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append({
                "config": cname, "T": t, "H": h, "recipe": rname, "bytes": nbytes,
                "graph_ms": round(ms, 4), "eager_ms": round(ms_eager, 4), "GB/s": round(gbs, 1),
                "pct_copy_bw": round(100 * gbs / copy_bw, 1),
                "torch_eager_ms": round(ms_ref, 4),
                "speedup_vs_torch_eager": round(ms_ref / ms_eager, 2),
            })
            print(f"{cname:>7} {rname:>22}: graph {ms:8.4f} ms {gbs:8.1f} GB/s "
                  f"{100 * gbs / copy_bw:5.1f}% of copy; eager {ms_eager:8.4f} ms; "
                  f"torch ops {ms_ref:8.4f} ms", file=sys.stderr)
    write_json(a.out, {"bench": "quantize", "env": env_info(), "copy_GB/s": round(copy_bw, 1),
                       "results": rows})


# --- bench compile_fp8 -----------------------------------------------------------------


def fp8_path(q, mask, probs, n):
    """FP8 rows grouped by expert and merged back: ``[T, H]`` high precision."""
    out, _, rid = qmoe.moe_permute_with_probs(q, probs, mask, n)
    return qmoe.moe_unpermute(out, rid, merging_probs=probs)


def _graphs_ms(q, mask, probs, n, want) -> tuple[float, float] | str:
    """``(median ms, host ms)`` per call of ``fp8_path`` compiled with
    ``mode="reduce-overhead"`` (CUDA graphs), after checking its output equals ``want``;
    the error as text if it fails."""
    torch._dynamo.reset()
    try:
        graphed = torch.compile(fp8_path, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # cudagraph trees record on the second or third call
            got = graphed(q, mask, probs, n)
        if not torch.equal(got, want):
            return "reduce-overhead output differs from eager"

        def call():
            return graphed(q, mask, probs, n)

        return round(median_ms(call), 4), round(host_us(call, 200) / 1e3, 4)
    except Exception as e:  # reported in the JSON; the other columns stand
        return f"reduce-overhead failed: {type(e).__name__}: {str(e)[:200]}"


def compile_config(name: str, dev: str) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev) * mask
    rows = []
    for rname, recipe in FP8_RECIPES.items():
        q = qmoe.quantize(x, recipe)
        torch._dynamo.reset()
        compiled = torch.compile(fp8_path, fullgraph=True)
        t0 = time.perf_counter()
        got = compiled(q, mask, probs, n)
        if dev == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        want = fp8_path(q, mask, probs, n)
        if not torch.equal(got, want):
            raise AssertionError(f"{name} {rname}: compiled output differs from eager")

        def eager_call(q=q):
            return fp8_path(q, mask, probs, n)

        def compiled_call(q=q, c=compiled):
            return c(q, mask, probs, n)

        eager, comp = median_ms(eager_call), median_ms(compiled_call)
        eager_host = host_us(eager_call, 200) / 1e3
        comp_host = host_us(compiled_call, 200) / 1e3
        row = {"config": name, "T": t, "H": h, "E": e, "K": k, "recipe": rname,
               "eager_ms": round(eager, 4), "compiled_ms": round(comp, 4),
               "eager_host_ms": round(eager_host, 4), "compiled_host_ms": round(comp_host, 4),
               "first_compiled_call_s": round(compile_s, 1)}
        graphs = ""
        if dev == "cuda":
            got = _graphs_ms(q, mask, probs, n, want)
            if isinstance(got, tuple):
                row["graphs_ms"], row["graphs_host_ms"] = got
                graphs = f"  reduce-overhead {got[0]:8.4f} ms (host {got[1]:8.4f} ms)"
            else:
                row["graphs_error"] = got
                graphs = f"  ({got})"
        rows.append(row)
        print(f"{name:>9} {rname:>13}: eager {eager:8.4f} ms (host {eager_host:8.4f} ms)  "
              f"compiled {comp:8.4f} ms (host {comp_host:8.4f} ms){graphs}"
              f" (first call {compile_s:.1f} s; outputs equal)", file=sys.stderr)
    return rows


def compile_fp8_args(p) -> None:
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default=None,
                   help="comma list (default: dsv3,small on CUDA, tiny on the CPU)")


def compile_fp8_main(a) -> None:
    """FP8 permute -> unpermute, eager against ``torch.compile(fullgraph=True)`` (issue 4).

        python -m benchmarks bench compile_fp8 [--configs dsv3,small] [--out compile_fp8.json]

    Per config and recipe: ``moe_permute_with_probs`` of a quantized input (the output is the
    recipe's quantized type), then ``moe_unpermute`` of those rows with merging probs (the
    merge dequantizes inside its kernel, high-precision result). The same function runs
    eagerly and compiled with ``fullgraph=True``; both are timed per call (``median_ms``: on
    the GPU, ``do_bench``'s events, GPU time) and as ``*_host_ms``, the host time per call of
    calls issued back to back (``common.host_us``, best of 5 rounds of 40; where the host is
    slower than the GPU, as at the small config, this is what a training step sees), and the
    compiled outputs are checked bit-identical to eager. Also the first compiled call's wall
    time (the compile, unless Inductor's on-disk cache already holds the graph). On CUDA also
    ``mode="reduce-overhead"`` (Inductor's CUDA graphs: the host cost of a small call goes),
    its outputs checked bit-identical too; a failure there is recorded, not raised.
    On CPU (no CUDA) it runs the ``tiny`` config unless ``--configs`` names others (the C++
    path).
    """
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    names = (a.configs or ("dsv3,small" if dev == "cuda" else "tiny")).split(",")
    rows = []
    for name in names:
        rows += compile_config(name, dev)
        write_json(a.out, {"bench": "compile_fp8", "env": env_info(), "device": dev,
                           "results": rows})


# --- bench grouped_mm ------------------------------------------------------------------

GEMM_SHAPES = {  # name: (routed rows, local experts, hidden, expert FFN width)
    "dsv3_ep8": (32768, 32, 7168, 2048),  # DeepSeek-V3 per rank after 8-way EP
    "qwen3": (65536, 128, 4096, 1536),  # T 8192 x K 8 over E 128
}


def grouped_mm_args(p) -> None:
    p.add_argument("--shapes", default=",".join(GEMM_SHAPES))
    p.add_argument("--out", default=None)


def grouped_mm_main(a) -> None:
    """The expert GEMMs of a MoE layer through ``qmoe.grouped_mm``, bf16 and FP8 side by
    side (issue: FP8 expert GEMMs).

        python -m benchmarks bench grouped_mm [--shapes dsv3_ep8,qwen3] [--out gmm.json]

    Per shape: the gate-up GEMM (``[rows, H] x [E, H, 2F]``) and the down GEMM (``[rows,
    F] x [E, F, H]``), rows spread evenly over the experts; bf16 rows, and ``RowWise`` e4m3
    rows (the FP8 row-wise path on Hopper) with the weights quantized in the call
    (``fp8``) or given by ``quantize_expert_weights`` (``fp8_prequantized``). Times:
    forward, and forward + backward (input and weight gradients), each the median of
    ``do_bench`` (GPU time, eager; the quantization of the rows is not timed, the
    weights' is); TFLOP/s counts 2 * rows * K * M per GEMM (three GEMMs for fwd + bwd).
    """
    if not torch.cuda.is_available():
        print("bench grouped_mm: needs CUDA, skipped")
        return
    rows_out = []
    for name in a.shapes.split(","):
        n, e, h, f = GEMM_SHAPES[name]
        offs = qmoe.expert_offsets(torch.full((e,), n // e, dtype=torch.int32,
                                              device="cuda"))
        for gemm, (k, m) in {"gate_up": (h, 2 * f), "down": (f, h)}.items():
            w = (torch.randn(e, k, m, device="cuda") / k**0.5).bfloat16().requires_grad_()
            x = torch.randn(n, k, device="cuda").bfloat16()
            g = torch.randn(n, m, device="cuda").bfloat16()
            flop = 2 * n * k * m
            wq = qmoe.quantize_expert_weights(w)
            # the weights' quantization alone, each layout, against a copy of its bytes
            # (read bf16, write e4m3: 3 bytes an element)
            copy_ms = same_bytes_copy_ms(3 * w.numel())
            wd = w.detach()
            for layout, quant in (("fwd", lambda wd=wd: torch.ops.qmoe.quantize_cols(wd)),
                                  ("bwd", lambda wd=wd: _quantize_last(wd))):
                ms_q = median_ms(quant)
                r = {"shape": name, "gemm": gemm, "E": e, "K": k, "M": m,
                     "mode": f"weight_quantize_{layout}", "ms": round(ms_q, 4),
                     "pct_of_copy": round(100 * copy_ms / ms_q, 1) if copy_ms else None,
                     "kernels_us": kernel_breakdown(quant, 3, width=90)}
                rows_out.append(r)
                print(r, file=sys.stderr, flush=True)
            for mode in ("bf16", "fp8", "fp8_prequantized"):
                xg = x.clone().requires_grad_()
                # the rows as the GEMM gets them, differentiable (FP8: a quantize's output)
                rows = xg if mode == "bf16" else qmoe.quantize(xg, qmoe.RowWise())
                pre = wq if mode == "fp8_prequantized" else None

                def fwd(rows=rows, w=w, offs=offs, pre=pre):
                    with torch.no_grad():
                        qmoe.grouped_mm(rows, w, offs, weight_fp8=pre)

                def fwd_bwd(rows=rows, w=w, offs=offs, g=g, pre=pre):
                    torch.autograd.grad(qmoe.grouped_mm(rows, w, offs, weight_fp8=pre),
                                        (rows, w), g)

                ms_f = median_ms(fwd)
                ms_fb = median_ms(fwd_bwd)
                r = {"shape": name, "gemm": gemm, "rows": n, "E": e, "K": k, "M": m,
                     "mode": mode, "fwd_ms": round(ms_f, 4), "fwd_bwd_ms": round(ms_fb, 4),
                     "fwd_TFLOPs": round(flop / ms_f / 1e9, 1),
                     "fwd_bwd_TFLOPs": round(3 * flop / ms_fb / 1e9, 1),
                     # where fwd + bwd spends its GPU time: us per call of each kernel
                     "fwd_bwd_kernels_us": dict(list(kernel_breakdown(
                         fwd_bwd, 3, width=90).items())[:12])}
                rows_out.append(r)
                print(r, file=sys.stderr, flush=True)
    write_json(a.out, {"bench": "grouped_mm", "env": env_info(), "results": rows_out})


# --- bench moe_layer -------------------------------------------------------------------

LAYER_SHAPES = {  # name: (tokens, hidden, expert FFN width, experts, top-k)
    "dsv3_ep8": (4096, 7168, 2048, 32, 8),  # 32,768 routed rows: the grouped_mm dsv3 shape
    "qwen3": (8192, 4096, 1536, 128, 8),
    "small": (256, 4096, 1536, 64, 8),
    "cpu": (1024, 1024, 512, 8, 2),  # the CPU run's default (C++ kernels, bf16 GEMMs)
}
# qmoe kernels (Triton) by name; the GEMM kernels by their libraries' names
_QMOE_KERNELS = ("permute", "quantize", "unpermute", "gather", "scatter", "zero_rows",
                 "row_id_map", "block_counts", "block_scan", "sort_chunks", "merge_backward")
_GEMM_KERNELS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "grouped")


def moe_layer_args(p) -> None:
    p.add_argument("--shapes", default=None,
                   help="default: every GPU shape on CUDA, 'cpu' on the CPU")
    p.add_argument("--out", default=None)


def torch_moe_layer(x, router_w, w1, w2, k: int):
    """The same layer in plain PyTorch (softmax top-k router, SwiGLU experts through
    ``F.grouped_mm``): argsort of the expert ids, ``index_select`` of the rows, the
    weighted ``index_add_`` back in fp32. One host-free step, as the qmoe layer's."""
    import torch.nn.functional as F

    t, e = x.shape[0], router_w.shape[0]
    scores = F.linear(x.float(), router_w.float()).softmax(-1)
    top = scores.topk(k, dim=-1)
    ids = top.indices.reshape(-1)
    order = ids.argsort(stable=True)
    tok = order // k
    offs = torch.bincount(ids, minlength=e).cumsum(0).to(torch.int32)
    rows = x.index_select(0, tok)
    hh = F.grouped_mm(rows, w1, offs=offs)
    f = w2.shape[1]
    y = F.grouped_mm(F.silu(hh[:, :f]) * hh[:, f:], w2, offs=offs)
    y = y.float() * top.values.reshape(-1)[order, None]
    return torch.zeros(t, x.shape[1], device=x.device).index_add_(0, tok, y).to(x.dtype)


def _kernel_shares(fn, iters: int = 5) -> dict:
    """GPU time (us per call) of ``fn``'s kernels: qmoe's, GEMMs', the rest's."""
    out = {"qmoe_us": 0.0, "gemm_us": 0.0, "other_us": 0.0}
    for name, us in kernel_breakdown(fn, iters, width=None).items():
        name = name.lower()
        key = ("qmoe_us" if any(k in name for k in _QMOE_KERNELS) else
               "gemm_us" if any(k in name for k in _GEMM_KERNELS) else "other_us")
        out[key] += us
    return {k: round(v, 1) for k, v in out.items()}


def moe_layer_main(a) -> None:
    """``qmoe.nn.MoE`` forward + backward, bf16 and FP8 ``RowWise`` (weights quantized in
    the step, or given by ``layer.quantize_weights()``: ``rowwise_prequantized``), beside
    the same layer in plain PyTorch (issue: qmoe.nn.MoE).

        python -m benchmarks bench moe_layer [--shapes dsv3_ep8,qwen3,small] [--out m.json]

    On the CPU (shape ``cpu``): GPU-only parts (kernel split, graph replay) are left out.

    Per shape and mode: the median GPU time of one step (``do_bench``), the eager host
    time per step (``host_us``), the CUDA-graph replay time, the router's share (its own
    forward + backward timed alone) and the kernel time split into qmoe's kernels,
    GEMMs and the rest (torch.profiler). bf16 parameters (no per-step weight cast; a
    framework's mixed-precision wrapper would cast fp32 master weights once per step).
    """
    from qmoe.nn import MoE

    dev = "cuda" if torch.cuda.is_available() else "cpu"

    rows_out = []
    shapes = a.shapes or (",".join(s for s in LAYER_SHAPES if s != "cpu") if dev == "cuda"
                          else "cpu")
    for name in shapes.split(","):
        t, h, f, e, k = LAYER_SHAPES[name]
        x0 = torch.randn(t, h, device=dev).bfloat16()
        g = torch.randn(t, h, device=dev).bfloat16()
        for mode in ("torch", "bf16", "rowwise", "rowwise_prequantized"):
            torch.manual_seed(0)
            layer = MoE(h, f, e, k, qmoe.RowWise() if mode.startswith("rowwise") else None,
                        device=dev, param_dtype=torch.bfloat16)
            wq = layer.quantize_weights() if mode == "rowwise_prequantized" else None
            params = (layer.router.weight, layer.w_gate_up, layer.w_down)
            x = x0.clone().requires_grad_()

            if mode == "torch":
                def step(x=x, params=params, g=g, k=k):
                    out = torch_moe_layer(x, *params, k)
                    torch.autograd.grad(out, (x, *params), g)
            else:
                def step(x=x, layer=layer, params=params, g=g, wq=wq):
                    out, _ = layer(x, weights_fp8=wq)
                    torch.autograd.grad(out, (x, *params), g)

            def router_step(x=x, layer=layer):
                r = layer.router(x)
                torch.autograd.grad(r.probs, (x, layer.router.weight),
                                    torch.ones_like(r.probs))

            r = {"shape": name, "T": t, "H": h, "F": f, "E": e, "K": k, "mode": mode}
            try:
                r["fwd_bwd_ms"] = round(median_ms(step), 4)
                r["host_us"] = round(host_us(step, 50), 1)
                r["router_ms"] = round(median_ms(router_step), 4)
                if dev == "cuda":
                    r.update(_kernel_shares(step))
                    try:
                        r["graph_ms"] = round(graph_median_ms(step), 4)
                    except Exception as err:  # noqa: BLE001 (reported, not fatal)
                        r["graph_ms"] = f"{type(err).__name__}: {str(err)[:120]}"
            except torch.OutOfMemoryError as err:
                r["error"] = f"OutOfMemoryError: {str(err)[:120]}"
            rows_out.append(r)
            print(r, file=sys.stderr, flush=True)
            del layer, params, x, wq
            if dev == "cuda":
                torch.cuda.empty_cache()
    write_json(a.out, {"bench": "moe_layer", "env": env_info(), "results": rows_out})


COMMANDS = {  # name: (add its options to a parser, run it on the parsed options)
    "permute": (permute_args, permute_main),
    "quantize": (quantize_args, quantize_main),
    "compile_fp8": (compile_fp8_args, compile_fp8_main),
    "grouped_mm": (grouped_mm_args, grouped_mm_main),
    "moe_layer": (moe_layer_args, moe_layer_main),
}

# --- table -----------------------------------------------------------------------------


def table_args(p) -> None:
    p.add_argument("paths", nargs="+", metavar="results.json",
                   help="JSON written by `bench permute` or `bench quantize`")


def table_main(a) -> None:
    """Markdown tables from benchmark JSON (``bench permute`` and ``bench quantize``).

        python -m benchmarks table results.json [...]
    """
    for path in a.paths:
        with open(path) as f:
            d = json.load(f)
        env = d["env"]
        print(f"<!-- {path}: {env} copy {d['copy_GB/s']} GB/s -->")
        if d["bench"] == "permute":
            print("| config (T, H, E, K) | op | graph ms | % copy BW | eager us |")
            print("|---|---|---|---|---|")
            for r in d["results"]:
                cfg = f"{r['config']} ({r['T']}, {r['H']}, {r['E']}, {r['K']})"
                print(f"| {cfg} | {r['op']} | {r['graph_ms']} | {r['pct_copy_bw']} | "
                      f"{r['eager_ms'] * 1e3:.0f} |")
        elif d["bench"] == "quantize":
            print("| config | T x H | recipe | graph ms | GB/s | % copy | eager ms | torch ms |")
            print("|---|---|---|---|---|---|---|---|")
            for r in d["results"]:
                print(f"| {r['config']} | {r['T']}x{r['H']} | {r['recipe']} | {r['graph_ms']} | "
                      f"{r['GB/s']} | {r['pct_copy_bw']} | {r['eager_ms']} | "
                      f"{r['torch_eager_ms']} |")
