"""The benchmark and GPU scripts call qmoe's internals (launchers with tiling keywords,
map builders); they run only on a GPU, where device time is scarce. Check on any machine
that every name they import from qmoe exists and that every call of such a function
passes keywords and positional counts its signature takes."""

import ast
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


def _imported(tree: ast.AST) -> dict[str, object]:
    """Local name -> object for each ``import qmoe...`` and ``from qmoe... import name``
    (submodules included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "qmoe":
                    mod = importlib.import_module(a.name)
                    root = importlib.import_module("qmoe")  # ``import qmoe.x`` binds qmoe
                    names[a.asname or "qmoe"] = mod if a.asname else root
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qmoe"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                if hasattr(mod, a.name):
                    obj = getattr(mod, a.name)
                else:  # a submodule not yet imported as an attribute
                    obj = importlib.import_module(f"{node.module}.{a.name}")
                names[a.asname or a.name] = obj
    return names


def _resolve(func: ast.expr, names: dict[str, object]):
    """The qmoe object a call's ``func`` names (``f``, ``mod.f``, ``kernel[grid]``), or
    None when it is not one of qmoe's; AttributeError when qmoe lacks the attribute."""
    if isinstance(func, ast.Subscript):  # a Triton launch: kernel[grid](...)
        func = func.value
    if isinstance(func, ast.Name):
        return names.get(func.id)
    if isinstance(func, ast.Attribute):
        base = _resolve(func.value, names)
        if base is None or not inspect.ismodule(base):
            return None  # attributes of qmoe objects (methods) are not followed
        return getattr(base, func.attr)
    return None


# Keywords a Triton launch takes besides the kernel's own parameters.
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "debug"}


def _call_problems(call: ast.Call, fn) -> list[str]:
    """Whether ``call``'s arguments bind to ``fn``'s signature (calls that spread ``*args``
    or ``**kwargs`` are not checked)."""
    launch = isinstance(call.func, ast.Subscript)
    fn = getattr(fn, "fn", fn)  # a Triton JITFunction: the Python function it wraps
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords):
        return []
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins, C functions: nothing to check against
        return []
    kw = {k.arg: None for k in call.keywords if not (launch and k.arg in LAUNCH_OPTIONS)}
    try:
        sig.bind(*range(len(call.args)), **kw)
    except TypeError as e:
        return [str(e)]
    return []


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_script_calls_match_qmoe(path):
    tree = ast.parse(path.read_text(), str(path))
    names = _imported(tree)
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        try:
            fn = _resolve(node.func, names)
        except AttributeError as e:
            problems.append(f"{path.name}:{node.lineno}: {e}")
            continue
        if callable(fn) and not inspect.isclass(fn):
            problems += [f"{path.name}:{node.lineno} {ast.unparse(node.func)}(): {m}"
                         for m in _call_problems(node, fn)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_bad_calls():
    from qmoe.ops.permute_mask import permute_mask_triton

    def problems(src):
        return _call_problems(ast.parse(src).body[0].value, permute_mask_triton)

    assert problems("permute_mask_triton(x, m, 4, 1, tilez=1)") == [
        "got an unexpected keyword argument 'tilez'"]
    n = len(inspect.signature(permute_mask_triton).parameters)
    assert "too many positional" in problems(f"f({', '.join(['a'] * (n + 1))})")[0]
    assert "missing a required argument" in problems("f()")[0]
    from qmoe.ops._kernels.permute import unpermute_gather_kernel

    launch = ast.parse("k[(1,)](a, b, c, d, e, f, g, h, i, j, HAS_W=0, num_warps=4)").body[0]
    assert "multiple values for argument 'HAS_W'" in _call_problems(
        launch.value, unpermute_gather_kernel)[0]  # sweep_permute.py's call before its mend
    names = _imported(ast.parse("import qmoe\nfrom qmoe.ops import backend as B"))
    with pytest.raises(AttributeError, match="no_such"):
        _resolve(ast.parse("B.no_such(x)").body[0].value.func, names)
    assert _resolve(ast.parse("qmoe.moe_permute(x)").body[0].value.func, names) is not None


SHELL = sorted(ROOT.glob("scripts/*.sh"))


@pytest.mark.parametrize("path", SHELL, ids=[p.name for p in SHELL])
def test_shell_scripts_parse(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _gpu_check(tmp_path, files: dict[str, str], tests_arg: str):
    """Run ``scripts/gpu_check.sh`` with ``QMOE_TEST_JOBS=2`` and no benchmarks on test
    files written under ``tmp_path/t`` (``tests_arg`` names them, absolute or relative):
    ``(completed process, tests.log text, OUT folder)``. (The script's CUDA lines just
    print errors here.)"""
    tests = tmp_path / "t"
    tests.mkdir()
    for name, text in files.items():
        (tests / name).write_text(text)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "QMOE_TEST_JOBS": "2", "QMOE_BENCHES": "none",
           "QMOE_TESTS": tests_arg,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    return r, (out / "tests.log").read_text(), out


def test_gpu_check_deals_test_ids_to_jobs(tmp_path):
    """``QMOE_TEST_JOBS=2``: the test ids are dealt round-robin to two pytest processes (each
    file's tests split over both), a failure in one job shows in the summary, and both
    jobs' output lands in one ``tests.log``."""
    r, log, out = _gpu_check(tmp_path, {
        "test_a.py": "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n",
        "test_b.py": "def test_ok():\n    pass\n\n\ndef test_bad():\n    assert False\n\n\n"
                     "def test_three():\n    pass\n",
    }, str(tmp_path / "t"))
    assert log.count("=== job ") == 2, log
    jobs = log.split("=== job ")[1:]  # by id: a::one, b::ok, b::three | a::two, b::bad
    assert "3 passed" in jobs[0] and "1 failed, 1 passed" in jobs[1], log
    assert log.count("pytest rc=") == 2 and "pytest rc=1" in log, log
    assert "FAILED" in r.stdout and "test_bad" in r.stdout, r.stdout
    assert not list(out.glob("*.part")), "the per-job logs are merged and removed"


def test_gpu_check_reports_a_file_that_does_not_import(tmp_path):
    """A test file that fails to import leaves the collection without its ids: the script
    then deals files, so the import error shows in a job (it must not vanish)."""
    r, log, _ = _gpu_check(tmp_path, {
        "test_a.py": "import warnings\nwarnings.warn('aten::x :: y')\n\n\n"
                     "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n",
        "test_c.py": "import nonexistent_module_qmoe\n",
    }, "t")
    assert "dealing files" in r.stderr, r.stderr
    assert "ERROR" in r.stdout and "test_c.py" in r.stdout, r.stdout
    assert "2 passed" in log, log
