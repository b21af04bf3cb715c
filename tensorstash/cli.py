"""The ``tensorstash`` command line: ``tensorstash bench`` and its options.

Example:
    $ tensorstash bench --model small --policies none,lz4,disk --steps 3 --json out.json
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
    run.add_argument("--model", choices=list(bench.CONFIGS), default="small", help="model size")
    run.add_argument(
        "--policies",
        type=_policy_list,
        default=list(bench.DEFAULT_POLICIES),
        help=f"comma-separated, from: {','.join(bench.ALL_POLICIES)} (default: all; "
        "none is always run, as the baseline)",
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
    run.add_argument("--seed", type=int, default=0, help="seeds weights, batch and dropout")
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


def _bench(args: argparse.Namespace) -> int:
    config = bench.CONFIGS[args.model]
    total = bench.planned_steps(args.policies, args.steps, args.warmup)
    with _progress_bar(total) as progress:
        rows = bench.run_bench(
            args.model,
            args.policies,
            args.steps,
            args.device,
            args.dtype,
            args.seed,
            warmup=args.warmup,
            progress=progress,
        )
    print(
        f"model {args.model} ({config.describe()}), {args.device} {args.dtype}, "
        f"{torch.get_num_threads()} threads, median of {args.steps} timed step(s) per policy"
    )
    print(bench.format_table(rows, device=args.device))
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorstash`` command.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success. Usage errors (an unknown policy, CUDA
        requested without a CUDA device) exit through ``SystemExit(2)`` with a
        message on stderr, as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    parser.error(f"unknown command {args.command!r}")  # argparse already rejects these
    return 2
