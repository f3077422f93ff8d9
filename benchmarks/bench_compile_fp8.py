"""FP8 permute -> unpermute, eager against ``torch.compile(fullgraph=True)`` (issue 4).

    python3 benchmarks/bench_compile_fp8.py [--configs dsv3,small] [--out compile_fp8.json]

Per config and recipe: ``moe_permute_with_probs`` of a quantized input (the output is the
recipe's quantized type), then ``moe_unpermute`` of those rows with merging probs (the
merge dequantizes inside its kernel, high-precision result). The same function runs eagerly
and compiled with ``fullgraph=True``; both are timed per call (``median_ms``: on the GPU,
``do_bench``'s events, GPU time) and as ``*_host_ms``, the host time per call of calls
issued back to back (``common.host_us``, best of 5 rounds of 40; where the host is slower
than the GPU, as at the small config, this is what a training step sees), and the compiled
outputs are checked bit-identical to eager. Also the first compiled call's wall time (the compile,
unless Inductor's on-disk cache already holds the graph). On CUDA also
``mode="reduce-overhead"`` (Inductor's CUDA graphs: the host cost of a small call goes), its
outputs checked bit-identical too; a failure there is recorded, not raised.
On CPU (no CUDA) it runs the ``tiny`` config unless ``--configs`` names others (the C++ path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS, FP8_RECIPES  # noqa: E402
from common import env_info, host_us, median_ms, write_json  # noqa: E402

import qmoe  # noqa: E402


def path(q, mask, probs, n):
    """FP8 rows grouped by expert and merged back: ``[T, H]`` high precision."""
    out, _, rid = qmoe.moe_permute_with_probs(q, probs, mask, n)
    return qmoe.moe_unpermute(out, rid, merging_probs=probs)


def _graphs_ms(q, mask, probs, n, want) -> tuple[float, float] | str:
    """``(median ms, host ms)`` per call of ``path`` compiled with
    ``mode="reduce-overhead"`` (CUDA graphs), after checking its output equals ``want``;
    the error as text if it fails."""
    torch._dynamo.reset()
    try:
        graphed = torch.compile(path, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # cudagraph trees record on the second or third call
            got = graphed(q, mask, probs, n)
        if not torch.equal(got, want):
            return "reduce-overhead output differs from eager"

        def call():
            return graphed(q, mask, probs, n)

        return round(median_ms(call), 4), round(host_us(call, 200) / 1e3, 4)
    except Exception as e:  # reported in the JSON; the other columns stand
        return f"reduce-overhead failed: {type(e).__name__}: {str(e)[:200]}"


def run_config(name: str, dev: str) -> list[dict]:
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
        compiled = torch.compile(path, fullgraph=True)
        t0 = time.perf_counter()
        got = compiled(q, mask, probs, n)
        if dev == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        want = path(q, mask, probs, n)
        if not torch.equal(got, want):
            raise AssertionError(f"{name} {rname}: compiled output differs from eager")

        def eager_call(q=q):
            return path(q, mask, probs, n)

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default=None,
                   help="comma list (default: dsv3,small on CUDA, tiny on the CPU)")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    names = (a.configs or ("dsv3,small" if dev == "cuda" else "tiny")).split(",")
    rows = []
    for name in names:
        rows += run_config(name, dev)
        write_json(a.out, {"bench": "compile_fp8", "env": env_info(), "device": dev,
                           "results": rows})


if __name__ == "__main__":
    main()
