"""tensorstash under tensor parallelism: DTensor activations on 2 CPU processes (gloo).

One spawned job (two ranks, a FileStore in tmp_path) runs each case (the MLP
of issue 15, a transformer block with SequenceParallel norms, and that block
with its attention and feed-forward recomputed) under plain autograd and under
every lossless policy, then a few probes (placements, in-place changes); each
rank writes what it saw to a file and the tests below read those files.

The oracle for what autograd saves is an identity hook pair run on the same
forward: the decision log, in pack order, is compared with it row by row.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checks import (
    POLICY_SPECS,
    GradMap,
    assert_grads_equal,
    leak_check,
    rank_results,
    readme_snippet,
    run_ranks,
)
from torch import Tensor, nn

import tensorstash as ts
from tensorstash.integrations.distributed import gather_stats

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available",
    ),
    pytest.mark.slow,  # every test reads the job of 2 spawned ranks
]

WORLD = 2
TIMEOUT_S = 300
CASES = ("mlp", "block", "recompute")
POLICIES = ("keep", "cpu", "lz4", "disk", "lz4+disk", "cpu+lz4+disk", "auto-tight", "select-defer")
"""Every lossless policy of ``checks.POLICY_SPECS``, run after plain autograd ("none")."""
SPECS = {spec.id: spec for spec in POLICY_SPECS}
PLACEMENTS = ("shard", "shard-uneven", "shard-transposed", "replicate", "partial", "strided", "2d")
"""DTensors the session rebuilds (see :func:`_probe_dtensor`)."""
ROUNDTRIP_POLICIES = ("disk", "lz4", "cpu+lz4+disk")
INPLACE_POLICIES = ("keep", "lz4", "disk")
CHANGED_POLICIES = ("copy", "keep", "disk")
"""Policies for :func:`_changed_between_saves`; "copy" is :class:`_CopyAtPack`."""


# -- the models ----------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, h: Tensor) -> Tensor:
        batch, seq, _ = h.shape
        # Each rank holds some of the heads: its shard of the projections.
        q, k, v = (w(h).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in self.qkv())
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.wq, self.wk, self.wv


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(h)))


class _Block(nn.Module):
    """A pre-norm transformer block, sharded as torchtitan shards one."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = _FeedForward(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _block_plan() -> dict[str, Any]:
    """Sequence-parallel norms; attention and feed-forward column- then row-wise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    return {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(**gather),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(**gather),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def _case(name: str, rank: int, mesh: Any) -> tuple[nn.Module, Tensor]:
    """A sharded model (the same on every rank) and this rank's input."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    if name == "mlp":  # the MLP of issue 15; its input is replicated
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return mlp, torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    block = _Block()
    parallelize_module(block, mesh, _block_plan())
    if name == "recompute":
        ts.recompute(block.attn)  # their inputs are DTensors: PrepareModuleInput
        ts.recompute(block.mlp)  # runs before the recomputed forward
    # This rank's half of the sequence (SequenceParallel's Shard(1)).
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(10 + rank))
    return block, x


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).square().mean()


# -- what autograd saves (the oracle for the decision log) ------------------------------


def _local_of(tensor: Tensor) -> Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return _local_of(tensor._local_tensor)
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.elem
    return tensor


def _inventory(model: nn.Module, x: Tensor) -> list[dict[str, Any]]:
    """What one forward saves, in order: kind, parameter storage or not, local shape and bytes."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    storages = {_local_of(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[dict[str, Any]] = []

    def pack(tensor: Tensor) -> Tensor:
        local = _local_of(tensor)
        kind = "plain"
        if isinstance(tensor, DTensor):
            kind = "dtensor"
        elif isinstance(tensor, AsyncCollectiveTensor):
            kind = "collective"
        saved.append(
            {
                "kind": kind,
                "parameter": local.untyped_storage().data_ptr() in storages,
                "shape": list(local.shape),
                "bytes": local.numel() * local.element_size(),
            }
        )
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _loss(model, x)
    return saved


# -- the job each rank runs ----------------------------------------------------------------


def _local_grads(model: nn.Module) -> GradMap:
    grads: GradMap = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        grads[f"param:{name}"] = None if grad is None else grad.detach().clone()
    return grads


def _leaks(session: ts.Session, spill: Path) -> str | None:
    """What ``leak_check`` finds after the graph is freed, or None."""
    try:
        leak_check(session, directories=[spill])
    except AssertionError as error:
        return str(error)
    return None


def _step(model: nn.Module, x: Tensor, policy: str | None, spill: Path) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    if policy is None:
        _loss(model, x).backward()
        return {"grads": _local_grads(model)}
    with ts.stash(SPECS[policy].make(spill), min_bytes=0, record=True) as session:
        loss = _loss(model, x)
    loss.backward()
    del loss
    return {
        "grads": _local_grads(model),
        "stats": session.stats.to_dict(),
        "leaks": _leaks(session, spill),
        "session": session,
    }


def _run_case(name: str, rank: int, mesh: Any, spill: Path) -> dict[str, Any]:
    model, x = _case(name, rank, mesh)
    runs = {"none": _step(model, x, None, spill)}
    for policy in POLICIES:
        runs[policy] = _step(model, x, policy, spill)
    # gather_stats in a tensor-parallel run: every rank calls it, as a collective.
    gathered = gather_stats(runs["disk"].pop("session"))
    for run in runs.values():
        run.pop("session", None)
    return {
        "inventory": _inventory(model, x),
        "runs": runs,
        "gathered": None if gathered is None else gathered.to_dict(),
    }


class _SaveDTensor(torch.autograd.Function):
    """Saves a DTensor for backward; backward reports what it unpacked."""

    @staticmethod
    def forward(ctx: Any, dtensor: Tensor, weight: Tensor, report: list[Any]) -> Tensor:
        ctx.save_for_backward(dtensor)
        ctx.report = report
        return weight * 2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        (dtensor,) = ctx.saved_tensors
        ctx.report.append(dtensor)
        return None, grad * 2, None


def _dtensor(name: str, rank: int, mesh: Any) -> Tensor:
    """A DTensor with the placement ``name`` (:data:`PLACEMENTS` and "mask-partial")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

    gen = torch.Generator().manual_seed(20 + rank)
    local = torch.randn(64, 48, generator=gen)
    if name == "shard":
        return DTensor.from_local(local, mesh, [Shard(0)])
    if name == "shard-uneven":  # 48 + 40 columns
        local = local[:, : 48 - 8 * rank].contiguous()
        return DTensor.from_local(local, mesh, [Shard(1)], shape=(64, 88), stride=(88, 1))
    if name == "shard-transposed":  # a non-contiguous local tensor
        return DTensor.from_local(local.t(), mesh, [Shard(0)])
    if name == "replicate":
        return DTensor.from_local(
            torch.randn(64, 48, generator=torch.Generator().manual_seed(3)), mesh, [Replicate()]
        )
    if name == "partial":
        return DTensor.from_local(local, mesh, [Partial()])
    if name == "strided":
        placement = _StridedShard(0, split_factor=2)
        return DTensor.from_local(local, mesh, [placement], shape=(128, 48), stride=(48, 1))
    if name == "2d":
        mesh_2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
        return DTensor.from_local(local, mesh_2d, [Replicate(), Shard(1)])
    placement = _MaskPartial(offset_shape=torch.Size([128, 48]), offset_dim=0)
    return DTensor.from_local(local, mesh, [placement])


def _probe_dtensor(name: str, policy: str, rank: int, mesh: Any, spill: Path) -> dict[str, Any]:
    """Save one DTensor under ``policy`` and unpack it twice (``retain_graph``): what came back."""
    dtensor = _dtensor(name, rank, mesh)
    weight = torch.ones(4, requires_grad=True)
    report: list[Any] = []
    with ts.stash(SPECS[policy].make(spill), min_bytes=0, record=True) as session:
        out = _SaveDTensor.apply(dtensor, weight, report)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    del out
    local = dtensor._local_tensor  # type: ignore[attr-defined]
    unpacked = [(u, u._local_tensor) for u in report]
    report.clear()
    return {
        "unpacks": len(unpacked),
        "same_object": all(u is dtensor for u, _ in unpacked),
        "type": {type(u).__name__ for u, _ in unpacked},
        "spec": all(
            u.device_mesh == dtensor.device_mesh  # type: ignore[attr-defined]
            and u.placements == dtensor.placements  # type: ignore[attr-defined]
            and (u.shape, u.stride()) == (dtensor.shape, dtensor.stride())
            for u, _ in unpacked
        ),
        "local": all(torch.equal(g, local) and g.stride() == local.stride() for _, g in unpacked),
        "rows": session.decisions,
        "leaks": _leaks(session, spill),
    }


def _inplace(policy: str | None, mesh: Any, spill: Path) -> str:
    """Change a saved DTensor activation in place before backward: the error, or "no error"."""
    from torch.distributed.tensor import DTensor, Shard

    x = DTensor.from_local(torch.randn(64, 64), mesh, [Shard(0)]).requires_grad_()
    session = ts.stash(SPECS[policy].make(spill), min_bytes=0) if policy else None
    with session if session is not None else contextlib.nullcontext():
        y = x * 2
        z = y.sin()  # saves y
    with torch.no_grad():
        y.add_(1)  # a DTensor op: bumps y's version, not its local tensor's
    try:
        z.sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@dataclass(frozen=True)
class _CopyAtPack:
    """Copies a tensor when it is packed: what a policy that moves bytes holds, at once.

    Lz4 and DiskSpill copy in the background, possibly after a later in-place
    change; this one makes a test of what the session hands back independent
    of that timing.
    """

    def pack(self, value: Tensor, ctx: ts.Context) -> Tensor:
        return value.clone()

    def unpack(self, packed: Tensor, ctx: ts.Context) -> Tensor:
        return packed


def _changed_between_saves(through: str, policy: str | None, mesh: Any, spill: Path) -> Tensor:
    """Save a DTensor, change it in place, save it again: the input's gradient.

    The first save's node stays alive but out of the loss, so backward never
    unpacks it and plain autograd raises nothing: only the second save counts,
    and it must see the changed data. ``through`` is "same" (the DTensor saved) or "other"
    (another DTensor over the same local tensor, with its own version counter).
    """
    from torch.distributed.tensor import DTensor, Shard

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    chosen = _CopyAtPack() if policy == "copy" else SPECS[policy].make(spill) if policy else None
    session = ts.stash(chosen, min_bytes=0) if chosen is not None else None
    with session if session is not None else contextlib.nullcontext():
        local = x * 2
        first = DTensor.from_local(local, mesh, [Shard(0)])
        second = first if through == "same" else DTensor.from_local(local, mesh, [Shard(0)])
        unused = first.sin()  # saves first; alive, but not in the loss
        first.mul_(3)
        loss = second.cos().to_local().sum()  # saves second
    loss.backward()
    del unused
    assert x.grad is not None
    return x.grad


def _readme_snippet(rank: int, mesh: Any, spill: Path) -> dict[str, Any]:
    """The README's tensor-parallel snippet run as shown, then plain autograd on its model."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    batch = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    namespace = {"mlp": mlp, "mesh": mesh, "batch": batch}
    tempfile.tempdir = str(spill)  # where DiskSpill() makes its private directory
    try:
        exec(readme_snippet("from torch.distributed.tensor.parallel import"), namespace)
    finally:
        tempfile.tempdir = None
    grads = _local_grads(mlp)
    session, gathered = namespace["session"], namespace["gathered"]
    return {
        "grads": grads,
        "expected": _step(mlp, batch, None, spill)["grads"],
        "gathered": None if gathered is None else gathered.ranks,
        "leaks": _leaks(session, spill),
    }


def _attempt(probe: Callable[..., Any], *args: Any) -> Any:
    """What ``probe(*args)`` returns, or its traceback (reported by the test that reads it)."""
    try:
        return probe(*args)
    except Exception:
        return traceback.format_exc()


def _worker(rank: int, store_path: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    spill = Path(out) / "spill" / f"rank{rank}"  # a leak check sees this rank's files only
    spill.mkdir(parents=True)
    results: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for name in CASES:
            try:
                results[name] = _run_case(name, rank, mesh, spill)
            except Exception:  # reported by the tests of this case
                results[name] = traceback.format_exc()
        results["probes"] = {
            (placement, policy): _attempt(_probe_dtensor, placement, policy, rank, mesh, spill)
            for placement in (*PLACEMENTS, "mask-partial")
            for policy in ROUNDTRIP_POLICIES
        }
        results["readme"] = _attempt(_readme_snippet, rank, mesh, spill)
        results["inplace"] = {p: _inplace(p, mesh, spill) for p in (None, *INPLACE_POLICIES)}
        results["changed"] = {
            (through, p): _attempt(_changed_between_saves, through, p, mesh, spill)
            for through in ("same", "other")
            for p in (None, *CHANGED_POLICIES)
        }
        gc.collect()
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results of the job run on 2 spawned ranks."""
    out = tmp_path_factory.mktemp("tensor_parallel")
    return run_ranks(_worker, out, world=WORLD, timeout_s=TIMEOUT_S)


def _results(job: list[dict[str, Any]], key: Any, group: str | None = None) -> list[Any]:
    return rank_results(job if group is None else [rank[group] for rank in job], key)


# -- gradients and what went where ---------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_grads_equal_plain_autograd(
    job: list[dict[str, Any]], case: str, policy: str
) -> None:
    for rank, result in enumerate(_results(job, case)):
        runs = result["runs"]
        try:
            assert_grads_equal(runs["none"]["grads"], runs[policy]["grads"])
        except AssertionError as error:
            raise AssertionError(f"rank {rank}: {error}") from None


def _rows(result: dict[str, Any], policy: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each saved tensor of the oracle with its row of the decision log."""
    inventory, rows = result["inventory"], result["runs"][policy]["stats"]["decisions"]
    assert len(rows) == len(inventory), f"{len(rows)} rows for {len(inventory)} saved tensors"
    return list(zip(inventory, rows, strict=True))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_dtensor_activations_go_through_the_policy(
    job: list[dict[str, Any]], case: str, policy: str
) -> None:
    tier = SPECS[policy].tier
    for rank, result in enumerate(_results(job, case)):
        pairs = [(s, r) for s, r in _rows(result, policy) if s["kind"] != "plain"]
        activations = [(s, r) for s, r in pairs if not s["parameter"]]
        assert activations, f"rank {rank}: no DTensor activation saved"
        for saved, row in activations:
            where = f"rank {rank}, {saved['kind']} {saved['shape']}: {row}"
            assert "subclass" not in row["reason"], where
            assert (row["shape"], row["bytes"]) == (saved["shape"], saved["bytes"]), where
            if row["reason"] != "deduplicated" and policy not in ("auto-tight", "select-defer"):
                # Lz4 leaves what does not compress where it was.
                assert row["tier"] == tier or "incompressible" in row["reason"], where
        if tier == "disk":  # deferring selectors keep the last ones for backward to start with
            assert any(r["tier"] == "disk" for _, r in activations), f"rank {rank}: none spilled"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_dtensor_parameters_kept_as_parameters(
    job: list[dict[str, Any]], case: str, policy: str
) -> None:
    for rank, result in enumerate(_results(job, case)):
        pairs = [(s, r) for s, r in _rows(result, policy) if s["parameter"]]
        assert any(s["kind"] == "dtensor" for s, _ in pairs), f"rank {rank}: no DTensor parameter"
        for _, row in pairs:
            assert (row["tier"], row["reason"]) == ("kept", "parameter"), f"rank {rank}: {row}"


@pytest.mark.parametrize("policy", POLICIES)
def test_tensor_parallel_same_dtensor_deduplicated(job: list[dict[str, Any]], policy: str) -> None:
    for rank, result in enumerate(_results(job, "block")):
        # q, k and v each save the attention's input: one DTensor, packed once.
        rows = [r for s, r in _rows(result, policy) if s["kind"] == "dtensor"]
        deduplicated = [r for r in rows if r["reason"] == "deduplicated"]
        assert len(deduplicated) >= 2, f"rank {rank}: {rows}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_nothing_left(job: list[dict[str, Any]], case: str, policy: str) -> None:
    for rank, result in enumerate(_results(job, case)):
        assert result["runs"][policy]["leaks"] is None, f"rank {rank}: {result['runs'][policy]}"


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_gather_stats_on_rank_zero(job: list[dict[str, Any]], case: str) -> None:
    first, second = _results(job, case)
    assert second["gathered"] is None, "gather_stats returned stats on a rank other than dst"
    gathered = first["gathered"]
    mine = [first["runs"]["disk"]["stats"], second["runs"]["disk"]["stats"]]
    assert gathered["ranks"] == mine
    disk = gathered["total"]["tiers"]["disk"]
    assert disk["bytes"] == sum(m["tiers"]["disk"]["bytes"] for m in mine) > 0


# -- probes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ROUNDTRIP_POLICIES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_dtensor_rebuilt_with_its_spec(
    job: list[dict[str, Any]], placement: str, policy: str
) -> None:
    for rank, probe in enumerate(_results(job, (placement, policy), "probes")):
        where = f"rank {rank}: {probe}"
        assert probe["unpacks"] == 2, where
        assert probe["type"] == {"DTensor"} and not probe["same_object"], where
        assert probe["spec"], where
        assert probe["local"], where
        (row,) = probe["rows"]
        assert row["tier"] == SPECS[policy].tier or "incompressible" in row["reason"], where
        assert probe["leaks"] is None, where


@pytest.mark.parametrize("policy", ROUNDTRIP_POLICIES)
def test_dtensor_mask_partial_kept_with_its_placement(
    job: list[dict[str, Any]], policy: str
) -> None:
    for rank, probe in enumerate(_results(job, ("mask-partial", policy), "probes")):
        (row,) = probe["rows"]
        assert probe["same_object"], f"rank {rank}: {probe}"
        assert (row["tier"], row["reason"]) == ("kept", "DTensor placement _MaskPartial"), row
        assert row["bytes"] == 64 * 48 * 4, row  # the local tensor's bytes


@pytest.mark.parametrize("policy", INPLACE_POLICIES)
def test_dtensor_changed_in_place_raises(job: list[dict[str, Any]], policy: str) -> None:
    for rank, result in enumerate(_results(job, "inplace")):
        assert "modified by an inplace operation" in result[None], f"rank {rank}: plain autograd"
        assert "modified by an inplace operation" in result[policy], f"rank {rank}: {result}"


@pytest.mark.parametrize("policy", CHANGED_POLICIES)
@pytest.mark.parametrize("through", ["same", "other"])
def test_dtensor_changed_between_saves_not_deduplicated(
    job: list[dict[str, Any]], through: str, policy: str
) -> None:
    expected = _results(job, (through, None), "changed")
    for rank, actual in enumerate(_results(job, (through, policy), "changed")):
        assert torch.equal(expected[rank], actual), f"rank {rank}: the gradient differs"


def test_readme_tensor_parallel_snippet(job: list[dict[str, Any]]) -> None:
    first, second = _results(job, "readme")
    for rank, result in enumerate((first, second)):
        assert_grads_equal(result["expected"], result["grads"])
        assert result["leaks"] is None, f"rank {rank}: {result['leaks']}"
    assert second["gathered"] is None and len(first["gathered"]) == WORLD
