"""Table-driven bad input: every public op gets every kind of wrong argument.

Each case must raise ValueError or TypeError whose message names the argument, with the
inputs left untouched (no partial write). The kinds are listed in docs/reliability.md.
"""

import pytest
import torch

import qmoe
from tests.tensors.helpers import assert_same_bits

T, H, E, K = 6, 32, 4, 2


def good():
    ids = torch.tensor([[0, 1], [1, 2], [3, -1], [0, 3], [2, 1], [-1, -1]])
    mask = torch.zeros(T, E + 1, dtype=torch.bool).scatter_(1, torch.where(ids >= 0, ids, E),
                                                            True)[:, :E].contiguous()
    x = torch.randn(T, H)
    _, rid = qmoe.moe_permute(x, mask)
    return {"x": x, "ids": ids, "mask": mask, "probs": torch.rand(T, E), "rid": rid,
            "y": torch.randn(int(mask.sum()), H), "sizes": torch.tensor([3, 0, 6]),
            "order": torch.tensor([2, 0, 1]), "p1": torch.rand(int(mask.sum()))}


# name -> (callable taking the kwargs, builder of the good kwargs)
OPS = {
    "moe_permute(mask)": (
        lambda a: qmoe.moe_permute(a["inp"], a["routing_map"], a["num_out_tokens"]),
        lambda g: {"inp": g["x"], "routing_map": g["mask"], "num_out_tokens": 7}),
    "moe_permute(index)": (
        lambda a: qmoe.moe_permute(a["inp"], a["routing_map"], a["num_out_tokens"],
                                   map_type="index", num_experts=a["num_experts"]),
        lambda g: {"inp": g["x"], "routing_map": g["ids"], "num_out_tokens": 7,
                   "num_experts": E}),
    "moe_permute_with_probs": (
        lambda a: qmoe.moe_permute_with_probs(a["inp"], a["probs"], a["routing_map"],
                                              a["num_out_tokens"]),
        lambda g: {"inp": g["x"], "probs": g["probs"], "routing_map": g["mask"],
                   "num_out_tokens": None}),
    "moe_permute_and_pad_with_probs": (
        lambda a: qmoe.moe_permute_and_pad_with_probs(
            a["inp"], a["probs"], a["routing_map"], a["tokens_per_expert"], a["align_size"]),
        lambda g: {"inp": g["x"], "probs": g["probs"], "routing_map": g["mask"],
                   "tokens_per_expert": g["mask"].sum(0), "align_size": 4}),
    "moe_unpermute": (
        lambda a: qmoe.moe_unpermute(a["inp"], a["row_id_map"], a["merging_probs"]),
        lambda g: {"inp": g["y"], "row_id_map": g["rid"], "merging_probs": g["probs"]}),
    "moe_sort_chunks_by_index": (
        lambda a: qmoe.moe_sort_chunks_by_index(a["inp"], a["split_sizes"], a["sorted_index"]),
        lambda g: {"inp": g["y"], "split_sizes": g["sizes"], "sorted_index": g["order"]}),
    "moe_sort_chunks_by_index_with_probs": (
        lambda a: qmoe.moe_sort_chunks_by_index_with_probs(
            a["inp"], a["probs"], a["split_sizes"], a["sorted_index"]),
        lambda g: {"inp": g["y"], "probs": g["p1"], "split_sizes": g["sizes"],
                   "sorted_index": g["order"]}),
}


def _generic(v):
    """Bad values any tensor argument must refuse: (kind, value)."""
    out = [("not a tensor", v.tolist()), ("wrong ndim", v.reshape(-1)[:1].reshape(()) if
                                          v.dim() == 1 else v.reshape(-1)),
           ("wrong device", v.to("meta"))]
    if v.dim() >= 1 and v.shape[0] > 1:
        out.append(("wrong leading size", v[:-1]))
    if v.dtype.is_floating_point:
        out.append(("integer dtype", v.long()))
    else:
        out.append(("float dtype", v.float()))
    return out


def _specific(op, name, g):
    """Value errors particular to an argument of an op."""
    q = qmoe.quantize(g["x"], qmoe.Blockwise())
    p = g["p1"] if op.startswith("moe_sort_chunks") else g["probs"]  # [N] there, [T, E] else
    cases = {
        "probs": [("NaN probs", torch.full_like(p, float("nan"))),
                  ("quantized probs", qmoe.quantize(p[:, None] if p.dim() == 1 else p,
                                                    qmoe.PerTensor()))],
        "merging_probs": [("NaN probs", torch.full_like(g["probs"], float("nan"))),
                          ("wrong column count", g["probs"][:, :3])],
        "num_out_tokens": [("negative count", -5), ("float count", 7.0), ("bool count", True),
                           ("1-d tensor count", torch.tensor([7])),
                           ("float tensor count", torch.tensor(7.0))],
        "num_experts": [("ids >= num_experts", 3), ("zero experts", 0)],
        "routing_map": [("ids below -1", g["ids"] - 3)] if "index" in op else
                       [("probs-shaped float map", g["probs"]),
                        ("expert ids in an integer mask", g["mask"].long() * 3)],
        "tokens_per_expert": [("counts that disagree", g["mask"].sum(0) + 1),
                              ("negative counts", -g["mask"].sum(0))],
        "align_size": [("zero alignment", 0), ("float alignment", 4.0)],
        "split_sizes": [("negative size", torch.tensor([-1, 4, 4])),
                        ("oversized sizes", torch.tensor([30, 0, 4]))],
        "sorted_index": [("index out of range", torch.tensor([3, 0, 1])),
                         ("repeated index", torch.tensor([0, 0, 1]))],
        "row_id_map": [("even width", g["rid"][:, :-1]), ("float map", g["rid"].float())],
    }.get(name, [])
    if name == "inp" and op.startswith("moe_permute"):
        cases.append(("quantized inp, wrong T", q[:-1]))
    return cases


def _cases():
    g = good()
    for op, (_call, build) in OPS.items():
        kw = build(g)
        for name, v in kw.items():
            kinds = _generic(v) if isinstance(v, torch.Tensor) and name != "probs" or (
                isinstance(v, torch.Tensor) and name == "probs") else []
            if name == "inp":
                kinds = [k for k in kinds if k[0] != "integer dtype"] + [("integer dtype",
                                                                          v.long())]
            for kind, bad in kinds + _specific(op, name, g):
                yield op, name, kind, bad


# (op, argument, kind) only: each test draws its inputs after the seed fixture has seeded
# torch, so QMOE_SEED replays them.
CASES = [pytest.param(op, name, kind, id=f"{op}-{name}-{kind}")
         for op, name, kind, _ in _cases()]


@pytest.mark.parametrize("op,name,kind", CASES)
def test_bad_argument_raises_clearly(op, name, kind):
    bad = next(b for o, n, k, b in _cases() if (o, n, k) == (op, name, kind))
    call, build = OPS[op]
    kw = build(good())
    kw[name] = bad
    keep = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)
            and v.device.type != "meta" and not isinstance(v, qmoe.QuantizedTensor)}
    with pytest.raises((ValueError, TypeError)) as info:
        call(kw)
    msg = str(info.value)
    assert name in msg or (name == "inp" and "inp" in msg), msg
    # the refusal is for this kind, not for some other fault of the bad value
    want = {"NaN probs": "NaN", "quantized probs": "only inp may be quantized"}.get(kind)
    assert want is None or want in msg, msg
    assert msg.split(":")[0].strip() in op or msg.startswith(op.split("(")[0]), msg
    for k, v in keep.items():  # nothing was written into the inputs
        assert_same_bits(kw[k], v)


def test_case_count():
    assert len(CASES) >= 80, len(CASES)
