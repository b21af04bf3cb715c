"""tensorstash.integrations.hf.StashTrainerCallback in a real ``transformers.Trainer`` loop.

The oracle is the same Trainer run without the callback: the final weights
must be equal bit for bit (dropout on, so the RNG must not be disturbed).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import leak_check, top_saved_tensors_hooks
from torch import Tensor, nn

import tensorstash as ts

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tensorstash.integrations.hf import StashTrainerCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_STEPS = 3


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token ids, the labels being the inputs (a language-model batch)."""

    def __init__(self, n: int = 16, length: int = 32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_gpt2() -> nn.Module:
    """A two-layer GPT-2 built from a config, dropout on, the same weights every call."""
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=128,
        n_positions=64,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def train(
    output_dir: Path,
    callbacks: list[Any] | None = None,
    *,
    model: nn.Module | None = None,
    eval_dataset: Any = None,
    attach: StashTrainerCallback | None = None,
    **overrides: Any,
) -> Any:
    """Train the tiny model; returns the Trainer (its model holds the final weights)."""
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 4,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
        "logging_steps": 1,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    trainer = transformers.Trainer(
        model=model if model is not None else tiny_gpt2(),
        args=transformers.TrainingArguments(**settings),
        train_dataset=Tokens(),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
    )
    if attach is not None:
        attach.attach(trainer)
    trainer.train()
    return trainer


_PLAIN: dict[tuple[tuple[str, Any], ...], dict[str, Tensor]] = {}


def plain_weights(tmp_path: Path, **overrides: Any) -> dict[str, Tensor]:
    """The final weights of a run without tensorstash (computed once per setting)."""
    key = tuple(sorted(overrides.items()))
    if key not in _PLAIN:
        trainer = train(tmp_path / "plain", **overrides)
        _PLAIN[key] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return _PLAIN[key]


def assert_weights_equal(expected: dict[str, Tensor], model: nn.Module) -> None:
    actual = model.state_dict()
    assert expected.keys() == actual.keys()
    moved = [name for name in expected if not torch.equal(expected[name], tiny_gpt2_init()[name])]
    assert moved, "training changed no weight: the comparison would be vacuous"
    for name, want in expected.items():
        assert torch.equal(want, actual[name]), f"weight {name} differs from plain training"


_INIT: dict[str, Tensor] = {}


def tiny_gpt2_init() -> dict[str, Tensor]:
    if not _INIT:
        _INIT.update(tiny_gpt2().state_dict())
    return _INIT


def tier_tensors(callback: StashTrainerCallback, tier: str) -> int:
    assert callback.stats is not None, "no training step was stashed"
    return int(callback.stats.tiers[tier].tensors)  # type: ignore[index]


# -- the weights -------------------------------------------------------------------------

POLICIES: dict[str, tuple[Callable[[Path], Any], str | None]] = {
    # id: (policy given a spill directory, the tier tensors must reach or None)
    "lz4": (lambda _: ts.Lz4(), "host"),
    "disk": (lambda d: ts.DiskSpill(directory=d), "disk"),
    "auto": (lambda _: "auto", None),
    "auto-small-budget": (lambda _: ts.Auto(device_budget="64KiB"), "disk"),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_callback_weights_equal_plain_training(
    name: str, tmp_path: Path, spill_dir: Path, private_tmp: Path
) -> None:
    make, tier = POLICIES[name]
    callback = StashTrainerCallback(make(spill_dir), min_bytes=0)
    trainer = train(tmp_path / "run", [callback])
    assert_weights_equal(plain_weights(tmp_path), trainer.model)
    assert callback.forwards == MAX_STEPS
    if tier is not None:
        assert tier_tensors(callback, tier) > 0, callback.stats.table()  # type: ignore[union-attr]
    leak_check(directories=[spill_dir, private_tmp])


def test_callback_gradient_accumulation_stashes_every_micro_batch(
    tmp_path: Path, spill_dir: Path
) -> None:
    callback = StashTrainerCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    trainer = train(tmp_path / "run", [callback], gradient_accumulation_steps=2)
    assert_weights_equal(plain_weights(tmp_path, gradient_accumulation_steps=2), trainer.model)
    assert callback.forwards == 2 * MAX_STEPS
    single = StashTrainerCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    train(tmp_path / "single", [single], max_steps=1)
    assert tier_tensors(callback, "disk") == 2 * tier_tensors(single, "disk") > 0
    leak_check(directories=[spill_dir])


_CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


@pytest.mark.parametrize(
    "overrides",
    [{"bf16": True}, {_CHECKPOINTING: True}],
    ids=["bf16-autocast", "activation-checkpointing"],
)
def test_callback_weights_equal_under_trainer_features(
    overrides: dict[str, Any], tmp_path: Path
) -> None:
    # bf16: accelerate wraps the model's forward in autocast; checkpointing:
    # the blocks push their own saved-tensor hooks inside the session.
    callback = StashTrainerCallback(ts.Lz4(), min_bytes=0)
    trainer = train(tmp_path / "run", [callback], **overrides)
    assert_weights_equal(plain_weights(tmp_path, **overrides), trainer.model)
    assert tier_tensors(callback, "host") > 0, callback.stats.table()  # type: ignore[union-attr]


# -- which forwards ----------------------------------------------------------------------


def test_callback_never_stashes_evaluation_or_prediction(tmp_path: Path) -> None:
    seen: list[tuple[bool, bool]] = []  # (training, hooks pushed) per block forward

    def probe(module: nn.Module, args: Any, output: Any) -> None:
        seen.append((module.training, top_saved_tensors_hooks() is not None))

    model = tiny_gpt2()
    model.transformer.h[0].register_forward_hook(probe)
    callback = StashTrainerCallback(ts.Lz4(), min_bytes=0)
    trainer = train(
        tmp_path / "run",
        [callback],
        model=model,
        eval_dataset=Tokens(n=8, seed=1),
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
    )
    trainer.predict(Tokens(n=4, seed=2))
    training = [pushed for is_training, pushed in seen if is_training]
    evaluation = [pushed for is_training, pushed in seen if not is_training]
    assert training == [True] * MAX_STEPS
    assert len(evaluation) == 2 * MAX_STEPS + 1 and not any(evaluation)
    assert callback.forwards == MAX_STEPS
    assert not model._forward_pre_hooks and not model._forward_hooks, "hooks left on the model"


# -- exceptions --------------------------------------------------------------------------


def failing_model(exception: type[BaseException], on_call: int) -> nn.Module:
    """The tiny model, whose second block raises ``exception("boom")`` in its
    ``on_call``-th training forward (after the first block saved its tensors).

    A new exception each time: a raised exception keeps its traceback, and the
    traceback the frames that hold the partial graph.
    """
    model = tiny_gpt2()
    calls = [0]

    def fail(module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            calls[0] += 1
            if calls[0] == on_call:
                raise exception("boom")

    model.transformer.h[1].register_forward_hook(fail)
    return model


def train_expecting(exception: type[BaseException], *args: Any, **kwargs: Any) -> None:
    # In a function of its own, so the traceback (which holds the partial
    # graph) is gone when the caller checks for leftover files.
    with pytest.raises(exception, match="boom"):
        train(*args, **kwargs)


def test_callback_exception_in_forward_leaves_no_hooks_or_files(
    tmp_path: Path, spill_dir: Path
) -> None:
    callback = StashTrainerCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    model = failing_model(RuntimeError, on_call=2)
    train_expecting(RuntimeError, tmp_path / "run", [callback], model=model)
    assert top_saved_tensors_hooks() is None, "the session is still pushed"
    assert callback.forwards == 2
    leak_check(directories=[spill_dir])
    callback.close()  # closing again does nothing
    assert top_saved_tensors_hooks() is None
    # The same model and callback train again; the hooks are replaced, not doubled.
    trainer = train(tmp_path / "again", [callback], model=model, max_steps=1)
    assert callback.forwards == 3
    assert not trainer.model._forward_pre_hooks, "hooks left on the model"
    leak_check(directories=[spill_dir])


def test_callback_close_ends_session_interrupted_in_forward(
    tmp_path: Path, spill_dir: Path
) -> None:
    # PyTorch runs no forward hook for a KeyboardInterrupt: close() (or the
    # callback's next Trainer event) ends the session.
    callback = StashTrainerCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    model = failing_model(KeyboardInterrupt, on_call=1)
    train_expecting(KeyboardInterrupt, tmp_path / "run", [callback], model=model)
    callback.close()
    callback.close()
    leak_check(directories=[spill_dir])


# -- logs --------------------------------------------------------------------------------

KEYS = {
    f"tensorstash/{tier}_{field}"
    for tier in ("kept", "host", "disk")
    for field in ("tensors", "bytes", "stored_bytes", "peak_bytes")
} | {
    f"tensorstash/{key}"
    for key in (
        "compression_ratio",
        "pack_seconds",
        "unpack_seconds",
        "wait_seconds",
        "returned_bytes",
    )
}


class LogRecorder(transformers.TrainerCallback):  # type: ignore[misc]
    """Keeps a copy of every log the Trainer hands to callbacks, at its turn."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs))


def test_callback_logs_stats_every_logging_steps(tmp_path: Path, spill_dir: Path) -> None:
    callback = StashTrainerCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    after = LogRecorder()
    trainer = train(tmp_path / "run", [callback, after], max_steps=4, logging_steps=2)
    history = trainer.state.log_history
    training = [entry for entry in history if "loss" in entry]
    assert [entry["step"] for entry in training] == [2, 4]
    per_step = float(tier_tensors(callback, "disk"))
    for entry in training:
        assert entry.keys() >= KEYS, f"missing {sorted(KEYS - entry.keys())}"
        assert entry["tensorstash/disk_tensors"] == per_step > 0  # the mean of two equal steps
    others = [entry for entry in history if "loss" not in entry]
    assert others and not any(KEYS & entry.keys() for entry in others)
    assert [sorted(KEYS & log.keys()) for log in after.logs if "loss" in log] == [sorted(KEYS)] * 2


def test_callback_attach_reaches_integrations_first(tmp_path: Path) -> None:
    callback = StashTrainerCallback(ts.Lz4(), min_bytes=0)
    before = LogRecorder()  # stands for a report_to integration, which runs first
    train(tmp_path / "run", [before], attach=callback, max_steps=1)
    assert before.logs[0].keys() >= KEYS


def test_callback_log_stats_false_logs_nothing(tmp_path: Path) -> None:
    callback = StashTrainerCallback(ts.Lz4(), min_bytes=0, log_stats=False)
    trainer = train(tmp_path / "run", [callback], max_steps=1)
    assert callback.forwards == 1
    assert not any(KEYS & entry.keys() for entry in trainer.state.log_history)


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_stats": "yes"}, TypeError, "log_stats must be True or False"),
        ({"min_bytes": -1}, ValueError, "min_bytes must be at least 0 bytes"),
        ({"policy": "nope"}, ValueError, "unknown policy name 'nope'"),
    ],
)
def test_callback_rejects_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        StashTrainerCallback(**kwargs)


def test_import_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    for path in ("tensorstash.integrations.hf", "tensorstash.hf"):  # new and old path
        monkeypatch.delitem(sys.modules, path, raising=False)
    with pytest.raises(ImportError, match=r"pip install tensorstash\[hf\]"):
        importlib.import_module("tensorstash.hf")
    with pytest.raises(ImportError, match=r"pip install tensorstash\[hf\]"):
        importlib.import_module("tensorstash.integrations.hf")


def test_metrics_average_steps_and_keep_the_largest_peak() -> None:
    first, second, interval = ts.StashStats(), ts.StashStats(), ts.StashStats()
    first.add("host", 100, 50)
    second.add("host", 300, 100)
    second.timed("wait", 0.5)
    for step in (first, second):
        interval.merge(step, decisions=False)
    values = interval.metrics(per=2)
    assert values.keys() == KEYS
    assert values["tensorstash/host_bytes"] == 200
    assert values["tensorstash/host_stored_bytes"] == 75
    assert values["tensorstash/host_tensors"] == 1
    assert values["tensorstash/host_peak_bytes"] == 100
    assert values["tensorstash/compression_ratio"] == 400 / 150
    assert values["tensorstash/wait_seconds"] == 0.25


@pytest.mark.slow  # compiles the model
def test_callback_auto_plans_a_compiled_model_through_the_compiler(tmp_path: Path) -> None:
    """``torch_compile=True``: Auto with a budget under what the compiled forward keeps asks
    the partitioner for less (NOTE [ Compiled code ]); no eager hook sees the compiled
    graphs' tensors, and training matches the compiled model alone within rounding (the
    search runs steps at several settings, so no single setting's run is bitwise the same;
    SGD, whose weights move by the learning rate times the gradients' rounding; no dropout,
    as graphs compiled at other settings draw the RNG apart)."""
    from tensorstash.planning import compiler

    compile_args = {"torch_compile": True, "optim": "sgd", "max_steps": 8}

    def model() -> nn.Module:  # no dropout: graphs compiled at other settings draw RNG apart
        built = tiny_gpt2()
        for module in built.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        return built

    torch._dynamo.reset()
    try:
        expected = train(tmp_path / "plain", model=model(), **compile_args).model.state_dict()
        callback = StashTrainerCallback(ts.Auto(device_budget="16KiB"), min_bytes=0)
        trainer = train(tmp_path / "run", [callback], model=model(), **compile_args)
    finally:
        torch._dynamo.reset()
    assert callback.profile is not None and compiler.known(callback.profile).compiled
    plans = [s for s in compiler.known(callback.profile).searches.values()]
    assert len(plans) == 1 and plans[0].trials[1.0].kept_bytes > 16 << 10
    assert min(plans[0].trials) < 1.0  # the partitioner was asked for less
    for name, want in expected.items():
        assert torch.allclose(want, trainer.model.state_dict()[name], rtol=1e-4, atol=1e-6), name


# -- the plan and the profile across checkpoints (rules 7 and 8 of NOTE [ Trainer ]) ----------


def test_callback_logs_the_plan_when_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = StashTrainerCallback(ts.Auto(device_budget="64KiB"), min_bytes=0)
    with caplog.at_level("INFO", logger="tensorstash"):
        train(tmp_path / "run", [callback], max_steps=5)
    logged = [r for r in caplog.records if "the plan from step" in r.getMessage()]
    assert callback.plans.changes, "no plan was followed"
    assert len(logged) == len(callback.plans.changes)
    step, table = callback.plans.changes[0]
    assert step >= 2 and "budget 64.0 KiB" in table  # the first step measures
    assert table in logged[0].getMessage()
    assert callback.plans.plan is not None


def test_callback_saves_the_profile_and_a_resumed_run_plans_from_it(tmp_path: Path) -> None:
    output = tmp_path / "run"
    first = StashTrainerCallback(ts.Auto(device_budget="64KiB"), min_bytes=0)
    train(output, [first], max_steps=4, save_strategy="steps", save_steps=2)
    for step in (2, 4):
        assert (output / f"checkpoint-{step}" / "tensorstash_profile.json").exists()
    second = StashTrainerCallback(ts.Auto(device_budget="64KiB"), min_bytes=0)
    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=transformers.TrainingArguments(
            output_dir=str(output),
            max_steps=6,
            per_device_train_batch_size=4,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
        ),
        train_dataset=Tokens(),
        callbacks=[second],
    )
    trainer.train(resume_from_checkpoint=str(output / "checkpoint-4"))
    assert second.profile is not None and second.profile.steps > 4  # it went on from the first
    # The first step after the resume planned (a fresh profile's first step measures).
    assert second.plans.changes and second.plans.changes[0][0] == 5


def test_callback_load_profile_names_a_missing_file(tmp_path: Path) -> None:
    callback = StashTrainerCallback("auto")
    with pytest.raises(FileNotFoundError, match="no tensorstash profile at"):
        callback.load_profile(str(tmp_path))
    assert callback.load_profile(str(tmp_path), missing_ok=True) is False
    with pytest.raises(ValueError, match="has no profile to load into"):
        StashTrainerCallback("lz4").load_profile(str(tmp_path))


class WideBlocks(nn.Module):
    """Six residual blocks on a 4096 x 512 batch (8 MiB activations); returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)) for _ in range(6)
        )

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        for block in self.blocks:
            x = x + block(x)
        return {"loss": x.square().mean()}


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.x = torch.randn(4096, 512, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": self.x[index]}


def _train_peak(output: Path, callbacks: list[Any], steps: int) -> tuple[int, int]:
    """The trimmed resident set before training and the most it held in it."""
    from tensorstash.memory._memory import PeakRss, return_free_memory

    trainer = transformers.Trainer(
        model=WideBlocks(),
        args=transformers.TrainingArguments(
            output_dir=str(output),
            max_steps=steps,
            per_device_train_batch_size=4096,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
            optim="adamw_torch",
            dataloader_num_workers=0,
        ),
        train_dataset=Rows(),
        callbacks=callbacks,
    )
    return_free_memory()
    with PeakRss() as meter:
        trainer.train()
    return meter.start_bytes, meter.peak_bytes


@pytest.mark.slow
def test_callback_keeps_every_step_under_a_limit_with_adamw(tmp_path: Path) -> None:
    # AdamW's state comes at its first step(): the plans after see it (NOTE [ Memory
    # limit ] rule 2), and no step of the run goes over the limit.
    steps, mib = 6, 1 << 20
    _train_peak(tmp_path / "warm", [], steps)  # what a first run imports is no step's
    base, peak = _train_peak(tmp_path / "plain", [], steps)
    limit = peak - 80 * mib  # 80 MiB of its activations must go
    callback = StashTrainerCallback(ts.Auto(limit=limit))
    start, held = _train_peak(tmp_path / "limited", [callback], steps)
    assert start <= base + 16 * mib  # the two runs began alike
    assert held <= limit + max(2 * mib, (limit - start) // 25), (held - limit) / mib
    assert any("disk" in t or "recompute" in t for _, t in callback.plans.changes)
