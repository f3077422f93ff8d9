"""The main job: train a ``qmoe.nn.MoE`` layer in bf16 and in each FP8 recipe, side by side.

Run with ``make demo`` (or ``python -m qmoe.demo``). Every recipe starts from the same
weights and sees the same batches: a regression of a fixed random SwiGLU network (the
teacher) by a residual MoE layer (the student), AdamW on fp32 master weights, the loss
normalized by the target's variance plus a small load-balancing loss. On a Hopper GPU the
``RowWise`` and ``PerTensor`` recipes run FP8 expert GEMMs; elsewhere (CPU, other recipes)
FP8 rows are dequantized into bf16 grouped GEMMs.

It prints the loss curves as a table, the step times, and a verdict: every FP8 recipe's
final loss (mean of the last tenth of the steps) within ``--tolerance`` (relative) of
bf16's, and bf16's below ``LEARNED`` of its first loss. With matplotlib installed
(``make demo`` installs it) the curves also go to a PNG.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import qmoe
from qmoe.nn import MoE, load_balancing_loss
from qmoe.ops.grouped_mm import fp8_gemm_runs

RECIPES = {
    "rowwise": ("RowWise(e4m3)", qmoe.RowWise()),
    "pertensor": ("PerTensor(e4m3)", qmoe.PerTensor()),
    "blockwise": ("Blockwise(128, e4m3)", qmoe.Blockwise()),
    "mx": ("MXFP8(e4m3)", qmoe.MXFP8()),
}
AUX_WEIGHT = 1e-2  # load-balancing loss weight (Switch Transformer's order of magnitude)
LEARNED = 0.75  # bf16's final loss must fall below this share of its first (it learns)
TEACHER_FFN = 16  # the target network's width: narrow, so a few hundred steps fit it well


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


class Teacher(torch.nn.Module):
    """The fixed target: a random SwiGLU MLP, ``x [T, H] -> [T, H]``."""

    def __init__(self, h: int, f: int, dev: str):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(1234)
        self.w1 = (torch.randn(h, 2 * f, generator=g) * h**-0.5).to(dev)
        self.w2 = (torch.randn(f, h, generator=g) * f**-0.5).to(dev)

    @torch.no_grad()
    def forward(self, x):
        a, b = (x.float() @ self.w1).chunk(2, dim=-1)
        return (F.silu(a) * b) @ self.w2


def train(recipe, a, dev: str, teacher: Teacher) -> tuple[list[float], float]:
    """Losses per step and the mean step time (ms) of one recipe."""
    torch.manual_seed(0)  # the same initial weights for every recipe
    layer = MoE(a.hidden, a.ffn, a.experts, a.topk, recipe, device=dev,
                capacity_factor=a.capacity_factor)
    opt = torch.optim.AdamW(layer.parameters(), lr=a.lr, weight_decay=0.0)
    fwd = torch.compile(layer, fullgraph=True) if a.compile else layer
    data = torch.Generator(device=dev).manual_seed(99)  # the same batches too
    losses, times = [], []
    for step in range(a.steps):
        x = torch.randn(a.tokens, a.hidden, device=dev, generator=data).bfloat16()
        target = teacher(x)
        _sync(dev)
        t0 = time.perf_counter()
        out, routing = fwd(x)
        y = x.float() + out.float()  # residual
        loss = F.mse_loss(y, target + x.float()) / target.var()
        (loss + AUX_WEIGHT * load_balancing_loss(routing.routing())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        if step >= min(5, a.steps // 2):  # warm-up (and compile) steps are not timed
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, 1e3 * sum(times) / max(len(times), 1)


def _plot(path: str, curves: dict[str, list[float]], title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib, or make demo)"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss / var(target)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"loss curves saved to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="per-expert capacity (default: dropless)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma list of {', '.join(RECIPES)} (bf16 always runs)")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="largest relative gap of an FP8 final loss to bf16's")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile(layer, fullgraph=True)")
    p.add_argument("--plot", default="moe_loss.png", help="PNG path ('' for none)")
    a = p.parse_args(argv)
    chosen = [r.strip() for r in a.recipes.split(",") if r.strip()]
    if unknown := [r for r in chosen if r not in RECIPES]:
        p.error(f"--recipes: unknown {unknown}; choose from {sorted(RECIPES)}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    runs = {"bf16": None, **dict(RECIPES[r] for r in chosen)}
    title = (f"qmoe {qmoe.__version__} MoE on {dev}: T={a.tokens} H={a.hidden} F={a.ffn} "
             f"E={a.experts} K={a.topk}, {a.steps} steps, torch {torch.__version__}")
    print(title)
    teacher = Teacher(a.hidden, TEACHER_FFN, dev)
    curves, ms = {}, {}
    for name, recipe in runs.items():
        curves[name], ms[name] = train(recipe, a, dev, teacher)
        h, f = a.hidden, a.ffn
        fp8 = [recipe is not None and fp8_gemm_runs(recipe, dev, *km)
               for km in ((h, 2 * f), (f, h))]  # gate-up, down
        name_gemm = {(True, True): "FP8 GEMMs", (True, False): "FP8 gate-up, bf16 down",
                     (False, True): "bf16 gate-up, FP8 down"}.get(tuple(fp8), "bf16 GEMMs")
        print(f"  trained {name:<22} {ms[name]:8.2f} ms/step ({name_gemm})", flush=True)
    names = list(curves)
    head = f"{'step':>6}" + "".join(f"{n[:20]:>22}" for n in names)
    print(head)
    print("-" * len(head))
    every = max(1, a.steps // 10)
    for s in sorted(set(range(0, a.steps, every)) | {a.steps - 1}):
        print(f"{s + 1:>6}" + "".join(f"{curves[n][s]:>22.4f}" for n in names))
    tail = max(1, a.steps // 10)
    final = {n: sum(c[-tail:]) / tail for n, c in curves.items()}
    ref = final["bf16"]
    print(f"final loss (mean of the last {tail} steps), against bf16's {ref:.4f}:")
    first = curves["bf16"][0]
    ok = ref < LEARNED * first
    print(f"  bf16 learned: {ref:.4f} from {first:.4f} "
          f"({'ok' if ok else 'FAIL'}: below {LEARNED} of the first step's)")
    for n in names[1:]:
        gap = abs(final[n] - ref) / ref
        good = gap <= a.tolerance
        ok &= good
        print(f"  {n:<22} {final[n]:.4f}  gap {100 * gap:5.1f}%  "
              f"{'ok' if good else 'FAIL'} (tolerance {100 * a.tolerance:.0f}%)")
    if a.plot:
        print(_plot(a.plot, curves, title))
    print("PASS: FP8 training matches bf16" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
