"""Does AOTInductor (CPU) load a package holding a Python-defined custom op? (probe)"""
import sys
import tempfile

import torch

lib = torch.library.Library("aoti_probe", "DEF")
lib.define("twice(Tensor x) -> Tensor")
lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
torch.library.register_fake("aoti_probe::twice", lambda x: torch.empty_like(x))


class M(torch.nn.Module):
    def forward(self, x):
        return torch.ops.aoti_probe.twice(x) + 1


x = torch.randn(4)
ep = torch.export.export(M(), (x,))
with tempfile.TemporaryDirectory() as d:
    p = torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/m.pt2")
    print("compiled", flush=True)
    loaded = torch._inductor.aoti_load_package(p)
    print("loaded", flush=True)
    print("equal", torch.equal(loaded(x), x * 2 + 1), torch.__version__, flush=True)
sys.exit(0)
