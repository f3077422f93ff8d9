"""Builds qmoe._C, the CPU kernels in csrc/, as part of installing the package.

`pip install --no-build-isolation -e .` compiles csrc/ against the torch already installed
(no build isolation, so no second torch is pulled). QMOE_SKIP_CPP_BUILD=1 skips the build;
qmoe then serves CPU tensors with its vectorized torch path. Importing qmoe never compiles.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("QMOE_SKIP_CPP_BUILD", "0") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [
        CppExtension(
            "qmoe._C",
            ["csrc/qmoe_cpu.cpp"],
            # -ffp-contract=off: no fused multiply-add, so merges round exactly as the torch
            # path does; -fopenmp: at::parallel_for runs on the OpenMP pool torch uses;
            # -fno-wrapv: undoes Python's -fwrapv, which keeps GCC from vectorizing the
            # indexed row loops (bf16 widening, dot products; python -m benchmarks.bench_cpu).
            extra_compile_args=["-O3", "-ffp-contract=off", "-fopenmp", "-fno-wrapv"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
