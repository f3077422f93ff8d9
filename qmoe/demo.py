"""End-to-end demo: quantize MoE tokens with each recipe, route them, check and time it.

Run with ``python -m qmoe.demo`` (or ``make demo``). It draws random tokens and a random
top-k routing, quantizes the tokens with every recipe, moves the quantized rows into
expert-major order with ``index_select`` on the quantized tensor (data and scales move
together, nothing is dequantized) and prints one row per recipe: accuracy, whether the
moved rows are bit-exact, and timings.
"""

from __future__ import annotations

import argparse
import time

import torch

import qmoe


def _time(fn, iters: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t, h, e, k = a.tokens, a.hidden, a.experts, a.topk

    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    x[:: max(1, t // 16)] *= 64  # a few outlier tokens, as real activations have
    experts = torch.rand(t, e, device=dev).topk(k, dim=1).indices  # (T, K)
    # Expert-major, token-minor order of the T*K routed copies.
    order = torch.sort(experts.reshape(-1) * t + torch.arange(t, device=dev).repeat_interleave(k))
    rows = order.values % t  # source token of each output row

    print(f"qmoe {qmoe.__version__} demo on {dev}: T={t} H={h} E={e} K={k}, "
          f"torch {torch.__version__}")
    hdr = f"{'recipe':<26}{'SQNR dB':>9}{'rows exact':>12}{'quantize ms':>13}{'route ms':>10}"
    print(hdr)
    print("-" * len(hdr))
    recipes = {
        "PerTensor(e4m3)": qmoe.PerTensor(),
        "Blockwise(128, e4m3)": qmoe.Blockwise(),
        "MXFP8(e4m3)": qmoe.MXFP8(),
        "MXFP8(e5m2)": qmoe.MXFP8(torch.float8_e5m2),
    }
    ok = True
    for name, recipe in recipes.items():
        q = qmoe.quantize(x, recipe)
        ref = x.double()
        sqnr = 20 * torch.log10(ref.norm() / (ref - q.dequantize().double()).norm()).item()
        with qmoe.strict_dispatch():  # routing must never dequantize
            routed = q.index_select(0, rows)
        exact = torch.equal(
            routed.qdata.view(torch.uint8), q.qdata.view(torch.uint8)[rows]
        ) and (
            q.block_size is None
            or torch.equal(routed.raw_scale.view(torch.uint8), q.raw_scale.view(torch.uint8)[rows])
        )
        ok &= exact and type(routed) is type(q)
        tq = _time(lambda r=recipe: qmoe.quantize(x, r), a.iters)
        tr = _time(lambda q=q: q.index_select(0, rows), a.iters)
        print(f"{name:<26}{sqnr:>9.2f}{str(exact):>12}{tq:>13.3f}{tr:>10.3f}")
    # The permutation ops on the high-precision tokens: permute -> experts -> unpermute.
    ids = experts
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev)
    out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, t * k)
    perm_exact = torch.equal(out, x[rows])
    y = qmoe.moe_unpermute(out.float() * 2, rid, probs)
    want = 2 * (x.float() * (probs * mask).sum(1, keepdim=True))
    merge_err = ((y - want).abs().max() / want.abs().max()).item()
    tp = _time(lambda: qmoe.moe_permute_with_probs(x, probs, mask, t * k), a.iters)
    tu = _time(lambda: qmoe.moe_unpermute(out, rid, probs), a.iters)
    print(f"moe_permute_with_probs: rows bit-exact {perm_exact}, {tp:.3f} ms; "
          f"moe_unpermute(merging_probs): rel err {merge_err:.1e}, {tu:.3f} ms")
    ok &= perm_exact and merge_err < 1e-5
    print("all checks passed:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
