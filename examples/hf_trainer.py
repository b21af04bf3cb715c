"""Train a tiny GPT-2 with the Hugging Face Trainer, its activations held to a budget.

``StashTrainerCallback`` runs the forward of every training step (every
micro-batch under gradient accumulation) inside ``tensorstash.stash``;
backward runs after it, as in a plain loop. The stats go into the Trainer's
logs every ``logging_steps`` (keys ``tensorstash/...``).

Run: python examples/hf_trainer.py [SCRATCH_DIRECTORY]
(needs ``pip install tensorstash[hf]``)
"""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

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
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    # Keep at most 256 KiB of activations per forward; on a CPU the rest is
    # compressed and spilled under the scratch directory.
    callback = StashTrainerCallback(ts.Auto(device_budget="256KiB", directory=directory))
    args = TrainingArguments(
        output_dir=directory,
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
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
        train_dataset=RandomTokens(16, 32, config.vocab_size),
        callbacks=[callback],
    )
    callback.attach(trainer)  # first among the callbacks: report_to loggers see its keys
    trainer.train()

    print(f"\n{callback.forwards} training forwards stashed; the last step, per tier:")
    assert callback.stats is not None
    print(callback.stats.table())
    logged = [entry for entry in trainer.state.log_history if "tensorstash/disk_bytes" in entry]
    print("disk bytes per step, as logged:", [int(e["tensorstash/disk_bytes"]) for e in logged])


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as scratch:
            main(scratch)
