"""Expert-parallel dispatch + combine: bytes on the wire, and time over Gloo or NCCL.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--out r.json] [--tokens 1024]
    python benchmarks/bench_distributed.py --spawn 2          # same, spawning Gloo ranks here

Per recipe (bf16, blockwise, MX, per-tensor) it reports the bytes one routed row costs on
the wire and the median time of dispatch + combine, split into the permutation ops (permute,
chunk sorts, unpermute) and the rest (the all-to-alls and count exchange), from timing the
same call with the permutation ops alone on the same data.

A script of its own, not a ``python -m benchmarks`` command: it is one process per rank,
started by torchrun (which runs a file: scripts/gpu_multi.sh) or by ``--spawn``, each
joining a process group before it measures anything. Run as a file, it imports nothing from
the ``benchmarks`` package (the directory of the file, not the repository root, is on
``sys.path`` then); its shapes are its options (``--tokens --hidden --experts --topk``), not
the shared config table. ``python -m benchmarks.bench_distributed`` runs it too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import qmoe
from qmoe.distributed import combine, dispatch, wire_bytes_per_row

RECIPES = {"bf16": None, "blockwise128": qmoe.Blockwise(), "mxfp8": qmoe.MXFP8(),
           "pertensor": qmoe.PerTensor()}


def _median(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        dist.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def run(args) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":  # ranks share the cores: one slice each, no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
    local = e // world
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k].to(dev)
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev) * mask
    sizes = mask.sum(0)  # chunk sizes for the stand-in chunk sorts below
    order = torch.arange(e, device=dev).view(world, local).t().reshape(-1)
    n = int(sizes.sum())
    rows = []
    for name, recipe in RECIPES.items():
        inp = x if recipe is None else qmoe.quantize(x, recipe)

        def full(inp=inp):
            ein, _, hd = dispatch(inp, probs, mask, local)
            y = ein.dequantize() if isinstance(ein, qmoe.QuantizedTensor) else ein
            return combine(y, hd)

        # The permutation ops alone on the same shapes (what dispatch/combine run locally).
        def ops_only(inp=inp):
            o, r = qmoe.moe_permute(inp, mask, n)
            s = qmoe.moe_sort_chunks_by_index(o, sizes, order)
            yy = s.dequantize() if isinstance(s, qmoe.QuantizedTensor) else s
            b = qmoe.moe_sort_chunks_by_index(yy, sizes, order)
            return qmoe.moe_unpermute(b, r, probs)

        ms = _median(full, args.iters)
        ms_ops = _median(ops_only, args.iters)
        per_row = wire_bytes_per_row(inp)
        rows.append({
            "recipe": name, "rank": rank, "world": world, "T": t, "H": h, "E": e, "K": k,
            "wire_bytes_per_row": per_row, "wire_bytes_per_token_dispatch": per_row * k,
            "dispatch_combine_ms": round(ms, 3), "permutation_ops_ms": round(ms_ops, 3),
            "permutation_share": round(ms_ops / ms, 3),
        })
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--spawn", type=int, default=0, help="spawn this many Gloo ranks here")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.spawn:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(a.spawn, port, a), nprocs=a.spawn, join=True)
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    _report(run(a), a)
    dist.destroy_process_group()


def _spawned(rank, world, port, a):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    _report(run(a), a)
    dist.destroy_process_group()


def _report(rows, a):
    if dist.get_rank() != 0:
        return
    import triton

    payload = {"bench": "distributed", "backend": dist.get_backend(), "torch": torch.__version__,
               "triton": triton.__version__, "threads_per_rank": torch.get_num_threads(),
               "results": rows}
    text = json.dumps(payload, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    for r in rows:
        print(f"{r['recipe']:>13}: {r['wire_bytes_per_token_dispatch']:6d} B/token on the wire, "
              f"dispatch+combine {r['dispatch_combine_ms']:8.3f} ms, permutation ops "
              f"{r['permutation_ops_ms']:8.3f} ms ({100 * r['permutation_share']:.0f}%)",
              file=sys.stderr)


if __name__ == "__main__":
    main()
