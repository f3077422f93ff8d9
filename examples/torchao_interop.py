"""torchao's MXFP8 tokens through qmoe's permutation, into torchao's MXFP8 grouped mm.

    python examples/torchao_interop.py      (CPU; needs the torchao extra)
"""

import torch
from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.quantization.quantize_.common import KernelPreference

import qmoe

T, H, N, E, K = 256, 128, 64, 8, 2
x = torch.randn(T, H, dtype=torch.bfloat16)
logits = torch.randn(T, E)
top = logits.topk(K, dim=1)
mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top.indices, True)
probs = torch.zeros(T, E).scatter_(1, top.indices, top.values.softmax(dim=1))
w = torch.randn(E, N, H, dtype=torch.bfloat16) / H**0.5

q = MXTensor.to_mx(x, torch.float8_e4m3fn, 32)  # torchao quantizes: [T, H] fp8 + [T, H/32] e8m0
bound = T * K + E * 32  # sync-free: a fixed upper bound on the padded rows
out, pp, rid, _, target = qmoe.moe_permute_and_pad_with_probs(
    q, probs, mask, None, 32, num_out_tokens=bound)  # groups padded to 32 rows, no host sync
print(type(out).__name__, tuple(out.shape), "scale", tuple(out.scale.shape), out.scale.dtype)

offs = torch.cumsum(target, 0).to(torch.int32)
offs[-1] = bound  # the spare (zero) rows join the last group
y = _to_mxfp8_then_scaled_grouped_mm(out, w.transpose(-2, -1), offs=offs,
                                     kernel_preference=KernelPreference.EMULATED,
                                     wgrad_with_hp=True)
z = qmoe.moe_unpermute(y, rid, probs)  # [T, N] bf16, fp32 accumulation

ref = sum(probs[:, e, None] * (x.float() @ w[e].float().T) for e in range(E))
sqnr = 20 * torch.log10(ref.norm() / (ref - z.float()).norm())
print(f"MXFP8 expert block vs fp32 math on bf16 inputs: SQNR {sqnr:.1f} dB")

qq = qmoe.from_torchao(q)  # the same bytes as a qmoe MXFP8Tensor
print(type(qq).__name__, qq.qdata.data_ptr() == q.qdata.data_ptr())
assert sqnr > 25
