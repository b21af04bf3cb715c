"""The ``tensorstash`` command line: ``tensorstash bench`` and ``tensorstash plan``.

Example:
    $ tensorstash bench --model small --policies none,lz4,auto:50% --steps 5 --json out.json
    $ tensorstash bench --sweep --model tiny --plot sweep.png
    $ tensorstash bench --plot bench.png --model-script my_model.py:make
    $ tensorstash plan --model-script my_model.py:make --limit 50%
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import tensorstash
from tensorstash import bench
from tensorstash.bench import plot as _plot
from tensorstash.bench.compiled import COMPILE_MODES, CompileOptions
from tensorstash.bench.loop import (
    LEARNING,
    format_loop_table,
    loop_rows,
    run_loops,
    train_alone,
)
from tensorstash.bench.planning import make_plan_run
from tensorstash.bench.rounds import LEARNING_ROUNDS


def _policy_list(text: str) -> list[str]:
    """Parse ``--policies``: comma-separated bench policy names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"no policy in {text!r}; valid policies are "
            f"{', '.join((*bench.ALL_POLICIES, *bench.OPTIONAL_PEERS))}, auto:<limit>, "
            "hf-offload and hf-every:<k>"
        )
    try:
        bench.resolve_policies(names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("tensorstash bench: ")) from None
    return names


def _device(text: str) -> str:
    """Parse ``--device``: "cpu", or "cuda" where torch sees a CUDA device."""
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"torch {torch.__version__} sees no CUDA device; run with --device cpu, "
            "or on a machine with a GPU and a CUDA build of torch"
        )
    return text


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
    return value


def _positive_int(text: str) -> int:
    """Parse ``--steps``: an integer of at least 1."""
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    """Parse ``--warmup``: an integer of at least 0."""
    return _int_at_least(text, 0)


def _escaped(names: Sequence[str]) -> str:
    """Names joined by commas for a help text, where argparse reads "%" as a format."""
    return ", ".join(names).replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tensorstash`` command."""
    parser = argparse.ArgumentParser(
        prog="tensorstash",
        description="Move the tensors autograd saves for backward out of the way.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"tensorstash {tensorstash.__version__} (torch {torch.__version__})",
        help="print tensorstash's version and torch's, and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    run = commands.add_parser(
        "bench",
        help="train a model under each policy and compare real memory and step time",
        description=(
            "Train a model for a few steps under each policy (and under no stash, torch's "
            "save_on_cpu and activation checkpointing), interleaving them step by step, and "
            "print the real peak memory of a step, step time and overhead against no stash, "
            "the planner's prediction for Auto, the bytes the stash counted per tier, and "
            "whether the gradients are bitwise equal to plain autograd."
        ),
    )
    models = run.add_mutually_exclusive_group()
    models.add_argument(
        "--model",
        choices=list(bench.MODELS),
        default="small",
        help=f"a built-in model: the embedded GPT sizes, or {bench.HF_GPT2} (a 4-layer "
        "GPT-2 from transformers, batch 4x128)",
    )
    models.add_argument(
        "--model-script",
        metavar="PATH.py:FUNCTION",
        help="bench a model of your own instead: FUNCTION() takes no arguments and returns "
        "(model, batch) or (model, batch, blocks); model(*batch) must return a scalar "
        "loss, batch is a tuple of the forward's arguments (the same every step; tensors "
        "are moved to --device) and blocks, needed by the checkpoint and recompute "
        "policies, is a module class or a list of submodule names (see "
        "tensorstash.recompute_modules)",
    )
    chosen = run.add_mutually_exclusive_group()
    chosen.add_argument(
        "--policies",
        type=_policy_list,
        default=None,
        help=f"comma-separated, from: {_escaped(bench.ALL_POLICIES)}, "
        f"{_escaped(bench.OPTIONAL_PEERS)} (GPU), auto:<limit>, Auto under a memory limit "
        "at each step's base plus a share of no stash's real peak growth (auto:50%%, "
        "auto:0.5) or a size (auto:64MiB), and on a "
        "Hugging Face model its own checkpointing: hf-every:<k> (one decoder layer in k) "
        "and hf-offload (every layer, their inputs in pinned host memory; GPU) (default: "
        f"{_escaped(bench.DEFAULT_POLICIES)}, and {_escaped(bench.HF_PEERS)} on an HF "
        "model; none is always run, as the baseline)",
    )
    chosen.add_argument(
        "--sweep",
        action="store_true",
        help=f"run {_escaped(bench.SWEEP_POLICIES)} (and {_escaped(bench.HF_PEERS)} on an HF "
        "model) in float32 and under bfloat16 autocast (the optional peers only on a GPU, "
        "where installed); --steps defaults to 8",
    )
    run.add_argument(
        "--steps", type=_positive_int, default=None, help="timed rounds (default 3; 8 with --sweep)"
    )
    run.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=None,
        help="untimed rounds first; Auto learns its plan in them (default 2), and up to "
        f"{LEARNING_ROUNDS} more run while Auto still learns its plan (the table's title "
        "says how many ran)",
    )
    run.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads (torch.set_num_threads; default: torch's own choice); on a "
        "machine other jobs keep busy, fewer threads spin less against them",
    )
    run.add_argument("--device", type=_device, choices=["cpu", "cuda"], default="cpu")
    run.add_argument(
        "--dtype",
        choices=list(bench.DTYPES),
        default=None,
        help="float32 (default), or bfloat16: the forward under bfloat16 autocast (weights "
        "stay float32); --sweep runs both",
    )
    run.add_argument(
        "--twins",
        action="store_true",
        help="run each auto:<limit> beside a twin that never plans (a fresh Profile every "
        "step), to measure what its plan changes",
    )
    run.add_argument(
        "--compile",
        action="store_true",
        help="run every policy on the model compiled by torch.compile (inductor), beside the "
        f"compiler's own activation memory budgets ({_escaped(bench.COMPILE_PEERS)}) and, "
        f"on CUDA, its own offload ({bench.COMPILE_OFFLOAD}), or only those of them that "
        "--policies names, under deterministic algorithms; compile time is reported apart "
        "from step time",
    )
    run.add_argument(
        "--compile-mode",
        choices=list(COMPILE_MODES),
        default=None,
        help="with --compile: torch.compile's mode, for the model and the compile:<b> peers "
        "(default: default); reduce-overhead and max-autotune record CUDA graphs, so they "
        "need --device cuda",
    )
    run.add_argument(
        "--fullgraph",
        action="store_true",
        help="with --compile: compile with fullgraph=True (a graph break is an error)",
    )
    run.add_argument(
        "--dynamic",
        action="store_true",
        help="with --compile: compile with dynamic shapes (dynamic=True)",
    )
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    run.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="also draw a PNG: memory over one step of each policy, and real peak against "
        "step time with the Pareto front (needs matplotlib: pip install tensorstash[plot])",
    )
    run.add_argument(
        "--memory-snapshot",
        type=Path,
        metavar="DIR",
        help="CUDA only: record one more step of each policy with the CUDA allocator's "
        "history and write DIR/<policy>.pickle, for https://pytorch.org/memory_viz",
    )
    run.add_argument("--seed", type=int, default=0, help="seeds weights, batch and dropout")
    run.add_argument(
        "--loop",
        type=_positive_int,
        default=None,
        metavar="STEPS",
        help="CPU: train each policy alone in a fresh process for STEPS SGD steps back to "
        "back, as a training loop runs them, and report the most the resident set grew "
        "over the loop (single steps each begin from memory handed back to the OS; a "
        "loop's do not); --steps rounds (default 3); STEPS > "
        f"{LEARNING} (an Auto profile learns in the first {LEARNING})",
    )
    run.add_argument("--loop-alone", default=None, help=argparse.SUPPRESS)  # a child's run
    run.set_defaults(subparser=run, handler=_bench)
    _add_plan(commands)
    return parser


def _add_plan(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="show Auto's plan for a model under a memory limit, and its predictions",
        description=(
            "Train a model a few steps under Auto with a Profile (the first step measures, "
            "the next follow the plan) and print the plan of the last step: the modules it "
            "recomputes, where call sites go, the predicted step time and real peak memory, "
            "beside what that step measured."
        ),
    )
    models = plan.add_mutually_exclusive_group()
    models.add_argument("--model", choices=list(bench.MODELS), default="small")
    models.add_argument(
        "--model-script",
        metavar="PATH.py:FUNCTION",
        help="your model, as for tensorstash bench --model-script",
    )
    plan.add_argument(
        "--limit",
        "--budget",
        dest="limit",
        required=True,
        help="the memory each step may add to its base: a share of no stash's real peak "
        "growth (50%%, 0.5) or a size (64MiB), as the bench's auto:<limit> "
        "(--budget: the same, its older name)",
    )
    plan.add_argument("--steps", type=_positive_int, default=3, help="steps to run (default 3)")
    plan.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    plan.add_argument("--device", type=_device, choices=["cpu", "cuda"], default="cpu")
    plan.add_argument("--dtype", choices=list(bench.DTYPES), default="float32")
    plan.add_argument("--json", type=Path, metavar="PATH", help="also write the plan as JSON")
    plan.add_argument("--seed", type=int, default=0)
    plan.set_defaults(subparser=plan, handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        workload = _load_workload(args)
        run = make_plan_run(
            workload,
            args.limit,
            steps=args.steps,
            device=bench.resolve_device(args.device),
            dtype=bench.resolve_dtype(args.dtype),
            seed=args.seed,
        )
    except ValueError as error:
        args.subparser.error(
            str(error).removeprefix("tensorstash bench: ").removeprefix("tensorstash plan: ")
        )
    print(f"{workload.description}, {args.device} {args.dtype}")
    print(run.report())
    if args.json is not None:
        args.json.write_text(json.dumps(run.to_dict(), indent=2) + "\n")
        print(f"wrote the plan to {args.json}", file=sys.stderr)
    return 0


@contextmanager
def _progress_bar(total: int) -> Iterator[Callable[[str], None]]:
    """A tqdm bar on stderr, or a no-op where tqdm is not installed or stderr not a tty."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda name: None
        return
    with tqdm(total=total, desc="bench", unit="step", file=sys.stderr, disable=None) as bar:

        def advance(name: str) -> None:
            bar.set_postfix_str(name, refresh=False)
            bar.update()

        yield advance


def _workload(args: argparse.Namespace) -> tuple[bench.Workload, list[str]]:
    """The model to bench and the policies to run; ValueError for what cannot run."""
    if args.sweep and args.dtype is not None:
        raise ValueError(
            "tensorstash bench: --sweep runs float32 and bfloat16 both; leave --dtype out"
        )
    if args.sweep and args.memory_snapshot is not None:
        raise ValueError(
            "tensorstash bench: --memory-snapshot records one run; leave it out of --sweep"
        )
    if args.plot is not None:
        _plot.require_matplotlib()
    if args.memory_snapshot is not None:
        bench.check_memory_snapshot(args.device)
    workload = _load_workload(args)
    policies = args.policies
    if policies is None:
        policies = bench.default_policies(workload, sweep=args.sweep)
        skipped = [name for name in policies if bench.needs_blocks(name, workload)]
        if skipped:
            policies = [name for name in policies if name not in skipped]
            print(
                f"tensorstash bench: skipping {' and '.join(skipped)}: the model script "
                "returns no blocks to wrap (return (model, batch, blocks) to run them)",
                file=sys.stderr,
            )
    bench.check_blocks(bench.resolve_policies(policies), workload)
    return workload, policies


def _run(
    args: argparse.Namespace, workload: bench.Workload, policies: list[str]
) -> list[bench.Row]:
    """The rows of the run (both dtypes with ``--sweep``), under a progress bar."""
    dtypes = list(bench.DTYPES) if args.sweep else [args.dtype or "float32"]
    plot = args.plot is not None
    total = sum(
        bench.planned_steps(
            policies,
            args.steps,
            args.warmup,
            timeline=plot and index == 0,
            memory_snapshot=args.memory_snapshot is not None,
            twins=args.twins,
            device=args.device,
            compile=args.compile,
            workload=workload,
        )
        for index in range(len(dtypes))
    )
    rows: list[bench.Row] = []
    with _progress_bar(total) as progress:
        for index, dtype in enumerate(dtypes):
            rows += bench.run_bench(
                args.model,
                policies,
                args.steps,
                args.device,
                dtype,
                args.seed,
                warmup=args.warmup,
                progress=progress,
                workload=workload,
                timeline=plot and index == 0,
                memory_snapshot=args.memory_snapshot,
                twins=args.twins,
                compile=args.compile,
            )
    return rows


def _compile_options(args: argparse.Namespace) -> CompileOptions | bool:
    """``--compile`` and how (``--compile-mode``, ``--fullgraph``, ``--dynamic``)."""
    given = {
        "--compile-mode": args.compile_mode is not None,
        "--fullgraph": args.fullgraph,
        "--dynamic": args.dynamic,
    }
    named = [flag for flag, on in given.items() if on]
    if not args.compile:
        if named:
            args.subparser.error(f"{', '.join(named)} say how to compile; add --compile")
        return False
    options = CompileOptions(
        mode=args.compile_mode or "default",
        fullgraph=args.fullgraph,
        dynamic=True if args.dynamic else None,
    )
    try:
        options.check(bench.resolve_device(args.device))
    except ValueError as error:
        args.subparser.error(str(error).removeprefix("tensorstash bench: "))
    return options if named else True


def _bench(args: argparse.Namespace) -> int:
    args.compile = _compile_options(args)
    if args.steps is None:
        args.steps = 8 if args.sweep else 3
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.loop is not None or args.loop_alone is not None:
        return _bench_loop(args)
    if args.warmup is None:
        args.warmup = 2
    try:
        workload, policies = _workload(args)
    except (ValueError, _plot.PlotUnavailable) as error:
        args.subparser.error(str(error).removeprefix("tensorstash bench: "))
    try:
        rows = _run(args, workload, policies)
    except bench.ModelScriptError as error:
        args.subparser.error(str(error).removeprefix("tensorstash bench: "))
    titles = []
    print(tensorstash.info().line())  # which extensions ran (tensorstash.info())
    dtypes = list(dict.fromkeys(row.dtype for row in rows))
    for index, dtype in enumerate(dtypes):
        mine = [row for row in rows if row.dtype == dtype]
        heading = bench.format_title(
            workload.description,
            args.device,
            dtype,
            mine,
            threads=torch.get_num_threads(),
            warmup=args.warmup,
            compiled=args.compile,
        )
        titles.append(heading)
        if index:
            print()
        print(heading)
        if isinstance(args.compile, CompileOptions):
            print(f"torch.compile: {args.compile.describe()}")
        last = index == len(dtypes) - 1
        print(bench.format_table(mine, device=args.device, legend=last))
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    if args.plot is not None:
        heading = titles[0]
        if len(titles) > 1:
            heading = (
                f"{workload.description}, {args.device} float32 (timelines) and bfloat16 "
                f"autocast, {bench.report.threads_text(torch.get_num_threads())}"
            )
        _plot.plot(rows, args.plot, title=heading, device=args.device)
        print(f"wrote the plot to {args.plot}", file=sys.stderr)
    if args.memory_snapshot is not None:
        print(
            f"wrote {len(rows)} snapshots to {args.memory_snapshot}/; open them at "
            "https://pytorch.org/memory_viz",
            file=sys.stderr,
        )
    return 0


def _bench_loop(args: argparse.Namespace) -> int:
    """``--loop``: each policy trained alone in a fresh process (NOTE [ Training loops ])."""
    dtype = args.dtype or "float32"
    unsupported = {
        "--sweep": args.sweep,
        "--warmup": args.warmup is not None,
        "--plot": args.plot is not None,
        "--memory-snapshot": args.memory_snapshot is not None,
        "--twins": args.twins,
        "--compile": bool(args.compile),
        "--device cuda": args.device != "cpu",
    }
    named = [flag for flag, given in unsupported.items() if given]
    if named:
        args.subparser.error(
            f"--loop measures a CPU training loop's resident memory; leave out {', '.join(named)}"
        )
    if args.loop is None or args.loop <= LEARNING:
        args.subparser.error(
            f"--loop takes more than {LEARNING} steps (an Auto profile learns in the first "
            f"{LEARNING}); got {args.loop}"
        )
    if args.loop_alone is not None:  # a child: one run, printed as JSON
        runner = bench.StepRunner(
            _load_workload(args), bench.resolve_device("cpu"), bench.resolve_dtype(dtype), args.seed
        )
        print(json.dumps(train_alone(runner, args.loop_alone, args.loop)))
        return 0
    try:
        workload, policies = _workload(args)
    except ValueError as error:
        args.subparser.error(str(error).removeprefix("tensorstash bench: "))
    names = [bench.BASELINE, *(p for p in policies if p != bench.BASELINE)]
    peers = [name for name in names if name in bench.OPTIONAL_PEERS]
    if peers:
        print(f"tensorstash bench: skipping {', '.join(peers)}: needs CUDA", file=sys.stderr)
        names = [name for name in names if name not in peers]
    for name in [name for name in names if bench.is_hf_peer(name)]:
        why = bench.skip_reason(name, bench.resolve_device("cpu"), workload=workload)
        if why is not None:
            print(f"tensorstash bench: skipping {name}: {why}", file=sys.stderr)
            names.remove(name)
    model = ["--model", args.model] if args.model_script is None else [
        "--model-script", args.model_script,
    ]  # fmt: skip

    def command(name: str) -> list[str]:
        return [
            sys.executable, "-m", "tensorstash", "bench", "--loop-alone", name,
            "--loop", str(args.loop), "--dtype", dtype, "--seed", str(args.seed),
            "--threads", str(torch.get_num_threads()), *model,
        ]  # fmt: skip

    try:
        runs = run_loops(names, args.steps, command)
    except RuntimeError as error:
        print(str(error), file=sys.stderr)
        return 1
    rows = loop_rows(runs)
    print(format_loop_table(rows, workload.description, dtype, args.loop, args.steps))
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0


def _load_workload(args: argparse.Namespace) -> bench.Workload:
    """The built-in model ``--model`` names, or the user's ``--model-script``."""
    if args.model_script is None:
        return bench.builtin_workload(args.model, args.seed)
    return bench.script_workload(args.model_script, args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorstash`` command.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success. Usage errors (an unknown policy, CUDA
        requested without a CUDA device, ``--plot`` without matplotlib,
        ``--memory-snapshot`` off CUDA, ``--model gpt2-hf`` without
        transformers, a model script that cannot be loaded or breaks its
        protocol, a model that returns no scalar loss) exit through
        ``SystemExit(2)`` with a message on stderr, as argparse does; all but
        the last before any training starts.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)
