"""The benchmark and GPU scripts call qmoe's internals (launchers with tiling keywords,
map builders); they run only on a GPU, where device time is scarce. Check on any machine
that every name they import from qmoe exists and that every call of such a function
passes keywords and positional counts its signature takes."""

import ast
import importlib
import inspect
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


def _imported(tree: ast.AST) -> dict[str, object]:
    """Local name -> object for each ``from qmoe... import name`` (submodules included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qmoe"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                obj = getattr(mod, a.name, None)
                if obj is None:  # a submodule not yet imported as an attribute
                    obj = importlib.import_module(f"{node.module}.{a.name}")
                names[a.asname or a.name] = obj
    return names


def _call_problems(call: ast.Call, fn) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins, C functions: nothing to check against
        return []
    kinds = {p.kind for p in params}
    named = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
    out = []
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        out += [f"no keyword {k.arg!r}" for k in call.keywords if k.arg and k.arg not in named]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    too_many = len(call.args) > len(positional)
    if inspect.Parameter.VAR_POSITIONAL not in kinds and not starred and too_many:
        out.append(f"{len(call.args)} positional arguments, takes {len(positional)}")
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_script_calls_match_qmoe(path):
    tree = ast.parse(path.read_text(), str(path))
    names = _imported(tree)
    problems = [
        f"{path.name}:{node.lineno} {node.func.id}(): {msg}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and callable(names.get(node.func.id))
        for msg in _call_problems(node, names[node.func.id])
    ]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_bad_keyword():
    from qmoe.ops.permute_mask import permute_mask_triton

    call = ast.parse("permute_mask_triton(x, m, 4, tilez=1)").body[0].value
    assert _call_problems(call, permute_mask_triton) == ["no keyword 'tilez'"]
    n = len([p for p in inspect.signature(permute_mask_triton).parameters.values()
             if p.kind is p.POSITIONAL_OR_KEYWORD])
    call = ast.parse(f"permute_mask_triton({', '.join(['a'] * (n + 1))})").body[0].value
    assert _call_problems(call, permute_mask_triton) == [
        f"{n + 1} positional arguments, takes {n}"]


SHELL = sorted(ROOT.glob("scripts/*.sh"))


@pytest.mark.parametrize("path", SHELL, ids=[p.name for p in SHELL])
def test_shell_scripts_parse(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
