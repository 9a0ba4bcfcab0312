"""The ``mambac`` command line: dump lowered graphs, launch ranks, run the demo.

    mambac dump MODEL [--stage NAME|all] [--format text|dot|svg] [-o FILE] [--batch B --seqlen L]
                      [--world-size W --rank R --tp T --dp D --cp C --sequence-parallel]
                      [--remat none|full|auto --memory-budget 8GiB]   (the recompute regions, as graph nodes)
    mambac dump MODEL --kernels [-o DIR]   (generated Triton source of the program's kernels)
    mambac explain MODEL [--world-size W --tp T --cp C --sequence-parallel --remat auto --memory-budget 8GiB]
    mambac run -n W [--timeout S] [--max-restarts R] script.py args...
    mambac plan MODEL --world-size W [--device-memory 80GiB] [--batch B --seqlen L] [--device h200|cpu]
    mambac bench [NAME [script options...]]   (the benchmarks/ scripts: ssd, cp, remat, train, ...)
    mambac demo [--steps N ...]

MODEL is a built-in preset name (``mambac dump --list``), ``path/to/file.py:factory`` (a function
returning an nn.Module), or a local checkpoint directory.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from mambac.errors import MambacError, MambacInputError
from mambac.knobs import knobs
from mambac.cli_types import count, index, seconds


def load_model(spec: str) -> torch.nn.Module:
    """Resolve MODEL: preset name, ``file.py:factory``, or checkpoint directory."""
    from mambac.presets import PRESETS, build_preset

    if spec in PRESETS:
        return build_preset(spec)
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        return _from_factory(*spec.split(":", 1))
    if Path(spec).is_dir():
        from mambac.convert import from_pretrained
        return from_pretrained(spec)
    raise MambacInputError(f"cannot resolve model {spec!r}: give a preset ({', '.join(sorted(PRESETS))}), "
                           "a file.py:factory, or a checkpoint directory.")


def _from_factory(path: str, name: str) -> torch.nn.Module:
    if not Path(path).is_file():
        raise MambacInputError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if factory is None:
        raise MambacInputError(f"{path} defines no {name!r}")
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise MambacInputError(f"{path}:{name}() returned {type(model).__name__}, not an nn.Module")
    return model


def _example_inputs(model: torch.nn.Module, batch: int, seqlen: int):
    maker = getattr(model, "example_inputs", None)
    if maker is None:
        raise MambacInputError(f"{type(model).__name__} has no example_inputs(batch, seqlen); "
                               "wrap it in a factory that returns a model providing one.")
    return maker(batch, seqlen)


def _render(program, fmt: str, indices: list[int]) -> str:
    """The chosen stages' graphs (by position in the pass history, since a pass such as dead-code
    elimination can run more than once): printed text, or Graphviz source (one digraph per stage)."""
    history = program.ctx.history if fmt == "text" else program.ctx.dot_history
    return "\n".join(history[i][1] for i in indices)


def cmd_dump(args: argparse.Namespace) -> int:
    import mambac
    from mambac.presets import preset_names

    if args.list:
        print("\n".join(preset_names()))
        return 0
    if not args.model:
        raise MambacInputError("mambac dump needs a MODEL (or --list).")
    if args.format == "svg" and shutil.which("dot") is None:
        raise MambacInputError("--format svg needs Graphviz's `dot` program, which is not on PATH. Install it "
                               "(Debian/Ubuntu: apt-get install graphviz) or use --format dot / text.")
    from mambac.convert import prepare_model
    from mambac.lowering import lower_all_ranks

    model = prepare_model(load_model(args.model))
    if not 0 <= args.rank < args.world_size:
        raise MambacInputError(f"--rank {args.rank} is not a rank of --world-size {args.world_size}.")
    programs = lower_all_ranks(model, _example_inputs(model, args.batch, args.seqlen), args.world_size,
                               **_mesh_options(args))
    program = programs[args.rank]
    if args.kernels:  # the generated Triton source of every kernel the program uses
        from mambac.codegen.dump import dump_program_kernels
        return dump_program_kernels(program.gm, args.output)
    history = program.ctx.history
    stages = [n for n, _ in history]
    if args.stage == "all":
        chosen = list(range(len(history)))
    elif not args.stage:
        chosen = [len(history) - 1]
    else:
        name = args.stage
        if name not in stages:
            raise MambacInputError(f"no stage {name!r}; stages: {', '.join(dict.fromkeys(stages))} (or 'all').")
        chosen = [i for i, n in enumerate(stages) if n == name]
    if args.format == "svg" and len(chosen) > 1:
        raise MambacInputError("--format svg draws one stage; pass --stage NAME (or --format dot, which "
                               "writes one digraph per stage).")
    out = _render(program, args.format, chosen)
    if args.format == "svg":
        out = subprocess.run(["dot", "-Tsvg"], input=out, capture_output=True, text=True, check=True).stdout
    if args.output:
        Path(args.output).write_text(out)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(out)
    return 0


def _mesh_options(args: argparse.Namespace) -> dict:
    """The layout and recompute options shared by ``dump`` and ``explain``."""
    opts = {"dp": args.dp, "cp": args.cp, "sequence_parallel": args.sequence_parallel}
    if args.tp is not None:
        opts["tp"] = args.tp
    if args.remat != "none":
        opts["remat"] = args.remat
    if args.memory_budget:
        opts["memory_budget"] = args.memory_budget   # a size such as 8GiB: CompileOptions reads it
        opts["memory_budget_scope"] = args.memory_budget_scope
    return opts


def cmd_explain(args: argparse.Namespace) -> int:
    from mambac.convert import prepare_model
    from mambac.explain import explain
    from mambac.lowering import lower_all_ranks

    if args.rank is not None and args.rank >= args.world_size:
        raise MambacInputError(f"--rank {args.rank} is not a rank of --world-size {args.world_size}.")
    model = prepare_model(load_model(args.model))
    opts = _mesh_options(args)
    programs = lower_all_ranks(model, _example_inputs(model, args.batch, args.seqlen), args.world_size, **opts)
    ranks = None if args.rank is None else [args.rank]
    sys.stdout.write(explain(programs, ranks, model))
    return 0


def _remat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remat", choices=("none", "full", "auto"), default="none")
    p.add_argument("--memory-budget", default="", help="bytes per rank for remat=auto, e.g. 8GiB")
    p.add_argument("--memory-budget-scope", default="activations", choices=("activations", "step"),
                   help="what the budget covers: saved activations, or the step (plus parameters, gradients, "
                        "AdamW state)")


def cmd_run(args: argparse.Namespace) -> int:
    from mambac.runtime.launcher import launch

    return launch(args.nprocs, args.script, args.args, timeout=args.timeout,
                  max_restarts=args.max_restarts)


def cmd_plan(args: argparse.Namespace) -> int:
    from mambac.autoplan import format_table, plan

    rows = plan(load_model(args.model), world_size=args.world_size, device_memory=args.device_memory,
                batch=args.batch, seqlen=args.seqlen, device=args.device)
    print(format_table(rows, limit=args.top))
    return 0


def benchmark_dir() -> Path | None:
    """The ``benchmarks/`` folder of the checkout mambac runs from (or of the current directory)."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (base / "benchmarks").is_dir() and any((base / "benchmarks").glob("bench_*.py")):
            return base / "benchmarks"
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    root = benchmark_dir()
    if root is None:
        raise MambacInputError("no benchmarks/ folder here: `mambac bench` runs the scripts of a source checkout; "
                               "run it from the repository root (git clone, then pip install -e .).")
    names = sorted(p.stem[len("bench_"):] for p in root.glob("bench_*.py"))
    if args.name is None:
        print("benchmarks: " + ", ".join(names) + f"  (in {root}; `mambac bench NAME --help` for options)")
        return 0
    if args.name not in names:
        raise MambacInputError(f"no benchmark {args.name!r}; benchmarks: {', '.join(names)}.")
    return subprocess.call([sys.executable, str(root / f"bench_{args.name}.py"), *args.args])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mambac", description="mambac: a compiler for Mamba-family models.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="print the lowered graph after any pass")
    d.add_argument("model", nargs="?", help="preset name, file.py:factory, or checkpoint directory")
    d.add_argument("--list", action="store_true", help="list the built-in presets")
    d.add_argument("--stage", default="", help="pass name, or 'all' (default: the last pass)")
    d.add_argument("--format", choices=("text", "dot", "svg"), default="text")
    d.add_argument("--world-size", type=count, default=1, help="lower the program of every rank of W")
    d.add_argument("--rank", type=index, default=0, help="which rank's program to print")
    d.add_argument("--tp", type=count, default=None)
    d.add_argument("--dp", type=count, default=1)
    d.add_argument("--cp", type=count, default=1, help="context-parallel ranks (the sequence split)")
    d.add_argument("--sequence-parallel", action="store_true")
    d.add_argument("--batch", type=count, default=2)
    d.add_argument("--seqlen", type=count, default=64)
    d.add_argument("-o", "--output", default="", help="file (with --kernels: a directory)")
    d.add_argument("--kernels", action="store_true", help="print the generated Triton kernels the program uses")
    _remat_arguments(d)
    d.set_defaults(fn=cmd_dump)
    e = sub.add_parser("explain", help="per rank: parameters, activation memory, communication, kernels")
    e.add_argument("model", help="preset name, file.py:factory, or checkpoint directory")
    e.add_argument("--world-size", type=count, default=1)
    e.add_argument("--rank", type=index, default=None, help="only this rank (default: all)")
    e.add_argument("--tp", type=count, default=None)
    e.add_argument("--dp", type=count, default=1)
    e.add_argument("--cp", type=count, default=1, help="context-parallel ranks (the sequence split)")
    e.add_argument("--sequence-parallel", action="store_true")
    _remat_arguments(e)
    e.add_argument("--batch", type=count, default=2)
    e.add_argument("--seqlen", type=count, default=64)
    e.set_defaults(fn=cmd_explain)
    r = sub.add_parser("run", help="launch W ranks of a script through torch.distributed.run")
    r.add_argument("-n", "--nprocs", type=count, required=True)
    r.add_argument("--timeout", type=seconds, default=None, help="stop every rank after this many seconds")
    r.add_argument("--max-restarts", type=index, default=0,
                   help="when a rank fails, restart every rank up to this many times")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("plan", help="rank parallel layouts (tp, cp, dp, sp, remat) by predicted step time")
    p.add_argument("model", help="preset name, file.py:factory, or checkpoint directory")
    p.add_argument("--world-size", type=count, default=1)
    p.add_argument("--device-memory", default=None, help="bytes per device, e.g. 80GiB (default: the device's)")
    p.add_argument("--device", choices=("h200", "cpu"), default="h200")
    p.add_argument("--batch", type=count, default=8)
    p.add_argument("--seqlen", type=count, default=2048)
    p.add_argument("--top", type=count, default=10, help="how many feasible layouts to print")
    p.set_defaults(fn=cmd_plan)
    b = sub.add_parser("bench", help="run a benchmark script of benchmarks/ (tables of speed and memory)")
    b.add_argument("name", nargs="?", help="benchmark name (none: list them), e.g. ssd, cp, remat, train")
    b.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the script")
    b.set_defaults(fn=cmd_bench)
    sub.add_parser("demo", help="run the main job (options: mambac demo --help)")
    return ap


def _setup_logging() -> None:
    from mambac.logs import configure
    configure(knobs().logs)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        _setup_logging()   # reads the environment knobs: a bad one ends here in one line
    except MambacError as exc:
        print(f"mambac: error: {exc}", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options
        from mambac import demo
        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MambacError as exc:
        print(f"mambac: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
