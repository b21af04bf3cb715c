"""StashTrainerCallback in TRL's ``SFTTrainer``: LoRA adapters (``peft_config``) on a tiny
Llama made from a config, a tokenizer and a dataset made in memory (no download).

The oracle is the same SFTTrainer run without the callback: the final weights must be
equal bit for bit (LoRA dropout on, so the RNG must not be disturbed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checks import leak_check
from torch import Tensor

import tensorstash as ts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from tensorstash.integrations.hf import StashTrainerCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_STEPS = 3
WORDS = ("the a cat dog sat ran on under mat log red blue small big quick slow").split()  # noqa: SIM905


def tokenizer() -> Any:
    """A word-level tokenizer over :data:`WORDS`, made in memory."""
    vocab = {word: index for index, word in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sentences(n: int = 16) -> Any:
    """``n`` random sentences of 12 to 24 words, as a ``datasets.Dataset`` of text."""
    generator = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(n):
        length = int(torch.randint(12, 25, (1,), generator=generator))
        picks = torch.randint(len(WORDS), (length,), generator=generator)
        texts.append(" ".join(WORDS[int(i)] for i in picks))
    return datasets.Dataset.from_dict({"text": texts})


def llama() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def sft(output_dir: Path, callbacks: list[Any] | None = None, **overrides: Any) -> Any:
    """An SFTTrainer of LoRA adapters on the tiny Llama, not trained yet. TRL's own defaults
    hold (activation checkpointing, bf16) unless ``overrides`` change them."""
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "max_length": 32,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
        "logging_steps": 1,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    return trl.SFTTrainer(
        model=llama(),
        args=trl.SFTConfig(**settings),
        train_dataset=sentences(),
        processing_class=tokenizer(),
        peft_config=lora,
        callbacks=callbacks,
    )


def trained_weights(trainer: Any) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


_CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)
SETTINGS: dict[str, dict[str, Any]] = {
    "trl-defaults": {},  # activation checkpointing and bf16 autocast on, as TRL sets them
    "float32": {"bf16": False, _CHECKPOINTING: False},
}


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param(name, marks=() if name == "trl-defaults" else pytest.mark.slow)
        for name in SETTINGS
    ],
)
def test_sft_trainer_with_callback_trains_lora_as_without_it(
    setting: str, tmp_path: Path, spill_dir: Path
) -> None:
    overrides = SETTINGS[setting]
    plain = sft(tmp_path / "plain", **overrides)
    initial = trained_weights(plain)
    plain.train()
    expected = trained_weights(plain)
    callback = StashTrainerCallback(ts.DiskSpill(directory=spill_dir), min_bytes=0)
    trainer = sft(tmp_path / "stashed", [callback], **overrides)
    trainer.train()
    assert peft.PeftModel in type(trainer.model).__mro__, "SFTTrainer trained no adapters"
    assert getattr(trainer.args, _CHECKPOINTING) is (setting == "trl-defaults")
    actual = trained_weights(trainer)
    assert expected.keys() == actual.keys() == initial.keys()
    adapters = [name for name in expected if "lora_" in name]
    assert any(not torch.equal(expected[n], initial[n]) for n in adapters), "nothing trained"
    for name, want in expected.items():
        assert torch.equal(want, actual[name]), f"{name} differs from training without tensorstash"
    assert callback.forwards == MAX_STEPS
    assert callback.stats is not None and callback.stats.tiers["disk"].tensors > 0
    assert callback.stats.skipped["parameter"] > 0  # the frozen base, kept where it is
    logged = [e for e in trainer.state.log_history if "tensorstash/disk_bytes" in e]
    assert len(logged) == MAX_STEPS
    del trainer, callback
    leak_check(directories=[spill_dir])
