import io

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
