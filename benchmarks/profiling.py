"""Where the time goes, for a profiler or by kernel (``python -m benchmarks profile
kernels|map|small|ncu``): kernel durations inside a CUDA-graph replay, the host cost of small
eager calls, and drivers that launch the mask-map and FP8 permute kernels for Nsight Compute
(``ncu ... python3 -m benchmarks profile map|ncu``). Nothing here decides a default. They
need CUDA; without it each says so and returns."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
from collections import defaultdict

import torch
import triton
import triton.language as tl

import qmoe
from benchmarks.common import (
    CONFIGS,
    FP8_RECIPES,
    capture_graph,
    env_info,
    graph_median_ms,
    host_us,
    mask_map,
    needs_cuda,
    write_json,
)
from qmoe import _triton
from qmoe._triton import _CACHE, _specs, _values, current_device, launch, launch_python
from qmoe.ops.kernels.permute import permute_rows_triton
from qmoe.ops.kernels.permute_mask import permute_mask_triton
from qmoe.ops.row_id_map import make_row_id_map
from qmoe.ops.tuning import MaskMapTiling

# --- profile kernels -------------------------------------------------------------------


def profile_graph(fn, replays: int) -> dict:
    """Per-kernel median durations (us) and the median replay span (us)."""
    from torch.profiler import ProfilerActivity, profile

    g = capture_graph(fn)
    flush = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush.bitwise_not_()  # cold L2, as do_bench's zero_ (a kernel named apart)
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
    kernels = [ev for ev in prof.events() if ev.device_type.name == "CUDA"
               and "bitwise_not" not in ev.name.lower()]
    # events in replay order; group them per replay by the order of kernel names
    kernels.sort(key=lambda ev: ev.time_range.start)
    per_launch = len(kernels) // replays
    dur = defaultdict(list)
    spans, sums = [], []
    for r in range(replays):
        evs = kernels[r * per_launch:(r + 1) * per_launch]
        if not evs:
            continue
        spans.append(evs[-1].time_range.end - evs[0].time_range.start)
        sums.append(sum(ev.time_range.end - ev.time_range.start for ev in evs))
        for i, ev in enumerate(evs):
            dur[f"{i}:{ev.name[:60]}"].append(ev.time_range.end - ev.time_range.start)
    return {"kernels_us": {k: round(statistics.median(v), 2) for k, v in dur.items()},
            "span_us": round(statistics.median(spans), 2) if spans else None,
            "kernel_sum_us": round(statistics.median(sums), 2) if sums else None}


def kernels_config(name: str, replays: int, picks=()) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].contiguous()
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    _, rid = qmoe.moe_permute(x, mask, n)
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    probs = torch.rand(t, e, device="cuda") * mask
    recipe = FP8_RECIPES["blockwise128"]
    q = qmoe.quantize(x, recipe)
    per_row = h + q.raw_scale[0].numel() * 4
    cases = {
        "bf16 permute(mask)": (lambda: qmoe.moe_permute(x, mask, n), (t + n) * h * 2),
        "fp8 blockwise permute(mask)": (lambda: qmoe.moe_permute(q, mask, n),
                                        (t + n) * per_row),
        "fp8 blockwise permute rows only": (lambda: torch.ops.qmoe.permute(q, rid, None, n),
                                            (t + n) * per_row),
        "bf16 unpermute(merging_probs)": (
            lambda: qmoe.moe_unpermute(y, rid, merging_probs=probs), (t + n) * h * 2),
        "fused blockwise quantize+permute(mask)": (
            lambda: qmoe.moe_permute(x, mask, n, quantize=recipe), t * h * 2 + n * per_row),
    }
    rows = []
    for case, (fn, nbytes) in cases.items():
        if picks and not any(p in case for p in picks):
            continue
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy = profile_graph(lambda src=src, dst=dst: dst.copy_(src), replays)
        prof = profile_graph(fn, replays)
        rows.append({"config": name, "case": case, "bytes": nbytes, **prof,
                     "same_bytes_copy_span_us": copy["span_us"]})
        print(f"{name:>9} {case:>40}: span {prof['span_us']:7.2f} us (kernels "
              f"{prof['kernel_sum_us']:7.2f}), same-bytes copy {copy['span_us']:7.2f} us "
              f"{prof['kernels_us']}", file=sys.stderr)
    return rows



def kernels_args(p) -> None:
    p.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss")
    p.add_argument("--cases", default="", help="comma list of case-name substrings")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)


def kernels_main(a) -> None:
    """Where a permute's time goes: each kernel's GPU time inside a CUDA-graph replay.

        python -m benchmarks profile kernels [--configs mixtral,gptoss] [--out prof.json]

    For each config and case, the call is captured in a CUDA graph and replayed under
    ``torch.profiler``; per kernel: its median duration; per replay: the span from the first
    kernel's start to the last one's end (so launch gaps between kernels count) and the sum
    of kernel durations (one-element fills and asserts included). Next to them, a copy of the
    same bytes (half read, half written, one ``copy_``) replayed alike: the ceiling for an op
    of that size, which is below the 1 GiB copy that ``bench permute``'s percentages use.
    Nothing here decides a default.
    """
    if not needs_cuda("profile kernels"):
        return
    rows = []
    for name in a.configs.split(","):
        rows += kernels_config(name, a.replays, [c for c in a.cases.split(",") if c])
    write_json(a.out, {"bench": "profile_kernels", "env": env_info(), "results": rows})


# --- profile map -----------------------------------------------------------------------


def map_args(p) -> None:
    p.add_argument("--configs", default="qwen3next,dsv3")
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--out", default=None,
                   help="JSON of what ran (configs, calls, env); ncu has the measurements")


def map_main(a) -> None:
    """Drive the mask-map kernels a few times per config, for a hardware profiler.

        ncu --clock-control none -k regex:'mask_|block_scan' --launch-skip 6 --launch-count 6 \\
            python3 -m benchmarks profile map --configs qwen3next,dsv3

    Each config runs the three mask-map launches (``mask_rows_triton``, what
    ``make_row_id_map(mask)`` calls on CUDA) ``--calls`` times on the bench's routing (K
    random experts a token); nothing is timed here: ncu does the measuring.
    """
    if not needs_cuda("profile map"):
        return
    for name in a.configs.split(","):
        t, _, e, k = CONFIGS[name]
        ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
        mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
        for _ in range(a.calls):
            mask_map(mask, t * k)
        torch.cuda.synchronize()
        print(name, "done", flush=True)
    if a.out:  # what ran, for the profile it goes with (printed nowhere: ncu's output stays)
        write_json_quiet(a.out, {"bench": "profile_map", "env": env_info(),
                                 "configs": a.configs.split(","), "calls": a.calls})


def write_json_quiet(path: str, payload: dict) -> None:
    """``payload`` as JSON into ``path``, printing nothing (a profiler driver's output
    stays the profiler's)."""
    import json

    with open(path, "w") as f:
        f.write(json.dumps(payload, indent=2) + "\n")


# --- profile small ---------------------------------------------------------------------


@triton.jit
def _empty1(x):  # (1,) any
    pass


@triton.jit
def _empty24(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n0, n1, n2, n3, n4, n5, n6,
             n7, F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr):
    pass


@triton.jit
def _empty_ptrs12(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11):
    pass


@triton.jit
def _empty_ints20(a0, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
                  n16, n17, n18, n19):
    pass


_NOSPEC = tuple(f"n{i}" for i in range(20))


@triton.jit(do_not_specialize=_NOSPEC)
def _empty_ints20_nospec(a0, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14,
                         n15, n16, n17, n18, n19):
    pass


def launches(fn) -> list[str]:
    """The names (cut at 80 characters) of the device kernels, memsets and copies one call
    of ``fn`` runs, in order, after a warm-up call (compiles, caches). Also what
    tests/ops/test_kernel_counts.py counts."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda ev: ev.time_range.start)
    return [ev.name[:80] for ev in evs]



def _launch_parts(kernel, args: tuple) -> dict:
    """The parts of one ``qmoe._triton.launch`` of ``kernel`` (no constexprs, grid (1,)),
    each alone: its Python path whole (the C launch off), that path's cache key, the
    addresses, the compiled launcher's call (Triton's ``CompiledKernel.run``: its Python
    wrapper, then Triton's C launch), on Triton 3.6 Triton's C launch alone (its arguments
    as that version's wrapper passes them, below), and qmoe's C launch's key alone."""
    launch(kernel, (1,), *args)  # compiles and fills the cache entry
    dev = current_device()
    c = _CACHE[_triton.python_key(kernel, dev, args, {})]
    stream = c.get_stream(dev)
    vals = _values(args)
    run = c.run
    parts = {
        "launch's Python path (the C launch off)": lambda: launch_python(kernel, (1,), args, {}),
        "launch's cache key alone (_specs)": lambda: _specs(args),
        "launch's addresses alone (_values)": lambda: _values(args),
        "compiled launcher alone (CompiledKernel.run)": lambda: run(
            1, 1, 1, stream, c.function, c.packed_metadata, None, None, None, *vals),
    }
    # Triton 3.6's CudaLauncher.__call__, for a kernel with no scratch, calls its C launch
    # with the cooperative-grid and PDL flags and two null scratch pointers before the rest
    if triton.__version__.startswith("3.6.") and run.global_scratch_size == 0 == (
            run.profile_scratch_size):
        c_launch, head = run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
        parts["C launch alone (Triton 3.6's, under CompiledKernel.run)"] = lambda: c_launch(
            1, 1, 1, stream, c.function, *head, c.packed_metadata, None, None, None, *vals)
    if _triton.fast_status()["loaded"]:
        key = _triton.build_fast().key
        parts["the C launch's key alone"] = lambda: key(kernel, dev, args, {}, True)
    return parts


def small_args(p) -> None:
    p.add_argument("--config", default="small")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--cprofile", type=int, default=25, help="top functions printed")
    p.add_argument("--cprofile-cases", default="moe_permute(mask);fp8 blockwise moe_permute(mask)"
                   ";step: permute_with_probs + unpermute + backward",
                   help="case names to run under cProfile, separated by ;")
    p.add_argument("--out", default=None)


def small_main(a) -> None:
    """Where the host time of a small eager call goes (issue 3's "small" target).

        python3 -m benchmarks profile small [--config small] [--out small.json] [--cprofile 25]

    For each case: host microseconds per call with calls issued back to back (the best of
    five rounds of ``--calls / 5`` calls, one synchronize after each: the CPU-bound rate an
    eager training step sees), the same with ``qmoe._triton``'s C launch off (where it
    loaded), the kernels one call launches (torch.profiler), and the GPU
    time from a CUDA-graph replay. Then a cProfile of each of ``--cprofile-cases`` (top
    functions by own time). Baselines: empty Triton kernels by argument count and kind
    (through Triton's launch and through ``qmoe._triton.launch``), ``torch.empty``, the
    torch part of the step's shape (a cast, sums, the backward engine, two accumulations),
    and the mask map built with three launches and with one
    (``mask_rows_triton`` with ``MaskMapTiling(one_launch=...)``).
    """
    if not needs_cuda("profile small"):
        return
    t, h, e, k = CONFIGS[a.config]
    n = t * k
    dev = "cuda"
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].contiguous()
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev)
    y = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    _, rid = qmoe.moe_permute(x, mask, n)
    q = qmoe.quantize(x, qmoe.Blockwise())
    xg = x.clone().requires_grad_(True)
    pg = probs.clone().requires_grad_(True)

    def step():  # one MoE step's permutation: permute with probs, merge, backward of both
        out, _, r = qmoe.moe_permute_with_probs(xg, pg, mask, num_out_tokens=n)
        qmoe.moe_unpermute(out, r, pg).float().sum().backward()

    @torch.compile  # (default mode; the backward runs outside, as in training loops)
    def step_loss(xg, pg):
        out, _, r = qmoe.moe_permute_with_probs(xg, pg, mask, num_out_tokens=n)
        return qmoe.moe_unpermute(out, r, pg).float().sum()

    def step_compiled():
        step_loss(xg, pg).backward()

    @torch.compile  # the torch part alone, compiled: torch.compile's own cost per call
    def torch_part_loss(xg, pg):
        return xg.float().sum() + pg.sum()

    ints = [0] * 8
    x1 = torch.zeros(1, device=dev)
    cases = {
        "triton empty kernel, 1 arg": lambda: _empty1[(1,)](x),
        "triton empty kernel, 24 args": lambda: _empty24[(1,)](
            *([x] * 12), *ints, F0=1, F1=2, F2=3, F3=4),
        "qmoe launch, empty kernel, 24 args": lambda: launch(
            _empty24, (1,), *([x] * 12), *ints, F0=1, F1=2, F2=3, F3=4),
        "triton empty kernel, 12 tensors": lambda: _empty_ptrs12[(1,)](*([x] * 12)),
        "qmoe launch, empty kernel, 12 tensors": lambda: launch(_empty_ptrs12, (1,), *([x] * 12)),
        **{f"12 tensors: {k}": v for k, v in _launch_parts(_empty_ptrs12, (x,) * 12).items()},
        "torch launch: x1.zero_() (one element)": x1.zero_,
        "torch launch: torch.ops.aten.zero_.default(x1)": lambda: torch.ops.aten.zero_.default(x1),
        "triton empty kernel, 1 tensor + 20 ints": lambda: _empty_ints20[(1,)](x, *range(20)),
        "... same, ints do_not_specialize": lambda: _empty_ints20_nospec[(1,)](x, *range(20)),
        "torch.empty": lambda: torch.empty(n, h, dtype=x.dtype, device=dev),
        "x.new_empty": lambda: x.new_empty((n, h)),
        "mask map, three launches": lambda: mask_map(mask, n, MaskMapTiling(one_launch=False)),
        "mask map, one launch": lambda: mask_map(mask, n, MaskMapTiling(one_launch=True)),
        "qmoe::make_row_id_map(mask)": lambda: torch.ops.qmoe.make_row_id_map(mask, n, False, 1),
        "qmoe::permute (rows only)": lambda: torch.ops.qmoe.permute(x, rid, None, n),
        "moe_permute(mask)": lambda: qmoe.moe_permute(x, mask, n),
        "moe_permute(index)": lambda: qmoe.moe_permute(x, ids, n, map_type="index"),
        "moe_permute_with_probs(mask)": lambda: qmoe.moe_permute_with_probs(x, probs, mask, n),
        "moe_unpermute(merging_probs)": lambda: qmoe.moe_unpermute(y, rid, probs),
        "moe_unpermute(no probs)": lambda: qmoe.moe_unpermute(y, rid),
        "fp8 blockwise moe_permute(mask)": lambda: qmoe.moe_permute(q, mask, n),
        "quantize(Blockwise)": lambda: qmoe.quantize(x, qmoe.Blockwise()),
        "moe_permute(mask, quantize=Blockwise)": lambda: qmoe.moe_permute(
            x, mask, n, quantize=qmoe.Blockwise()),
        "moe_sort_chunks_by_index": lambda: qmoe.moe_sort_chunks_by_index(
            y, torch.full((32,), n // 32, device=dev, dtype=torch.int64),
            torch.arange(32, device=dev).flip(0)),
        "step: permute_with_probs + unpermute + backward": step,
        "step, forward under torch.compile": step_compiled,
        # the torch floor of the step's shape: a cast, sums, the engine, two accumulations
        "step's torch part: (x.float().sum() + p.sum()).backward()": lambda: (
            xg.float().sum() + pg.sum()).backward(),
        "the same, forward under torch.compile": lambda: torch_part_loss(xg, pg).backward(),
    }
    rows = []
    fast = _triton.fast_status()
    print(f"the C launch: {fast}", file=sys.stderr)
    for name, fn in cases.items():
        us = host_us(fn, a.calls)
        us_py = None
        if fast["loaded"]:  # the same case with the C launch off (launch's Python path)
            _triton.use_fast(False)
            try:
                us_py = host_us(fn, a.calls)
            finally:
                _triton.use_fast(True)
        kernels = launches(fn)
        try:
            # (the parts alone launch on the stream fetched outside the capture: no graph)
            no_graph = "empty" in name[-12:] or "alone" in name
            g = None if no_graph else graph_median_ms(fn, rep=50)
        except Exception as err:  # the step's backward does not capture
            g = None
            print(f"{name}: no graph ({type(err).__name__})", file=sys.stderr)
        rows.append({"case": name, "host_us": round(us, 1),
                     "host_us_python_launch": None if us_py is None else round(us_py, 1),
                     "launches": len(kernels),
                     "kernels": kernels, "graph_us": None if g is None else round(g * 1e3, 1)})
        py = "" if us_py is None else f" ({us_py:.1f} with the C launch off)"
        print(f"{name:>34}: host {us:7.1f} us/call{py}, {len(kernels)} launches, graph "
              f"{'-' if g is None else f'{g * 1e3:.1f}'} us", file=sys.stderr)
    profiles = {}
    for name in a.cprofile_cases.split(";"):
        prof = cProfile.Profile()
        fn = cases[name]
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.cprofile)
        print(s.getvalue(), file=sys.stderr)
        profiles[name] = s.getvalue()
    write_json(a.out, {"bench": "profile_small", "env": env_info(), "config": a.config,
                       "calls": a.calls, "c_launch": fast, "results": rows,
                       "cprofile": profiles})


# --- profile ncu -----------------------------------------------------------------------


def ncu_args(p) -> None:
    p.add_argument("config", nargs="?", default="dsv3", help="a config name (default dsv3)")
    p.add_argument("--out", default=None,
                   help="JSON of what ran (config, env); ncu has the measurements")


def ncu_main(a) -> None:
    """Driver for Nsight Compute: the fused mask permute and the scatter alone (prebuilt map)
    on dsv3-sized FP8 rows (uint8 bits + fp32 blockwise scale rows), each launched once after
    warm-up. Results: docs/benchmarks.md, "FP8 rows: the ceiling".

        ncu --clock-control none --kernel-name regex:"permute_mask_kernel|permute_scatter_kernel" \\
            --launch-skip 4 --launch-count 2 --set full python3 -m benchmarks profile ncu dsv3

    (the first four matching launches are the warm-up's).
    """
    if not needs_cuda("profile ncu"):
        return
    t, h, e, k = CONFIGS[a.config]
    n = t * k
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    x = torch.randint(0, 255, (t, h), dtype=torch.uint8, device="cuda")
    side = torch.rand(t, -(-h // 128), device="cuda")
    rid, fill = make_row_id_map(mask, n, False, 1)
    so = torch.empty(n, side.shape[1], device="cuda")
    for _ in range(2):  # warm-up (compiles), then the profiled launches
        permute_mask_triton(x, mask, n, 1, side=side)
        permute_rows_triton(x, rid, n, fill=fill, side=side, side_out=so)
    torch.cuda.synchronize()
    permute_mask_triton(x, mask, n, 1, side=side)
    permute_rows_triton(x, rid, n, fill=fill, side=side, side_out=so)
    torch.cuda.synchronize()
    print("done")
    if a.out:
        write_json_quiet(a.out, {"bench": "profile_ncu", "env": env_info(), "config": a.config})


COMMANDS = {  # name: (add its options to a parser, run it on the parsed options)
    "kernels": (kernels_args, kernels_main),
    "map": (map_args, map_main),
    "small": (small_args, small_main),
    "ncu": (ncu_args, ncu_main),
}
