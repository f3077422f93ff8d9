"""qmoe's benchmarks, one command line run from the repository root: ``python -m benchmarks
bench|sweep|profile|table ...`` (``python -m benchmarks --help``; docs/benchmarks.md gives the
command behind each table).

- ``common.py``: the model shapes (``CONFIGS``: dsv3, qwen3, qwen3next, mixtral, gptoss,
  small, ...), the FP8 recipes, and the timing and bandwidth helpers.
- ``bench.py``: the full suites (``bench permute|quantize|compile_fp8``) and ``table``.
- ``sweeps.py``: the tiling sweeps behind qmoe's tuning constants (``sweep ...``).
- ``profiling.py``: kernel and host profiles and drivers for Nsight Compute (``profile ...``).
- ``bench_cpu.py`` and ``bench_distributed.py`` run on their own (their docstrings say why).

Nothing is imported here, so ``python -m benchmarks.bench_cpu`` loads only what it uses.
"""
