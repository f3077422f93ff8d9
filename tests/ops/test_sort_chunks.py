import pytest
import torch

import qmoe
from qmoe.ops import reference as R
from tests.tensors.helpers import assert_same_bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("t,h,c", [(1, 1, 1), (63, 17, 5), (1025, 64, 16), (100, 7168, 3)])
@pytest.mark.parametrize("tail", [0, 9])
def test_sort_chunks_matches_reference(t, h, c, tail):
    x = torch.randn(t + tail, h, dtype=torch.bfloat16, device=DEV)
    cuts = torch.sort(torch.randint(0, t + 1, (c - 1,))).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([t])]))
    order = torch.randperm(c)
    probs = torch.rand(t + tail, device=DEV)
    out, pp = qmoe.moe_sort_chunks_by_index_with_probs(x, probs, sizes.to(DEV), order.to(DEV))
    ref, rpp = R.sort_chunks(x.cpu(), sizes.tolist(), order.tolist(), probs.cpu())
    assert_same_bits(out.cpu(), ref)
    assert_same_bits(pp.cpu(), rpp)
    out2 = qmoe.moe_sort_chunks_by_index(x, sizes.to(DEV), order.to(DEV))
    assert_same_bits(out2, out)


def test_sort_then_inverse_is_identity():
    t = 96
    x = torch.randn(t, 32, device=DEV)
    sizes = torch.tensor([10, 0, 30, 6, 40, 10], device=DEV)
    order = torch.tensor([2, 5, 0, 1, 4, 3], device=DEV)
    y = qmoe.moe_sort_chunks_by_index(x, sizes, order)
    inv = torch.argsort(order)
    back = qmoe.moe_sort_chunks_by_index(y, sizes[order], inv)
    assert torch.equal(back, x)


def test_empty():
    x = torch.randn(0, 8, device=DEV)
    e = torch.zeros(0, dtype=torch.long, device=DEV)
    assert qmoe.moe_sort_chunks_by_index(x, e, e).shape == (0, 8)
    z = torch.zeros(3, dtype=torch.long, device=DEV)
    assert qmoe.moe_sort_chunks_by_index(x, z, torch.arange(3, device=DEV)).shape == (0, 8)
