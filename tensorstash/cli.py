"""The ``tensorstash`` command line: ``tensorstash bench`` and its options.

Example:
    $ tensorstash bench --model small --policies none,lz4,disk --steps 3 --json out.json
    $ tensorstash bench --plot bench.png --model-script my_model.py:make
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from tensorstash import bench
from tensorstash.bench import plot as _plot


def _policy_list(text: str) -> list[str]:
    """Parse ``--policies``: comma-separated bench policy names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"no policy in {text!r}; valid policies are {', '.join(bench.ALL_POLICIES)}"
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tensorstash`` command."""
    parser = argparse.ArgumentParser(
        prog="tensorstash",
        description="Move the tensors autograd saves for backward out of the way.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    run = commands.add_parser(
        "bench",
        help="train a small embedded GPT under each policy and compare memory and time",
        description=(
            "Train an embedded GPT-style model for a few steps under each policy (and "
            "under no stash, torch's save_on_cpu and activation checkpointing), "
            "interleaving them step by step, and print peak memory, activation bytes "
            "per tier, step time, overhead against no stash, and whether the gradients "
            "are bitwise equal to plain autograd."
        ),
    )
    models = run.add_mutually_exclusive_group()
    models.add_argument(
        "--model", choices=list(bench.CONFIGS), default="small", help="embedded model size"
    )
    models.add_argument(
        "--model-script",
        metavar="PATH.py:FUNCTION",
        help="bench a model of your own instead: FUNCTION() takes no arguments and returns "
        "(model, batch) or (model, batch, blocks); model(*batch) must return a scalar "
        "loss, batch is a tuple of the forward's arguments (the same every step; tensors "
        "are moved to --device, floating-point ones cast to --dtype) and blocks, needed "
        "by the checkpoint and recompute policies, is a module class or a list of "
        "submodule names (see tensorstash.recompute_modules)",
    )
    run.add_argument(
        "--policies",
        type=_policy_list,
        default=None,
        help=f"comma-separated, from: {','.join(bench.ALL_POLICIES)} and auto:<budget> "
        f"(default: {','.join(bench.DEFAULT_POLICIES)}; none is always run, as the baseline)",
    )
    run.add_argument("--steps", type=_positive_int, default=3, help="timed steps per policy")
    run.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=1,
        help="untimed warm-up steps per policy (one more untimed step measures memory)",
    )
    run.add_argument("--device", type=_device, choices=["cpu", "cuda"], default="cpu")
    run.add_argument("--dtype", choices=list(bench.DTYPES), default="float32")
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    run.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="also draw a PNG: live bytes per tier over one step of each policy, and peak "
        "memory against step time (needs matplotlib: pip install tensorstash[plot])",
    )
    run.add_argument(
        "--memory-snapshot",
        type=Path,
        metavar="DIR",
        help="CUDA only: record one more step of each policy with the CUDA allocator's "
        "history and write DIR/<policy>.pickle, for https://pytorch.org/memory_viz",
    )
    run.add_argument("--seed", type=int, default=0, help="seeds weights, batch and dropout")
    run.set_defaults(subparser=run)
    return parser


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
    if args.plot is not None:
        _plot.require_matplotlib()
    if args.memory_snapshot is not None:
        bench.check_memory_snapshot(args.device)
    if args.model_script is None:
        workload = bench.builtin_workload(args.model, args.seed)
    else:
        workload = bench.script_workload(args.model_script, args.seed)
    policies = args.policies
    if policies is None:
        policies = list(bench.DEFAULT_POLICIES)
        if workload.blocks is None:
            skipped = [name for name in policies if name in bench.NEEDS_BLOCKS]
            policies = [name for name in policies if name not in bench.NEEDS_BLOCKS]
            print(
                f"tensorstash bench: skipping {' and '.join(skipped)}: the model script "
                "returns no blocks to wrap (return (model, batch, blocks) to run them)",
                file=sys.stderr,
            )
    bench.check_blocks(bench.resolve_policies(policies), workload)
    return workload, policies


def _bench(args: argparse.Namespace) -> int:
    try:
        workload, policies = _workload(args)
    except (ValueError, _plot.PlotUnavailable) as error:
        args.subparser.error(str(error).removeprefix("tensorstash bench: "))
    total = bench.planned_steps(
        policies,
        args.steps,
        args.warmup,
        timeline=args.plot is not None,
        memory_snapshot=args.memory_snapshot is not None,
    )
    with _progress_bar(total) as progress:
        try:
            rows = bench.run_bench(
                args.model,
                policies,
                args.steps,
                args.device,
                args.dtype,
                args.seed,
                warmup=args.warmup,
                progress=progress,
                workload=workload,
                timeline=args.plot is not None,
                memory_snapshot=args.memory_snapshot,
            )
        except bench.ModelScriptError as error:
            args.subparser.error(str(error).removeprefix("tensorstash bench: "))
    title = (
        f"{workload.description}, {args.device} {args.dtype}, "
        f"{torch.get_num_threads()} threads, median of {args.steps} timed step(s) per policy"
    )
    print(title)
    print(bench.format_table(rows, device=args.device))
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    if args.plot is not None:
        _plot.plot(rows, args.plot, title=title, device=args.device)
        print(f"wrote the plot to {args.plot}", file=sys.stderr)
    if args.memory_snapshot is not None:
        print(
            f"wrote {len(rows)} snapshots to {args.memory_snapshot}/; open them at "
            "https://pytorch.org/memory_viz",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorstash`` command.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success. Usage errors (an unknown policy, CUDA
        requested without a CUDA device, ``--plot`` without matplotlib,
        ``--memory-snapshot`` off CUDA, a model script that cannot be loaded or
        breaks its protocol) exit through ``SystemExit(2)`` with a message on
        stderr, as argparse does, before any training starts.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    parser.error(f"unknown command {args.command!r}")  # argparse already rejects these
    return 2
