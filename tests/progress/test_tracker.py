"""ProgressTracker: captures fed as the log follower would, checkpoints on disk, time by FakeClock."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor import config
from supervisor.cli.render import progress_line
from supervisor.clock import FakeClock
from supervisor.notify.alerts import Alerts
from supervisor.progress.tracker import ProgressTracker
from supervisor.statefile import StateStore
from tests.fixtures.context import ConfiguredContext

DATA = Path(__file__).parents[1] / "data" / "progress"
CONTRACT = {"step", "max_steps", "epoch", "loss", "tokens_per_s", "eta_s"}
GiB = 1024**3


class Outbox:
    """A Mailer that keeps what it was asked to send."""

    def __init__(self):
        self.sent: list[tuple[str, str]] = []

    def send(self, subject: str, body: str) -> None:
        self.sent.append((subject, body))


class Gpu:
    """Stands in for supervisor.gpu.monitor.GpuMonitor at its seam: peak memory and the status block."""

    def peak_mem_bytes(self):
        return 70 * GiB

    def status(self):
        return {"gpus": [{"index": 0, "mem_total_bytes": 80 * GiB}], "gpu_error": None}


def make(tmp_path, clock, gpu=None, **top) -> tuple[ProgressTracker, ConfiguredContext, Outbox]:
    doc = {"state_dir": str(tmp_path / "state"), "price_per_hour": 3.90, "currency": "EUR", **top}
    cfg = config.from_dict(doc)
    store = StateStore(cfg.state_dir)
    box = Outbox()
    alerts = Alerts(cfg.alerts, clock, cfg.state_dir, box)
    ctx = ConfiguredContext(clock, store, alerts, cfg)
    return tracker(ctx, gpu), ctx, box


def tracker(ctx: ConfiguredContext, gpu=None) -> ProgressTracker:
    """Built as the daemon builds it: the price and currency handed over from the config."""
    return ProgressTracker(ctx, ctx.config.progress, price_per_hour=ctx.config.price_per_hour, currency=ctx.config.currency, gpu=gpu,
                           job_env=ctx.config.training.env, job_user=ctx.config.training.user)


def render_line(tr: ProgressTracker, now: float) -> str:
    """The status line as `supervisorctl status` builds it, from the status --json blocks alone."""
    return progress_line({"now": now, "training": {"progress": tr.snapshot(now)}, "cost": tr.cost(now)})


def lines(name: str) -> list[str]:
    return (DATA / name).read_bytes().decode("utf-8", errors="replace").split("\n")


def feed(tr, clock, items, dt):
    for line in items:
        clock.advance(dt)
        tr.feed_line(line, clock.time())


def tsup(**kw) -> str:
    return "TSUP " + json.dumps(kw)


def sane(snap: dict, cost: dict) -> None:
    """Whatever came in, what goes out is either a plausible number or None, and valid JSON."""
    json.dumps(snap, allow_nan=False)
    json.dumps(cost, allow_nan=False)
    assert CONTRACT <= set(snap)
    if snap["step"] is not None and snap["max_steps"] is not None:
        assert 0 <= snap["step"] <= snap["max_steps"] or snap["source"] == "trainer_state"
    assert snap["percent"] is None or 0 <= snap["percent"] <= 100
    for k in ("eta_s", "steps_per_s", "tokens_per_s", "elapsed_s"):
        assert snap[k] is None or snap[k] >= 0, k
    for k in ("spent", "eta_cost"):
        assert cost[k] is None or cost[k] >= 0


# --- arithmetic against hand-computed values ------------------------------------------------------

def test_eta_and_cost_hand_computed(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(1, t0)
    # a TSUP line every 10 s, 5 steps and 20,480 tokens each: 0.5 steps/s, 2,048 tokens/s
    for k in range(1, 204):
        clock.advance(10)
        tr.feed_line(tsup(step=5 * k, max_steps=3750, loss=1.21, tokens=20480 * k), clock.time())
    now = clock.time()  # t0 + 2030 s, step 1015
    s = tr.snapshot(now)
    assert (s["step"], s["max_steps"], s["source"]) == (1015, 3750, "tsup")
    assert s["steps_per_s"] == pytest.approx(0.5)
    assert s["tokens_per_s"] == pytest.approx(2048.0)
    assert s["eta_s"] == pytest.approx((3750 - 1015) / 0.5)           # 5470 s
    assert s["elapsed_s"] == pytest.approx(2030.0)
    assert s["total_s"] == pytest.approx(7500.0)
    assert s["percent"] == pytest.approx(27.07)
    c = tr.cost(now)
    assert c["spent"] == pytest.approx(3.90 * 2030 / 3600, abs=1e-4)   # 2.1992
    assert c["eta_cost"] == pytest.approx(3.90 * 5470 / 3600, abs=1e-4)  # 5.9258
    assert (c["price_per_hour"], c["currency"]) == (3.90, "EUR")
    assert render_line(tr, now) == ("progress  [#####---------------]  1,015/3,750  27.1%  loss 1.21  "
                                   "2,048 tok/s  ETA 1h31m  spent €2.20, to finish ~€5.93")
    # five seconds later nothing new was printed: 5 s less to go, 5 s more spent
    s2 = tr.snapshot(now + 5)
    assert s2["eta_s"] == pytest.approx(5465.0)
    assert tr.cost(now + 5)["spent"] == pytest.approx(3.90 * 2035 / 3600, abs=1e-4)


def test_tsup_time_makes_rates_exact_despite_the_log_poll(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(1, t0)
    # a line every 0.25 s, read by a follower that polls every 2 s: 8 lines arrive at once
    for poll in range(1, 31):
        clock.advance(2)
        for i in range(8):
            k = (poll - 1) * 8 + i + 1
            tr.feed_line(tsup(step=k, max_steps=1000, tokens=4096 * k, time=t0 + 0.25 * k), clock.time())
    s = tr.snapshot(clock.time())
    assert s["steps_per_s"] == pytest.approx(4.0, rel=1e-9) and s["tokens_per_s"] == pytest.approx(16384.0)
    # a time far off (a wrong clock, a replayed log) is ignored: the arrival time counts
    tr.feed_line(tsup(step=241, max_steps=1000, time=t0 - 7200), clock.time())
    assert tr.snapshot(clock.time())["step"] == 241


def test_axolotl_capture_eta(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    t0 = clock.time()
    ls = lines("axolotl.log")
    pre, train, tail = ls[:11], ls[11:-1], ls[-1:]
    feed(tr, clock, pre, 1.0)
    feed(tr, clock, train, 42.4)   # 10 steps a line at 4.24 s/it, as the bar says
    feed(tr, clock, tail, 0.0)
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["num_epochs"]) == (260, 873, 3.0)
    assert s["steps_per_s"] == pytest.approx(10 / 42.4, rel=1e-5)     # status rounds to 6 digits
    assert s["eta_s"] == pytest.approx(613 * 4.24, abs=0.05)          # 2599.12 s, to 0.1 s
    assert s["loss"] is not None and s["epoch"] == pytest.approx(round(260 / 291, 4))
    assert s["tokens_per_s"] is None                                  # Axolotl printed none: unknown
    assert tr.cost(clock.time())["spent"] == pytest.approx(3.90 * (clock.time() - t0) / 3600, abs=1e-4)


# --- real captures -----------------------------------------------------------------------------------

def test_hf_capture_eval_bars_never_show(tmp_path, clock):
    tr, ctx, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    steps = []
    for line in lines("hf_trainer_4.46.log"):
        clock.advance(20)
        tr.feed_line(line, clock.time())
        s = tr.snapshot(clock.time())
        sane(s, tr.cost(clock.time()))
        assert s["max_steps"] in (None, 120)
        if s["step"] is not None:
            steps.append(s["step"])
    assert steps == sorted(steps) and steps[-1] == 120
    s = tr.snapshot(clock.time())
    assert s["finished"] and s["eta_s"] == 0.0 and s["percent"] == 100.0
    assert tr.cost(clock.time())["eta_cost"] == 0.0
    assert "done in" in render_line(tr, clock.time())


def test_eval_on_start_bar_is_let_go_and_tokens_rate(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    seen_max = set()
    for line in lines("hf_trainer_4.50_strings.log"):
        clock.advance(7.5)   # 5 steps a line at 1.5 s/it
        tr.feed_line(line, clock.time())
        seen_max.add(tr.snapshot(clock.time())["max_steps"])
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["finished"]) == (90, 90, True)
    assert seen_max <= {None, 25, 90}       # the evaluation bar was shown only until it completed
    assert s["tokens_per_s"] == pytest.approx(16384 * 5 / 7.5)
    assert s["loss"] is not None and s["learning_rate"] is not None


def test_unsloth_banner_sets_max_steps(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    feed(tr, clock, lines("unsloth.log"), 3.0)
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["num_epochs"], s["finished"]) == (60, 60, 1.0, True)


def test_trl_rounded_tokens_still_give_a_rate(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    ls = lines("trl_sft.log")
    feed(tr, clock, ls[:12], 10.0)   # 10 steps a line at 1 s/it; tokens printed as '1.638e+05'
    s = tr.snapshot(clock.time())
    assert s["tokens_per_s"] == pytest.approx(16384, rel=0.01)
    assert s["steps_per_s"] == pytest.approx(1.0)


def test_garbage_capture_shows_only_true_numbers(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    for line in lines("garbage.log"):
        clock.advance(10)
        tr.feed_line(line, clock.time())
        s = tr.snapshot(clock.time())
        sane(s, tr.cost(clock.time()))
        assert s["step"] in (None, 100, 200, 300, 400)
        assert s["max_steps"] in (None, 1000)
        assert s["loss"] in (None, 0.9, 1.0, 0.8123)
        render_line(tr, clock.time())
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["loss"]) == (400, 1000, 0.8123)


def test_rotated_log(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    for line in lines("rotated-train.log.1"):
        for seg in line.split("\r"):
            clock.advance(0.5)
            tr.feed_line(seg, clock.time())
    assert tr.snapshot(clock.time())["step"] == 200   # 201 was cut mid-repaint
    tr.reset(clock.time())                             # the follower saw the truncation
    for line in lines("rotated-train.log"):
        for seg in line.split("\r"):
            clock.advance(0.5)
            tr.feed_line(seg, clock.time())
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"]) == (300, 500)
    assert s["steps_per_s"] == pytest.approx(2.0, rel=0.02)
    assert s["eta_s"] == pytest.approx(100, rel=0.03)


# --- which bar is the training bar ------------------------------------------------------------------

def bar(n, total):
    return f"{100 * n / total:3.0f}%|{'#' * (10 * n // total):<10}| {n}/{total} [00:01<00:01,  2.00it/s]"


def test_provisional_bar_released_when_it_completes_before_any_loss(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    feed(tr, clock, [bar(n, 5000) for n in range(0, 5001, 1000)], 1)  # a preprocessing loop, no desc
    assert tr.snapshot(clock.time())["step"] is None
    feed(tr, clock, [bar(n, 400) for n in range(0, 40)], 1)
    feed(tr, clock, ["{'loss': 0.7, 'learning_rate': 1e-05, 'epoch': 0.1}"], 1)
    feed(tr, clock, [bar(n, 25) for n in range(0, 26, 5)], 1)          # evaluation: ignored now
    feed(tr, clock, [bar(n, 400) for n in range(40, 401)], 1)          # runs to completion: stays
    feed(tr, clock, [bar(n, 25) for n in range(0, 26, 5)], 1)          # final evaluation: ignored
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"]) == (400, 400)


def test_trusted_max_steps_overrules_a_provisional_bar(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    feed(tr, clock, [bar(n, 30) for n in range(0, 20)], 1)
    assert tr.snapshot(clock.time())["max_steps"] == 30
    feed(tr, clock, ["  Total optimization steps = 1,000"], 1)
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"]) == (None, 1000)
    feed(tr, clock, [bar(n, 30) for n in range(20, 30)] + [bar(7, 1000)], 1)
    assert tr.snapshot(clock.time())["step"] == 7


def test_tsup_outranks_the_bar_and_a_resume_restarts_the_rate(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    for k in range(1, 61):
        clock.advance(1)
        tr.feed_line(bar(k, 400), clock.time())
        tr.feed_line(tsup(step=k, max_steps=400), clock.time())
    tr.feed_line(bar(399, 400), clock.time())  # an odd bar while TSUP speaks: ignored
    assert tr.snapshot(clock.time())["step"] == 60
    # the user's script died and resumed from checkpoint-50 inside the same run
    for k in range(50, 71):
        clock.advance(2)
        tr.feed_line(tsup(step=k, max_steps=400), clock.time())
    s = tr.snapshot(clock.time())
    assert s["step"] == 70 and s["steps_per_s"] == pytest.approx(0.5)


def test_epoch_only_progress(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    feed(tr, clock, ["  Num Epochs = 4"], 1)
    for k in range(1, 31):
        clock.advance(60)
        tr.feed_line(f"{{'loss': 0.5, 'learning_rate': 1e-05, 'epoch': {k * 0.05:.2f}}}", clock.time())
    s = tr.snapshot(clock.time())
    assert s["step"] is None and s["epoch"] == 1.5
    assert s["percent"] == pytest.approx(37.5)
    assert s["eta_s"] == pytest.approx((4 - 1.5) / (0.05 / 60))       # 3000 s
    assert "epoch 1.50/4" in render_line(tr, clock.time())


# --- checkpoints -------------------------------------------------------------------------------------------

def write_state(folder: Path, t: float, **doc) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "trainer_state.json"
    p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.utime(p, (t, t))
    return p


def test_scan_newest_checkpoint_of_this_run(tmp_path, clock, monkeypatch):
    import supervisor.progress.tracker as tracker_mod

    tr, _, _ = make(tmp_path, clock)
    out = tmp_path / "out"
    t0 = clock.time()
    write_state(out / "checkpoint-9999", t0 - 86400, global_step=9999, max_steps=9999)  # an older run's
    tr.start_run(1, t0)
    write_state(out / "checkpoint-100", t0 + 600, global_step=100, max_steps=400,
                log_history=[{"loss": 0.9, "learning_rate": 1e-4, "step": 100}])
    write_state(out / "tmp-checkpoint-300", t0 + 1700, global_step=300, max_steps=400)  # never final
    (out / "checkpoint-200").mkdir()                                                   # still being written
    clock.advance(1250)
    reads = []
    real = tracker_mod.parse_trainer_state
    monkeypatch.setattr(tracker_mod, "parse_trainer_state", lambda b: reads.append(1) or real(b))
    tr.scan_checkpoints([str(out), str(tmp_path / "missing")])
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["loss"], s["source"]) == (100, 400, 0.9, "trainer_state")
    tr.scan_checkpoints([str(out)])
    assert len(reads) == 1   # unchanged: not read again
    write_state(out / "checkpoint-200", t0 + 1200, global_step=200, max_steps=400)
    tr.scan_checkpoints([str(tmp_path)])   # one level above works too
    s = tr.snapshot(clock.time())
    assert s["step"] == 200 and s["steps_per_s"] == pytest.approx(100 / 600, rel=1e-5)
    assert s["eta_s"] == pytest.approx(200 / (100 / 600) - 50, abs=0.05)   # the checkpoint is 50 s old
    assert s["loss"] == 0.9   # the newer checkpoint's log_history had no loss: the last known stays


def test_truncated_trainer_state_is_read_again_when_rewritten(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(1, t0)
    ck = tmp_path / "out" / "checkpoint-1200"
    ck.mkdir(parents=True)
    full = (DATA / "trainer_state_4.50.json").read_bytes()
    p = ck / "trainer_state.json"
    p.write_bytes(full[:5000])
    os.utime(p, (t0 + 10, t0 + 10))
    clock.advance(30)
    tr.scan_checkpoints([str(tmp_path / "out")])
    assert tr.snapshot(clock.time())["step"] is None
    p.write_bytes(full)
    os.utime(p, (t0 + 40, t0 + 40))
    clock.advance(30)
    tr.scan_checkpoints([str(tmp_path / "out")])
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["loss"]) == (1200, 3750, 1.22)


def test_log_ahead_of_checkpoint_keeps_the_log_step(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(1, t0)
    for k in range(1, 1211, 10):
        clock.advance(5)
        tr.feed_line(bar(k, 3750), clock.time())
    tr.feed_line("{'loss': 1.3, 'learning_rate': 1e-05, 'epoch': 0.97}", clock.time())
    write_state(tmp_path / "out" / "checkpoint-1200", clock.time() - 5, global_step=1200, max_steps=3750,
                log_history=[{"loss": 1.25, "step": 1200}])
    tr.scan_checkpoints([str(tmp_path / "out")])
    s = tr.snapshot(clock.time())
    assert (s["step"], s["source"], s["loss"]) == (1201, "tqdm", 1.3)


# --- persistence across a daemon restart --------------------------------------------------------------------

def test_restart_keeps_the_run(tmp_path, clock):
    tr, ctx, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(7, t0)
    for k in range(1, 61):
        clock.advance(10)
        tr.feed_line(tsup(step=5 * k, max_steps=3750, tokens=20480 * k), clock.time())
    tr.maybe_early_estimate(clock.time())   # the minute duty saves what is unsaved
    before = tr.snapshot(clock.time())
    again = tracker(ctx)
    again.start_run(7, t0)                   # the daemon re-adopts the same run
    assert again.snapshot(clock.time()) == before
    clock.advance(120)                       # the daemon was down two minutes; the job went on
    for k in range(73, 80):
        clock.advance(10)
        again.feed_line(tsup(step=5 * k, max_steps=3750, tokens=20480 * k), clock.time())
    s = again.snapshot(clock.time())
    assert s["steps_per_s"] == pytest.approx(0.5) and s["elapsed_s"] == pytest.approx(clock.time() - t0)
    fresh = tracker(ctx)
    fresh.start_run(8, clock.time())
    assert fresh.snapshot(clock.time())["step"] is None


@pytest.mark.parametrize("content", [b"{not json", b'{"run_id": "x"}', b"[1, 2]",
                                     b'{"run_id": 3, "step": "many", "started_at": 1e999, "series": {"steps": 5}}'])
def test_corrupt_saved_state_starts_fresh(tmp_path, clock, content):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "progress.json").write_bytes(content)
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(3, clock.time())
    tr.feed_line(tsup(step=5, max_steps=10), clock.time())
    s = tr.snapshot(clock.time())
    assert s["step"] == 5
    sane(s, tr.cost(clock.time()))


# --- the end of a run, and what people read ------------------------------------------------------------------

def test_end_run_freezes_cost_and_eta(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(1, t0)
    for k in range(1, 40):
        clock.advance(10)
        tr.feed_line(tsup(step=k, max_steps=100), clock.time())
    tr.end_run(1, clock.time())     # it crashed at step 39
    spent = tr.cost(clock.time())["spent"]
    clock.advance(3600)
    s, c = tr.snapshot(clock.time()), tr.cost(clock.time())
    assert c["spent"] == spent == pytest.approx(3.90 * 390 / 3600, abs=1e-4)
    assert s["eta_s"] is None and c["eta_cost"] is None and s["step"] == 39
    assert "ended after 6m30s" in render_line(tr, clock.time())
    tr.feed_line(tsup(step=40, max_steps=100), clock.time())    # lines after the end change nothing
    assert tr.snapshot(clock.time())["step"] == 39


def test_render_and_summary_in_every_state(tmp_path, clock):
    tr, _, _ = make(tmp_path, clock)
    assert render_line(tr, clock.time()) == ""
    assert tr.snapshot(clock.time())["step"] is None
    t0 = clock.time()
    tr.start_run(1, t0)
    clock.advance(60)
    assert render_line(tr, clock.time()) == ("progress  unknown (no progress in the log or a checkpoint yet)  "
                                            "ETA unknown  spent €0.07")
    assert "Progress: unknown" in tr.email_summary(clock.time())
    for k in range(1, 31):
        clock.advance(10)
        tr.feed_line(tsup(step=k * 10, max_steps=1000, loss=0.5), clock.time())
    clock.advance(900)   # nothing for 15 minutes
    line = render_line(tr, clock.time())
    assert "300/1,000" in line and "ETA unknown (no progress for 15m00s)" in line
    s = tr.snapshot(clock.time())
    assert s["steps_per_s"] == 0.0 and s["eta_s"] is None and s["stalled_since"] == t0 + 360
    summary = tr.email_summary(clock.time())
    assert "step 300 of 1,000 (30.0%)" in summary and "Estimated finish: unknown" in summary
    assert "€" in summary and "so far at €3.90/h" in summary


def test_without_price_cost_is_unknown(tmp_path, clock):
    doc = {"state_dir": str(tmp_path / "state")}
    cfg = config.from_dict(doc)
    ctx = ConfiguredContext(clock, StateStore(cfg.state_dir), Alerts(cfg.alerts, clock, None), cfg)
    tr = tracker(ctx)
    tr.start_run(1, clock.time())
    clock.advance(100)
    c = tr.cost(clock.time())
    assert (c["price_per_hour"], c["spent"], c["eta_cost"], c["fits_budget"]) == (None, None, None, None)
    assert render_line(tr, clock.time()).endswith("elapsed 1m40s")


# --- the early estimate --------------------------------------------------------------------------------------

def test_early_estimate_mailed_once_with_gpu_peak_and_budget(tmp_path, clock):
    tr, ctx, box = make(tmp_path, clock, gpu=Gpu(),
                        progress={"estimate_email": True, "estimate_after": "15m", "budget": 10.0})
    t0 = clock.time()
    tr.start_run(4, t0)
    for k in range(1, 90):           # 14m50s of 0.5 steps/s
        clock.advance(10)
        tr.feed_line(tsup(step=5 * k, max_steps=3750), clock.time())
        tr.maybe_early_estimate(clock.time())
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    assert box.sent == []
    clock.advance(10)
    tr.feed_line(tsup(step=450, max_steps=3750), clock.time())
    tr.maybe_early_estimate(clock.time())   # 15 minutes in
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    assert len(box.sent) == 1
    subject, body = box.sent[0]
    # 3300 steps to go at 0.5/s = 6600 s; 900 s + 6600 s at EUR 3.90/h = EUR 8.13
    assert subject == "Training estimate: done in 1h50m, about €8.13 in all"
    assert "Peak GPU memory so far: 70.0 GiB of 80.0 GiB (88%)" in body
    assert "Projected cost of the run: €8.13 (€0.98 so far + €7.15 to finish)" in body
    assert "the run fits the budget of €10.00 (€9.03 left)" in body
    for _ in range(30):
        clock.advance(60)
        tr.maybe_early_estimate(clock.time())
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    assert len(box.sent) == 1
    assert [a["kind"] for a in ctx.alerts.recent() if a.get("what") == "event"] == ["early_estimate"]


def test_early_estimate_over_budget_is_a_warning(tmp_path, clock):
    tr, ctx, box = make(tmp_path, clock, progress={"estimate_email": True, "budget": 5.0})
    tr.start_run(1, clock.time())
    for k in range(1, 92):
        clock.advance(10)
        tr.feed_line(tsup(step=5 * k, max_steps=3750), clock.time())
    tr.maybe_early_estimate(clock.time())
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    subject, body = box.sent[0]
    assert subject.endswith("(over budget)") and "does NOT fit the budget of €5.00" in body
    assert "Peak GPU memory so far: unknown" in body
    assert ctx.alerts.recent()[-2]["severity"] == "warning"


def test_early_estimate_waits_for_figures_then_sends_unknowns(tmp_path, clock):
    tr, _, box = make(tmp_path, clock, progress={"estimate_email": True})
    tr.start_run(1, clock.time())
    clock.advance(16 * 60)
    tr.maybe_early_estimate(clock.time())
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    assert box.sent == []           # no ETA yet: a little longer
    clock.advance(15 * 60)
    tr.maybe_early_estimate(clock.time())
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    subject, body = box.sent[0]
    assert subject == "Training estimate: finish time unknown" and 'TSUP {"step"' in body


def test_early_estimate_without_email_goes_to_the_log_only(tmp_path, clock):
    tr, _, box = make(tmp_path, clock)
    tr.start_run(1, clock.time())
    for k in range(1, 95):
        clock.advance(10)
        tr.feed_line(tsup(step=5 * k, max_steps=3750), clock.time())
    with structlog.testing.capture_logs() as logs:
        tr.maybe_early_estimate(clock.time())
    tr.ctx.alerts.flush(10)  # delivery runs on the channel's own worker
    assert box.sent == []
    events = {e["event"]: e for e in logs}
    assert events["progress_estimate"]["eta_s"] == pytest.approx((3750 - 470) / 0.5)
    assert events["progress"]["step"] == 470          # the periodic structured progress line


# --- nothing fed can break it ----------------------------------------------------------------------------------

_LINES = st.sampled_from([
    bar(10, 100), bar(50, 100), bar(5, 25), bar(25, 25), bar(100, 100), bar(0, 100),
    "{'loss': 0.5, 'learning_rate': 1e-05, 'epoch': 0.5}", "{'loss': nan, 'epoch': 1}",
    "{'train_runtime': 1.0, 'train_loss': 0.2, 'epoch': 1.0}", "  Total optimization steps = 100",
    "  Total steps = 200", "  Num Epochs = 2", tsup(step=30, max_steps=100), tsup(step=5), tsup(tokens=100),
    tsup(tokens=50, step=3), "{'loss': '1.0', 'num_tokens': '1.2e+05', 'epoch': '0.3'}", "3,000 tok/s",
    "Continuing training from global step 20", "\ufffd\x00garbage", "{'loss': 0.9, 'lear", ""])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_LINES, st.floats(0, 400)), max_size=40), st.booleans())
def test_any_sequence_of_lines_gives_sane_figures(tmp_path, items, end):
    clock = FakeClock()
    tr, _, _ = make(tmp_path / str(abs(hash(str(items)))), clock)
    tr.start_run(1, clock.time())
    for line, dt in items:
        clock.advance(dt)
        tr.feed_line(line, clock.time())
        sane(tr.snapshot(clock.time()), tr.cost(clock.time()))
    if end:
        tr.end_run(1, clock.time())
    clock.advance(1000)
    s = tr.snapshot(clock.time())
    sane(s, tr.cost(clock.time()))
    assert isinstance(render_line(tr, clock.time()), str) and isinstance(tr.email_summary(clock.time()), str)
    assert not any(isinstance(v, float) and math.isnan(v) for v in s.values())


def test_step_at_a_time_for_the_manifest_of_a_save_that_names_none(tmp_path, clock):
    """The sync asks the step at a save's mtime (nanoGPT's ckpt.pt names none): the newest step
    seen at or before it, None before the first."""
    tr, _, _ = make(tmp_path, clock)
    t0 = clock.time()
    tr.start_run(1, t0)
    assert tr.step_at(t0) is None
    marks = {}
    for k in range(1, 6):
        clock.advance(10)
        tr.feed_line(f"iter {10 * k}: loss 2.{k}, time 10.00ms, mfu 1.00%", clock.time())
        marks[10 * k] = clock.time()
    assert tr.step_at(t0 + 1) is None
    assert tr.step_at(marks[30]) == 30
    assert tr.step_at(marks[30] + 5) == 30
    assert tr.step_at(clock.time() + 100) == 50
