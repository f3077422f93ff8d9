"""qmoe benchmarks, run from the repository root:

    python -m benchmarks bench permute|quantize|compile_fp8 [options]
    python -m benchmarks sweep map|permute|permute_mask|gather|merge_backward|quantize|sort_chunks
    python -m benchmarks profile kernels|map|small|ncu [options]
    python -m benchmarks table results.json [...]

Every benchmark writes its JSON to ``--out`` (and prints it), its progress to stderr;
``python -m benchmarks <group> <command> --help`` gives a command's options and what it
measures. Run on their own: ``python -m benchmarks.bench_cpu`` (the CPU paths) and
``benchmarks/bench_distributed.py`` (under torchrun, or ``--spawn N``).
"""

from __future__ import annotations

import argparse
import inspect

from benchmarks import bench, profiling, sweeps

GROUPS = {  # group: (module, help)
    "bench": (bench, "the full suites, by op (docs/benchmarks.md's main tables)"),
    "sweep": (sweeps, "kernel tilings behind qmoe's tuning constants (CUDA)"),
    "profile": (profiling, "kernel and host profiles, Nsight Compute drivers (CUDA)"),
}


def _add_command(subparsers, name: str, add_args, run) -> None:
    doc = inspect.cleandoc(run.__doc__ or "")
    summary = doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
    sp = subparsers.add_parser(name, help=summary.replace("%", "%%"), description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(sp)
    sp.set_defaults(_run=run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = p.add_subparsers(dest="_group", required=True, metavar="{bench,sweep,profile,table}")
    for gname, (mod, ghelp) in GROUPS.items():
        gp = groups.add_parser(gname, help=ghelp, description=inspect.cleandoc(mod.__doc__),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        commands = gp.add_subparsers(dest="_command", required=True)
        for cname, (add_args, run) in mod.COMMANDS.items():
            _add_command(commands, cname, add_args, run)
    _add_command(groups, "table", bench.table_args, bench.table_main)
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    run = a._run
    for key in ("_run", "_group", "_command"):  # the options alone, as the JSON records them
        vars(a).pop(key, None)
    run(a)


if __name__ == "__main__":
    main()
