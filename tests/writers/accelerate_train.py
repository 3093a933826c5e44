"""A real Accelerate 1.16 loop on the CPU that checkpoints with `save_state` and automatic
naming, keeping two, and prints its progress as many scripts do: `step N/M loss X`.

    python accelerate_train.py OUT [--steps 30] [--every 5] [--sleep 0]

Checkpoints land in OUT/checkpoints/checkpoint_{i}/ (model.safetensors, optimizer.bin,
scheduler.bin, sampler.bin, random_states_0.pkl, custom_checkpoint_0.pkl with the step);
`total_limit=2` deletes the oldest before writing the next. Resumes from
$TRAIN_SUPERVISOR_RESUME_FROM when set (a checkpoint_{i} folder)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed


class Step:
    """The step, saved with the checkpoint (custom_checkpoint_0.pkl) so a resume continues from it."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, d: dict) -> None:
        self.n = int(d["n"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=a.out, automatic_checkpoint_naming=True, total_limit=2))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x = torch.randn(64, 16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                                       shuffle=True)
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    step = Step()
    acc.register_for_checkpointing(step)
    resume = os.environ.get("TRAIN_SUPERVISOR_RESUME_FROM")
    if resume:
        acc.load_state(resume)
        m = re.search(r"checkpoint_(\d+)$", resume.rstrip("/"))
        acc.project_configuration.iteration = int(m.group(1)) + 1 if m else 0  # the next save's number
        print(f"resumed from {resume} at step {step.n}", flush=True)
    while step.n < a.steps:
        for xb, yb in data:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step.n += 1
            if a.sleep:
                time.sleep(a.sleep)  # a test's cadence
            print(f"step {step.n}/{a.steps} loss {loss.item():.4f}", flush=True)
            if step.n % a.every == 0 or step.n == a.steps:
                acc.save_state()
            if step.n >= a.steps:
                break
    sys.stdout.flush()


if __name__ == "__main__":
    main()
