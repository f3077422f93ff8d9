r"""CPU paths side by side: C++ kernels (qmoe._C), the vectorized torch path, plain PyTorch.

    python -m benchmarks.bench_cpu [--out results.json] [--iters 5] [--cpp-only]
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
        python -m benchmarks.bench_cpu --out reuse.json   # outputs reuse faulted-in pages

Configs (T, H, E, K), bf16: dsv3 (4096, 7168, 256, 8), mixtral (8192, 4096, 8, 2), and the
small cpu256 (256, 256, 8, 2) and cpu1024 (1024, 1024, 8, 2) where per-call overhead shows;
``--configs`` picks others of the shared table (``--configs tiny``: a smoke run).
Calls under 50 ms also get the best of 9 rounds of back-to-back calls (``*_best_ms``),
the implementations taken in turn. Bytes: each input row read once and each output row
written once. The ceiling is a
single-threaded memcpy (numpy copyto of 512 MiB, bytes read + written, into a buffer
already written once) measured in the same run; next to it the same copy into a fresh
buffer each time (what any op with a new large output pays: with glibc's defaults every
large block is a fresh mmap, whose pages the kernel zero-fills on first touch). Medians
over --iters runs; the JSON records GLIBC_TUNABLES.

A module of its own, not a ``python -m benchmarks`` command: what it measures depends on the
process's allocator (glibc's tunables are read when the process starts, and each output's
pages are fresh or reused according to what the process freed before), so it runs in a
process that does nothing else: no Triton kernels or GPU benchmark modules loaded, only
qmoe, numpy and the shared shapes (``benchmarks.common.CONFIGS``). Its JSON differs too (a
memcpy ceiling, system time, no CUDA environment).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np
import torch

import qmoe
from benchmarks.common import CONFIGS, median_ms
from qmoe._backends import cpp_loaded
from qmoe.ops import torch_impl
from qmoe.ops.row_id_map import _mask_rows

BEST_OF_MAX_MS = 50  # longer calls get the median alone (best-of rounds would take minutes)


def memcpy_gbs(fresh: bool = False) -> float:
    """Single-threaded copy of 512 MiB, bytes read + written: into one buffer written
    before, or (``fresh``) into a new buffer each time."""
    src = np.random.rand(1 << 26)  # 512 MiB of float64
    dst = np.empty_like(src)
    fn = (lambda: np.copyto(np.empty_like(src), src)) if fresh else (
        lambda: np.copyto(dst, src))
    ms = median_ms(fn, warmup=1, iters=5)
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


def run_config(name: str, bw: float, iters: int, cpp_only: bool = False) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    rows = []
    n = t * k
    x = torch.randn(t, h).to(torch.bfloat16)
    ids = torch.rand(t, e).argsort(1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.rand(t, e) * mask
    y = torch.randn(n, h).to(torch.bfloat16)
    rid, _ = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    order = torch.argsort(ids.reshape(-1), stable=True)
    w_flat = probs.gather(1, ids).reshape(-1)
    move = (t + n) * h * 2

    def torch_path_permute():
        r = _mask_rows(mask, n, 1)
        return torch_impl.permute_rows(x, r, n)

    def plain_unpermute():
        acc = torch.zeros(t, h)
        acc.index_add_(0, order // k, y.float() * w_flat[order, None])
        return acc.to(torch.bfloat16)

    xg = x.clone().requires_grad_()
    pg = probs.clone().requires_grad_()

    def qmoe_step():  # permute with probs, merge with them, backward of both
        out, _, r = qmoe.moe_permute_with_probs(xg, pg, mask, num_out_tokens=n)
        qmoe.moe_unpermute(out, r, pg).float().sum().backward()

    def plain_step():  # the same math in plain PyTorch (autograd of index ops)
        tok = torch.argsort(ids.reshape(-1), stable=True)
        rows = xg.index_select(0, tok // k)
        w = pg.gather(1, ids).reshape(-1)[tok]
        acc = torch.zeros(t, h).index_add(0, tok // k, rows.float() * w[:, None])
        acc.to(torch.bfloat16).float().sum().backward()

    cases = {
        "MoE step (fwd + bwd)": {
            "c++": qmoe_step,
            "torch path": None,
            "plain pytorch": plain_step,
        },
        "permute (map + rows)": {
            "c++": lambda: qmoe.moe_permute(x, mask, n),
            "torch path": torch_path_permute,
            "plain pytorch": lambda: x.index_select(0, torch.argsort(
                ids.reshape(-1), stable=True) // k),
        },
        "unpermute(merging_probs)": {
            "c++": lambda: qmoe.moe_unpermute(y, rid, probs),
            "torch path": lambda: torch_impl.unpermute_rows(y, rid, probs),
            "plain pytorch": plain_unpermute,
        },
    }
    for op, impls in cases.items():
        impls = {k_: f for k_, f in impls.items() if f is not None}
        if cpp_only:
            impls = {"c++": impls["c++"]}
        sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        res = {"c++": median_ms(impls["c++"], warmup=1, iters=iters)}
        sys_ms = (resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0) / (iters + 1) * 1e3
        res.update({k_: median_ms(f, warmup=1, iters=iters) for k_, f in impls.items()
                    if k_ != "c++"})
        # Where a call is short, also the best of 9 rounds of back-to-back calls, taken
        # in turn for each implementation: a VM's noisy neighbours move medians by up to 2x
        # between runs, the best round much less (it is what the code costs unperturbed).
        best = {}
        if max(res.values()) < BEST_OF_MAX_MS:
            per = max(1, int(20 / max(res.values())))  # about 20 ms a round
            for _ in range(9):
                for k_, f in impls.items():
                    t0 = time.perf_counter()
                    for _ in range(per):
                        f()
                    ms = (time.perf_counter() - t0) / per * 1e3
                    best[k_] = min(best.get(k_, ms), ms)
        gbs = move / (res["c++"] * 1e-3) / 1e9
        row = {"config": name, "T": t, "H": h, "E": e, "K": k, "op": op,
               **{f"{k_}_ms": round(v, 3) for k_, v in res.items()},
               **{f"{k_}_best_ms": round(v, 3) for k_, v in best.items()},
               "c++_system_ms_per_call": round(sys_ms, 2)}
        if not op.startswith("MoE step"):  # (a step is not one pass over the rows)
            row.update({"c++_GB/s": round(gbs, 2), "pct_memcpy": round(100 * gbs / bw, 1)})
        if "torch path" in res:
            row["speedup_vs_torch_path"] = round(res["torch path"] / res["c++"], 2)
        if "plain pytorch" in res:
            row["speedup_vs_plain"] = round(res["plain pytorch"] / res["c++"], 2)
            if best:
                row["best_speedup_vs_plain"] = round(best["plain pytorch"] / best["c++"], 2)
        rows.append(row)
        others = "".join(f", {k_} {v:8.2f} ms" for k_, v in res.items() if k_ != "c++")
        if best:
            others += " (best rounds: " + ", ".join(f"{k_} {v:.3f}" for k_, v in best.items()) + ")"
        pct = f"{row['pct_memcpy']:5.1f}% of memcpy; " if "pct_memcpy" in row else ""
        print(f"{name:>8} {op:>26}: c++ {res['c++']:8.3f} ms ({pct}system time "
              f"{sys_ms:6.2f} ms a call){others}", file=sys.stderr)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--configs", default="dsv3,mixtral,cpu256,cpu1024",
                   help="comma list of benchmarks.common.CONFIGS names")
    p.add_argument("--cpp-only", action="store_true",
                   help="time the C++ path alone (no torch-path or plain-PyTorch runs between)")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if not cpp_loaded():
        print("bench_cpu: qmoe._C is not built (QMOE_SKIP_CPP_BUILD=1?); nothing to compare")
        return
    bw = memcpy_gbs()
    fresh_bw = memcpy_gbs(fresh=True)
    print(f"single-thread memcpy {bw:.1f} GB/s (into a fresh buffer: {fresh_bw:.1f} GB/s); "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}", file=sys.stderr)
    rows = []
    for name in a.configs.split(","):
        rows += run_config(name, bw, a.iters, a.cpp_only)
    payload = {"bench": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
               "memcpy_1thread_GB/s": round(bw, 2),
               "memcpy_1thread_fresh_dst_GB/s": round(fresh_bw, 2),
               "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "results": rows}
    text = json.dumps(payload, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
