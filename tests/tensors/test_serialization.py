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


def test_parameters_and_attributes_survive():
    """A quantized Parameter stays a Parameter through torch.save (weights_only) and
    pickle, user attributes come along, and torch.export's save/load of a module holding
    one works; a non-leaf needing grad pickles (loaded as a leaf), as torch's tensors do."""
    p = torch.nn.Parameter(qmoe.quantize(torch.randn(4, 64), qmoe.Blockwise(32)),
                           requires_grad=False)
    p.tag = "experts.0"
    for out in (_roundtrip(p), pickle.loads(pickle.dumps(p))):
        assert isinstance(out, torch.nn.Parameter) and out.tag == "experts.0"
        assert_same_quantized(out, p)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(qmoe.quantize(torch.randn(16, 64), qmoe.MXFP8()),
                                        requires_grad=False)

        def forward(self, x):
            return x @ self.w.dequantize(torch.float32).t()

    ep = torch.export.export(M(), (torch.randn(3, 64),))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    x = torch.randn(3, 64)
    assert torch.equal(torch.export.load(buf).module()(x), ep.module()(x))
    q = qmoe.quantize(torch.randn(4, 64, requires_grad=True), qmoe.Blockwise())
    assert pickle.loads(pickle.dumps(q)).requires_grad  # a non-leaf pickles, as torch's do


def test_rebuild_quantized_checks_its_arguments():
    from qmoe.tensors.base import rebuild_quantized

    bits = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(TypeError, match="not a qmoe quantized tensor type"):
        rebuild_quantized(torch.nn.Parameter, bits, torch.float8_e4m3fn, torch.tensor(1.0),
                          (torch.float32,), False)
    with pytest.raises(TypeError, match="fp8 dtype"):
        rebuild_quantized(qmoe.Float8Tensor, bits, torch.int8, torch.tensor(1.0),
                          (torch.float32,), False)
