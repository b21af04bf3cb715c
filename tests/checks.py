"""Checkers shared by the tests: gradients against plain autograd, policies, leaks.

The oracle is always plain autograd run fresh in the same test: a tensorstash
result is never compared with another tensorstash result.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import tensorstash as ts

ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
"""Element types every pack and unpack is checked with."""

GradMap = dict[str, Tensor | None]
"""``"param:<name>"`` or ``"input:<index>"`` -> a clone of the gradient (None if none)."""

SEED = 1234


# -- running a step -----------------------------------------------------------------


def fresh_inputs(inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """New leaf copies of ``inputs`` with the same strides and ``requires_grad``.

    ``clone()`` preserves the memory format (channels_last stays channels_last).
    """
    return tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)


def collect_grads(model: nn.Module, inputs: Sequence[Tensor]) -> GradMap:
    """Clones of every parameter's and every grad-requiring input's ``.grad``."""
    grads: GradMap = {}
    for name, param in model.named_parameters():
        grads[f"param:{name}"] = None if param.grad is None else param.grad.detach().clone()
    for index, x in enumerate(inputs):
        if x.requires_grad:
            grads[f"input:{index}"] = None if x.grad is None else x.grad.detach().clone()
    return grads


def grads_of(
    model: nn.Module,
    inputs: Sequence[Tensor],
    loss_fn: Callable[[Any], Tensor],
    ctx: contextlib.AbstractContextManager[Any] | None = None,
    *,
    seed: int = SEED,
) -> GradMap:
    """Run one step and return its gradients.

    Reseeds the RNG (so dropout draws the same masks in every run), clears the
    model's gradients, makes fresh leaf inputs, runs the forward and the loss
    inside ``ctx`` (if given) and the backward after leaving it, as a training
    loop does.
    """
    model.zero_grad(set_to_none=True)
    leaves = fresh_inputs(inputs)
    torch.manual_seed(seed)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = loss_fn(model(*leaves))
    loss.backward()
    return collect_grads(model, leaves)


class Ticks:
    """A clock that moves a microsecond each time it is read (a profile's, in tests).

    Module times then count the reads in a module, so recomputing a module
    looks far cheaper than moving its bytes, whatever the machine's load: plans
    recompute wherever they can.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


def run_case(case: Any, ctx: contextlib.AbstractContextManager[Any] | None = None) -> GradMap:
    """One step of a zoo case (``zoo.Case``) inside ``ctx``: its gradients."""
    return grads_of(case.model, case.inputs, case.loss, ctx)


@contextlib.contextmanager
def within(*managers: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """Enter ``managers`` left to right (outermost first) as one context."""
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


# -- comparing gradients ----------------------------------------------------------------


def _describe_difference(expected: Tensor, actual: Tensor) -> str:
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return (
            f"expected shape {tuple(expected.shape)} {expected.dtype}, "
            f"got {tuple(actual.shape)} {actual.dtype}"
        )
    diff = (expected.double() - actual.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    worst = int(diff.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
    unequal = int((expected != actual).sum())
    return (
        f"{unequal} of {expected.numel()} elements differ; largest difference "
        f"{float(diff.flatten()[worst]):.3g} at index {index} "
        f"(expected {float(expected[index]):.6g}, got {float(actual[index]):.6g})"
    )


def assert_grads_equal(expected: GradMap, actual: GradMap) -> None:
    """Every gradient in ``actual`` is ``torch.equal`` to the one in ``expected``.

    ``expected`` comes from plain autograd. Fails with the name of the first
    parameter or input whose gradient differs. Also fails if ``expected`` has no
    non-zero gradient, so a comparison can never pass vacuously.
    """
    assert expected.keys() == actual.keys(), (
        f"different gradients: only in plain autograd {sorted(expected.keys() - actual.keys())}, "
        f"only under tensorstash {sorted(actual.keys() - expected.keys())}"
    )
    assert any(g is not None and bool(g.ne(0).any()) for g in expected.values()), (
        "plain autograd produced no non-zero gradient: the comparison would be vacuous"
    )
    for name, want in expected.items():
        got = actual[name]
        if want is None or got is None:
            assert want is None and got is None, (
                f"gradient of {name}: plain autograd gave "
                f"{'none' if want is None else 'one'}, tensorstash gave "
                f"{'none' if got is None else 'one'}"
            )
            continue
        assert torch.equal(want, got), (
            f"gradient of {name} differs from plain autograd: {_describe_difference(want, got)}"
        )
        assert want.stride() == got.stride(), (
            f"gradient of {name} has stride {got.stride()}, plain autograd's has {want.stride()}"
        )


def assert_tensors_equal(expected: Tensor, actual: Tensor, what: str) -> None:
    """``torch.equal`` and the same stride, with messages like :func:`assert_grads_equal`'s."""
    assert torch.equal(expected, actual), (
        f"{what} differs from plain autograd: {_describe_difference(expected, actual)}"
    )
    assert expected.stride() == actual.stride(), (
        f"{what} has stride {actual.stride()}, plain autograd's has {expected.stride()}"
    )


# -- policies ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicySpec:
    """A policy to test, and where it puts the tensors of a CPU model.

    Attributes:
        id: the test id.
        make: builds the policy (or its name) given a spill directory, so that
            tests can find the files a disk policy writes.
        tier: the tier eligible CPU tensors end in: "kept" (Keep, and
            CpuOffload, which keeps CPU tensors where they are), "host" (lz4)
            or "disk".
    """

    id: str
    make: Callable[[Path], Any]
    tier: str

    def __repr__(self) -> str:
        return f"PolicySpec({self.id})"


POLICY_SPECS: tuple[PolicySpec, ...] = (
    PolicySpec("keep", lambda _: ts.Keep(), "kept"),
    PolicySpec("cpu", lambda _: ts.CpuOffload(), "kept"),
    PolicySpec("lz4", lambda _: ts.Lz4(), "host"),
    PolicySpec("disk", lambda d: ts.DiskSpill(directory=d), "disk"),
    PolicySpec("lz4+disk", lambda d: ts.Chain(ts.Lz4(), ts.DiskSpill(directory=d)), "disk"),
    PolicySpec(
        "cpu+lz4+disk",
        lambda d: ts.Chain(ts.CpuOffload(), ts.Lz4(), ts.DiskSpill(directory=d)),
        "disk",
    ),
    # The names stash() accepts; "disk" spills to a private temporary directory.
    PolicySpec("name-keep", lambda _: "keep", "kept"),
    PolicySpec("name-cpu", lambda _: "cpu", "kept"),
    PolicySpec("name-lz4", lambda _: "lz4", "host"),
    PolicySpec("name-disk", lambda _: "disk", "disk"),
    # Selectors whose deferred path runs: tensors wait in the recent window and
    # go to disk once newer ones push them out.
    PolicySpec("auto-tight", lambda d: ts.Auto(device_budget=96 << 10, directory=d), "disk"),
    PolicySpec(
        "select-defer",
        lambda d: ts.Select(lambda t, m: ts.Defer(ts.DiskSpill(directory=d), window=48 << 10)),
        "disk",
    ),
)


def policy_params() -> list[Any]:
    """``pytest.param`` for every policy, with its id, to parametrize over."""
    return [pytest.param(spec, id=spec.id) for spec in POLICY_SPECS]


FAST_POLICY, FAST_MODEL = "cpu+lz4+disk", "transformer"
"""The pairs of :func:`model_policy_params` that ``make test`` runs: every model under the
chain through all three tiers, and every policy on the model that saves the most kinds of
tensor; ``make test-all`` runs the rest."""


def model_policy_params(models: Sequence[str]) -> list[Any]:
    """``pytest.param(name, spec)`` for every model under every policy, for
    ``parametrize(("name", "spec"), ...)``: the pairs beside ``FAST_POLICY`` and
    ``FAST_MODEL`` are marked slow."""
    return [
        pytest.param(
            name,
            spec,
            id=f"{spec.id}-{name}",
            marks=() if spec.id == FAST_POLICY or name == FAST_MODEL else pytest.mark.slow,
        )
        for spec in POLICY_SPECS
        for name in models
    ]


def tier_counts(session: Any) -> dict[str, int]:
    """Tensors counted in each tier of a session's stats."""
    tiers = session.stats.to_dict()["tiers"]
    return {name: int(counters["tensors"]) for name, counters in tiers.items()}


def assert_went_to(session: Any, tier: str) -> None:
    """Some tensors rest in ``tier``, none further from the device than it.

    "kept" < "host" < "disk": a Keep session must not have moved anything, an
    lz4 session must have compressed some tensors and spilled none, a disk
    session must have spilled some.
    """
    order = ("kept", "host", "disk")
    counts = tier_counts(session)
    table = session.stats.table()
    assert counts[tier] > 0, f"no tensor reached tier {tier!r}:\n{table}"
    for other in order[order.index(tier) + 1 :]:
        assert counts[other] == 0, f"tensors reached tier {other!r}, expected {tier!r}:\n{table}"


class Stows:
    """The tensors compiled plans' carries stowed inside their graphs (rule 12 of NOTE
    [ Compiled code ]), per session, while :func:`counting_stows` runs."""

    def __init__(self) -> None:
        self._by_context: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def add(self, ctx: Any) -> None:
        self._by_context[ctx] = self._by_context.get(ctx, 0) + 1

    def of(self, session: Any) -> int:
        """The tensors ``session``'s carry stowed (they rest in its disk tier)."""
        return self._by_context.get(session._ctx, 0)


@contextlib.contextmanager
def counting_stows() -> Iterator[Stows]:
    """Count each tensor a compiled graph stows, by the session it stows for: the stow
    asks ``compiler.stow_target()`` for that session's tier and context, once a tensor."""
    from tensorstash.planning import compiler

    stows, target = Stows(), compiler.stow_target

    def counted() -> tuple[Any, Any] | None:
        found = target()
        if found is not None:
            stows.add(found[1])
        return found

    compiler.stow_target = counted
    try:
        yield stows
    finally:
        compiler.stow_target = target


def moved_by_eager_hooks(session: Any, tier: str, stows: Stows) -> int:
    """The tensors a session's stats count in ``tier`` that eager hooks moved: all of
    them, less, on disk, those its compiled plan's carry stowed inside the graphs
    (``stows``, from :func:`counting_stows` around the session's step)."""
    counted = tier_counts(session)[tier]
    if tier != "disk":
        return counted
    stowed = stows.of(session)
    assert stowed <= counted, f"{stowed} stowed, {counted} counted on disk"
    return counted - stowed


# -- the README ---------------------------------------------------------------------------

README = Path(__file__).parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_snippets() -> list[str]:
    """The README's Python snippets, in order."""
    return _BLOCK.findall(README.read_text())


def readme_snippet(starting: str) -> str:
    """The one README Python snippet whose code starts with ``starting``."""
    found = [code for code in readme_snippets() if code.startswith(starting)]
    assert len(found) == 1, f"the README has {len(found)} Python snippets starting {starting!r}"
    return found[0]


# -- several processes ------------------------------------------------------------------


def run_ranks(
    worker: Callable[[int, str, str], None], directory: Path, *, world: int, timeout_s: float
) -> list[Any]:
    """Run ``worker(rank, store_path, directory)`` on ``world`` spawned processes.

    Each rank sets up its process group on the FileStore at ``store_path`` and
    saves what it saw with ``torch.save`` to ``directory / f"rank{rank}.pt"``;
    this returns those results, in rank order. Spawned processes are killed and
    the test fails if the job is not done within ``timeout_s`` seconds (a rank
    that dies leaves the others waiting in a collective).
    """
    import torch.multiprocessing as mp

    context = mp.spawn(
        worker, args=(str(directory / "store"), str(directory)), nprocs=world, join=False
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the distributed job did not finish within {timeout_s} s")
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rank_results(ranks: list[dict[str, Any]], key: Any) -> list[Any]:
    """Each rank's result under ``key``, failing the test where a rank saved a traceback instead."""
    found = [rank[key] for rank in ranks]
    for rank, result in enumerate(found):
        assert not isinstance(result, str), f"{key} failed on rank {rank}:\n{result}"
    return found


# -- leaks ------------------------------------------------------------------------------


def top_saved_tensors_hooks() -> Any:
    """The innermost saved-tensor hook pair pushed on this thread, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def tensorstash_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tensorstash"))


def files_under(directories: Sequence[Path]) -> list[str]:
    """Every file (not directory) below ``directories``, recursively."""
    found: list[str] = []
    for directory in directories:
        if directory.exists():
            found.extend(str(p) for p in directory.rglob("*") if not p.is_dir())
    return sorted(found)


def open_descriptors() -> list[tuple[str, str]]:
    """This process's open descriptors: each ``/proc/self/fd`` entry and what it names."""
    found: list[tuple[str, str]] = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor listdir itself used, closed since
        found.append((f"/proc/self/fd/{fd}", target))
    return found


def spill_descriptors(directories: Sequence[Path]) -> list[str]:
    """What this process's open descriptors name below ``directories``: spill
    files have no name, so they are found by what ``/proc/self/fd`` says."""
    roots = [str(Path(d).resolve()) + os.sep for d in directories]
    found: list[str] = []
    for entry, target in open_descriptors():
        if any(target.startswith(root) for root in roots) and target.endswith("(deleted)"):
            found.append(entry)
    return sorted(found)


def spill_mappings(directories: Sequence[Path]) -> list[str]:
    """This process's mappings of files below ``directories`` (``/proc/self/maps``):
    a mapped spill file lives on after its descriptors are closed."""
    roots = [str(Path(d).resolve()) + os.sep for d in directories]
    with open("/proc/self/maps") as maps:
        lines = maps.read().splitlines()
    return sorted({line for line in lines if any(root in line for root in roots)})


def poll(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition()`` turns true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def leak_check(*sessions: Any, directories: Sequence[Path] = (), timeout: float = 2.0) -> None:
    """After ``gc.collect()``: no saved-tensor hooks pushed, no live bytes in any
    session, no ``tensorstash-*`` thread, and no file under ``directories``,
    named, open or mapped.

    Threads stop and files go away asynchronously, so those are polled for up
    to ``timeout`` seconds.
    """
    gc.collect()
    assert top_saved_tensors_hooks() is None, "saved-tensor hooks are still pushed"
    for session in sessions:
        assert poll(lambda s=session: s.stats.live_bytes == 0, timeout), (
            f"session still holds {session.stats.live_bytes} live bytes:\n{session.stats.table()}"
        )
    assert poll(lambda: not tensorstash_threads(), timeout), (
        f"threads left running: {tensorstash_threads()}"
    )
    assert poll(lambda: not files_under(directories), timeout), (
        f"files left behind: {files_under(directories)}"
    )
    assert poll(lambda: not spill_descriptors(directories), timeout), (
        f"spill files left open: {spill_descriptors(directories)}"
    )
    assert poll(lambda: not spill_mappings(directories), timeout), (
        f"spill files left mapped: {spill_mappings(directories)}"
    )
