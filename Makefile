# The two commands the README promises: `make demo` and `make test`.
# Both install what they need: torch==2.13.0 first when torch is missing (never a bare
# `torch`, which would pull a multi-GB CUDA build), then qmoe itself, compiling csrc/ against
# that torch (QMOE_SKIP_CPP_BUILD=1 skips the C++ build; the torch CPU path then serves).
PY ?= python3

.PHONY: setup demo test lint bench sm90-triton36

setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@# setuptools >= 70.1 builds editable wheels without the separate `wheel` package (a new
	@# venv of Python 3.11 ships 65.5, which fails with "invalid command 'bdist_wheel'").
	@$(PY) -c "import setuptools as s, sys; sys.exit(tuple(map(int, s.__version__.split('.')[:2])) < (70, 1))" 2>/dev/null \
		|| $(PY) -m pip install -q "setuptools>=70.1"
	@if [ "$${QMOE_SKIP_CPP_BUILD:-0}" = 1 ]; then rm -f qmoe/_C*.so; fi
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"

# matplotlib (the `demo` extra) draws the loss curves; the demo runs without it too
demo: setup
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.7"
	$(PY) -m qmoe.demo

# Triton kernels run through the interpreter on machines without a GPU. TEST_WORKERS pytest
# processes share the tests (pytest-xdist; CI's machine has two cores; 0: one process).
TEST_WORKERS ?= 2
test: setup
	@if $(PY) -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then \
		export TRITON_INTERPRET=1; fi; \
	$(PY) -m pytest tests -n $(TEST_WORKERS) --durations=25

lint:
	$(PY) -m pip install -q ruff import-linter
	$(PY) -m ruff check qmoe tests benchmarks scripts
	lint-imports

bench: setup
	$(PY) -m benchmarks bench quantize

# Every Triton kernel variant compiled for sm_90 with the GPU machine's Triton (3.6), which
# goes into .triton36/ beside this machine's own (tests/ops/test_sm90_compile.py's main).
# Needs qmoe importable (`make setup` first; CI has run it).
TRITON_GPU ?= 3.6.0
sm90-triton36:
	@test -d .triton36/triton-$(TRITON_GPU).dist-info \
		|| $(PY) -m pip install -q --no-deps --upgrade --target .triton36 "triton==$(TRITON_GPU)"
	env -u TRITON_INTERPRET CUDA_VISIBLE_DEVICES= PYTHONPATH="$(CURDIR)/.triton36" $(PY) -c \
		"import triton; assert triton.__version__ == '$(TRITON_GPU)', triton.__version__; \
		from tests.ops.test_sm90_compile import main; main()"
