"""Shared benchmark table and helpers: the model shapes every benchmark draws from, the FP8
recipes, the copy-bandwidth ceiling, medians (eager, host, CUDA-graph replay), JSON output.

``python -m benchmarks ...`` (benchmarks/__main__.py) runs the benchmarks; ``bench_cpu.py``
uses this table too.
"""

from __future__ import annotations

import json
import platform
import time
from collections import defaultdict

import torch

import qmoe

CONFIGS = {  # name: (T, H, E, K)
    "dsv3": (4096, 7168, 256, 8),
    "qwen3": (16384, 4096, 128, 8),
    "mixtral": (8192, 4096, 8, 2),
    "gptoss": (8192, 2880, 128, 4),
    "qwen3next": (16384, 2048, 512, 10),
    "small": (256, 4096, 64, 8),
    "tiny": (64, 256, 8, 2),  # CPU smoke run only
    # bench_cpu only: small CPU steps, where per-call overhead shows
    "cpu256": (256, 256, 8, 2),
    "cpu1024": (1024, 1024, 8, 2),
    # sweeps only: a mask just past the one-launch size (the three-launch form at small T)
    "mid": (1024, 4096, 64, 8),
}
SWEEP_ONLY = ("tiny", "mid", "cpu256", "cpu1024")
# ``bench quantize``'s shapes: tokens x hidden, no routing
QUANTIZE_CONFIGS = {  # name: (T, H)
    "dsv3": (16384, 7168),
    "qwen3": (16384, 4096),
    "gptoss": (16384, 2880),
    "small": (128, 7168),
}
FP8_RECIPES = {
    "blockwise128": qmoe.Blockwise(),
    "mxfp8": qmoe.MXFP8(),
    "pertensor": qmoe.PerTensor(),
}


def env_info() -> dict:
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
    return info


def median_ms(fn, *, warmup: int = 5, iters: int = 50) -> float:
    """Median wall time of ``fn`` in ms: CUDA events on GPU, perf_counter on CPU."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def host_us(fn, calls: int, rounds: int = 5) -> float:
    """Host microseconds per call: the best of ``rounds`` rounds of ``calls // rounds``
    back-to-back calls, one synchronize after each round (the CPU-bound rate an eager step
    sees; the host of the GPU machine is shared: single rounds vary by up to 2x)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    per = max(1, calls // rounds)
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / per * 1e6)
    return best


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after three warm-up calls on a side stream (they
    compile the kernels outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_median_ms(fn, rep: int = 200) -> float | None:
    """Median time of ``fn`` replayed from a CUDA graph (``rep`` ms of replays): the GPU
    time without the Python and launch overhead of eager calls. ``None`` on CPU."""
    if not torch.cuda.is_available():
        return None
    import triton.testing

    g = capture_graph(fn)
    return float(triton.testing.do_bench(g.replay, warmup=10, rep=rep, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def write_json(path: str | None, payload: dict) -> None:
    text = json.dumps(payload, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)


def mask_map(mask: torch.Tensor, n: int, tiling=None):
    """``(row_id_map, fill)`` of a CUDA ``[T, E]`` mask from the Triton map launches alone
    (``mask_rows_triton``, what ``qmoe::make_row_id_map`` runs on CUDA), ``n`` output rows,
    no padding; ``tiling``: a ``qmoe.ops.tuning.MaskMapTiling`` (None: the launcher's)."""
    from qmoe.ops.kernels.row_id_map import mask_rows_triton
    from qmoe.ops.launch import fill_count

    fill = mask.new_empty((fill_count(mask, False, 1), 2), dtype=torch.int32)
    return mask_rows_triton(mask, n, 1, fill, tiling), fill


def int_list(s: str) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]`` (a sweep's command-line list)."""
    return [int(v) for v in s.split(",") if v]


def auto_bools(s: str) -> list[bool | None]:
    """``"auto,0,1"`` -> ``[None, False, True]`` (a sweep's list of on / off / the
    launcher's choice)."""
    return [None if v == "auto" else bool(int(v)) for v in s.split(",")]


def needs_cuda(command: str) -> bool:
    """Whether CUDA is there; if not, say that ``command`` is skipped (a GPU-only
    benchmark returns, with exit status 0, rather than failing on its first CUDA call)."""
    if torch.cuda.is_available():
        return True
    print(f"{command}: needs CUDA, skipped")
    return False


def variant_recorder(rows: list, config: str, nbytes: int, copy_bw: float, width: int = 40):
    """``record(variant, fn)``: time ``fn`` by CUDA-graph replay, append ``{config, variant,
    graph_ms, pct_copy_bw}`` to ``rows`` (``nbytes`` moved a call) and print the line."""
    import sys

    def record(variant: str, fn) -> None:
        ms = graph_median_ms(fn)
        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
        rows.append({"config": config, "variant": variant, "graph_ms": round(ms, 4),
                     "pct_copy_bw": round(pct, 1)})
        print(f"{config:>9} {variant:>{width}}: {ms:8.4f} ms {pct:5.1f}% of copy",
              file=sys.stderr)

    return record


def kernel_breakdown(fn, iters: int = 20, width: int | None = 60) -> dict[str, float]:
    """CUDA time per call of each kernel ``fn`` launches (us), from the profiler; kernel
    names cut to ``width`` characters (None: whole)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:width]] += ev.device_time / iters
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
