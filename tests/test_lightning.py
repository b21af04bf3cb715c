"""StashCallback with a real Lightning Trainer on the CPU (NOTE [ Lightning ] in lightning.py).

Weights after a few steps are compared with a run without the callback: the
oracle is plain autograd under the same Trainer, never another tensorstash run.
"""

from __future__ import annotations

import csv
import importlib
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import files_under, leak_check, top_saved_tensors_hooks
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as lp

import tensorstash as ts
from tensorstash.integrations.lightning import StashCallback

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable"),
]

STEPS = 3
BATCH = 16
WIDTH = 256


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4)
    )


def loader(batches: int = 8) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(batches * BATCH, 32, generator=generator),
        torch.randn(batches * BATCH, 4, generator=generator),
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


class Automatic(lp.LightningModule):
    """One forward per training_step; Lightning runs backward and the optimizer."""

    def __init__(self, out: Path | None = None) -> None:
        super().__init__()
        self.net = tiny_net()
        self.out = out
        self.hooks_in_validation: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # Gradients inside validation (e.g. a saliency metric): something to stash.
        self.hooks_in_validation.append(top_saved_tensors_hooks() is not None)
        with torch.enable_grad():
            x, y = batch
            nn.functional.mse_loss(self.net(x), y).backward()
        self.net.zero_grad(set_to_none=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self) -> None:
        if self.out is None:
            return
        # What each rank's callback did, and its weights: read back by the DDP test.
        stashed = [c.stats for c in self.trainer.callbacks if isinstance(c, StashCallback)]
        spilled = [tier_counts_of(stats)["disk"] for stats in stashed if stats is not None]
        torch.save(
            {"weights": self.net.state_dict(), "spilled": spilled},
            self.out / f"rank{self.global_rank}.pt",
        )


class Manual(Automatic):
    """Two forwards in one training_step, then one manual backward and step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        loss = loss + nn.functional.mse_loss(self.net(x.flip(0) * 2), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()


MODES: dict[str, tuple[type[Automatic], dict[str, Any]]] = {
    "automatic": (Automatic, {}),
    "manual": (Manual, {}),
    "accumulated": (Automatic, {"accumulate_grad_batches": 2}),
}


def trainer(callbacks: list[Any], **kwargs: Any) -> lp.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": STEPS,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    options.update(kwargs)
    return lp.Trainer(callbacks=callbacks, **options)


def fit(
    module: lp.LightningModule, callbacks: list[Any], ckpt_path: Path | None = None, **kwargs: Any
) -> lp.Trainer:
    run = trainer(callbacks, **kwargs)
    validate = kwargs.get("limit_val_batches", 0) != 0
    # weights_only: the callback's checkpoint state must load without unpickling objects.
    val = loader(2) if validate else None
    run.fit(module, loader(), val, ckpt_path=ckpt_path, weights_only=True)
    return run


def assert_weights_equal(expected: nn.Module, actual: nn.Module) -> None:
    initial = tiny_net()
    moved = [
        name
        for (name, p), q in zip(expected.named_parameters(), initial.parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert moved, "training did not change the weights: the comparison would be vacuous"
    for (name, want), got in zip(expected.named_parameters(), actual.parameters(), strict=True):
        assert torch.equal(want, got), f"weight {name} differs from the run without tensorstash"


POLICIES: dict[str, tuple[Callable[[Path], Any], str]] = {
    "lz4": (lambda _: ts.Lz4(), "host"),
    "disk": (lambda d: ts.DiskSpill(directory=d), "disk"),
    "auto-budget": (lambda d: ts.Auto(device_budget=20_000, directory=d), None),
    "auto": (lambda _: "auto", "kept"),
}


# -- weights equal plain training -------------------------------------------------------


@pytest.mark.parametrize("policy_id", list(POLICIES))
@pytest.mark.parametrize("mode", list(MODES))
def test_callback_trains_bitwise_like_plain_lightning(
    mode: str, policy_id: str, spill_dir: Path, private_tmp: Path
) -> None:
    module_class, options = MODES[mode]
    make, tier = POLICIES[policy_id]
    expected = module_class()
    fit(expected, [], **options)

    callback = StashCallback(make(spill_dir), min_bytes=0)
    actual = module_class()
    fit(actual, [callback], **options)

    assert_weights_equal(expected.net, actual.net)
    assert callback.stats is not None, "the callback recorded no stats"
    counts = {name: t["tensors"] for name, t in callback.stats.to_dict()["tiers"].items()}
    if callback.stats.quiet:  # Auto's plan moved nothing: plain autograd, nothing counted
        assert not any(counts.values()), callback.stats.table()
    elif tier is not None:  # Auto with a budget plans: recomputed or moved, test_plan.py says
        assert counts[tier] > 0, f"no tensor reached tier {tier!r}:\n{callback.stats.table()}"
    assert "training_step" not in actual.__dict__, "training_step was not restored"
    leak_check(directories=[spill_dir, private_tmp])


def test_callback_makes_a_profile_for_auto_and_plans_from_step_two(spill_dir: Path) -> None:
    auto = ts.Auto(device_budget=20_000, directory=spill_dir)
    callback = StashCallback(auto, min_bytes=0, record=True)
    assert callback.profile is not None
    fit(Automatic(), [callback])
    assert callback.profile.steps == STEPS
    history = list(callback.profile.history)
    assert not history[0].recomputed and not history[0].moved  # the first step measures
    assert all(step.recomputed or step.moved for step in history[1:])  # then plans


def test_callback_uses_no_profile_for_other_policies() -> None:
    assert StashCallback("lz4").profile is None
    profile = ts.Profile()
    assert StashCallback("lz4", profile=profile).profile is profile


class Lbfgs(Automatic):
    """LBFGS calls its closure, hence training_step, several times per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_callback_merges_the_sessions_of_one_batch(spill_dir: Path) -> None:
    expected = Lbfgs()
    fit(expected, [])
    callback = StashCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    actual = Lbfgs()
    fit(actual, [callback])
    assert_weights_equal(expected.net, actual.net)
    assert actual.calls > 1
    assert callback.stats is not None
    spilled = tier_counts_of(callback.stats)["disk"]
    assert spilled > 0 and spilled % actual.calls == 0, (spilled, actual.calls)
    leak_check(directories=[spill_dir])


class StopsAtBatchTwo(Automatic):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx == 2 else None


def test_callback_survives_a_batch_start_that_ends_the_epoch() -> None:
    callback = StashCallback("lz4", min_bytes=0)
    module = StopsAtBatchTwo()
    fit(module, [callback], max_epochs=1, max_steps=-1)
    assert module.global_step == 2
    assert callback.stats is not None and tier_counts_of(callback.stats)["host"] > 0
    assert "training_step" not in module.__dict__


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("stash_validation", [False, True])
def test_callback_stashes_validation_only_when_asked(stash_validation: bool) -> None:
    callback = StashCallback("lz4", min_bytes=0, stash_validation=stash_validation)
    module = Automatic()
    fit(module, [callback], limit_val_batches=2, val_check_interval=2, inference_mode=False)
    assert module.hooks_in_validation, "validation_step never ran"
    assert set(module.hooks_in_validation) == {stash_validation}
    if stash_validation:
        assert callback.validation_stats is not None
        assert sum(tier_counts_of(callback.validation_stats).values()) > 0
    else:
        assert callback.validation_stats is None
    assert "validation_step" not in module.__dict__


def tier_counts_of(stats: ts.StashStats) -> dict[str, int]:
    return {name: t["tensors"] for name, t in stats.to_dict()["tiers"].items()}


# -- exceptions ---------------------------------------------------------------------------


class FailsInStep(Automatic):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1:
            raise RuntimeError("boom in training_step")
        return loss


class FailsBeforeBackward(Automatic):
    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.global_step == 1:
            raise RuntimeError("boom before backward")


@pytest.mark.parametrize("module_class", [FailsInStep, FailsBeforeBackward])
def test_callback_leaves_no_hooks_nor_files_after_an_exception(
    module_class: type[Automatic], spill_dir: Path
) -> None:
    callback = StashCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    module = module_class()
    with pytest.raises(RuntimeError, match="boom"):
        fit(module, [callback])
    assert top_saved_tensors_hooks() is None, "saved-tensor hooks are still pushed"
    assert "training_step" not in module.__dict__, "training_step was not restored"
    leak_check(directories=[spill_dir])


def test_callback_restores_an_instance_training_step() -> None:
    module = Automatic()
    own = module.training_step
    module.training_step = own  # type: ignore[method-assign]
    callback = StashCallback("lz4", min_bytes=0)
    fit(module, [callback])
    assert module.__dict__["training_step"] is own
    assert callback.stats is not None


# -- logging ------------------------------------------------------------------------------


def test_callback_logs_stats_every_n_steps(tmp_path: Path) -> None:
    logger = lp.loggers.CSVLogger(tmp_path, name="run")
    callback = StashCallback("lz4", min_bytes=0)
    fit(Automatic(), [callback], logger=logger, log_every_n_steps=2, max_steps=4)
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("tensorstash/host_bytes")]
    assert [int(row["step"]) for row in rows] == [1, 3]
    for row in rows:
        assert float(row["tensorstash/host_tensors"]) > 0
        assert float(row["tensorstash/host_bytes"]) > float(row["tensorstash/host_stored_bytes"])
        assert float(row["tensorstash/compression_ratio"]) > 1
        for key in ("kept_bytes", "disk_bytes", "wait_seconds", "pack_seconds"):
            assert f"tensorstash/{key}" in row


def test_callback_logs_nothing_when_asked_not_to() -> None:
    callback = StashCallback("lz4", min_bytes=0, log_stats=False)
    run = fit(Automatic(), [callback])
    assert not [key for key in run.callback_metrics if key.startswith("tensorstash/")]
    assert callback.stats is not None


# -- checkpoints --------------------------------------------------------------------------


def test_callback_profile_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    first = StashCallback(ts.Auto(device_budget=20_000), min_bytes=0)
    run = fit(Automatic(), [first])
    path = tmp_path / "last.ckpt"
    run.save_checkpoint(path)
    assert first.profile is not None
    saved = first.profile.state_dict()
    assert saved["steps"] == STEPS and saved["sites"]

    # Resume for one more step: its plan comes from the checkpoint.
    second = StashCallback(ts.Auto(device_budget=20_000), min_bytes=0, record=True)
    resumed = Automatic()
    fit(resumed, [second], max_steps=STEPS + 1, ckpt_path=path)
    assert second.profile is not None and second.stats is not None
    assert second.profile.steps == STEPS + 1
    assert set(second.profile.last) == {
        (s["module"], s["op"], s["occurrence"]) for s in saved["sites"]
    }
    resumed_step = second.profile.history[-1]
    assert resumed_step.recomputed or resumed_step.moved, "the resumed step did not plan"


def test_callback_logs_the_plan_when_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    # Rule 7 of NOTE [ Lightning ]: a new plan's table reaches the "tensorstash" logger.
    callback = StashCallback(ts.Auto(device_budget=20_000), min_bytes=0)
    with caplog.at_level("INFO", logger="tensorstash"):
        fit(Automatic(), [callback], max_steps=STEPS + 2)
    logged = [r for r in caplog.records if "the plan from step" in r.getMessage()]
    assert callback.plans.changes, "no plan was followed"
    assert len(logged) == len(callback.plans.changes)
    step, table = callback.plans.changes[0]
    assert step >= 1 and table.startswith("budget 19.5 KiB")
    assert table in logged[0].getMessage()


def test_callback_warns_when_a_checkpoint_profile_has_nowhere_to_go() -> None:
    state = StashCallback("auto").state_dict()
    with pytest.warns(UserWarning, match="has none"):
        StashCallback("lz4").load_state_dict(state)


def test_callback_pickles_after_a_fit_for_spawned_processes() -> None:
    callback = StashCallback("auto", min_bytes=0)
    fit(Automatic(), [callback])
    copy = pickle.loads(pickle.dumps(callback))
    assert copy.stats is None and copy.profile is not None
    assert copy.profile.state_dict() == callback.profile.state_dict()  # type: ignore[union-attr]
    assert copy.policy == callback.policy


# -- arguments, packages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "zip"}, ValueError, "unknown policy name 'zip'"),
        ({"min_bytes": -1}, ValueError, "min_bytes must be at least 0 bytes"),
        ({"log_stats": "yes"}, TypeError, "log_stats must be True or False"),
        ({"stash_validation": 1}, TypeError, "stash_validation must be True or False"),
        ({"profile": {}}, TypeError, "profile must be a tensorstash.Profile"),
    ],
)
def test_callback_rejects_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        StashCallback(**kwargs)


def test_callback_is_built_on_one_lightning_package() -> None:
    assert issubclass(StashCallback, lp.Callback)
    pl = pytest.importorskip("pytorch_lightning")
    assert not issubclass(StashCallback, pl.Callback)


def test_pl_callback_trains_a_pytorch_lightning_trainer(spill_dir: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from tensorstash.integrations.lightning import PLStashCallback

    assert issubclass(PLStashCallback, pl.Callback)
    assert not issubclass(PLStashCallback, lp.Callback)

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(callbacks: list[Any]) -> nn.Module:
        module = Module()
        pl.Trainer(
            accelerator="cpu",
            max_steps=STEPS,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            callbacks=callbacks,
        ).fit(module, loader())
        return module.net

    callback = PLStashCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    assert_weights_equal(run([]), run([callback]))
    assert callback.stats is not None and tier_counts_of(callback.stats)["disk"] > 0
    leak_check(directories=[spill_dir])


def test_import_without_lightning_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of None raises ImportError
    for path in ("tensorstash.integrations.lightning", "tensorstash.lightning"):  # new and old path
        monkeypatch.delitem(sys.modules, path, raising=False)
    with pytest.raises(ImportError, match=r"pip install tensorstash\[lightning\]"):
        importlib.import_module("tensorstash.lightning")
    with pytest.raises(ImportError, match=r"pip install tensorstash\[lightning\]"):
        importlib.import_module("tensorstash.integrations.lightning")


# -- distributed ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_callback_trains_bitwise_like_plain_lightning_under_ddp(tmp_path: Path) -> None:
    # ddp_fork: two CPU processes on gloo. ddp_spawn is the same strategy, but
    # each spawned process imports Lightning again, which takes many seconds.
    options = {"strategy": "ddp_fork", "devices": 2}
    plain, stashed = tmp_path / "plain", tmp_path / "stashed"
    spill = tmp_path / "spill"
    for path in (plain, stashed, spill):
        path.mkdir()
    fit(Automatic(out=plain), [], **options)
    callback = StashCallback(ts.DiskSpill(directory=spill), min_bytes=0)
    fit(Automatic(out=stashed), [callback], **options)
    expected = torch.load(plain / "rank0.pt")["weights"]
    assert not torch.equal(expected["0.weight"], tiny_net().state_dict()["0.weight"])
    for rank in (0, 1):
        for where in (plain, stashed):
            saved = torch.load(where / f"rank{rank}.pt")
            for name, want in expected.items():
                assert torch.equal(want, saved["weights"][name]), (
                    f"{where.name} rank {rank}: {name}"
                )
        spilled = torch.load(stashed / f"rank{rank}.pt")["spilled"]
        assert spilled and spilled[0] > 0, f"rank {rank} spilled nothing: {spilled}"
    # Spill files are gone. (Each process's empty private directory stays until
    # a later process removes it: these processes end with os._exit, skipping atexit.)
    assert files_under([spill]) == []


class Compiled(Automatic):
    """The network compiled (the min-cut partitioner, without inductor's compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="aot_eager_decomp_partition")


@pytest.mark.slow  # compiles the network at several settings
def test_callback_auto_plans_a_compiled_module_through_the_compiler() -> None:
    """Auto with a budget under what the compiled forward keeps asks the partitioner for
    less (NOTE [ Compiled code ]): no eager hook sees the compiled graph's tensors, and the
    weights are those of the compiled module trained alone."""
    from tensorstash.planning import compiler

    torch._dynamo.reset()
    try:
        expected = Compiled()
        fit(expected, [], max_steps=10)
        callback = StashCallback(ts.Auto(device_budget=4096), min_bytes=0)
        actual = Compiled()
        fit(actual, [callback], max_steps=10)
    finally:
        torch._dynamo.reset()
    assert callback.profile is not None and compiler.known(callback.profile).compiled
    (search,) = compiler.known(callback.profile).searches.values()
    assert search.trials[1.0].kept_bytes > 4096 and search.settled
    assert search.choice is not None and search.choice < 1.0
    counts = callback.stats.to_dict()["tiers"] if callback.stats is not None else {}
    assert not any(tier["tensors"] for tier in counts.values()), "an eager hook saw a tensor"
    assert_weights_equal(expected.net, actual.net)


# -- a memory limit ---------------------------------------------------------------------------


class Wide(lp.LightningModule):
    """Six residual blocks on a 4096 x 512 batch (8 MiB activations), trained with AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)) for _ in range(6)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _wide_loader() -> torch.utils.data.DataLoader[Any]:
    data = torch.randn(4096, 512, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4096)


def _fit_peak(callbacks: list[Any], steps: int) -> tuple[int, int]:
    """The trimmed resident set before a fit and the most it held in it."""
    from tensorstash.memory._memory import PeakRss, return_free_memory

    return_free_memory()
    with PeakRss() as meter:
        trainer(callbacks, max_steps=steps).fit(Wide(), _wide_loader())
    return meter.start_bytes, meter.peak_bytes


@pytest.mark.slow
def test_callback_keeps_every_step_under_a_limit_with_adamw() -> None:
    # The optimizer's state comes at its first step(): the plans after see it (NOTE
    # [ Memory limit ] rule 2), and no step of the fit goes over the limit.
    steps = 6
    _fit_peak([], steps)  # what a first fit imports and sets up is no step's
    base, peak = _fit_peak([], steps)
    mib = 1 << 20
    limit = base + (peak - base) - 80 * mib  # 80 MiB of its activations must go
    callback = StashCallback(ts.Auto(limit=limit))
    start, held = _fit_peak([callback], steps)
    assert start <= base + 16 * mib  # the two fits began alike
    assert held <= limit + max(2 * mib, (limit - start) // 25), (held - limit) / mib
    assert any("moving" in t or "disk" in t or "recompute" in t for _, t in callback.plans.changes)
