"""Two source trees of qmoe side by side on one GPU: GPU time, eager host time, call path.

    python scripts/compare_trees.py old=/tmp/qmoe_old new=. [--out compare.json]

Each tree runs in its own process (PYTHONPATH=tree; two versions cannot share the
``qmoe::`` namespace), in alternating rounds so clock drift falls on both alike. Only
public functions are timed, so any two versions compare:

* ``gpu_us``: CUDA-graph replay of 20 calls / 20 (the kernels alone);
* ``host_us``: wall time of 200 eager calls back to back / 200, synchronized at the end
  (host-bound calls show their host cost, GPU-bound ones their GPU time);
* ``step_compiled_bf16``: the step with its forward under ``torch.compile`` (compiled once
  per config; host time as above);
* ``hops``: one eager call of ``moe_permute`` (bf16, FP8 blockwise input, ``quantize=``)
  traced with ``sys.setprofile``: the qmoe files it enters, in order, and the number of
  moves from one qmoe file to another (``files``: distinct files).

Configs (T, H, E, K) as ``benchmarks/common.py``'s: dsv3, qwen3, gptoss, small.
``--cases permute_bf16,step_bf16`` times those cases alone (a short device call; the
compiled step compiles for a minute), ``--rounds`` sets the alternating rounds (3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = {"dsv3": (4096, 7168, 256, 8), "qwen3": (16384, 4096, 128, 8),
           "gptoss": (8192, 2880, 128, 4), "small": (256, 4096, 64, 8)}
ROUNDS = 3
#: the cases ``_cases`` times, in order (``--cases`` picks among them)
CASES = ("permute_bf16", "permute_mask_bf16", "permute_index_bf16", "permute_index_e_bf16",
         "quantize_blockwise", "permute_fp8", "permute_quantize", "unpermute_bf16",
         "unpermute_fp8", "sort_chunks_bf16", "step_bf16", "step_compiled_bf16")


def _cases(cfg):
    import torch

    import qmoe

    t, h, e, k = CONFIGS[cfg]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
    top = torch.randn(t, e, device=dev, generator=g).topk(k, dim=1)
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, top.indices, True)
    probs = torch.zeros(t, e, device=dev).scatter(1, top.indices, top.values.softmax(1))
    ids = top.indices.contiguous()
    n = t * k
    q = qmoe.quantize(x, qmoe.Blockwise())
    rows, rid = qmoe.moe_permute(x, mask, num_out_tokens=n)
    qrows, _ = qmoe.moe_permute(q, mask, num_out_tokens=n)
    sizes = torch.full((32,), n // 32, device=dev, dtype=torch.int64)
    order = torch.randperm(32, device=dev)
    xg = x.clone().requires_grad_(True)
    pg = probs.clone().requires_grad_(True)

    def step():
        out, pp, r = qmoe.moe_permute_with_probs(xg, pg, mask, num_out_tokens=n)
        qmoe.moe_unpermute(out, r, pg).float().sum().backward()

    @torch.compile  # (default mode; the backward runs outside, as in training loops)
    def step_loss(xg, pg):
        out, _, r = qmoe.moe_permute_with_probs(xg, pg, mask, num_out_tokens=n)
        return qmoe.moe_unpermute(out, r, pg).float().sum()

    cases = {
        "permute_bf16": lambda: qmoe.moe_permute_with_probs(x, probs, mask, num_out_tokens=n),
        "permute_mask_bf16": lambda: qmoe.moe_permute(x, mask, num_out_tokens=n),
        "permute_index_bf16": lambda: qmoe.moe_permute(x, ids, n, map_type="index"),
        "permute_index_e_bf16": lambda: qmoe.moe_permute(x, ids, n, map_type="index",
                                                         num_experts=e),
        "quantize_blockwise": lambda: qmoe.quantize(x, qmoe.Blockwise()),
        "permute_fp8": lambda: qmoe.moe_permute(q, mask, num_out_tokens=n),
        "permute_quantize": lambda: qmoe.moe_permute(x, mask, num_out_tokens=n,
                                                     quantize=qmoe.Blockwise()),
        "unpermute_bf16": lambda: qmoe.moe_unpermute(rows, rid, probs),
        "unpermute_fp8": lambda: qmoe.moe_unpermute(qrows, rid, probs),
        "sort_chunks_bf16": lambda: qmoe.moe_sort_chunks_by_index(rows, sizes, order),
        "step_bf16": step,
        "step_compiled_bf16": lambda: step_loss(xg, pg).backward(),
    }
    assert tuple(cases) == CASES, "CASES must name _cases' cases in order"
    return cases


def _time(fn):
    import time

    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu = None
    try:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        gpu = a.elapsed_time(b) * 1000 / 200
    except Exception as err:  # (the step's backward does not capture: host time only)
        gpu = f"no graph: {type(err).__name__}"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    return gpu, (time.perf_counter() - t0) * 1e6 / 200


def _hops(fn, root):
    """``(files in order of entry, moves between qmoe files)`` of one eager call."""
    seq = []

    def prof(frame, event, arg):
        if event == "call":
            f = os.path.abspath(frame.f_code.co_filename)
            if f.startswith(root) and (not seq or seq[-1] != f):
                seq.append(f)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    names = [os.path.relpath(f, root) for f in seq]
    return {"path": names, "hops": max(len(names) - 1, 0), "files": len(set(names))}


def worker(cfgs, picked=None):
    import torch

    import qmoe

    root = os.path.dirname(os.path.abspath(qmoe.__file__))
    out = {}
    for cfg in cfgs:
        for name, fn in _cases(cfg).items():
            if picked and name not in picked:
                continue
            gpu, host = _time(fn)
            out[f"{cfg}/{name}"] = {"gpu_us": gpu, "host_us": host}
    small = _cases("small")
    for name in ("permute_bf16", "permute_fp8", "permute_quantize"):
        out[f"hops/{name}"] = _hops(small[name], root)
    out["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", help="name=path of a source tree holding qmoe/")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    args.cases = ",".join(c.strip() for c in args.cases.split(",") if c.strip())
    unknown = [c for c in args.cases.split(",") if c and c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; the cases are {', '.join(CASES)}")
    runs = {}
    for _ in range(args.rounds):
        for spec in args.trees:
            name, path = spec.split("=", 1)
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            env.pop("TRITON_INTERPRET", None)
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                args.configs, args.cases], env=env, capture_output=True, text=True,
                               cwd=os.path.abspath(path))
            if p.returncode:
                print(p.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{name}: worker failed (rc {p.returncode})")
            runs.setdefault(name, []).append(json.loads(p.stdout.strip().splitlines()[-1]))
    result = {}
    for name, rs in runs.items():  # per key: the best of the rounds (least disturbed)
        merged = {}
        for key in rs[0]:
            if key.startswith("hops/") or key == "env":
                merged[key] = rs[0][key]
                continue
            gpus = [r[key]["gpu_us"] for r in rs if isinstance(r[key]["gpu_us"], float)]
            merged[key] = {"gpu_us": min(gpus) if gpus else rs[0][key]["gpu_us"],
                           "host_us": min(r[key]["host_us"] for r in rs)}
        result[name] = merged
    names = [s.split("=", 1)[0] for s in args.trees]
    print(f"{'case':36s}" + "".join(f"{n + ' gpu':>12s}{n + ' host':>12s}" for n in names))
    for key in result[names[0]]:
        if key.startswith("hops/") or key == "env":
            continue
        row = f"{key:36s}"
        for n in names:
            v = result[n][key]
            g = v["gpu_us"]
            row += f"{g:12.1f}" if isinstance(g, float) else f"{'-':>12s}"
            row += f"{v['host_us']:12.1f}"
        print(row)
    for key in [k for k in result[names[0]] if k.startswith("hops/")]:
        print(key, " | ".join(f"{n}: {result[n][key]['hops']} hops, {result[n][key]['files']} "
                               "files" for n in names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2].split(","), set(filter(None, sys.argv[3].split(",")))
               if len(sys.argv) > 3 else None)
    else:
        main()
