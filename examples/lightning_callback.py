"""Lightning with tensorstash: one callback stashes the activations of every training step.

Run: python examples/lightning_callback.py [scratch directory]
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import lightning
import torch
from torch import nn

import tensorstash as ts
from tensorstash.integrations.lightning import StashCallback

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Classifier(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(scratch: Path, steps: int = 4) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 256), torch.randint(0, 10, (512,)))
    loader = torch.utils.data.DataLoader(data, batch_size=128)
    # Compress activations with lz4, then spill what is left to files in `scratch`.
    callback = StashCallback(ts.Chain(ts.Lz4(), ts.DiskSpill(directory=scratch)))
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback],
        logger=lightning.pytorch.loggers.CSVLogger(scratch, name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=scratch,
    )
    trainer.fit(Classifier(), loader)
    assert callback.stats is not None
    print(f"last of {steps} steps, loss {float(trainer.callback_metrics['loss']):.4f}:")
    print(callback.stats.table())
    logged = sorted(k for k in trainer.callback_metrics if k.startswith("tensorstash/"))
    print(f"logged per step: {', '.join(logged[:4])}, ...")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as directory:
            main(Path(directory))
