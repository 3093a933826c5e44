"""The real writers of issue 50 on the CPU, their output fed through the progress code (skipped
unless TSUP_HF_PYTHON names the side venv, tests/run.sh builds it): a 2-epoch Lightning fit with its
TQDMProgressBar and CSVLogger (metrics.csv written again under a new header mid-run), the same fit
with Lightning's default bar (Rich, installed there), the HF WandbCallback and Lightning's
WandbLogger offline, a nanoGPT-style loop and an Accelerate loop.

Each writer's stdout and stderr go to one log file, as the runner writes them; the log is then read
line by line (split at CR and LF, as the log follower does) into the tracker under a fake clock. The
writer waits at fixed steps for the test (a file it polls) only where the test must look at a file
between two of its writes."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.progress.trackers import TrackerFiles
from tests.progress.test_tracker import make
from tests.waiting import wait_until

HF_PYTHON = os.environ.get("TSUP_HF_PYTHON", "")
pytestmark = pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf)")

LIGHTNING = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    out, bar, hold = Path(sys.argv[1]), sys.argv[2], [int(s) for s in sys.argv[3].split(",") if s]

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 1)
        def training_step(self, b, i):
            loss = torch.nn.functional.mse_loss(self.l(b[0]), b[1])
            self.log("train_loss", loss, prog_bar=True)
            self.log("ep_loss", loss, on_step=False, on_epoch=True)
            return loss
        def validation_step(self, b, i):
            self.log("val_loss", torch.nn.functional.mse_loss(self.l(b[0]), b[1]))
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Hold(L.Callback):  # the test looks at metrics.csv at these steps
        def on_train_batch_end(self, trainer, *a):
            s = trainer.global_step
            if s in hold:
                (out / f"at-{s}").touch()
                t = time.monotonic()
                while not (out / f"go-{s}").exists() and time.monotonic() - t < 120:
                    time.sleep(0.02)

    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    callbacks = [Hold()] + ([TQDMProgressBar()] if bar == "tqdm" else [])
    t = L.Trainer(max_epochs=2, logger=CSVLogger(out, flush_logs_every_n_steps=10), callbacks=callbacks,
                  log_every_n_steps=5, accelerator="cpu", enable_checkpointing=False)
    t.fit(M(), DataLoader(ds, batch_size=2), DataLoader(ds, batch_size=4))
""")


def run(tmp_path: Path, script: str, *args: str, log: Path | None = None, wait=None) -> Path:
    """The writer with its stdout and stderr in one log (as the runner writes them); `wait(proc)`
    runs while it does."""
    log = log or tmp_path / "train.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    with open(log, "wb") as f:
        p = subprocess.Popen([HF_PYTHON, "-c", script, *args], stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                             env=env)
        try:
            if wait is not None:
                wait(p)
            assert p.wait(timeout=300) == 0, log.read_bytes()[-3000:].decode(errors="replace")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return log


def replay(tmp_path: Path, log: Path, dirs: list[str], dt: float = 1.0, stop_at: str = ""):
    """The log read into a started tracker, one line every `dt` of fake time, then the trackers'
    files; returns the tracker, its clock, and the line it stopped before (`stop_at`, a regex)."""
    clock = FakeClock(start=time.time())
    tr, _, _ = make(tmp_path / "t", clock)
    tr.start_run(1, clock.time() - 30)
    for line in re.split(r"[\r\n]", log.read_bytes().decode("utf-8", "replace")):
        if stop_at and re.search(stop_at, line):
            return tr, clock, line
        clock.advance(dt)
        tr.feed_line(line, clock.time())
    tr.poll_trackers(dirs, rediscover=True)
    return tr, clock, ""


def test_a_real_lightning_fit_with_its_tqdm_bar_and_csvlogger(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    t = TrackerFiles(["lightning"])
    seen: dict[int, list[int]] = {}

    def look(p: subprocess.Popen) -> None:
        for s in (15, 25):
            wait_until(lambda s=s: (out / f"at-{s}").exists() or p.poll() is not None, 120, what=f"step {s}")
            seen[s] = [o.step for o, _ in t.poll([str(out)], None, rediscover=True).obs]
            (out / f"go-{s}").touch()
    log = run(tmp_path, LIGHTNING, str(out), "tqdm", "15,25", wait=look)
    # flushed at step 10 under "epoch,step,train_loss"; then val_loss and ep_loss (epoch 0's end) made
    # the logger write it all again under a new header: read from its start, no row taken as garbage
    assert seen == {15: [5, 10], 25: [5, 10, 15, 20]}, seen
    assert t.status()["files"][0]["skipped"] == 0
    text = log.read_bytes().decode()
    assert "Epoch 1:  45%|████▌     | 9/20 [" in text and "`Trainer.fit` stopped: `max_epochs=2` reached." in text

    # halfway through the second epoch: the run's step, no ETA (its length is printed nowhere)
    tr, clock, line = replay(tmp_path, log, [str(out)], stop_at=r"^Epoch 1: +50%")
    p = tr.snapshot(clock.time())
    assert line.startswith("Epoch 1:  50%|█████     | 10/20")
    assert (p["step"], p["max_steps"], p["eta_s"], p["source"]) == (29, None, None, "tqdm"), p
    assert p["epoch"] == 1.45 and p["steps_per_s"] is not None
    clock.advance(31 * 60)
    assert tr.stall(clock.time()).stall.step == 29  # a hang here would be called one

    tr, clock, _ = replay(tmp_path / "2", log, [str(out)])
    p = tr.snapshot(clock.time())
    assert (p["step"], p["epoch"], p["finished"], p["max_steps"]) == (40, 2.0, True, None), p
    csv = [o.step for o, _ in TrackerFiles(["lightning"]).poll([str(out)], None).obs]
    assert csv[-1] == 40  # metrics.csv says 39, the index of the 40th step; its step is steps done


def test_a_real_lightning_fit_with_its_default_bar(tmp_path):
    """rich is installed in the venv, so Lightning 2.6 draws a RichProgressBar: to a file it prints
    one frame, at the end, after "`Trainer.fit` stopped". The CSV gives the step while it runs."""
    out = tmp_path / "out"
    log = run(tmp_path, LIGHTNING, str(out), "default", "")
    text = log.read_bytes().decode()
    assert re.search(r"^Epoch 1/1 +━+ 20/20 ", text, re.M), text[-2000:]
    assert "%|" not in text
    tr, clock, _ = replay(tmp_path, log, [str(out)])
    p = tr.snapshot(clock.time())
    assert (p["step"], p["max_steps"], p["percent"], p["finished"]) == (40, 40, 100.0, True), p
    tr, clock, _ = replay(tmp_path / "2", log, [str(out)], stop_at=r"`Trainer\.fit` stopped")
    tr.poll_trackers([str(out)], rediscover=True)
    p = tr.snapshot(clock.time())
    assert (p["step"], p["source"], p["max_steps"], p["eta_s"]) == (40, "lightning", None, None), p


HF_WANDB = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    class Tokens(torch.utils.data.Dataset):
        def __len__(self): return 512
        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32))
    a = TrainingArguments(output_dir=sys.argv[1], max_steps=30, logging_steps=10, save_strategy="no",
                          per_device_train_batch_size=4, report_to=["wandb"], use_cpu=True, disable_tqdm=True)
    Trainer(model=m, args=a, train_dataset=Tokens()).train()
""")
LIGHTNING_WANDB = textwrap.dedent("""
    import sys, torch
    import lightning as L
    from lightning.pytorch.loggers import WandbLogger
    from torch.utils.data import DataLoader, TensorDataset
    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 1)
        def training_step(self, b, i):
            loss = torch.nn.functional.mse_loss(self.l(b[0]), b[1])
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    t = L.Trainer(max_epochs=2, logger=WandbLogger(project="p", offline=True, save_dir=sys.argv[1]),
                  log_every_n_steps=5, accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False)
    t.fit(M(), DataLoader(ds, batch_size=2))
""")


def test_real_wandb_runs_give_the_trainers_step(tmp_path):
    """HF's WandbCallback: _step 0, 1, 2 for steps 10, 20, 30; Lightning's WandbLogger:
    trainer/global_step 4 ... 39 for steps 5 ... 40."""
    run(tmp_path, HF_WANDB, str(tmp_path / "out"))
    got = TrackerFiles(["wandb"]).poll([str(tmp_path)], None)
    assert [o.step for o, _ in got.obs] == [10, 20, 30]
    lt = tmp_path / "lt"
    lt.mkdir()
    run(lt, LIGHTNING_WANDB, str(lt))
    got = TrackerFiles(["wandb"]).poll([str(lt)], None)
    assert [o.step for o, _ in got.obs] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [round(o.epoch, 1) for o, _ in got.obs][3:5] == [0.0, 1.0]


NANOGPT = textwrap.dedent("""
    # nanoGPT-style: train.py's own prints, its ckpt.pt overwritten in place
    import os, sys, time, torch
    out_dir, max_iters, eval_interval, log_interval = sys.argv[1], 25, 10, 1
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(1337)
    model = torch.nn.Sequential(torch.nn.Embedding(65, 16), torch.nn.Linear(16, 65))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 65, (2000,))
    def get_batch():
        ix = torch.randint(len(data) - 9, (4,))
        return torch.stack([data[i:i + 8] for i in ix]), torch.stack([data[i + 1:i + 9] for i in ix])
    def loss_of(X, Y):
        return torch.nn.functional.cross_entropy(model(X).view(-1, 65), Y.view(-1))
    print(f"tokens per iteration will be: {4 * 8:,}")
    iter_num, running_mfu, t0 = 0, -1.0, time.time()
    X, Y = get_batch()
    while True:
        if iter_num % eval_interval == 0:
            with torch.no_grad():
                losses = {"train": loss_of(*get_batch()).item(), "val": loss_of(*get_batch()).item()}
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if iter_num > 0:
                print(f"saving checkpoint to {out_dir}")
                torch.save({"model": model.state_dict(), "iter_num": iter_num}, os.path.join(out_dir, "ckpt.pt"))
        loss = loss_of(X, Y)
        X, Y = get_batch()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % log_interval == 0:
            lossf = loss.item()
            if iter_num >= 5:
                running_mfu = 0.01 if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * 0.012
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
        iter_num += 1
        if iter_num > max_iters:
            break
""")
ACCELERATE = textwrap.dedent("""
    import logging, sys, torch
    from accelerate import Accelerator
    from accelerate.logging import get_logger
    from accelerate.utils import ProjectConfiguration
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO)
    logger = get_logger(__name__)
    out, max_steps = sys.argv[1], 30
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True,
                                                                    total_limit=2))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    for step in range(1, max_steps + 1):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        acc.print(f"step {step}/{max_steps}")
        logger.info(f"Step {step}/{max_steps} | loss {loss.item():.4f} | lr 1.00e-02")
        if step % 10 == 0:
            acc.save_state()
""")


@pytest.mark.parametrize("script,step,max_steps", [(NANOGPT, 25, None), (ACCELERATE, 30, 30)], ids=["nanogpt", "accelerate"])
def test_real_printed_step_lines(tmp_path, script, step, max_steps):
    log = run(tmp_path, script, str(tmp_path / "out"))
    tr, clock, _ = replay(tmp_path, log, [])
    p = tr.snapshot(clock.time())
    assert (p["step"], p["max_steps"], p["source"]) == (step, max_steps, "log"), p
    assert p["loss"] is not None and p["steps_per_s"] is not None
    assert (p["eta_s"] is None) == (max_steps is None)  # nanoGPT's max_iters is in its config only
    clock.advance(31 * 60)
    assert tr.stall(clock.time()).stall.step == step  # the stall rule armed on these lines
