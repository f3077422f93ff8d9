"""End-to-end demo: a small FP8 MoE block, eager and compiled, against a bf16 reference.

Run with ``python -m qmoe.demo`` (or ``make demo``). For each recipe it quantizes the
tokens, permutes the quantized rows to the experts (``moe_permute_with_probs``: data and
scales move, nothing is dequantized), runs each expert's two matmuls on its rows
(dequantized operands), merges back with the router probs (``moe_unpermute``), and
backpropagates to the tokens and the expert weights. It prints one row per recipe: error
of the output and of the token gradient against the bf16 block, whether the permuted
rows were bit-exact, and eager / ``torch.compile(fullgraph=True)`` step times.
"""

from __future__ import annotations

import argparse
import time

import torch

import qmoe


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_ms(fn, iters: int) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters * 1e3


def moe_block(x, w1, w2, mask, probs, recipe, n_rows: int):
    """x [T, H] -> [T, H]. Expert e's rows are contiguous in the permuted layout; each
    expert's matmuls run on a row mask of its group (fixed shapes, so it compiles)."""
    e = mask.shape[1]
    inp = x if recipe is None else qmoe.quantize(x, recipe)
    out, pp, rid = qmoe.moe_permute_with_probs(inp, probs, mask, n_rows)
    rows = out if recipe is None else out.dequantize()
    counts = mask.sum(0)
    ends = torch.cumsum(counts, 0)
    expert_of_row = torch.searchsorted(ends, torch.arange(n_rows, device=x.device), right=True)
    y = torch.zeros_like(rows)
    for j in range(e):
        sel = (expert_of_row == j).unsqueeze(1).to(rows.dtype)
        y = y + sel * (torch.nn.functional.gelu(rows @ w1[j]) @ w2[j])
    # Side outputs leave detached: a quantized output needing grad would get a quantized
    # tangent guess under compile (docs/tensors.md).
    return qmoe.moe_unpermute(y, rid, probs), out.detach(), pp.detach()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--recipes", default="blockwise,mx,pertensor",
                   help="comma list of blockwise, mx, pertensor (the bf16 row always runs)")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t, h, f, e, k = a.tokens, a.hidden, a.ffn, a.experts, a.topk
    n_rows = t * k
    torch.manual_seed(0)
    x0 = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    x0[:: max(1, t // 16)] *= 32  # a few outlier tokens, as real activations have
    w1 = (torch.randn(e, h, f, device=dev) / h**0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(e, f, h, device=dev) / f**0.5).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(t, e, device=dev)
    top = logits.topk(k, dim=1)
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, top.indices, True)
    probs = torch.zeros(t, e, device=dev).scatter_(1, top.indices, top.values.softmax(1))

    def step(fn, recipe):
        x = x0.clone().requires_grad_()
        y, out, pp = fn(x, w1, w2, mask, probs, recipe, n_rows)
        y.float().square().mean().backward()
        return y.detach(), x.grad, out

    ref_y, ref_dx, _ = step(moe_block, None)
    tok = torch.arange(t, device=dev).repeat_interleave(k)
    order = torch.sort(top.indices.reshape(-1) * t + tok)
    src_rows = order.values % t  # expert-major, token-minor source token of each row

    print(f"qmoe {qmoe.__version__} FP8 MoE block on {dev}: T={t} H={h} F={f} E={e} K={k}, "
          f"torch {torch.__version__}")
    hdr = (f"{'recipe':<22}{'out rel err':>12}{'dx rel err':>12}{'rows exact':>12}"
           f"{'eager ms':>10}{'compiled ms':>13}")
    print(hdr)
    print("-" * len(hdr))
    known = {
        "blockwise": ("Blockwise(128, e4m3)", qmoe.Blockwise()),
        "mx": ("MXFP8(e4m3)", qmoe.MXFP8()),
        "pertensor": ("PerTensor(e4m3)", qmoe.PerTensor()),
    }
    chosen = [r.strip() for r in a.recipes.split(",") if r.strip()]
    if unknown := [r for r in chosen if r not in known]:
        p.error(f"--recipes: unknown {unknown}; choose from {sorted(known)}")
    recipes = {"bf16 (reference)": None, **dict(known[r] for r in chosen)}
    ok = True
    for name, recipe in recipes.items():
        y, dx, out = step(moe_block, recipe)
        err = ((y.float() - ref_y.float()).norm() / ref_y.float().norm()).item()
        derr = ((dx.float() - ref_dx.float()).norm() / ref_dx.float().norm()).item()
        if recipe is None:
            exact = torch.equal(out, x0[src_rows])
        else:
            q = qmoe.quantize(x0, recipe)
            exact = type(out) is type(q) and torch.equal(
                out.qdata.view(torch.uint8), q.qdata.view(torch.uint8)[src_rows]
            )
        # Floors on the error against bf16: 0.1 on the output; 0.2 on dx, where the
        # quantization error of the activations adds up through both GEMMs (MX floor
        # scales, up to one binade coarser, give ~0.1 at these small sizes).
        ok &= exact and err < 0.1 and derr < 0.2
        te = _time_ms(lambda r=recipe: step(moe_block, r), a.iters)
        tc = float("nan")
        if not a.no_compile:
            torch._dynamo.reset()
            compiled = torch.compile(moe_block, fullgraph=True)
            yc, dxc, _ = step(compiled, recipe)
            ok &= bool(torch.allclose(yc.float(), y.float(), rtol=2e-2, atol=2e-2))
            tc = _time_ms(lambda r=recipe, c=compiled: step(c, r), a.iters)
        print(f"{name:<22}{err:>12.2e}{derr:>12.2e}{str(exact):>12}{te:>10.2f}{tc:>13.2f}")
    print("all checks passed:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
