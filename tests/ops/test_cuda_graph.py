"""CUDA-graph capture of the plain and FP8 permute (sync-free pad form) -> unpermute path,
FP8 by quantize then permute or by the fused ``quantize=``, replayed with new data in the
captured buffers."""

import pytest
import torch

import qmoe
from tests.ops.helpers import routing
from tests.tensors.helpers import LAYOUTS, assert_same_quantized

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# (rows, fused: quantize= in the permute, K): K = 8 makes N >= 6T, where the fused path
# builds the map inside its launch (qmoe::quantize_permute_mask)
CASES = [("bf16", False, 4), *((n, False, 4) for n in LAYOUTS),
         *((n, True, k) for n in LAYOUTS for k in (4, 8))]


@pytest.mark.parametrize("name,fused,k", CASES)
def test_pipeline_graph_replay(name, fused, k):
    t, h, e, align = 256, 512, 16, 16
    bound = t * k + e * align
    recipe = LAYOUTS.get(name)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    mask = routing(t, e, k, "random", "cuda")[1]
    probs = torch.rand(t, e, device="cuda")

    def pipeline():
        q = x if recipe is None or fused else qmoe.quantize(x, recipe)
        out, pp, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(
            q, probs, mask, None, align, num_out_tokens=bound,
            quantize=recipe if fused else None)
        return out, qmoe.moe_unpermute(out, rid, probs)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pipeline()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out, g_y = pipeline()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        mask.copy_(routing(t, e, k, "random", "cuda")[1])
        probs.copy_(torch.rand_like(probs))
        g.replay()
        torch.cuda.synchronize()
        want_out, want_y = pipeline()
        if recipe is None:
            assert torch.equal(g_out, want_out)
        else:
            assert_same_quantized(g_out, want_out)
        assert torch.equal(g_y, want_y)
