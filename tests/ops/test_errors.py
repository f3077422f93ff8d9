"""Bad input raises a clear ValueError/TypeError naming the argument."""

import pytest
import torch

import qmoe

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
