"""A real PyTorch Lightning 2.6 run on the CPU, as a user writes it: ModelCheckpoint every N
steps keeping the two newest (monitor="step", mode="max") plus `last.ckpt`, a CSVLogger, the
default (Rich) progress bar, and a resume from what the supervisor restored.

    python lightning_train.py OUT [--epochs 3] [--batches 12] [--every 4] [--last true|link] [--sleep 0]
        [--flush 100]

Checkpoints land in OUT/checkpoints/ as `{epoch}-{step}.ckpt` (+ last.ckpt, a symlink with
--last link); metrics in OUT/logs/version_0/metrics.csv, written every --flush steps (Lightning's 100
by default: a test scales it down with the run). The run's total is epochs * batches steps.
Resumes from $TRAIN_SUPERVISOR_RESUME_FROM when set (a .ckpt path)."""

from __future__ import annotations

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self, sleep: float):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.sleep = sleep

    def training_step(self, batch, _i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        if self.sleep:
            time.sleep(self.sleep)  # a test's cadence: a step takes at least this long
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--last", choices=["true", "link"], default="true")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--flush", type=int, default=100, help="CSVLogger's flush_logs_every_n_steps")
    ap.add_argument("--hold", default="", help="after fit, wait (at most 120 s) until this file exists: a test "
                                               "releases the run once it has seen what it watches for")
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.batches * 4, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    # the two newest by step (Lightning's documented way to keep the latest k), and last.ckpt
    ckpt = ModelCheckpoint(dirpath=os.path.join(a.out, "checkpoints"), monitor="step", mode="max", save_top_k=2,
                           every_n_train_steps=a.every, save_last=True if a.last == "true" else "link")
    logger = CSVLogger(a.out, name="logs", flush_logs_every_n_steps=a.flush)
    trainer = pl.Trainer(max_epochs=a.epochs, accelerator="cpu", devices=1, default_root_dir=a.out,
                         callbacks=[ckpt], logger=logger, log_every_n_steps=1, enable_model_summary=False)
    trainer.fit(Tiny(a.sleep), data, ckpt_path=os.environ.get("TRAIN_SUPERVISOR_RESUME_FROM") or None)
    deadline = time.monotonic() + 120
    while a.hold and not os.path.exists(a.hold) and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
