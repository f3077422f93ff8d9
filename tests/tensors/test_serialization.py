import io
import pickle

import pytest
import torch

import qmoe
from tests.tensors.helpers import RECIPES, assert_same_quantized


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", list(RECIPES))
def test_save_load_weights_only(name):
    q = qmoe.quantize(torch.randn(5, 129, dtype=torch.bfloat16), RECIPES[name])
    out = _roundtrip(q)
    assert_same_quantized(out, q)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.equal(out.dequantize(), q.dequantize())


def test_state_dict_of_mixed_types():
    x = torch.randn(3, 256)
    sd = {n: qmoe.quantize(x, r) for n, r in RECIPES.items()}
    sd["plain"] = x
    out = _roundtrip(sd)
    for n in RECIPES:
        assert_same_quantized(out[n], sd[n])
    assert torch.equal(out["plain"], x)


@pytest.mark.parametrize("name", list(RECIPES))
def test_pickle_roundtrip(name):
    """Plain pickle (multiprocessing, Ray): torch 2.13 cannot load fp8 storages it pickled
    itself; our types travel with their bits as uint8."""
    x = torch.randn(5, 129, dtype=torch.bfloat16)
    q = qmoe.quantize(x, RECIPES[name])
    for obj in (q, q[1:4], q.detach().requires_grad_()):
        out = pickle.loads(pickle.dumps(obj))
        assert_same_quantized(out, obj)
        assert out.requires_grad == obj.requires_grad and out.dtype == obj.dtype


def test_views_share_storage_through_save():
    q = qmoe.quantize(torch.randn(6, 256), qmoe.Blockwise())
    out = _roundtrip({"q": q, "v": q[2:]})
    assert_same_quantized(out["v"], q[2:])
    ptr = [out[k].qdata.untyped_storage().data_ptr() for k in ("q", "v")]
    assert ptr[0] == ptr[1]


class _TorchReduction:
    """Pickles ``q`` the way torch's own Tensor reduction did before ``__reduce_ex__``."""

    def __init__(self, q):
        self.q = q

    def __reduce__(self):
        return torch.Tensor.__reduce_ex__(self.q, 2)


@pytest.mark.parametrize("name", ["pertensor-e4m3", "blockwise-e5m2", "mx-e4m3"])
def test_files_of_torchs_own_reduction_still_load(name):
    q = qmoe.quantize(torch.randn(5, 129), RECIPES[name])
    assert_same_quantized(_roundtrip(_TorchReduction(q)), q)
