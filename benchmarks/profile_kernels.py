"""Where a permute's time goes: each kernel's GPU time inside a CUDA-graph replay.

    python benchmarks/profile_kernels.py [--configs mixtral,gptoss] [--out prof.json]

For each config and case, the call is captured in a CUDA graph and replayed under
``torch.profiler``; per kernel: its median duration; per replay: the span from the first
kernel's start to the last one's end (so launch gaps between kernels count) and the sum
of kernel durations (one-element fills and asserts included). Next to them, a copy of the
same bytes (half read, half written, one ``copy_``) replayed alike: the ceiling for an op
of that size, which is below the 1 GiB copy that ``bench_permute.py``'s percentages use.
Nothing here decides a default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS, FP8_RECIPES  # noqa: E402
from common import capture_graph, env_info, write_json  # noqa: E402

import qmoe  # noqa: E402


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


def run_config(name: str, replays: int, picks=()) -> list[dict]:
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss")
    p.add_argument("--cases", default="", help="comma list of case-name substrings")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for name in a.configs.split(","):
        rows += run_config(name, a.replays, [c for c in a.cases.split(",") if c])
    write_json(a.out, {"bench": "profile_kernels", "env": env_info(), "results": rows})


if __name__ == "__main__":
    main()
