"""GPU reliability runs for docs/reliability.md (issue 8), JSON out.

    python scripts/gpu_reliability.py --out rel.json [--part streams,scale,determinism,small]
    compute-sanitizer --tool memcheck python scripts/gpu_reliability.py --part sanitize

Parts: ``streams`` (2 and 4 pipelines on their own streams, plain and FP8, many rounds,
each result against its single-stream reference), ``scale`` (N*H >= 2**31 rows checked on
samples), ``small`` (T=1, E=1024), ``determinism`` (outputs and gradients, incl. probs
gradients, hashed: run twice, in two processes, and compare), ``sanitize`` (every op once
on small awkward inputs, for compute-sanitizer; includes num_out_tokens < routed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

import qmoe
from qmoe.ops import reference as R

DEV = "cuda"


def routing(t, e, k, g=None):
    ids = torch.rand(t, e, device=DEV, generator=g).argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device=DEV).scatter_(1, ids, True)
    return ids, mask


def pipeline(x, mask, probs, n, recipe):
    inp = x if recipe is None else qmoe.quantize(x, recipe)
    out, pp, rid = qmoe.moe_permute_with_probs(inp, probs, mask, n)
    rows = out if recipe is None else out.dequantize(torch.bfloat16)
    y = qmoe.moe_unpermute(rows * pp[:, None].to(rows.dtype), rid, probs)
    return out, y


def flat(out):
    return [out] if not isinstance(out, qmoe.QuantizedTensor) else [out.qdata, out.raw_scale]


def streams(rounds: int) -> dict:
    res = {}
    t, h, e, k = 2048, 2048, 64, 6
    for npipe in (2, 4):
        for recipe_name, recipe in (("bf16", None), ("blockwise", qmoe.Blockwise()),
                                    ("mxfp8", qmoe.MXFP8())):
            jobs = []
            for j in range(npipe):
                _, mask = routing(t, e, k)
                x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
                probs = torch.rand(t, e, device=DEV)
                n = t * k - 100 * j  # different drop counts per pipeline
                jobs.append((x, mask, probs, n, pipeline(x, mask, probs, n, recipe)))
            ss = [torch.cuda.Stream() for _ in jobs]
            bad = 0
            for _ in range(rounds):
                outs = []
                for s, (x, mask, probs, n, _) in zip(ss, jobs):
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        outs.append(pipeline(x, mask, probs, n, recipe))
                torch.cuda.synchronize()
                for (o, y), job in zip(outs, jobs):
                    wo, wy = job[4]
                    same = all(torch.equal(a, b) for a, b in zip(flat(o), flat(wo)))
                    bad += int(not (same and torch.equal(y, wy)))
            res[f"{npipe}x-{recipe_name}"] = {"rounds": rounds, "results": rounds * npipe,
                                              "mismatches": bad}
            print("streams", npipe, recipe_name, "mismatches", bad, flush=True)
    return res


def scale() -> dict:
    t, h, e, k = 40000, 7168, 256, 8
    n = t * k
    assert n * h >= 2**31
    g = torch.Generator(device=DEV).manual_seed(0)
    ids, mask = routing(t, e, k, g)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=g)
    out, rid = qmoe.moe_permute(x, mask, n)
    s = (rid.shape[1] - 1) // 2
    sample = torch.randint(0, t, (2000,), device=DEV, generator=g)
    rows = rid[sample, :s]
    ok_fwd = True
    for j in range(s):
        r = rows[:, j]
        v = r >= 0
        ok_fwd &= bool(torch.equal(out[r[v].long()], x[sample[v]]))
    last = rid[:, :s].max()  # the highest row, whose offset passes 2**31 elements
    top_tok = (rid[:, :s] == last).any(1).nonzero()[0, 0]
    ok_fwd &= bool(torch.equal(out[last.long()], x[top_tok]))
    w = torch.rand(t, e, device=DEV)
    y = qmoe.moe_unpermute(out, rid, w)
    ref = torch.zeros(sample.numel(), h, dtype=torch.float64, device=DEV)
    for j in range(s):
        r = rows[:, j]
        v = (r >= 0)
        col = rid[sample, s + j].clamp(min=0).long()
        term = out[r.clamp(min=0).long()].double() * w[sample, col].double()[:, None]
        ref += torch.where(v[:, None], term, 0)
    err = (y[sample].double() - ref).abs().max().item()
    res = {"T": t, "H": h, "E": e, "K": k, "N_times_H": n * h, "forward_rows_equal": ok_fwd,
           "highest_row": int(last), "merge_max_abs_err_vs_fp64": err,
           "merge_tol_bf16_out": "0.5 ulp of bf16 + fp32 accumulation"}
    ok_merge = bool(((y[sample].double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all())
    res["merge_within_bf16_rounding"] = ok_merge
    print("scale", res, flush=True)
    del out, y
    torch.cuda.empty_cache()
    return res


def small() -> dict:
    res = {}
    for t, h, e, k in ((1, 7168, 256, 8), (1, 1, 1, 1), (4096, 256, 1024, 8), (3, 17, 1024, 2)):
        _, mask = routing(t, e, k)
        x = torch.randn(t, h, device=DEV)
        probs = torch.rand(t, e, device=DEV)
        out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, t * k)
        want, pw, _ = R.permute(x.cpu(), mask.cpu(), "mask", t * k, probs.cpu())
        y = qmoe.moe_unpermute(out, rid, probs)
        ref = R.unpermute(out.cpu(), mask.cpu(), "mask", probs.cpu(), t * k)
        ok = (torch.equal(out.cpu(), want) and torch.equal(pp.cpu(), pw)
              and torch.allclose(y.cpu().double(), ref, rtol=1e-6, atol=1e-6))
        res[f"T{t}-H{h}-E{e}-K{k}"] = ok
        print("small", t, h, e, k, ok, flush=True)
    return res


def determinism() -> dict:
    g = torch.Generator(device=DEV).manual_seed(1234)
    t, h, e, k = 4096, 1024, 128, 8
    _, mask = routing(t, e, k, g)
    x0 = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=g)
    p0 = torch.rand(t, e, device=DEV, generator=g)
    digests = []
    for _ in range(3):
        x = x0.clone().requires_grad_()
        p = p0.clone().requires_grad_()
        out, pp, rid = qmoe.moe_permute_with_probs(x, p, mask, t * k - 500)
        y = qmoe.moe_unpermute(out * pp[:, None].to(out.dtype), rid, p)
        (y.float().square().sum() + pp.square().sum()).backward()
        hsh = hashlib.sha256()
        for v in (out, pp, y, x.grad, p.grad):
            hsh.update(v.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        digests.append(hsh.hexdigest())
    res = {"runs": len(digests), "identical": len(set(digests)) == 1, "sha256": digests[0]}
    print("determinism", res, flush=True)
    return res


def sanitize() -> dict:
    """Every op once, small awkward shapes, dropping and padding; FP8 layouts and the fused
    quantize-and-permute too."""
    count = 0
    for t, h, e, k in ((1, 17, 4, 2), (63, 130, 8, 3), (257, 256, 32, 4)):
        ids, mask = routing(t, e, k)
        ids = torch.where(torch.rand(t, k, device=DEV) < 0.2, -1, ids)
        mask = torch.zeros(t, e + 1, dtype=torch.bool, device=DEV).scatter_(
            1, torch.where(ids >= 0, ids, e), True)[:, :e].contiguous()
        routed = int(mask.sum())
        for recipe in (None, qmoe.PerTensor(), qmoe.Blockwise(), qmoe.MXFP8()):
            if recipe is not None and h % 32:
                continue
            x = torch.randn(t, h, device=DEV, requires_grad=recipe is None)
            inp = x if recipe is None else qmoe.quantize(x.detach(), recipe)
            probs = torch.rand(t, e, device=DEV)
            for n in (routed, routed // 2, routed + 7):  # routed // 2: the TE overflow case
                out, pp, rid = qmoe.moe_permute_with_probs(inp, probs, mask, n)
                oi, ri = qmoe.moe_permute(inp, ids, n, map_type="index")
                y = qmoe.moe_unpermute(out, rid, probs)
                qmoe.moe_unpermute(oi, ri, probs.gather(1, ids.clamp(min=0)), map_type="index")
                if recipe is None:
                    y.sum().backward()
                else:  # the fused quantize-and-permute kernel, plain and padded
                    qmoe.moe_permute_with_probs(x.detach(), probs, mask, n, quantize=recipe)
                    qmoe.moe_permute_and_pad_with_probs(x.detach(), probs, mask, None, 16,
                                                        num_out_tokens=n + e * 16,
                                                        quantize=recipe)
                po, pp2, prid, _, _ = qmoe.moe_permute_and_pad_with_probs(
                    inp, probs, mask, None, 16, num_out_tokens=n + e * 16)
                qmoe.moe_unpermute(po, prid, probs)
                sizes = torch.tensor([n // 3, 0, n - n // 3], device=DEV)
                qmoe.moe_sort_chunks_by_index_with_probs(out, pp, sizes,
                                                         torch.tensor([2, 0, 1], device=DEV))
                count += 1
    torch.cuda.synchronize()
    print("sanitize cases", count, flush=True)
    return {"cases": count}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--part", default="streams,scale,small,determinism")
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args()
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for part in a.part.split(","):
        t0 = time.time()
        res[part] = streams(a.rounds) if part == "streams" else globals()[part]()
        res[part + "_s"] = round(time.time() - t0, 1)
    text = json.dumps(res, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
