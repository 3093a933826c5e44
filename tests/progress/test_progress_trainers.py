"""Progress, ETA and stall from the trainers that are not the HF Trainer (issue 50): Lightning's bars
and its metrics.csv, Accelerate-style and nanoGPT printed step lines, W&B's step under the HF
WandbCallback and Lightning's WandbLogger, the rate after a resume.

Every line and file here is what the real writer printed or wrote to a log that is no TTY, pasted as
captured (Lightning 2.6.6 with tqdm 4 and rich 14, a tqdm loop, nanoGPT's train.py prints, an
Accelerate 1.16 loop; tests/e2e/test_progress_trainers_real.py runs them again when TSUP_HF_PYTHON is set).
Time comes from the test: a fake clock, never a sleep."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.clock import FakeClock
from supervisor.progress import trackfiles as tf
from supervisor.progress.parse import parse_line
from supervisor.progress.record import LEAP_STEPS, Run, figures, merge, merge_line
from supervisor.progress.trackers import TrackerFiles
from supervisor.untrusted import INT_MAX, Unreadable
from tests.progress.test_progress_sources import wandb_file, wandb_history
from tests.progress.test_tracker import make
from tests.progress.test_trackers_hostile import _EDIT, FUZZ, _mutate

W = 300.0

# --- Lightning's TQDMProgressBar (Trainer(max_epochs=2), 20 batches an epoch, CSVLogger) ----------
# to a file each repaint follows a carriage return; "Epoch 0: 0%| 0/20" after "Epoch 0: 20/20" is the
# bar reset at the epoch's end, before it is named "Epoch 1"
LT_EPOCH0 = [
    "Training: |          | 0/? [00:00<?, ?it/s]",
    "Epoch 0:   0%|          | 0/20 [00:00<?, ?it/s]",
    "Epoch 0:   5%|▌         | 1/20 [00:00<00:02,  8.39it/s]",
    "Epoch 0:   5%|▌         | 1/20 [00:00<00:02,  8.35it/s, v_num=0, train_loss=0.705]",
    "Epoch 0:  10%|█         | 2/20 [00:00<00:01, 11.47it/s, v_num=0, train_loss=0.705]",
    "Epoch 0:  45%|████▌     | 9/20 [00:00<00:00, 16.05it/s, v_num=0, train_loss=0.000957]",
    "Epoch 0:  95%|█████████▌| 19/20 [00:01<00:00, 17.23it/s, v_num=0, train_loss=1.150]",
    "Epoch 0: 100%|██████████| 20/20 [00:01<00:00, 17.28it/s, v_num=0, train_loss=0.514]",
    "Epoch 0: 100%|██████████| 20/20 [00:01<00:00, 17.27it/s, v_num=0, train_loss=0.514]",
    "Epoch 0:   0%|          | 0/20 [00:00<?, ?it/s, v_num=0, train_loss=0.514]         ",
]
LT_EPOCH1 = [
    "Epoch 1:   0%|          | 0/20 [00:00<?, ?it/s, v_num=0, train_loss=0.514]",
    "Epoch 1:   5%|▌         | 1/20 [00:00<00:01, 18.24it/s, v_num=0, train_loss=0.514]",
    "Epoch 1:  45%|████▌     | 9/20 [00:00<00:00, 18.21it/s, v_num=0, train_loss=0.0346]",
]
LT_END = [
    "Epoch 1: 100%|██████████| 20/20 [00:01<00:00, 18.25it/s, v_num=0, train_loss=0.366]",
    "Epoch 1: 100%|██████████| 20/20 [00:01<00:00, 18.22it/s, v_num=0, train_loss=0.366]",
]
LT_STOPPED = "`Trainer.fit` stopped: `max_epochs=2` reached."
# Trainer(max_epochs=-1, max_steps=30): Lightning cuts the last epoch's total to the steps left
LT_MAX_STEPS = [
    "Epoch 0: 100%|██████████| 20/20 [00:00<00:00, 167.43it/s, v_num=0, train_loss=0.514]",
    "Epoch 0:   0%|          | 0/20 [00:00<?, ?it/s, v_num=0, train_loss=0.514]          ",
    "Epoch 1:   0%|          | 0/10 [00:00<?, ?it/s, v_num=0, train_loss=0.514]",
    "Epoch 1:  10%|█         | 1/10 [00:00<00:00, 371.67it/s, v_num=0, train_loss=1.010]",
    "Epoch 1: 100%|██████████| 10/10 [00:00<00:00, 234.57it/s, v_num=0, train_loss=1.720] ",
]
# an IterableDataset (6 batches, no length)
LT_ITERABLE = [
    "Epoch 0: |          | 0/? [00:00<?, ?it/s] ",
    "Epoch 0: |          | 1/? [00:00<00:00, 67.04it/s]",
    "Epoch 0: |          | 6/? [00:00<00:00, 211.49it/s, v_num=0]",
    "Epoch 0: |          | 0/? [00:00<?, ?it/s, v_num=0]         ",
    "Epoch 1: |          | 0/? [00:00<?, ?it/s, v_num=0]",
    "Epoch 1: |          | 1/? [00:00<00:00, 485.85it/s, v_num=0]",
    "Epoch 1: |          | 6/? [00:00<00:00, 304.71it/s, v_num=0]",
]
# RichProgressBar (Lightning's default with rich installed): one frame, when the fit ends or fails
RICH_END = "Epoch 1/1  ━━━━━━━━━━━━━━━━━ 20/20 0:00:01 • 0:00:00 18.56it/s v_num: 0.000     "
RICH_END_3 = "Epoch 2/2  ━━━━━━━━━━━━━━━━ 20/20 0:00:00 • 0:00:00 456.91it/s v_num: 0.000     "
RICH_CRASHED = "Epoch 1/2  ━━━━━╸            7/20 0:00:00 • 0:00:01 597.94it/s v_num: 0.000     "
RICH_MAX_STEPS = "Epoch 1/-2 ━━━━━━━━━━━━━━━━ 10/10 0:00:00 • 0:00:00 342.21it/s v_num: 0.000     "
RICH_METRICS = "                                                               train_loss: 0.366"


def feed(r: Run, lines: list[str], t0: float, dt: float = 1.0) -> float:
    t = t0
    for line in lines:
        t += dt
        merge_line(r, line, t)
    return t


def test_lightnings_bar_counts_the_run_across_epochs_and_gives_no_eta_without_the_runs_length():
    r = Run(run_id=1, started_at=0.0)
    t = feed(r, LT_EPOCH0, 0.0)
    assert (r.step, r.epoch, r.max_steps) == (20, 1.0, None)
    t = feed(r, LT_EPOCH1, t)
    f = figures(r, t, W)
    # what status said before: "9/20, ETA 8s" with more than an epoch left
    assert (r.step, r.max_steps, r.epoch, r.loss, r.step_source) == (29, None, 1.45, 0.0346, "tqdm")
    assert f.eta_s is None and f.fraction is None and f.steps_per_s is not None
    feed(r, [*LT_END, LT_STOPPED], t)
    assert (r.step, r.epoch, r.finished) == (40, 2.0, True)
    assert [s.v for s in r.steps.samples][:3] == [1, 2, 9]  # never the reset's 0/20, never 20 -> 0


def test_the_end_glued_to_the_bars_last_repaint():
    """Lightning logs its end to stderr while the bar's last repaint on stdout has no line end yet:
    one segment of the log holds both (as a real run under the runner wrote it)."""
    r = Run(run_id=1, started_at=0.0)
    t = feed(r, LT_EPOCH0 + LT_EPOCH1, 0.0)
    feed(r, ["Epoch 1: 100%|██████████| 20/20 [00:00<00:00, 124.59it/s, v_num=0, train_loss=0.366]"
             "`Trainer.fit` stopped: `max_epochs=2` reached."], t)
    assert (r.step, r.finished, figures(r, t + 5, W).eta_s) == (40, True, 0.0)


def test_richs_frame_comes_after_the_end_and_still_counts():
    """With the Rich bar the order is the other way: the end first, then the one frame."""
    r = Run(run_id=1, started_at=0.0)
    feed(r, [LT_STOPPED, RICH_END, RICH_METRICS], 0.0)
    assert (r.step, r.max_steps, r.finished) == (40, 40, True)
    assert figures(r, 5.0, W).fraction == 1.0
    feed(r, LT_EPOCH0[:3], 5.0)  # a second fit's bar after the end: not the run's step
    assert r.step == 40


def test_one_log_line_of_carriage_return_repaints_reads_the_same():
    r = Run(run_id=1, started_at=0.0)
    merge_line(r, "\r".join(LT_EPOCH0 + LT_EPOCH1), 5.0)
    assert (r.step, r.max_steps) == (29, None)


def test_a_last_epoch_shortened_by_max_steps_counts_what_it_holds():
    r = Run(run_id=1, started_at=0.0)
    feed(r, [*LT_MAX_STEPS, "`Trainer.fit` stopped: `max_steps=30` reached."], 0.0)
    assert (r.step, r.finished) == (30, True)


def test_a_dataloader_without_length_counts_its_epochs_too():
    r = Run(run_id=1, started_at=0.0)
    feed(r, LT_ITERABLE[:3], 0.0)
    assert (r.step, r.max_steps, r.epoch) == (6, None, None)
    feed(r, LT_ITERABLE[3:], 10.0)
    assert r.step == 12


def test_a_bar_first_seen_in_a_later_epoch_counts_the_epochs_before_it():
    """A daemon that came late (or a resume at an epoch's start): the epochs before were as long."""
    r = Run(run_id=1, started_at=0.0)
    feed(r, LT_EPOCH1, 0.0)
    assert r.step == 29 and r.first_step == 21


@pytest.mark.parametrize("frame,step,max_steps,epoch", [
    (RICH_END, 40, 40, 2.0), (RICH_END_3, 60, 60, 3.0), (RICH_CRASHED, 27, 60, 1.35)])
def test_richs_one_frame_gives_the_runs_step_and_length(frame, step, max_steps, epoch):
    r = Run(run_id=1, started_at=0.0)
    feed(r, [frame, RICH_METRICS], 0.0)
    assert (r.step, r.max_steps, r.epoch) == (step, max_steps, epoch)
    assert figures(r, 2.0, W).fraction == step / max_steps


def test_rich_bounded_by_max_steps_alone_is_not_read():
    """Epoch 1/-2: the first epoch's length is not in the frame (the last one is cut to what was left)."""
    assert parse_line(RICH_MAX_STEPS) is None
    assert parse_line(RICH_METRICS) is None


# a loop's own bar per epoch: `tqdm(data, desc=f"Epoch {epoch + 1}/{E}")`, 8 batches, 3 epochs
LOOP_FROM_1 = [
    "Epoch 1/3:   0%|          | 0/8 [00:00<?, ?it/s, loss=1.5890]",
    "Epoch 1/3:  50%|█████     | 4/8 [00:00<00:00, 38.72it/s, loss=0.0242]",
    "Epoch 1/3: 100%|██████████| 8/8 [00:00<00:00, 39.56it/s, loss=0.1979]",
    "Epoch 2/3: 100%|██████████| 8/8 [00:00<00:00, 42.62it/s, loss=0.2085]",
    "Epoch 3/3: 100%|██████████| 8/8 [00:00<00:00, 41.73it/s, loss=0.2183]",
]
# ... and `desc=f"Epoch {epoch}/{E}"`
LOOP_FROM_0 = [
    "Epoch 0/3: 100%|██████████| 8/8 [00:00<00:00, 45.89it/s, loss=0.1958]",
    "Epoch 1/3: 100%|██████████| 8/8 [00:00<00:00, 46.26it/s, loss=0.0683]",
    "Epoch 2/3: 100%|██████████| 8/8 [00:00<00:00, 46.09it/s, loss=0.0587]",
]


def test_a_loops_epoch_bar_numbered_from_one_or_from_zero():
    r = Run(run_id=1, started_at=0.0)
    feed(r, LOOP_FROM_1[:2], 0.0)
    assert (r.step, r.max_steps, r.epoch_base) == (4, 24, 1)
    feed(r, LOOP_FROM_1[2:], 10.0)
    assert (r.step, r.max_steps, r.num_epochs) == (24, 24, 3.0)
    r = Run(run_id=1, started_at=0.0)
    feed(r, LOOP_FROM_0, 0.0)
    assert (r.step, r.max_steps, r.epoch_base) == (24, 24, 0)


def test_a_loops_epoch_bar_whose_numbering_is_not_known_gives_nothing():
    """A resumed run (a checkpoint here at its start) whose first bar says "Epoch 2/3": from 0 it is
    the third epoch, from 1 the second: no step, no ETA, rather than one epoch wrong."""
    r = Run(run_id=1, started_at=0.0, from_step=8)
    feed(r, LOOP_FROM_1[3:4], 0.0)
    assert (r.step, r.max_steps) == (None, None)
    feed(r, LOOP_FROM_1[4:], 5.0)  # 3/3: the last epoch shows the numbering
    assert (r.step, r.max_steps, r.epoch_base) == (24, 24, 1)


def test_the_users_tsup_line_owns_the_step_over_an_epoch_bar():
    r = Run(run_id=1, started_at=0.0)
    feed(r, ['TSUP {"step": 7, "max_steps": 100}', *LT_EPOCH1], 0.0)
    assert (r.step, r.max_steps, r.step_source) == (7, 100, "tsup")


# --- printed step counters -------------------------------------------------------------------------
NANOGPT = [  # a nanoGPT-style train.py: its own print statements
    "tokens per iteration will be: 32",
    "step 0: train loss 4.3326, val loss 4.2971",
    "iter 0: loss 4.5469, time 132.45ms, mfu -100.00%",
    "iter 1: loss 4.3125, time 124.22ms, mfu -100.00%",
    "iter 9: loss 4.3333, time 196.19ms, mfu 1.07%",
    "step 10: train loss 4.3250, val loss 4.2140",
    "saving checkpoint to /tmp/cap/nano",
    "iter 25: loss 4.2676, time 36.39ms, mfu 1.18%",
]
ACCELERATE = [  # an Accelerate loop: accelerator.print and accelerate.logging.get_logger(__name__)
    "step 1/30",
    "12/07/2026 02:49:35 - INFO - __main__ - [RANK 0] Step 1/30 | loss 2.6634 | lr 1.00e-02",
    "step=1 loss=2.6634 lr=1.0e-02",
    "step 2/30",
]


def test_nanogpt_lines():
    got = [parse_line(x) for x in NANOGPT]
    assert got[0] is None and got[6] is None
    assert [(o.step, o.max_steps, o.loss, o.source) for o in got if o] == [
        (0, None, 4.3326, "log"), (0, None, 4.5469, "log"), (1, None, 4.3125, "log"), (9, None, 4.3333, "log"),
        (10, None, 4.325, "log"), (25, None, 4.2676, "log")]


def test_accelerate_lines():
    assert [(o.step, o.max_steps, o.loss) for o in map(parse_line, ACCELERATE)] == [
        (1, 30, None), (1, 30, 2.6634), (1, None, 2.6634), (2, 30, None)]


@pytest.mark.parametrize("line,step,max_steps,loss", [
    ("step 125/150", 125, 150, None), ("Step 125/150", 125, 150, None), ("step=125", 125, None, None),
    ("INFO:__main__:step 125/150", 125, 150, None), ("[step 12/100] loss 1.1", 12, 100, 1.1),
    ("Step: 100 | Loss: 2.3", 100, None, 2.3), ("global_step=40 loss=0.5", 40, None, 0.5),
    ("step: 7 | loss: nan", 7, None, None),
    (" iteration      100/    1000 | consumed samples:         3200 | elapsed time per iteration (ms): 512.3 |"
     " learning rate: 1.500E-04 | global batch size:    32 | lm loss: 7.210336E+00 | loss scale: 1.0 |",
     100, 1000, 7.210336),  # Megatron
])
def test_a_printed_step_counter(line, step, max_steps, loss):
    o = parse_line(line)
    assert o is not None and (o.step, o.max_steps, o.loss) == (step, max_steps, loss)


@pytest.mark.parametrize("line", [
    "Step 1/5 : FROM ubuntu:22.04",                       # a Docker build
    "Epoch [1/10], Step [100/600], Loss: 0.2154",         # steps within an epoch
    "epoch 2 step 100/600 loss 0.3",
    "eval step 5/20 loss 0.31", "Validation step 5/20: loss 0.3",
    "Saving checkpoint at step 500", "Downloading step 3/5", "Step 2: tokenizing",
    "max_steps=100", "warmup steps 100", "  Gradient Accumulation steps = 1", "total_steps: 100",
    "{'step': 5, 'x': 1}", "[Rank 0] step=10, skipped=0, lr=[0.0001], mom=[(0.9, 0.999)]",
    "step 12/10 loss 1.0",                                # more than its own total
])
def test_what_is_not_a_training_step_counter(line):
    assert parse_line(line) is None


def test_a_hung_nanogpt_or_accelerate_run_is_called_stalled(tmp_path):
    """The stall rule arms at the first step a printed counter gives."""
    for lines, name in ((NANOGPT, "nano"), (ACCELERATE, "acc"), (LT_EPOCH0, "lightning")):
        clock = FakeClock()
        tr, _, _ = make(tmp_path / name, clock)
        tr.start_run(1, clock.time())
        for line in lines:
            clock.advance(2.0)
            tr.feed_line(line, clock.time())
        assert tr.stall(clock.time()).stall is None
        clock.advance(31 * 60)
        s = tr.stall(clock.time()).stall
        assert s is not None and s.step == tr.run.step > 0, name


# --- the rate after a resume -------------------------------------------------------------------------
def hf_bar(n: int, total: int, rate: str) -> str:
    return f" {n * 100 // total:3d}%|#         | {n}/{total} [00:01<00:10, {rate}]"


def test_the_rate_after_a_resume_counts_only_this_runs_steps():
    """Resumed at step 100 of 200 (a checkpoint the daemon did not know: no from_step), one step a
    second: ~20 s in the rate counted the 100 steps it resumed at (ETA 12 s where 78 s remained)."""
    r = Run(run_id=2, started_at=0.0)
    merge_line(r, hf_bar(0, 200, "?it/s"), 2.0)
    merge_line(r, hf_bar(101, 200, "101.00it/s"), 3.0)  # the bar's first update: the leap
    for i in range(1, 20):
        merge_line(r, hf_bar(101 + i, 200, "40.00it/s"), 3.0 + i)  # tqdm's average still remembers it
    f = figures(r, 22.0, W)
    assert f.steps_per_s is None and f.eta_s is None  # not known yet, never 6 steps/s and ETA 12 s
    merge_line(r, hf_bar(122, 200, "30.00it/s"), 24.0)
    f = figures(r, 24.0, W)
    assert r.first_step == 101 > LEAP_STEPS
    assert abs(f.steps_per_s - 1.0) < 0.01 and 76 <= f.eta_s <= 80, f


def test_the_rate_after_a_resume_from_printed_lines_and_trackers():
    for src, lines in (("log", [f"step {s}/200" for s in (0, 101, *range(102, 125))]),
                       ("tensorboard", None)):
        r = Run(run_id=2, started_at=0.0)
        if lines is not None:
            for i, line in enumerate(lines):
                merge_line(r, line, 2.0 + i)
        else:
            from supervisor.progress.observation import Observation
            merge_line(r, "  Total optimization steps = 200", 1.0)
            merge(r, Observation(step=0, source=src), 2.0)
            for i, s in enumerate((101, *range(102, 125))):
                merge(r, Observation(step=s, source=src), 3.0 + i)
        f = figures(r, 26.0, W)
        assert abs(f.steps_per_s - 1.0) < 0.01 and 75 <= f.eta_s <= 78, (src, f)


def test_a_run_from_nothing_still_has_its_bars_rate_at_once():
    r = Run(run_id=1, started_at=0.0)
    merge_line(r, hf_bar(0, 200, "?it/s"), 1.0)
    merge_line(r, hf_bar(3, 200, "3.00it/s"), 2.0)
    f = figures(r, 2.0, W)
    assert f.steps_per_s == 3.0 and f.eta_s is not None


def test_step_zero_arms_nothing_wrong_and_is_no_sample():
    r = Run(run_id=1, started_at=0.0)
    merge_line(r, "step 0: train loss 4.3326, val loss 4.2971", 1.0)
    assert r.step == 0 and len(r.steps) == 0 and r.first_step is None
    r2 = Run.from_json(json.loads(json.dumps(r.to_json())))
    assert r2.step == 0 and r2.epoch_base is None


# --- Lightning's metrics.csv ---------------------------------------------------------------------------
# CSVLogger(flush every 100 steps): what a 2-epoch run with a validation loop wrote at its end ...
CSV_FINAL = (b"ep_loss,epoch,step,train_loss,val_loss\r\n,0,4,0.14172253012657166,\r\n,0,9,2.341512441635132,\r\n"
             b",0,14,0.7216095328330994,\r\n,0,19,0.5139488577842712,\r\n,0,19,,1.0616703033447266\r\n"
             b"1.3537688255310059,0,19,,\r\n,1,24,0.18270748853683472,\r\n,1,29,1.7243717908859253,\r\n"
             b",1,34,0.7525777816772461,\r\n,1,39,0.36605530977249146,\r\n,1,39,,0.8552571535110474\r\n"
             b"0.9976902008056641,1,39,,\r\n")
# ... and, flushed every 10 steps, what it held before val_loss and ep_loss made it write it all again
CSV_BEFORE = (b"epoch,step,train_loss\r\n0,4,0.14172253012657166\r\n0,9,2.341512441635132\r\n"
              b"0,14,0.7216095328330994\r\n0,19,0.5139488577842712\r\n")


def csv_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out" / "lightning_logs" / "version_0"
    d.mkdir(parents=True)
    return d


def test_metrics_csv_steps_are_steps_done_and_a_new_header_is_read_from_the_start(tmp_path):
    d = csv_dir(tmp_path)
    f = d / "metrics.csv"
    f.write_bytes(CSV_BEFORE[:-9])  # a row being written
    t = TrackerFiles(["lightning"])
    got = t.poll([str(tmp_path / "out")], None)
    assert [(o.source, o.step, o.epoch, round(o.loss, 3)) for o, _ in got.obs] == [
        ("lightning", 5, 0.0, 0.142), ("lightning", 10, 0.0, 2.342), ("lightning", 15, 0.0, 0.722)]
    with open(f, "ab") as fh:
        fh.write(CSV_BEFORE[-9:])
    assert [o.step for o, _ in t.poll([str(tmp_path / "out")], None).obs] == [20]
    with open(f, "r+b") as fh:  # as the logger does it: open("w") and everything again under the new header
        fh.truncate(0)
        fh.write(CSV_FINAL)
    got = t.poll([str(tmp_path / "out")], None)
    assert [o.step for o, _ in got.obs] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert got.obs[-1][1] == os.stat(f).st_mtime  # rows carry no time: the file's
    st = t.status()["files"][0]
    assert (st["read_bytes"], st["skipped"], st["error"]) == (len(CSV_FINAL), 0, None)


def test_metrics_csv_in_the_run_record(tmp_path):
    """The CSV lags the bar (a flush every 100 steps): never a restart, and a step of its own when
    it is the only source."""
    r = Run(run_id=1, started_at=0.0)
    feed(r, LT_EPOCH0 + LT_EPOCH1, 0.0)
    d = csv_dir(tmp_path)
    (d / "metrics.csv").write_bytes(CSV_BEFORE)
    for o, _ in TrackerFiles(["auto"]).poll([str(tmp_path / "out")], None).obs:
        merge(r, o, 20.0)
    assert (r.step, r.step_source, r.epoch) == (29, "tqdm", 1.45)
    r = Run(run_id=1, started_at=0.0)
    (d / "metrics.csv").write_bytes(CSV_FINAL)
    for o, _ in TrackerFiles(["auto"]).poll([str(tmp_path / "out")], None).obs:
        merge(r, o, 20.0)
    assert (r.step, r.step_source, r.loss) == (40, "lightning", 0.36605530977249146)


@pytest.mark.parametrize("line", [b",0,4,0.1", b"0,x,0.1", b"0,-1,0.1", b"0,1e999,0.1", b"0," + b"9" * 30 + b",0.1",
                                  b'0,"4,0.1'])
def test_a_bad_row_is_skipped_and_counted(tmp_path, line):
    d = csv_dir(tmp_path)
    (d / "metrics.csv").write_bytes(b"epoch,step,train_loss\r\n" + line + b"\r\n0,9,2.5\r\n")
    t = TrackerFiles(["lightning"])
    assert [o.step for o, _ in t.poll([str(tmp_path / "out")], None).obs] == [10]
    assert t.status()["files"][0]["skipped"] == 1


def test_a_metrics_csv_that_is_not_one_is_left_alone(tmp_path):
    d = csv_dir(tmp_path)
    (d / "metrics.csv").write_bytes(b"name,accuracy\r\nresnet,0.9\r\n")
    t = TrackerFiles(["auto"])
    assert t.poll([str(tmp_path / "out")], None).obs == []
    assert "no step column" in t.status()["files"][0]["error"]


def test_csv_cells_as_pythons_csv_writes_them():
    cols = tf.csv_header(b'"val,acc",step,"say ""hi"""\r')
    assert cols == ("val,acc", "step", 'say "hi"')
    assert [(p.step, p.key, p.value) for p in tf.csv_row(b'"0.5",7,', cols, 1.0, 1)] == [(8, "val,acc", 0.5)]
    with pytest.raises(Unreadable):
        tf.csv_row(b"0.5,7", cols, 1.0)
    assert tf.csv_row(b"", cols, 1.0) == []


@FUZZ
@given(st.one_of(st.lists(_EDIT, max_size=6).map(lambda es: _mutate(CSV_FINAL, es)), st.binary(max_size=400)))
def test_fuzz_metrics_csv(data):
    """Mutated and random bytes in place of the real file: only points or Unreadable come out."""
    lines = [bytes(x) for x in data.split(b"\n")]
    try:
        cols = tf.csv_header(lines[0])
    except Unreadable:
        return
    for line in lines[1:]:
        try:
            for p in tf.csv_row(line, cols, 1.7e9, 1):
                assert isinstance(p.step, int) and 0 <= p.step <= INT_MAX and p.key in cols and p.value == p.value
        except Unreadable:
            continue


# --- W&B: the training step, not W&B's own _step ---------------------------------------------------
def test_wandb_takes_the_trainers_global_step(tmp_path):
    """HF's WandbCallback logs train/global_step beside each row without step=, so _step counts its
    log() calls (0, 1, 2 for steps 10, 20, 30, as the real run wrote); Lightning's WandbLogger logs
    trainer/global_step, the index of the step just made (39 after 40 steps)."""
    recs = [wandb_history(0, 10.0, {"train/loss": 4.32, "train/global_step": 10.0}),
            wandb_history(1, 11.0, {"train/loss": 4.31, "train/global_step": 20.0}),
            wandb_history(2, 12.0, {"train_loss": 0.37, "epoch": 1.0, "trainer/global_step": 39.0}),
            wandb_history(3, 13.0, {"train/loss": 1.0}),
            wandb_history(4, 14.0, {"train/loss": 1.0, "train/global_step": 10.5})]
    assert [tf.wandb_record(x)[0][0].step for x in recs[:4]] == [10, 20, 40, 3]
    with pytest.raises(Unreadable):
        tf.wandb_record(recs[4])
    run = tmp_path / "wandb" / "offline-run-1-x"
    run.mkdir(parents=True)
    (run / "run-x.wandb").write_bytes(wandb_file(recs[:2]))
    t = TrackerFiles(["wandb"])
    assert [(o.step, o.loss) for o, _ in t.poll([str(tmp_path)], None).obs] == [(10, 4.32), (20, 4.31)]
