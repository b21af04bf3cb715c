"""Fine-tune LoRA adapters (PEFT) with the Hugging Face Trainer, activations held to a budget.

A small Llama made from a config (no download) gets LoRA adapters on its attention and
MLP projections; its own weights stay frozen. ``StashTrainerCallback`` runs the forward
of every training step inside ``tensorstash.stash``: the frozen base weights are never
moved (they are parameters), the activations beyond the budget are spilled, and the
adapters train exactly as they would without it.

Run: python examples/hf_lora_trainer.py [SCRATCH_DIRECTORY]
(needs ``pip install tensorstash[finetune]``: transformers, accelerate and peft)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import tensorstash as ts
from tensorstash.integrations.hf import StashTrainerCallback


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token ids; a language model learns to predict its own input."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main(directory: str) -> None:
    config = LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    adapters = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.1,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
    )  # fmt: skip
    model = get_peft_model(base, adapters)
    model.print_trainable_parameters()
    # At most 1 MiB of activations per forward; on a CPU the rest is spilled under the
    # scratch directory. The budget counts activations only: the frozen weights stay put.
    callback = StashTrainerCallback(ts.Auto(device_budget="1MiB", directory=directory))
    args = TrainingArguments(
        output_dir=directory,
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(16, 64, config.vocab_size),
        callbacks=[callback],
    )
    callback.attach(trainer)  # first among the callbacks: report_to loggers see its keys
    trainer.train()

    print(f"\n{callback.forwards} training forwards stashed; the last step, per tier:")
    assert callback.stats is not None
    print(callback.stats.table())
    model.save_pretrained(Path(directory) / "adapter")  # the adapters alone, as PEFT saves them
    print("adapter saved:", sorted(p.name for p in (Path(directory) / "adapter").iterdir()))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as scratch:
            main(scratch)
