"""Two permutation pipelines on two CUDA streams do not interfere (no shared workspace)."""

import pytest
import torch

import qmoe
from tests.ops.helpers import routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_two_streams_many_times():
    t, h, e, k = 2048, 1024, 64, 4
    jobs = []
    for _ in range(2):
        ids, mask = routing(t, e, k, "random", "cuda")
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(t, e, device="cuda")
        out, rid = qmoe.moe_permute(x, mask, t * k)
        want = (out, qmoe.moe_unpermute(out, rid, w))
        jobs.append((x, mask, w, want))
    streams = [torch.cuda.Stream() for _ in jobs]
    for _ in range(20):
        results = []
        for s, (x, mask, w, _) in zip(streams, jobs):
            with torch.cuda.stream(s):
                out, rid = qmoe.moe_permute(x, mask, t * k)
                results.append((out, qmoe.moe_unpermute(out, rid, w)))
        torch.cuda.synchronize()
        for (out, y), (_, _, _, (w_out, w_y)) in zip(results, jobs):
            assert torch.equal(out, w_out) and torch.equal(y, w_y)
