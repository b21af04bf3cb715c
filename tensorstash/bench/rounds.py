"""The rounds of ``tensorstash bench``: every variant, interleaved, measured alike.

# NOTE [ Fair comparison ]
Every variant (no stash, each policy, each peer) runs in one process on one
model, and the numbers are only comparable if nothing but the variant differs:

1. Variants are interleaved step by step: a burst of machine noise hits every
   variant of a round alike. Each round starts one variant further along, so
   none always runs first, and the rest follow in an order shuffled anew each
   round (seeded by the round), so none always runs after the same one: a step
   inherits what the step before it left (the kernel's free pages, a file's
   page cache being freed, a trim thread ending). With a plain rotation
   (A B C, B C A, C A B) every variant follows the same one in every round
   and carries what that one leaves: no stash, always run after one Auto
   budget, measured slower than ``auto`` keeping everything with no hooks,
   which is plain autograd (docs/figures/planning.md).
2. Every step starts from the same weights (a ``state_dict`` copy is
   restored), the same batch and the same RNG seed (dropout masks), so
   a lossless variant must produce gradients bitwise equal to plain autograd.
3. The first rounds are untimed warm-up (``warmup``, 2 by default): one-time
   work (lazy imports, thread pools, kernel caches), and Auto's learning steps
   (rule 6). While a planner still learns its plan after them (a step under
   it has yet to take its real peak, or a plan that moves nothing has yet to
   run quiet: ``PlanReading.settled``), up to ``LEARNING_ROUNDS`` more untimed
   rounds run, so the timed rounds measure the plan, not its learning (the
   warm-up rounds alone left some of the HF GPT-2 config's timed rounds
   running with the hooks its plan drops once settled). Every later round
   is timed.
4. Before the first round, one plain-autograd step gives the reference
   gradients ("none" is compared against them too, which checks that the
   step itself is deterministic), and one ``Keep`` step gives the model's
   activation bytes: the eligible bytes a step saves, the kept tier's peak
   (parameters, buffers and tensors under ``min_bytes`` are skipped, not
   counted); a second plain step gives no stash's real peak growth, the base
   of ``auto:<share>`` limits (the first carries the process's one-time work).
5. Memory is measured on every timed step, as NOTE [ Real memory ] in
   memory/_memory.py says: the real peak growth (resident set on the CPU, from a
   trimmed heap; ``max_memory_allocated`` on CUDA) is the headline. What the
   stash counted per tier is a secondary figure: tiers peak at different
   moments, skipped tensors are not in it, and it is not what the process
   held (the disk tier counts bytes from pack on, those still waiting for the
   writer in RAM included). The trim before each step makes every variant
   touch fresh pages in its timed step, as the acceptance checks do.
6. Auto variants ("auto", ``auto:<budget>``, "recompute") each carry their own
   :class:`~tensorstash.Profile` across all their steps, warm-up included: the
   warm-up rounds are their learning steps (the planner applies its plan from
   the second step; checks count from the third), so the timed rounds follow
   the plan. With ``--warmup`` below 2, the first timed steps still learn.
   The plan each step ran under (``session.plan``, where the planner exposes
   one) is read after the step: its predicted step time and real peak are
   compared with that step's measurement. With ``twins``, each
   ``auto:<budget>`` variant also has a twin that never plans (a fresh Profile
   every step), run beside it in every round, the two in turn first: the
   plan's effect is the median of the variant's step over its twin's.
7. Timelines (``--plot``) and allocator snapshots (``--memory-snapshot``)
   come from extra untimed rounds after the timed ones: their hooks cost time,
   so no timed step carries them.
8. On CUDA the whole run uses deterministic algorithms
   (``torch.use_deterministic_algorithms``, and ``CUBLAS_WORKSPACE_CONFIG``
   set to ":4096:8" unless the user set it), restored afterwards: some CUDA
   kernels (atomic adds in attention and embedding backward) give different
   bits on every run, and rule 4's check would then say nothing.
   Deterministic mode also fills every ``torch.empty`` with NaN; the run turns
   that fill off (``torch.utils.deterministic.fill_uninitialized_memory``),
   as the kernels' bits do not depend on it: with it on, every peer that
   allocates a pinned buffer per tensor (``save_on_cpu``) paid a pass of the
   CPU over its bytes that no training run pays.
9. Every ratio is the median over the timed rounds of a ratio inside one
   round (overhead, real peak against none, a plan against its twin, the
   measured overhead against the predicted one) or one step (measured peak
   over predicted), never a ratio of medians: the rounds share the machine's
   state, the medians do not. A predicted step time is compared as an
   overhead (over the plan's base, the step with nothing moved) with the
   step's overhead over none in its round: on a shared machine the same
   step's time drifts by a large share within a minute, and a plan predicts
   from earlier steps than those it runs in.
10. ``--dtype bfloat16`` runs the forward under bfloat16 autocast, weights and
    gradients staying float32, the reference too. Each dtype is a run of its
    own (reference, activation bytes, rounds); ``--sweep`` runs both.
11. An optional peer (another library's offloader, or the compiler's own
    offload, ``compile:offload``, whose stream ops are marked for testing in
    some torch releases) or one of HF's own (NOTE [ HF peers ]) that raises
    while it is made, compiled or run is left out of the rest of the run: its
    row says it was skipped and why, the hooks it left pushed are popped, and
    every other variant goes on.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from tensorstash.bench.compiled import (
    COMPILE_OFFLOAD,
    COMPILE_PREFIX,
    COMPILE_RUNS,
    compiled_run,
)
from tensorstash.bench.hf import is_hf_peer
from tensorstash.bench.measure import (
    DTYPES,
    StepResult,
    StepRunner,
    dtype_name,
    resolve_device,
    resolve_dtype,
)
from tensorstash.bench.rows import Row, summarize
from tensorstash.bench.snapshot import check_memory_snapshot, snapshot_round
from tensorstash.bench.variants import (
    AUTO_PREFIX,
    BASELINE,
    DEFAULT_POLICIES,
    NO_PLAN,
    OPTIONAL_PEERS,
    check_blocks,
    default_policies,
    limit_bytes,
    limit_slack,
    resolve_policies,
    skip_reason,
)
from tensorstash.bench.workloads import Workload, builtin_workload
from tensorstash.core._layout import without_fill

Progress = Callable[[str], None]
"""Called with the variant's name after every step."""

LEARNING_ROUNDS = 12
"""The most untimed rounds added after the warm-up while a planner still learns (rule 3)."""


def planned_steps(
    policies: Sequence[str],
    steps: int,
    warmup: int = 2,
    *,
    timeline: bool = False,
    memory_snapshot: bool = False,
    twins: bool = False,
    device: str | torch.device = "cpu",
    compile: bool = False,
    workload: Workload | None = None,
) -> int:
    """How many steps :func:`run_bench` runs: reference, warm-up, timed and extra rounds,
    and up to ``LEARNING_ROUNDS`` rounds more while a planner learns (rule 3); HF's peers
    count only with a ``workload`` they run on."""
    requested = with_compile_rows(policies, compile)
    names = _runnable(
        resolve_policies(requested), torch.device(device), compiled=compile, workload=workload
    )
    extra = int(timeline) + int(memory_snapshot)
    twin_count = sum(len(group) - 1 for group in _groups(names, twins=twins))
    return 2 + len(names) * (warmup + steps + extra) + twin_count * (warmup + steps)


def with_compile_rows(policies: Sequence[str], compile: bool) -> list[str]:
    """``policies``, and with ``compile`` the compiler's own rows beside them: every one of
    them, or only those ``policies`` names (rule 9 of NOTE [ Compiled runs ])."""
    if not compile or any(name.startswith(COMPILE_PREFIX) for name in policies):
        return list(policies)
    return [*policies, *COMPILE_RUNS]


def _learning(warm: dict[str, list[StepResult]]) -> bool:
    """Rule 3: whether a planner's last step ran a plan it still learns."""
    return any(
        results and results[-1].plan is not None and not results[-1].plan.settled
        for results in warm.values()
    )


def _runnable(
    names: list[str],
    device: torch.device,
    *,
    compiled: bool = False,
    workload: Workload | None = None,
) -> list[str]:
    return [
        name
        for name in names
        if skip_reason(name, device, compiled=compiled, workload=workload) is None
    ]


def _groups(names: Sequence[str], *, twins: bool) -> list[list[str]]:
    """The variants in run order, each ``auto:<budget>`` with its twin beside it (rule 6)."""
    return [
        [name, name + NO_PLAN] if twins and name.startswith(AUTO_PREFIX) else [name]
        for name in names
    ]


def round_order(groups: list[list[str]], index: int) -> list[str]:
    """The variants of round ``index`` (rule 1): the group ``index`` along first, the
    others shuffled by a generator seeded with ``index``; twins in turn first."""
    if not groups:
        return []
    first = groups[index % len(groups)]
    others = [group for group in groups if group is not first]
    random.Random(index).shuffle(others)
    order: list[str] = []
    for group in [first, *others]:
        order.extend(reversed(group) if index % 2 else group)
    return order


def run_bench(
    config_name: str = "small",
    policies: Sequence[str] = DEFAULT_POLICIES,
    steps: int = 3,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    *,
    warmup: int = 2,
    progress: Progress | None = None,
    workload: Workload | None = None,
    timeline: bool = False,
    memory_snapshot: str | Path | None = None,
    twins: bool = False,
    compile: bool = False,
) -> list[Row]:
    """Train a model for a few steps under each variant and measure them.

    The variants are interleaved and compared as NOTE [ Fair comparison ]
    describes; "none" (plain autograd) is always run first, as the baseline.

    Args:
        config_name: a built-in model: "tiny", "small", "medium", "large" or "gpt2-hf".
        policies: names from ``ALL_POLICIES``, ``OPTIONAL_PEERS`` or ``auto:<budget>``.
        steps: timed rounds.
        device: "cpu" or "cuda".
        dtype: "float32", or "bfloat16" for the forward under autocast (rule 10).
        seed: seeds the weights, the batch and dropout.
        warmup: untimed rounds first, Auto's learning steps among them (rules 3, 6).
        progress: called with the variant's name after every step.
        workload: a model of your own (see ``script_workload``) instead of a
            built-in one; ``config_name`` is then unused.
        timeline: run one more untimed step per variant that records memory
            over it (``Row.timeline``, for :func:`tensorstash.bench.plot.plot`).
        memory_snapshot: a directory: run one more untimed step per variant
            under ``torch.cuda.memory._record_memory_history`` and dump it to
            ``<directory>/<policy>.pickle`` for https://pytorch.org/memory_viz
            (CUDA only).
        twins: run each ``auto:<budget>`` beside a twin that never plans (rule 6).
        compile: run every variant on the model compiled by ``torch.compile``,
            with the compiler's own memory budgets (``compile:<b>``) as peers
            (NOTE [ Compiled runs ] in compiled.py).

    Returns:
        One :class:`Row` per variant, "none" first; optional peers that cannot
        run here come back as skipped rows, with the reason.

    Raises:
        ValueError: an unknown model, policy or dtype, ``steps < 1``, CUDA
            requested without a CUDA device, a snapshot asked for off CUDA, or
            "checkpoint"/"recompute" asked for on a workload without blocks.
        WorkloadUnavailable: "gpt2-hf" without transformers.
        ModelScriptError: the model does not return a scalar loss.

    Example:
        >>> for row in run_bench("tiny", ["lz4", "auto:50%"], steps=2):
        ...     print(row.policy, row.real_peak_bytes, row.overhead, row.grads_equal)
    """
    names = resolve_policies(with_compile_rows(policies, compile))
    if steps < 1 or warmup < 0:
        raise ValueError(
            f"tensorstash bench: steps={steps}, warmup={warmup}; pass steps >= 1 "
            "(--steps 1) and warmup >= 0"
        )
    resolved_device, resolved_dtype = resolve_device(device), resolve_dtype(dtype)
    if memory_snapshot is not None:
        check_memory_snapshot(resolved_device)
    if workload is None:
        workload = builtin_workload(config_name, seed)
    check_blocks(names, workload)
    compiles = compile or any(name.startswith(COMPILE_PREFIX) for name in names)
    with _deterministic(resolved_device), compiled_run(compiles):
        runner = StepRunner(workload, resolved_device, resolved_dtype, seed, compile=compile)
        rounds = _Rounds(runner, names, steps, warmup, twins, progress)
        return rounds.run(timeline, memory_snapshot)


def run_sweep(
    config_name: str = "small",
    steps: int = 8,
    device: str | torch.device = "cpu",
    seed: int = 0,
    *,
    policies: Sequence[str] | None = None,
    warmup: int = 2,
    progress: Progress | None = None,
    workload: Workload | None = None,
    timeline: bool = False,
    compile: bool = False,
) -> list[Row]:
    """``tensorstash bench --sweep``: :func:`run_bench` in float32, then under bf16 autocast.

    Runs Auto at 25, 50 and 75% of the activation bytes beside none,
    checkpoint, recompute, save_on_cpu, cpu, lz4, disk and the default Auto,
    and on a GPU the optional peers (:data:`~tensorstash.bench.variants.SWEEP_POLICIES`),
    and on an HF model HF's own peers (``policies=None``:
    :func:`~tensorstash.bench.variants.default_policies`). ``timeline`` records the
    float32 run's timelines only; ``compile`` runs both on the compiled model, beside the
    compiler's own budgets.

    Returns:
        The rows of both runs, float32 first (``Row.dtype`` tells them apart).
    """
    if workload is None:
        workload = builtin_workload(config_name, seed)
    if policies is None:
        policies = default_policies(workload, sweep=True)
    rows: list[Row] = []
    for index, dtype in enumerate(DTYPES):
        rows += run_bench(
            config_name, policies, steps, device, dtype, seed,
            warmup=warmup, progress=progress, workload=workload,
            timeline=timeline and index == 0, compile=compile,
        )  # fmt: skip
    return rows


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """Rule 8 of NOTE [ Fair comparison ]: deterministic CUDA kernels for the run."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with without_fill():
            yield
    finally:
        torch.use_deterministic_algorithms(before)


class _Rounds:
    """One run's rounds, in the order NOTE [ Fair comparison ] gives."""

    def __init__(
        self,
        runner: StepRunner,
        names: list[str],
        steps: int,
        warmup: int,
        twins: bool,
        progress: Progress | None,
    ) -> None:
        self.runner = runner
        self.names = names
        self.runnable = _runnable(
            names, runner.device, compiled=runner.forwards.compile, workload=runner.workload
        )
        self.groups = _groups(self.runnable, twins=twins)
        self.steps = steps
        self.warmup = warmup
        self.tick = progress or (lambda name: None)
        self.dtype = dtype_name(runner.dtype)
        self.failed: dict[str, str] = {}  # rule 11: optional peers that raised, and why

    def run(self, timeline: bool, memory_snapshot: str | Path | None) -> list[Row]:
        self.runner.take_reference()  # rule 4
        self.tick(BASELINE)
        self.tick("keep")
        warm = self._rounds(self.warmup)  # rule 3
        first = self.warmup
        while self.warmup and first < self.warmup + LEARNING_ROUNDS and _learning(warm):
            for name, results in self._rounds(1, first=first).items():
                warm[name].extend(results)
            first += 1
        timed = self._rounds(self.steps, first=first)  # rules 1, 5 and 6
        traces: dict[str, StepResult] = {}
        if timeline:  # rule 7
            for name in self.runnable:
                traces[name] = self.runner.step(name, timeline=True)
                self.tick(name)
        if memory_snapshot is not None:
            snapshot_round(self.runner, self.runnable, Path(memory_snapshot), self.tick)
        return [self._row(name, warm, timed, traces.get(name)) for name in self.names]

    def _rounds(self, count: int, first: int = 0) -> dict[str, list[StepResult]]:
        results: dict[str, list[StepResult]] = {n: [] for group in self.groups for n in group}
        for index in range(first, first + count):
            for name in round_order(self.groups, index):
                if name in self.failed:
                    continue
                step = self._step(name)
                if step is not None:
                    results[name].append(step)
                self.tick(name)
        return results

    def _step(self, name: str) -> StepResult | None:
        """One step of ``name``; rule 11: an optional peer that raises is left out."""
        if name not in OPTIONAL_PEERS and name != COMPILE_OFFLOAD and not is_hf_peer(name):
            return self.runner.step(name)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            return self.runner.step(name)
        except Exception as error:  # another library's code: its failure is its row's
            for _ in range(64):  # hooks it pushed and left behind go with it
                now = torch._C._autograd._top_saved_tensors_default_hooks(False)
                if now is None or now == top:
                    break
                torch._C._autograd._pop_saved_tensors_default_hooks()
            self.failed[name] = f"failed: {type(error).__name__}: {error}"
            return None

    def _row(
        self,
        name: str,
        warm: dict[str, list[StepResult]],
        timed: dict[str, list[StepResult]],
        trace: StepResult | None,
    ) -> Row:
        why = skip_reason(
            name,
            self.runner.device,
            compiled=self.runner.forwards.compile,
            workload=self.runner.workload,
        ) or self.failed.get(name)
        if why is not None:
            return Row.skip(name, self.dtype, why)
        activations, growth = self.runner.activation_bytes, self.runner.plain_growth
        row = summarize(name, self.dtype, timed[name], timed[BASELINE], warm[name])
        limit = limit_bytes(name, growth)
        row = replace(
            row,
            activation_bytes=activations,
            limit_bytes=limit,
            plain_growth=growth,
            over_limit=None
            if limit is None
            else sum(r.peak_bytes > limit + limit_slack(limit) for r in timed[name]),
            timeline=None if trace is None else trace.timeline,
        )
        twin = timed.get(name + NO_PLAN)
        if twin is None:
            return row
        return replace(
            row,
            grads_equal=bool(row.grads_equal)
            and all(r.grads_equal for r in warm[name + NO_PLAN] + twin),
            no_plan_step_times=tuple(r.seconds for r in twin),
            no_plan_peak_bytes=tuple(r.peak_bytes for r in twin),
        )
