"""Bad input raises a clear ValueError / TypeError naming the argument and the fix.

Two parts: a table in which every public op gets every kind of wrong argument (each case
must raise a message naming the argument, with the inputs left untouched: no partial
write; the kinds are listed in docs/reliability.md), then single cases whose message is
checked word for word (mask values, ids, counts, alignment, hand-made maps, devices).
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


# ---------------------------------------------------------------- single cases
x = torch.randn(6, 8)
mask = torch.zeros(6, 4, dtype=torch.bool)
mask[:, 0] = True
ids = torch.zeros(6, 2, dtype=torch.long)
_rid = qmoe.moe_permute(x, mask)[1]  # [6, 9]: every token to expert 0


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: qmoe.moe_permute(x[0], mask), ValueError, "inp must be 2-d"),
        (lambda: qmoe.moe_permute(x.long(), mask), TypeError, "inp must have dtype"),
        (lambda: qmoe.moe_permute([1.0], mask), TypeError, "inp must be a torch.Tensor"),
        (lambda: qmoe.moe_permute(x, mask[:5]), ValueError, "routing_map has 5 rows"),
        (lambda: qmoe.moe_permute(x, mask.float()), TypeError, "routing_map must have dtype"),
        (lambda: qmoe.moe_permute(x, mask[:, 0]), ValueError, "routing_map must be 2-d"),
        (lambda: qmoe.moe_permute(x, mask, map_type="dense"), ValueError, "map_type"),
        (lambda: qmoe.moe_permute(x, mask, num_out_tokens=-3), ValueError, "num_out_tokens"),
        (lambda: qmoe.moe_permute(x, mask, num_out_tokens=2.0), TypeError, "num_out_tokens"),
        (lambda: qmoe.moe_permute(x, ids + 3, 12), ValueError,
         r"holds values other than 0 and 1; if it holds \[T, K\] expert ids, pass "
         "map_type='index'"),
        (lambda: qmoe.moe_permute(x, ids + 3), ValueError, "map_type='index'"),
        (lambda: qmoe.moe_permute_with_probs(x, torch.rand(6, 2), ids + 3, 12), ValueError,
         "map_type='index'"),
        (lambda: qmoe.moe_permute(x, mask.to(torch.int8) * 2, 12), ValueError,
         "other than 0 and 1"),
        (lambda: qmoe.moe_permute(x, mask.to(torch.int32) - 1, 12), ValueError,
         "other than 0 and 1"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(x, torch.rand(6, 2), ids + 3, None, 4),
         ValueError, r"scatter_\(1, ids, True\)"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(x, torch.rand(6, 2), ids + 3, None, 4,
                                                     num_out_tokens=24),
         ValueError, "other than 0 and 1"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(x, torch.rand(6, 4), mask,
                                                     mask.sum(0).float(), 4),
         TypeError, r"pass tokens_per_expert.long\(\)"),
        (lambda: qmoe.moe_unpermute(x, torch.cat([_rid[:, :-1], _rid[:, -1:] + 9], 1)),
         ValueError, r"^moe_unpermute: row_id_map counts routes outside \[0, 4\]"),
        (lambda: qmoe.moe_unpermute(x, torch.cat([_rid[:, :4], _rid[:, 4:8] + 4, _rid[:, 8:]],
                                                 1), torch.rand(6, 4)),
         ValueError, r"^moe_unpermute: row_id_map names probs columns outside \[0, 4\)"),
        (lambda: qmoe.moe_permute(x, ids - 2, map_type="index"), ValueError, "expert id -2"),
        (lambda: qmoe.moe_permute(x, ids - 2, 4, map_type="index"), ValueError, ">= -1"),
        (lambda: qmoe.moe_permute(x, ids + 5, map_type="index", num_experts=4), ValueError,
         "num_experts=4"),
        (lambda: qmoe.moe_permute(x, ids + 5, 3, map_type="index", num_experts=4), ValueError,
         "num_experts=4"),
        (lambda: qmoe.moe_permute(x, mask, 2**31), ValueError, "row_id_map rows are int32"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(x, torch.rand(6, 4), mask, None, 2**62,
                                                     num_out_tokens=16),
         ValueError, "could pad past 2..31 rows"),
        (lambda: qmoe.moe_permute(x, ids, map_type="index", num_experts=True), TypeError,
         r"num_experts \(or None\) must be an int"),
        (lambda: qmoe.moe_permute_with_probs(x, torch.rand(6, 3), mask), ValueError,
         r"probs must be \[T, E\]"),
        (lambda: qmoe.moe_permute_with_probs(x, torch.rand(6, 4).long(), mask), TypeError,
         "probs must have dtype"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(x, torch.rand(6, 4), mask, None, 0),
         ValueError, "align_size"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(
            x, torch.rand(6, 4), mask, torch.tensor([1, 0, 0, 0]), 4), ValueError,
         "tokens_per_expert does not match"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(
            x, torch.rand(6, 4), mask, torch.tensor([1, 0, 0, 0]), 4, num_out_tokens=40),
         ValueError, "tokens_per_expert does not match"),  # the sync-free form checks too
        (lambda: qmoe.moe_permute_and_pad_with_probs(
            x, torch.rand(6, 4), mask, torch.tensor([6, 0]), 4), ValueError,
         r"tokens_per_expert must be \[E\]"),
        (lambda: qmoe.moe_permute(x, mask, num_experts=5), ValueError,
         "num_experts=5 but the mask routing_map has 4 expert columns"),
        (lambda: qmoe.moe_unpermute(x, torch.zeros(6, 9)), TypeError, "row_id_map must have"),
        (lambda: qmoe.moe_unpermute(x, torch.zeros(6, 8, dtype=torch.int32)), ValueError,
         r"\[T, 2\*S \+ 1\]"),
        (lambda: qmoe.moe_unpermute(x, qmoe.moe_permute(x, mask)[1], torch.rand(6, 2)),
         ValueError, "merging_probs has 2 columns"),
        (lambda: qmoe.moe_unpermute(x, qmoe.moe_permute(x, mask)[1], restore_shape=(5, 8)),
         ValueError, "restore_shape"),
        (lambda: qmoe.moe_unpermute(x, qmoe.moe_permute(x, mask)[1], torch.rand(6, 4),
                                    probs=torch.rand(6, 4)), ValueError, "not both"),
        (lambda: qmoe.moe_unpermute(x, qmoe.moe_permute(x, ids, map_type="index")[1],
                                    map_type="index", pad_offsets=torch.zeros(4)), ValueError,
         "pad_offsets goes with the mask maps"),
        (lambda: qmoe.moe_sort_chunks_by_index(x, torch.tensor([3, 3]), torch.tensor([0])),
         ValueError, "split_sizes and sorted_index"),
        (lambda: qmoe.moe_sort_chunks_by_index_with_probs(
            x, qmoe.quantize(torch.rand(6), qmoe.PerTensor()), torch.tensor([3, 3]),
            torch.tensor([1, 0])), TypeError, "only inp may be quantized"),
        (lambda: qmoe.moe_sort_chunks_by_index_with_probs(
            qmoe.quantize(x, qmoe.PerTensor()), qmoe.quantize(torch.rand(6), qmoe.PerTensor()),
            torch.tensor([3, 3]), torch.tensor([1, 0])), TypeError, "only inp may be quantized"),
        (lambda: qmoe.moe_sort_chunks_by_index(x, torch.tensor([4, 3]), torch.tensor([1, 0])),
         ValueError, "sum to at most"),
        (lambda: qmoe.moe_sort_chunks_by_index(x, torch.tensor([3, 3]), torch.tensor([1, 2])),
         ValueError, "sorted_index entries"),
        (lambda: qmoe.moe_sort_chunks_by_index(x, torch.tensor([-1, 3]), torch.tensor([1, 0])),
         ValueError, "split_sizes must be >= 0"),
        (lambda: qmoe.moe_sort_chunks_by_index(x, torch.tensor([3., 3.]), torch.tensor([1, 0])),
         TypeError, "split_sizes must have dtype"),
        (lambda: qmoe.moe_unpermute(x, qmoe.moe_permute(x, mask)[1],
                                    qmoe.quantize(torch.rand(6, 4), qmoe.PerTensor())),
         TypeError, "merging_probs is a Float8Tensor; only inp may be quantized"),
        (lambda: qmoe.moe_permute(qmoe.quantize(torch.randn(2, 3, 128), qmoe.Blockwise()),
                                  mask), ValueError, "inp must be 2-d"),
        (lambda: qmoe.moe_permute(x, mask, 12, quantize=qmoe.PerTensor(),
                                  quantize_scale=torch.tensor([1.0, 2.0])), ValueError,
         "quantize_scale must be a one-element tensor"),
        (lambda: qmoe.moe_permute(x, mask, 12, quantize=qmoe.PerTensor(),
                                  quantize_scale=torch.tensor(1.0, device="meta")), ValueError,
         "quantize_scale is on meta but inp is on cpu"),
        # clear errors for the calls a fuzz of the public functions found: a float
        # quantize_scale, quantize_scale without quantize=, probs=None, quantized
        # chunk-sort probs, a non-tuple restore_shape, sparse tensors
        (lambda: qmoe.moe_permute(x, mask, 12, quantize=qmoe.PerTensor(), quantize_scale=0.5),
         TypeError, "quantize_scale must be a one-element float tensor, got float"),
        (lambda: qmoe.moe_permute(x, mask, 12, quantize_scale=torch.tensor(0.5)), ValueError,
         "pass quantize=qmoe.PerTensor"),
        (lambda: qmoe.moe_permute_and_pad_with_probs(x, None, mask, None, 4), TypeError,
         "probs is required"),
        (lambda: qmoe.moe_sort_chunks_by_index_with_probs(
            x, None, torch.tensor([6]), torch.tensor([0])), TypeError, "probs is required"),
        (lambda: qmoe.moe_sort_chunks_by_index_with_probs(
            x, qmoe.quantize(torch.rand(6, 1), qmoe.PerTensor()), torch.tensor([6]),
            torch.tensor([0])), TypeError, "probs is a Float8Tensor; only inp may be quantized"),
        (lambda: qmoe.moe_unpermute(x, qmoe.moe_permute(x, mask)[1], restore_shape=6),
         TypeError, "restore_shape must be a"),
        (lambda: qmoe.moe_permute(x.to_sparse(), mask), TypeError, "inp must be a dense"),
        (lambda: qmoe.moe_permute(x, mask.to_sparse()), TypeError, "routing_map must be a dense"),
        # a hand-made map naming row 0 twice: the forward would sum, the backward keep one
        (lambda: qmoe.moe_unpermute(x[:1], torch.tensor([[0, 0, 0, 1, 2]], dtype=torch.int32),
                                    torch.tensor([[0.25, 0.5]])), ValueError,
         "names an output row twice"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wrong_device():
    with pytest.raises(ValueError, match="routing_map is on"):
        qmoe.moe_permute(x.cuda(), mask)
    with pytest.raises(ValueError, match="probs is on"):
        qmoe.moe_permute_with_probs(x.cuda(), torch.rand(6, 4), mask.cuda())
