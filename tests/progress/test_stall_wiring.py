"""The stall decision as status, config, words, render, metrics and the guard see it. Pure parts
directly; the tracker with lines fed as the log follower feeds them; the guard with the in-test
stand-ins of tests/idle/test_guard.py (the e2e in tests/progress/test_stall_e2e.py wires the real parts)."""

from __future__ import annotations

import pytest

from supervisor import config
from supervisor.cli.render import progress_line
from supervisor.clock import FakeClock
from supervisor.fleet.metrics import exposition
from supervisor.notify.mails import stall as words
from supervisor.progress import stall
from supervisor.states import TrainingState as T
from tests.idle.test_guard import FakeGpu, FakeProgress, FakeTraining, H
from tests.progress.test_tracker import make

T0 = 1_800_000_000.0


# --- the pure decision ----------------------------------------------------------------------------
def test_view_before_the_first_step_and_when_not_running():
    assert stall.view(None, None, [], T0, None, True) == stall.View(None, None, None)
    assert stall.view(5, T0, [T0], T0 + 9999, None, running=False) == stall.View(None, None, None)


def test_view_counts_seconds_since_the_step_and_judges_at_the_threshold():
    times = [T0 + 60 * i for i in range(6)]       # a step a minute: 10 x 1m < 30m, the floor holds
    v = stall.view(5, times[-1], times, times[-1] + 1799, None, True)
    assert v == stall.View(1799, 1800.0, None)
    v = stall.view(5, times[-1], times, times[-1] + 1800, None, True)
    assert v.stall == stall.Stall(5, times[-1], 1800, 1800.0)
    slow = [T0 + 600 * i for i in range(6)]       # a step per 10 min: 100 min
    assert stall.view(5, slow[-1], slow, slow[-1] + 3600, None, True).stall is None
    assert stall.view(5, slow[-1], slow, slow[-1] + 6000, None, True).stall is not None
    assert stall.view(5, slow[-1], slow, slow[-1] + 300, 300.0, True).threshold_s == 300.0  # configured wins


def test_only_stop_counts_a_stall_as_idle():
    s = stall.Stall(5, T0, 2000, 1800)
    assert stall.counts_as_idle(s, "stop")
    assert not stall.counts_as_idle(s, "alert")
    assert not stall.counts_as_idle(None, "stop")


# --- config ----------------------------------------------------------------------------------------
def test_config_defaults_and_values():
    c = config.from_dict({})
    assert c.progress.stall_after is None and c.progress.stalled_action == "alert"
    assert config.from_dict({"progress": {"stall_after": ""}}).progress.stall_after is None
    c = config.from_dict({"progress": {"stall_after": "45m", "stalled_action": "stop"}})
    assert c.progress.stall_after == 2700.0 and c.progress.stalled_action == "stop"


@pytest.mark.parametrize("section, problem", [
    ({"stall_after": "10s"}, 'progress.stall_after: must be at least 1m00s, got "10s"'),
    ({"stall_after": 1800}, 'progress.stall_after: expected a duration like "2h", got 1800'),
    ({"stall_after": "soon"}, 'progress.stall_after: expected a duration like "2h", got "soon"'),
    ({"stalled_action": "halt"}, 'progress.stalled_action: expected one of alert, stop, got "halt"'),
    ({"stalled_acton": "stop"}, "progress.stalled_acton: unknown key (did you mean progress.stalled_action?)"),
])
def test_config_errors_name_the_key(section, problem):
    with pytest.raises(config.ConfigError) as e:
        config.from_dict({"progress": section})
    assert problem in e.value.problems, e.value.problems


# --- the tracker ---------------------------------------------------------------------------------
def tsup(step: int, max_steps: int = 100) -> str:
    return f'TSUP {{"step": {step}, "max_steps": {max_steps}}}'


def test_tracker_status_keys(tmp_path):
    clock = FakeClock(start=T0)
    tr, ctx, _ = make(tmp_path, clock)
    tr.start_run(1, T0)
    p = tr.snapshot(T0)
    assert (p["since_step_s"], p["stall_after_s"], p["stalled"]) == (None, None, False)  # no step yet
    for i in range(1, 6):
        tr.feed_line(tsup(i), T0 + 120 * i)   # a step every 2 min: 10 x 2m < 30m
    last = T0 + 600
    p = tr.snapshot(last + 1000)
    assert (p["since_step_s"], p["stall_after_s"], p["stalled"]) == (1000.0, 1800.0, False)
    p = tr.snapshot(last + 1800)
    assert p["stalled"] is True and tr.stall(last + 1800).stall == stall.Stall(5, last, 1800.0, 1800.0)
    tr.feed_line(tsup(6), last + 1900)
    assert tr.snapshot(last + 1900)["stalled"] is False
    tr.end_run(1, last + 2000)
    p = tr.snapshot(last + 9999)
    assert p["since_step_s"] is None and p["stalled"] is False  # an ended run is not judged


def test_few_steps_count_the_wait_for_the_first_one(tmp_path):
    """Steps seen only in hourly checkpoints: one step is not a cadence; the hour to it is one gap."""
    clock = FakeClock(start=T0)
    tr, _, _ = make(tmp_path, clock)
    tr.start_run(1, T0)
    tr.feed_line(tsup(500, 5000), T0 + 3600)
    assert tr.stall(T0 + 3600 + 1800).stall is None and tr.stall(T0 + 3600).threshold_s == 36_000.0
    tr.feed_line(tsup(1000, 5000), T0 + 7200)
    tr.feed_line(tsup(1500, 5000), T0 + 10_800)
    assert tr.stall(T0 + 10_800).threshold_s == 36_000.0
    for i in range(4, 40):                      # then a fast cadence: the floor again
        tr.feed_line(tsup(1500 + i, 5000), T0 + 10_800 + 2 * i)
    assert tr.stall(T0 + 11_000).threshold_s == 1800.0


def test_tracker_uses_the_configured_threshold_and_never_judges_a_finished_run(tmp_path):
    clock = FakeClock(start=T0)
    tr, _, _ = make(tmp_path, clock, progress={"stall_after": "5m"})
    tr.start_run(1, T0)
    tr.feed_line(tsup(3), T0 + 10)
    assert tr.stall(T0 + 310).stall is not None and tr.snapshot(T0 + 310)["stall_after_s"] == 300.0
    tr.feed_line('TSUP {"step": 100, "max_steps": 100, "done": true}', T0 + 320)
    assert tr.stall(T0 + 99_999).stall is None  # pushing to the Hub for an hour after the end is no hang


# --- words ---------------------------------------------------------------------------------------
def facts(**kw) -> words.Stalled:
    base = dict(run_id=3, step=120, since=T0, for_s=1830, threshold_s=1800, configured=False, max_steps=3750,
                pids=(101, 102), cpu="CPU 97%",
                gpus=(words.GpuFigure(0, 100.0, 70 * 2**30, 80 * 2**30), words.GpuFigure(1, None, None, None)),
                log_path="/workspace/train.log", log_tail=("step 120 loss 1.2",), stacks="Thread 101 (idle)\n  f (x.py:1)")
    return words.Stalled(**{**base, **kw})


def test_the_stalled_mail():
    m = words.stalled(facts())
    assert m.subject == "training stalled: no step for 30m30s (step 120/3750)"
    for part in ("Training run 3 is running, but its step has not advanced for 30m30s.",
                 "Last step: 120/3750, seen at ", "Stalled after: 30m00s without a new step (the larger of 30m",
                 "GPU 0: util 100%, memory 70.0 GiB of 80.0 GiB", "GPU 1: util unknown, memory unknown",
                 "Processes of the training: 101, 102 (CPU 97% of one core in all)",
                 'Nothing is stopped (progress.stalled_action = "alert")',
                 "Last lines of /workspace/train.log:\n  step 120 loss 1.2",
                 "Python stacks (py-spy dump):\nThread 101 (idle)\n  f (x.py:1)"):
        assert part in m.body, part
    m = words.stalled(facts(configured=True, action="stop", gpus=(), gpu_error="no driver", log_tail=(), cpu=""))
    assert "(progress.stall_after)" in m.body and "GPUs: no driver" in m.body and "  (none)" in m.body
    assert 'progress.stalled_action = "stop": this run now counts as idle' in m.body
    assert "Processes of the training: 101, 102\n" in m.body


# --- render and metrics ----------------------------------------------------------------------------
def status(**progress) -> dict:
    p = {"step": 120, "max_steps": 3750, "percent": 3.2, "started_at": T0, "ended_at": None, "finished": False,
         "eta_s": None, "since_step_s": 2700.0, "stall_after_s": 1800.0, "stalled": True, **progress}
    return {"now": T0 + 5000, "training": {"state": "RUNNING", "progress": p}, "cost": {}}


def test_render_says_stalled():
    assert "STALLED: no step for 45m00s (since " in progress_line(status())
    assert "STALLED" not in progress_line(status(stalled=False, since_step_s=20.0))
    assert "STALLED" not in progress_line(status(stalled=None, since_step_s=None, stall_after_s=None))


def test_metrics():
    text = exposition(status())
    assert "train_supervisor_seconds_since_step 2700" in text
    assert "train_supervisor_training_stall_after_seconds 1800" in text
    assert "train_supervisor_training_hung 1" in text
    text = exposition(status(stalled=False, since_step_s=None, stall_after_s=None))
    assert "train_supervisor_seconds_since_step " not in text and "train_supervisor_training_hung " not in text


# --- the guard: stalled_action = "stop" counts the run as idle --------------------------------------
class StalledProgress(FakeProgress):
    def __init__(self):
        self.stalled = True

    def stall(self, now):
        s = stall.Stall(120, now - 2000, 2000, 1800) if self.stalled else None
        return stall.View(2000 if s else 5, 1800, s)


@pytest.mark.parametrize("action", ["alert", "stop"])
def test_a_stalled_run_counts_as_idle_only_with_stop(tmp_path, action):
    training = FakeTraining(tmp_path)
    training.state, training.run_id = T.RUNNING, 1
    h = H(tmp_path, FakeClock(start=T0), training=training, gpu=FakeGpu(100.0),
          config={"progress": {"stalled_action": action}})
    progress = StalledProgress()
    h.guard.progress = progress
    h.poll(3)
    idle = h.guard.status()["idle"]
    if action == "alert":
        assert idle["state"] == "ACTIVE" and any(r.startswith("gpu: 100%") for r in idle["reasons"])
        return
    assert idle["state"] == "IDLE" and idle["training_stalled"] is True
    assert any(n.startswith("gpu: 100%") and "(training stalled: step 120 unchanged since" in n
               for n in idle["checked"]), idle
    # the step moves: its GPU load is work again, the idle clock starts over
    progress.stalled = False
    h.poll()
    assert h.guard.status()["idle"]["state"] == "ACTIVE"
    # stalled long enough: warned like any idle machine, then the stop interrupts the run
    progress.stalled = True
    h.until("WARNED")
    h.until("STOPPING")
    h.poll(2)
    assert training.stops >= 1
