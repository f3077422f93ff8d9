"""CUDA-graph capture of the plain and FP8 permute (sync-free pad form) -> unpermute path,
replayed with new data in the captured buffers."""

import pytest
import torch

import qmoe
from tests.ops.helpers import routing
from tests.tensors.helpers import LAYOUTS, assert_same_quantized

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", ["bf16", *LAYOUTS])
def test_pipeline_graph_replay(name):
    t, h, e, k, align = 256, 512, 16, 4, 16
    bound = t * k + e * align
    recipe = LAYOUTS.get(name)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    mask = routing(t, e, k, "random", "cuda")[1]
    probs = torch.rand(t, e, device="cuda")

    def pipeline():
        q = x if recipe is None else qmoe.quantize(x, recipe)
        out, pp, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(
            q, probs, mask, None, align, num_out_tokens=bound
        )
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
