"""Device kernels per call on CUDA, counted with torch.profiler: qmoe's hot paths launch
only qmoe's Triton kernels (no aten glue: fills, casts, index ops) and few of them."""

import inspect

import pytest
import torch
import triton

import qmoe
from benchmarks.profiling import launches
from qmoe.ops import kernels as ops_kernels
from qmoe.ops.tuning import small_index_map
from qmoe.tensors import kernels as tensors_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA kernels")


def _our_kernels() -> set[str]:
    """The names of qmoe's Triton kernels (every JIT function in its kernel modules)."""
    import importlib
    import pkgutil

    names = set()
    for pkg in (ops_kernels, tensors_kernels):
        for info in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for _, obj in inspect.getmembers(mod):
                if isinstance(obj, triton.runtime.JITFunction):
                    names.add(obj.fn.__name__)
    return names


def _routing(t, e, k):
    ids = torch.rand(t, e, device="cuda").argsort(1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    probs = torch.zeros(t, e, device="cuda").scatter(1, ids, torch.rand(t, k, device="cuda"))
    return ids, mask, probs


@pytest.mark.parametrize("t,h,e,k", [(256, 4096, 64, 8), (4096, 512, 256, 8)])
def test_forward_kernel_counts(t, h, e, k):
    """``moe_permute(mask)``: at most 3 (count, scan, move; one at small T), with probs
    too; ``moe_unpermute``: 1; the fused ``quantize=``: at most 3; ``moe_permute(index)``
    with ``num_experts`` at most 3 (fused: count, scan, move; small: map, move), without
    it 2 at a small map; all qmoe kernels."""
    ours = _our_kernels()
    ids, mask, probs = _routing(t, e, k)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    n = t * k
    y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    _, rid = qmoe.moe_permute(x, mask, num_out_tokens=n)
    cases = {
        "moe_permute": (lambda: qmoe.moe_permute(x, mask, num_out_tokens=n), 3),
        "moe_permute_with_probs": (
            lambda: qmoe.moe_permute_with_probs(x, probs, mask, num_out_tokens=n), 3),
        "moe_unpermute": (lambda: qmoe.moe_unpermute(y, rid, probs), 1),
        "quantize=": (lambda: qmoe.moe_permute(x, mask, num_out_tokens=n,
                                               quantize=qmoe.Blockwise()), 3),
        # the ids checked by the map (small) or fused kernel's assert: no aten id check
        "moe_permute(index)": (lambda: qmoe.moe_permute(x, ids, n, map_type="index"),
                               2 if small_index_map(t, k) else None),
        "moe_permute(index, num_experts)": (
            lambda: qmoe.moe_permute(x, ids, n, map_type="index", num_experts=e), 3),
    }
    for name, (fn, most) in cases.items():
        if most is None:  # (a large index map without num_experts: torch's sorts)
            continue
        got = launches(fn)
        assert 1 <= len(got) <= most, (name, got)
        assert set(got) <= ours, (name, sorted(set(got) - ours))


def test_backward_kernel_counts():
    """The backward of ``moe_permute_with_probs``: one launch (the merge of the rows'
    gradient writes the probs' gradient); of ``moe_unpermute(merging_probs)``: at this
    size (below ``MERGE_BACKWARD_FILL_BYTES``) a zero fill of the input gradient (rows no
    token reads stay zero) and the merge backward (both gradients): qmoe kernels and that
    fill only."""
    ours = _our_kernels()
    t, h, e, k = 256, 4096, 64, 8
    _, mask, probs = _routing(t, e, k)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = probs.clone().requires_grad_()
    n = t * k
    out, pp, rid = qmoe.moe_permute_with_probs(x, p, mask, num_out_tokens=n)
    g, gq = torch.randn_like(out), torch.randn_like(pp)
    got = launches(lambda: torch.autograd.grad((out, pp), (x, p), (g, gq),
                                                 retain_graph=True))
    assert len(got) == 1 and set(got) <= ours, got
    y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    merged = qmoe.moe_unpermute(y, rid, p)
    gm = torch.randn_like(merged)
    got = launches(lambda: torch.autograd.grad(merged, (y, p), gm, retain_graph=True))
    glue = [name for name in got if name not in ours]
    assert len(got) <= 2 and len(glue) <= 1, got  # glue: the input gradient's zero fill


@pytest.mark.parametrize("path", ["bf16", "fp8_weights_given", "fp8"])
def test_grouped_mm_forward_kernel_counts(path):
    """``qmoe.grouped_mm`` forward: the offsets check (one qmoe launch), the grouped GEMM
    and the tail zeroing; with FP8 weights quantized in the call, their column quantize
    too. Every other kernel is torch's grouped GEMM (its problem-setup kernel and the
    CUTLASS GEMM): no aten glue."""
    if torch.cuda.get_device_capability()[0] != 9 and path != "bf16":
        pytest.skip("the FP8 grouped GEMM runs on compute capability 9.x")
    ours = _our_kernels()
    e, k, m, n = 8, 512, 256, 1000
    counts = torch.full((e,), n // e - 3, dtype=torch.int64, device="cuda")
    offsets = torch.cumsum(counts, 0).to(torch.int32)  # a tail past the last group
    w = torch.randn(e, k, m, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if path != "bf16":
        rows = qmoe.quantize(rows, qmoe.RowWise())
    wq = qmoe.quantize_expert_weights(w) if path == "fp8_weights_given" else None
    got = launches(lambda: qmoe.grouped_mm(rows, w, offsets, weight_fp8=wq))
    mine = [name for name in got if name in ours]
    want = {"check_offsets_kernel", "zero_tail_kernel"} | (
        {"quantize_cols_kernel"} if path == "fp8" else set())
    assert set(mine) == want and len(mine) == len(want), got
    gemm = [name for name in got if name not in ours]
    assert 1 <= len(gemm) <= 2, got
    assert all("gemm" in name.lower() or "cutlass" in name.lower() for name in gemm), got
