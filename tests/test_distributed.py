"""tensorstash under torch.distributed: DDP and FSDP2 on 2 CPU processes (gloo).

One spawned job (two ranks, a FileStore in tmp_path) runs every combination
of a wrapper (DDP, FSDP2, FSDP2 with bf16 parameters) and a policy for two
training steps, plain autograd first, and each rank writes what it saw to a
file; the tests below read those files. Gradients are compared after DDP's
all-reduce or FSDP2's reduce-scatter, each rank's against plain autograd's in
the same job.
"""

from __future__ import annotations

import contextlib
import datetime
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zoo
from checks import (
    GradMap,
    Ticks,
    assert_grads_equal,
    files_under,
    leak_check,
    rank_results,
    run_ranks,
)
from torch import Tensor, nn

import tensorstash as ts
from tensorstash.integrations.distributed import GatheredStats, gather_stats
from tensorstash.session import _modules

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)

multi_rank = pytest.mark.slow
"""The mark of the tests that read the job of 2 spawned ranks (``make test-all`` runs them)."""
WORLD = 2
STEPS = 2
TIMEOUT_S = 240
MODES = ("ddp", "fsdp", "fsdp-bf16")
POLICIES = ("lz4", "disk", "auto", "auto-plan", "select")
"""Policies run after plain autograd ("none"); "select" is DiskSpill behind a rule
that records every packed tensor sharing storage with a parameter in use;
"auto-plan" is Auto with a Profile kept across the steps, whose second step
follows a plan that recomputes modules (each rank its own plan)."""
QUIET_STEPS = 6
"""Steps of "auto-quiet": Auto at its default budget with a Profile, no decision log,
so that from the fourth step the plan keeps everything and steps run quiet (and
sessions open quiet: rule 11 of NOTE [ Session ]); plain autograd runs as many."""
WHERE = {"lz4": "host", "disk": "disk", "auto": "disk", "auto-plan": "kept", "select": "disk"}


# -- the job each rank runs -----------------------------------------------------------


def _wrap(mode: str, model: nn.Module) -> nn.Module:
    if mode == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # Gradients as views of DDP's buckets, reduced by a communication hook.
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mode == "fsdp-bf16" else None,
        reduce_dtype=torch.float32 if mode == "fsdp-bf16" else None,
    )
    # On the CPU (gloo) also where a GPU is present: fully_shard would pick CUDA.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # fc1 is a unit of its own: its unsharded parameters are swapped in by the
    # pre-forward hook of the very module that saves them.
    fully_shard(model.fc1, mesh=mesh, mp_policy=precision)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, mp_policy=precision)
    return model


def _params_in_use(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters registered now: FSDP2's unsharded ones inside its units' forward."""
    from torch.distributed.tensor import DTensor

    return [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]


def _guard(model: nn.Module, spill: Path, notes: list[str]) -> ts.Select:
    """DiskSpill for every eligible tensor, noting any that shares a parameter's storage."""

    def rule(tensor: Tensor, memory: ts.Memory) -> Any:
        storage = tensor.untyped_storage()
        for name, param in _params_in_use(model):
            if param.untyped_storage().data_ptr() == storage.data_ptr() and storage.nbytes():
                notes.append(f"offered to a policy: {tuple(tensor.shape)}, storage of {name}")
        for module in _modules._stack():  # the modules running now
            for name, param in module.named_parameters(recurse=False):
                if not _modules.is_state(param):
                    notes.append(f"{type(module).__name__}.{name}: storage not recorded")
        return ts.DiskSpill(directory=spill), "guard"

    return ts.Select(rule)


def _policy(name: str, model: nn.Module, spill: Path, notes: list[str]) -> Any:
    if name == "lz4":
        return ts.Lz4()
    if name == "disk":
        return ts.DiskSpill(directory=spill)
    if name in ("auto", "auto-plan"):
        return ts.Auto(device_budget="256KiB", directory=str(spill))
    return _guard(model, spill, notes)


def _local_grads(model: nn.Module) -> GradMap:
    grads: GradMap = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()  # FSDP2: this rank's shard of the reduced gradient
        grads[f"param:{name}"] = None if grad is None else grad.detach().clone()
    return grads


def _train(
    mode: str, policy: str | None, rank: int, spill: Path, steps: int = STEPS, lr: float = 0.1
) -> dict[str, Any]:
    case = zoo.transformer(seed=0)
    shapes = sorted({tuple(p.shape) for p in case.model.parameters()})
    # What autograd saves of them: nn.Linear its weight transposed, layer_norm
    # its weight and bias.
    saved = {tuple(m.weight.shape[::-1]) for m in case.model.modules() if isinstance(m, nn.Linear)}
    saved |= {tuple(m.weight.shape) for m in case.model.modules() if isinstance(m, nn.LayerNorm)}
    model = _wrap(mode, case.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    notes: list[str] = []
    run: dict[str, Any] = {
        "grads": [],
        "stats": [],
        "shapes": [list(s) for s in shapes],
        "saved": [list(s) for s in sorted(saved)],
    }
    profile = ts.Profile(clock=Ticks()) if policy in ("auto-plan", "auto-quiet") else None
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + 10 * rank + step)
        x = torch.randn(4, 64, 128, generator=gen)  # each rank its own batch
        torch.manual_seed(1000 + 10 * rank + step)  # the same dropout masks in every run
        session = None
        if policy == "auto-quiet":
            session = ts.stash(ts.Auto(), profile=profile)
        elif policy is not None:
            chosen = _policy(policy, model, spill, notes)
            session = ts.stash(chosen, min_bytes=0, record=True, profile=profile)
        with session if session is not None else contextlib.nullcontext():
            loss = case.loss(model(x).float())
        loss.backward()
        run["grads"].append(_local_grads(model))
        if session is not None:
            run["stats"].append(session.stats.to_dict())
            plan = session.plan
            run.setdefault("plans", []).append(None if plan is None else list(plan.recompute))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    run["notes"] = notes
    return run


def _gather(rank: int) -> dict[str, Any]:
    """This rank's stats of a small stash, and what gather_stats returned here."""
    model = zoo.mlp(seed=rank).model
    x = torch.randn(64 * (rank + 1), 256)
    with ts.stash(ts.Lz4(), min_bytes=0) as session:
        loss = model(x).square().sum()
    loss.backward()
    gathered = gather_stats(session.stats)
    via_session = gather_stats(session, dst=1)
    return {
        "mine": session.stats.to_dict(),
        "gathered": None if gathered is None else gathered.to_dict(),
        "table": None if gathered is None else gathered.table(),
        "via_session": via_session is not None,
    }


def _worker(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    spill = Path(out) / "spill"
    results: dict[str, Any] = {}
    try:
        for mode in MODES:
            try:
                results[mode] = {
                    name: _train(mode, None if name == "none" else name, rank, spill)
                    for name in ("none", *POLICIES)
                }
                for name in ("none", "auto-quiet"):
                    policy = None if name == "none" else name
                    # A smaller step: at 0.1 the gradients of the fourth step are not finite.
                    long = _train(mode, policy, rank, spill, QUIET_STEPS, lr=1e-3)
                    results[mode][f"{name}-long"] = long
            except Exception:  # reported by the test of this mode
                results[mode] = traceback.format_exc()
        results["gather"] = _gather(rank)
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[dict[str, Any]], Path]]:
    """Run the job on 2 spawned ranks; each rank's results, and the job's directory."""
    out = tmp_path_factory.mktemp("distributed")
    (out / "spill").mkdir()
    yield run_ranks(_worker, out, world=WORLD, timeout_s=TIMEOUT_S), out


def _mode(job: tuple[list[dict[str, Any]], Path], mode: str) -> list[dict[str, Any]]:
    return rank_results(job[0], mode)


# -- gradients -----------------------------------------------------------------------


@multi_rank
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_distributed_grads_equal_plain_autograd(
    job: tuple[list[dict[str, Any]], Path], mode: str, policy: str
) -> None:
    for rank, runs in enumerate(_mode(job, mode)):
        for step in range(STEPS):
            expected, actual = runs["none"]["grads"][step], runs[policy]["grads"][step]
            try:
                assert_grads_equal(expected, actual)
            except AssertionError as error:
                raise AssertionError(f"rank {rank}, step {step}: {error}") from None


@multi_rank
@pytest.mark.parametrize("mode", MODES)
def test_distributed_quiet_steps_equal_plain_autograd(
    job: tuple[list[dict[str, Any]], Path], mode: str
) -> None:
    for rank, runs in enumerate(_mode(job, mode)):
        quiet = runs["auto-quiet-long"]
        assert [stats["quiet"] for stats in quiet["stats"]] == [0, 0, 0, 1, 1, 1], rank
        for step in range(QUIET_STEPS):
            expected, actual = runs["none-long"]["grads"][step], quiet["grads"][step]
            try:
                assert_grads_equal(expected, actual)
            except AssertionError as error:
                raise AssertionError(f"rank {rank}, step {step}: {error}") from None


@multi_rank
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_distributed_policy_packs(
    job: tuple[list[dict[str, Any]], Path], mode: str, policy: str
) -> None:
    tier = WHERE[policy]
    for rank, runs in enumerate(_mode(job, mode)):
        for step, stats in enumerate(runs[policy]["stats"]):
            packed = stats["tiers"][tier]["tensors"]
            assert packed > 0, f"rank {rank}, step {step}: nothing reached {tier!r}: {stats}"
            live = {name: t["live_bytes"] for name, t in stats["tiers"].items()}
            assert all(v == 0 for v in live.values()), f"live bytes after backward: {live}"


@multi_rank
@pytest.mark.parametrize("mode", MODES)
def test_distributed_plan_recomputes_on_each_rank(
    job: tuple[list[dict[str, Any]], Path], mode: str
) -> None:
    for rank, runs in enumerate(_mode(job, mode)):
        plans = runs["auto-plan"]["plans"]
        assert plans[0] is None and plans[-1], f"rank {rank}: plans {plans}"


@multi_rank
def test_distributed_spill_files_removed(job: tuple[list[dict[str, Any]], Path]) -> None:
    assert files_under([job[1] / "spill"]) == []


# -- parameters are never offloaded ---------------------------------------------------


@multi_rank
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_distributed_parameters_kept(
    job: tuple[list[dict[str, Any]], Path], mode: str, policy: str
) -> None:
    for rank, runs in enumerate(_mode(job, mode)):
        run = runs[policy]
        shapes = {tuple(s) for s in run["shapes"]}
        transposed = {s[::-1] for s in shapes if len(s) == 2}
        for step, stats in enumerate(run["stats"]):
            rows = stats["decisions"]
            moved = [r for r in rows if r["tier"] != "kept" and tuple(r["shape"]) in shapes]
            moved += [r for r in rows if r["tier"] != "kept" and tuple(r["shape"]) in transposed]
            assert moved == [], f"rank {rank}, step {step}: parameters offloaded: {moved}"
            if run.get("plans", [None] * (step + 1))[step]:
                continue  # recomputed modules save their parameters inside their own region
            recognised = {tuple(r["shape"]) for r in rows if r["reason"] == "parameter"}
            missing = {tuple(s) for s in run["saved"]} - recognised
            assert not missing, f"rank {rank}, step {step}: not seen as parameters: {missing}"


@multi_rank
@pytest.mark.parametrize("mode", MODES)
def test_distributed_parameter_storage_never_offered(
    job: tuple[list[dict[str, Any]], Path], mode: str
) -> None:
    for rank, runs in enumerate(_mode(job, mode)):
        assert runs["select"]["notes"] == [], f"rank {rank}: {runs['select']['notes'][:5]}"


# -- gathered stats --------------------------------------------------------------------


@multi_rank
def test_gather_stats_on_rank_zero(job: tuple[list[dict[str, Any]], Path]) -> None:
    first, second = (rank["gather"] for rank in job[0])
    assert second["gathered"] is None, "gather_stats returned stats on a rank other than dst"
    gathered = first["gathered"]
    assert gathered["ranks"] == [first["mine"], second["mine"]]
    for tier, counters in gathered["total"]["tiers"].items():
        for key, value in counters.items():
            parts = [rank["mine"]["tiers"][tier][key] for rank in (first, second)]
            assert value == sum(parts), f"total {tier}.{key}: {value} != {parts}"
    assert first["mine"] != second["mine"], "the ranks' stats should differ (different batches)"
    assert "tier" in first["table"] and "all 2 ranks" in first["table"]


@multi_rank
def test_gather_stats_dst_and_session(job: tuple[list[dict[str, Any]], Path]) -> None:
    assert [rank["gather"]["via_session"] for rank in job[0]] == [False, True]


def test_gathered_stats_table_names_every_rank() -> None:
    first, second = ts.StashStats(), ts.StashStats()
    first.add("host", 1000, 250)
    second.add("disk", 500, 500)
    ranks = [first.to_dict(), second.to_dict()]
    table = GatheredStats(ranks, ts.StashStats.combined(ranks, concurrent=True)).table()
    assert "all 2 ranks" in table and "\n0 " in table and "\n1 " in table


def test_gather_stats_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gather_stats(ts.StashStats())


def test_gather_stats_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="StashStats"):
        gather_stats({"tiers": {}})  # type: ignore[arg-type]


# -- wrappers that swap tensors in from their own pre-forward hook (one process) ----------


class _Swapped(nn.Module):
    """Saves a tensor that a pre-forward hook registered, as FSDP2 registers parameters."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.scale = nn.Parameter(torch.rand(256, 256) + 0.5)
        self.register_buffer("table", torch.rand(256, 256) + 0.5)
        self.register_forward_pre_hook(self._swap_in)

    @staticmethod
    def _swap_in(module: nn.Module, args: Any) -> None:
        # A fresh storage on every call, registered after the global hooks ran.
        if module.kind == "parameter":
            module._parameters["scale"] = nn.Parameter(module.scale.detach().clone())
        else:
            module._buffers["table"] = module.table.clone()

    def forward(self, x: Tensor) -> Tensor:
        other = self.scale.detach() if self.kind == "parameter" else self.table
        return torch.tanh(x) * other


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_swapped_in_state_kept(kind: str, tmp_path: Path) -> None:
    def run(ctx: contextlib.AbstractContextManager[Any] | None) -> Tensor:
        torch.manual_seed(0)
        model = _Swapped(kind)
        x = torch.randn(256, 256, requires_grad=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = model(x).sum()
        loss.backward()
        assert x.grad is not None
        return x.grad

    expected = run(None)
    session = ts.stash(ts.DiskSpill(directory=tmp_path), min_bytes=0, record=True)
    assert torch.equal(expected, run(session))
    rows = [(r["op"], r["tier"], r["reason"]) for r in session.decisions]
    assert (None, "kept", kind) in rows, f"the swapped-in tensor was offloaded: {rows}"
    assert any(tier == "disk" for _, tier, _ in rows), f"nothing spilled: {rows}"
    leak_check(session, directories=[tmp_path])
