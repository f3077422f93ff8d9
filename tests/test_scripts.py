"""The benchmark and GPU scripts call qmoe's internals (launchers with tiling keywords,
map builders); they run only on a GPU, where device time is scarce. Check on any machine
that every name they import from qmoe exists and that every call of such a function
passes keywords and positional counts its signature takes; that every benchmark command
(``python -m benchmarks ...``, ``benchmarks.bench_cpu``, ``benchmarks/bench_distributed.py``)
prints its help; that every benchmark command quoted in docs/*.md and README.md parses
with its options (the commands behind the tables stay runnable), and that the benchmark files
the docs name exist; and that scripts/gpu_check.sh runs benchmarks by name."""

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import os
import re
import shlex
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
    from qmoe.ops.kernels.permute_mask import permute_mask_triton

    def problems(src):
        return _call_problems(ast.parse(src).body[0].value, permute_mask_triton)

    assert problems("permute_mask_triton(x, m, 4, 1, tilez=1)") == [
        "got an unexpected keyword argument 'tilez'"]
    n = len(inspect.signature(permute_mask_triton).parameters)
    assert "too many positional" in problems(f"f({', '.join(['a'] * (n + 1))})")[0]
    assert "missing a required argument" in problems("f()")[0]
    from qmoe.ops.kernels.unpermute import unpermute_gather_kernel

    launch = ast.parse("k[(1,)](a, b, c, d, e, f, g, h, i, j, k, l, HAS_W=0, num_warps=4)").body[0]
    assert "multiple values for argument 'HAS_W'" in _call_problems(
        launch.value, unpermute_gather_kernel)[0]  # `sweep permute`'s call before its mend
    names = _imported(ast.parse("import qmoe\nfrom qmoe.ops import torch_impl as B"))
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


# --- the benchmark command line --------------------------------------------------------


def _cli():
    from benchmarks.__main__ import GROUPS, build_parser

    commands = [[g, c] for g, (mod, _) in GROUPS.items() for c in mod.COMMANDS] + [["table"]]
    return build_parser, commands


def _parse(parser: argparse.ArgumentParser, argv: list[str]):
    """``parser.parse_args(argv)``: ``(namespace or None, exit status, stdout + stderr)``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            return parser.parse_args(argv), None, out.getvalue()
        except SystemExit as e:
            return None, e.code, out.getvalue()


def test_every_benchmark_command_prints_its_help():
    """Each subcommand's ``--help`` (its docstring: what it measures, and its options), the
    groups' and the top level's, and the two scripts that run on their own."""
    build_parser, commands = _cli()
    assert len(commands) == 17, commands  # 5 bench, 7 sweep, 4 profile, table
    for argv in [[], ["bench"], ["sweep"], ["profile"], *commands]:
        _, code, text = _parse(build_parser(), [*argv, "--help"])
        assert code == 0 and text.startswith(f"usage: python -m benchmarks {' '.join(argv)}"), (
            argv, text)
        if len(argv) == 2 or argv == ["table"]:
            assert "--out" in text or argv == ["table"], (argv, text)
            assert len(text.split("\n\n")) > 2, f"{argv}: no description"
    for name, parser in _parsers().items():
        _, code, text = _parse(parser, ["--help"])
        assert code == 0 and "--out" in text, (name, text)
    _, code, text = _parse(build_parser(), ["sweep", "no_such"])
    assert code == 2 and "invalid choice" in text, text


def test_benchmarks_run_as_a_module_and_a_file():
    """``python -m benchmarks`` from the repository root (no ``sys.path`` edits, qmoe
    installed or on PYTHONPATH), ``-m benchmarks.bench_cpu``, and bench_distributed.py run
    as a file, as torchrun runs it (scripts/gpu_multi.sh)."""
    for argv in (["-m", "benchmarks", "sweep", "map", "--help"],
                 ["-m", "benchmarks.bench_cpu", "--help"],
                 ["benchmarks/bench_distributed.py", "--help"]):
        r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and r.stdout.startswith("usage:"), (argv, r.stderr[-2000:])


def test_gpu_commands_refuse_without_cuda(monkeypatch, capsys):
    """Without CUDA a GPU-only benchmark says so and returns (exit status 0, no JSON)."""
    import torch

    from benchmarks.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, says in ((["bench", "permute"], "bench permute: CUDA not available"),
                       (["sweep", "gather"], "sweep gather: needs CUDA, skipped"),
                       (["sweep", "sort_chunks", "--fp8"], "needs CUDA"),
                       (["profile", "ncu", "gptoss"], "profile ncu: needs CUDA")):
        main(argv)
        assert says in capsys.readouterr().out, argv


DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
SPAN = re.compile(r"```[^\n]*\n(?P<block>.*?)```|`(?P<code>[^`]+)`", re.S)
PYTHON = re.compile(r"python3?|torchrun")
# a benchmark file's name: benchmarks/<file>.py, or bench_|sweep_|profile_|ncu_<name>.py
BENCH_FILE = re.compile(r"benchmarks/(\w+\.py)|(?<![\w/.])((?:bench|sweep|profile|ncu)_\w+\.py)")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The benchmark command lines, by how the docs start them."""
    from benchmarks import bench_cpu, bench_distributed

    build_parser, _ = _cli()
    return {"python -m benchmarks": build_parser(),
            "python -m benchmarks.bench_cpu": bench_cpu.build_parser(),
            "python -m benchmarks.bench_distributed": bench_distributed.build_parser(),
            "benchmarks/bench_distributed.py": bench_distributed.build_parser()}


def _benchmark_call(words: list[str]) -> tuple[str, list[str]] | None:
    """``(how it starts, its arguments)`` for the benchmark a shell line runs, or None:
    ``python -m benchmarks ...`` (also after ``ncu ...`` or environment settings),
    ``python -m benchmarks.<module>``, ``python|torchrun benchmarks/<file>.py``, and the
    short ``bench|sweep|profile <command> ...`` of prose."""
    for i, w in enumerate(words):
        if w in ("|", "||", "&&", ";", "&") or w.startswith((">", "2>")):
            words = words[:i]  # the command ends there
            break
    for i, w in enumerate(words):
        rest = words[i + 1:]
        if PYTHON.fullmatch(w) and rest[:1] == ["-m"] and rest[1:2] and (
                rest[1] == "benchmarks" or rest[1].startswith("benchmarks.")):
            return f"python -m {rest[1]}", rest[2:]
        if w.startswith("benchmarks/") and any(PYTHON.fullmatch(v) for v in words[:i]):
            return w, rest  # run as a file (by python, or torchrun and its options)
    if len(words) > 1 and words[0] in ("bench", "sweep", "profile"):
        return "python -m benchmarks", words
    return None


def _doc_commands(text: str):
    """``(span, how it starts, arguments)`` for each benchmark command in ``text``'s code
    (inline spans, joined across line breaks, and fenced blocks' lines), in order; an inline
    span of options alone (``--configs mid,small``) goes with the last command before it."""
    last = None
    for m in SPAN.finditer(text):
        inline = m["block"] is None
        for span in [" ".join(m["code"].split())] if inline else m["block"].splitlines():
            try:
                words = shlex.split(span, comments=True)
            except ValueError:
                continue
            call = _benchmark_call(words) if words else None
            if call:
                start, argv = call
                yield span, start, argv
                head = argv[:1] if argv[:1] == ["table"] else argv[:2]  # group and command
                last = start, [w for w in head if not w.startswith("-")] if (
                    start == "python -m benchmarks") else []
            elif inline and words and words[0].startswith("--") and last:
                yield span, last[0], [*last[1], *words]


def _doc_problems(name: str, text: str, files: bool = True) -> list[str]:
    parsers = _parsers()
    problems = []
    for span, start, argv in _doc_commands(text):
        if start not in parsers:
            problems.append(f"{name}: `{span}`: {start} is not how a benchmark runs")
            continue
        _, code, out = _parse(parsers[start], argv)
        if code:  # argparse's error (0: a --help)
            problems.append(f"{name}: `{span}`: {out.strip().splitlines()[-1]}")
    # benchmark files named anywhere in the text exist
    for m in BENCH_FILE.finditer(text) if files else ():
        if not (ROOT / "benchmarks" / (m[1] or m[2])).is_file():
            problems.append(f"{name}: {m[0]}: no such file in benchmarks/")
    return problems


def test_docs_benchmark_commands_parse():
    """Every benchmark command quoted in docs/*.md and README.md parses, options included,
    and every benchmark file they name exists."""
    commands = [c for doc in DOCS for c in _doc_commands(doc.read_text())]
    assert len(commands) > 40, commands  # the check sees the commands behind the tables
    problems = [p for doc in DOCS for p in _doc_problems(doc.name, doc.read_text())]
    assert not problems, "\n".join(problems)


def test_qmoe_benchmark_commands_parse():
    """The benchmark commands that qmoe's comments and docstrings cite for a tuning constant
    (``python -m benchmarks sweep map --pdl 0,1``, or the short ``sweep map --pdl 0,1``)
    parse, options included, and no benchmark file they name is missing."""
    problems = [p for path in sorted((ROOT / "qmoe").rglob("*.py"))
                for p in _doc_problems(str(path.relative_to(ROOT)), path.read_text())]
    assert not problems, "\n".join(problems)


def test_the_docs_check_sees_bad_commands():
    text = """`python3 -m benchmarks sweep gather --quick`, then `--more --configs dsv3,qwen3`;
`python3 -m benchmarks sweep gather
--no-such 1` and `--also-no`; ``` bash
GLIBC_TUNABLES=x python -m benchmarks.bench_cpu --iters 3 > cpu.log   # fine
torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --tokens 64
python benchmarks/bench_cpu.py --out cpu.json
```
`ncu --set full python3 -m benchmarks profile ncu dsv3` `sweep nosuch --x` `bench permute`'s,
`python3 benchmarks/bench_permute.py --out a.json`, `sweep_gather.py`, `benchmarks/common.py`
"""
    assert [c[1:] for c in _doc_commands(text)] == [
        ("python -m benchmarks", ["sweep", "gather", "--quick"]),
        ("python -m benchmarks", ["sweep", "gather", "--more", "--configs", "dsv3,qwen3"]),
        ("python -m benchmarks", ["sweep", "gather", "--no-such", "1"]),
        ("python -m benchmarks", ["sweep", "gather", "--also-no"]),
        ("python -m benchmarks.bench_cpu", ["--iters", "3"]),
        ("benchmarks/bench_distributed.py", ["--tokens", "64"]),
        ("benchmarks/bench_cpu.py", ["--out", "cpu.json"]),
        ("python -m benchmarks", ["profile", "ncu", "dsv3"]),
        ("python -m benchmarks", ["sweep", "nosuch", "--x"]),
        ("python -m benchmarks", ["bench", "permute"]),
        ("benchmarks/bench_permute.py", ["--out", "a.json"]),
    ]
    problems = _doc_problems("t.md", text)
    assert [p.split(": ")[1] for p in problems] == [
        "`python3 -m benchmarks sweep gather --no-such 1`", "`--also-no`",
        "`python benchmarks/bench_cpu.py --out cpu.json`", "`sweep nosuch --x`",
        "`python3 benchmarks/bench_permute.py --out a.json`", "benchmarks/bench_permute.py",
        "sweep_gather.py"], problems


def test_gpu_check_runs_benchmarks_by_name(tmp_path):
    """``QMOE_BENCHES`` names benchmarks as the $OUT files do: ``permute`` runs ``bench
    permute`` into bench_permute.log / .json, ``sweep_map`` runs ``sweep map``; a name that
    is no command is skipped and leaves no file (the device brings back 8 files at most).
    Without CUDA (hidden here) the two say so and write no JSON."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "QMOE_TESTS": "none", "CUDA_VISIBLE_DEVICES": "",
           "QMOE_BENCHES": "permute sweep_map nosuch sweep_nosuch",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "bench_permute.log", "env.txt", "sweep_map.log"], r.stderr
    assert "bench permute: CUDA not available" in (out / "bench_permute.log").read_text()
    assert "sweep map: needs CUDA, skipped" in (out / "sweep_map.log").read_text()
    assert "no benchmark 'bench_nosuch'" in r.stderr and "'sweep_nosuch'" in r.stderr, r.stderr
