"""The training job in a real tmux session: states, exit codes, signals, stop escalation, re-adoption."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from supervisor.clock import FakeClock, SystemClock
from supervisor.config import from_dict
from supervisor.notify.alerts import Alerts
from supervisor.statefile import StateStore
from supervisor.states import TrainingState as S
from supervisor.training.job import Training, TrainingError
from tests.fixtures.context import ConfiguredContext
from tests.fixtures.procs import kill_under
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def make(tmp_path, clock=None, **training) -> tuple[Training, list, list]:
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "ctl.sock"),
                     "training": {"log": str(tmp_path / "train.log"), "workdir": str(tmp_path), **training}})
    clock = clock or SystemClock()
    store = StateStore(cfg.state_dir)
    ctx = ConfiguredContext(clock, store, Alerts(cfg.alerts, clock, cfg.state_dir), cfg)
    started, ended = [], []
    t = Training(ctx, ctx.config.training, on_start=started.append, on_end=ended.append)
    return t, started, ended


@pytest.fixture(autouse=True)
def _no_scope(monkeypatch):
    monkeypatch.setenv("TRAIN_SUPERVISOR_NO_SCOPE", "1")


@pytest.fixture
def cleanup(tmp_path):
    made: list[Training] = []
    yield made
    for t in made:
        subprocess.run(["tmux", "-S", t.tmux.socket, "kill-server"], capture_output=True)
    kill_under(tmp_path, settle=0)  # the runner ignores SIGHUP: it outlives its tmux server by design


def logtext(tmp_path) -> str:
    try:
        return (tmp_path / "train.log").read_text()
    except FileNotFoundError:
        return ""


def settle(t: Training, timeout=15.0):
    def ended():
        t.poll()
        return t.state in (S.FINISHED, S.FAILED, S.STOPPED)
    wait_until(ended, timeout, what="the training to end")
    return t.info()


def test_exit_0_is_finished_with_exit_code(tmp_path, cleanup):
    t, started, ended = make(tmp_path, command="echo hello from training; exit 0")
    cleanup.append(t)
    t.start()
    assert t.state in (S.STARTING, S.RUNNING)
    info = settle(t)
    assert info.state == S.FINISHED and info.exit_code == 0 and info.signal is None
    assert len(started) == 1 and len(ended) == 1 and ended[0].exit_code == 0
    assert "hello from training" in (tmp_path / "train.log").read_text()


def test_exit_3_is_failed(tmp_path, cleanup):
    t, _, ended = make(tmp_path, command="exit 3")
    cleanup.append(t)
    t.start()
    info = settle(t)
    assert info.state == S.FAILED and info.exit_code == 3
    assert ended[0].state == S.FAILED


def test_killed_by_signal_is_failed_with_the_signal(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command="sleep 60")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    child = t.info().pid
    os.kill(child, signal.SIGKILL)  # e.g. the kernel OOM killer
    info = settle(t)
    assert info.state == S.FAILED and info.signal == "SIGKILL" and info.exit_code == -9


def test_running_reports_pid_and_one_session(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command="sleep 60")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    assert psutil.pid_exists(t.info().pid)
    with pytest.raises(TrainingError, match="already RUNNING"):
        t.start()
    out = subprocess.run(["tmux", "-S", t.tmux.socket, "list-sessions"], capture_output=True, text=True).stdout
    assert len(out.strip().splitlines()) == 1


def test_stop_sends_sigint_and_job_exits(tmp_path, cleanup):
    script = tmp_path / "job.py"
    script.write_text("import signal, sys, time\n"
                      "def h(*a):\n    print('got SIGINT, saving', flush=True); sys.exit(0)\n"
                      "signal.signal(signal.SIGINT, h)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    t, _, ended = make(tmp_path, command=f"{sys.executable} {script}")
    cleanup.append(t)
    t.start()
    wait_until(lambda: "ready" in logtext(tmp_path), what="job ready")
    t.poll()
    t.stop()
    assert t.state == S.STOPPING
    info = settle(t)
    assert info.state == S.STOPPED and info.exit_code == 0
    assert "got SIGINT" in (tmp_path / "train.log").read_text()
    assert ended == []  # a requested stop is not a training end for on_finish


def test_stop_escalates_to_sigterm_then_sigkill_after_grace(tmp_path, cleanup):
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                      "while True: time.sleep(1)\n")
    clock = FakeClock()
    t, _, _ = make(tmp_path, clock=clock, command=f"exec {sys.executable} {script}", stop_grace="30s")
    cleanup.append(t)
    t.start()
    wait_until(lambda: "ready" in logtext(tmp_path), what="job ready")
    t.poll()
    t.stop()
    t.poll()
    assert t.doc.stop_phase == "SIGINT" and t.state == S.STOPPING
    clock.advance(31)
    t.poll()
    assert t.doc.stop_phase == "SIGTERM" and t.state == S.STOPPING
    clock.advance(31)
    t.poll()
    assert t.doc.stop_phase == "SIGKILL"
    info = settle(t)
    assert info.state == S.STOPPED and info.signal == "SIGKILL"


def test_new_daemon_readopts_running_job_without_second_copy(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command="sleep 60")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    pid = t.info().pid
    # a fresh Training over the same state_dir is what a restarted daemon builds
    t2, started2, _ = make(tmp_path)
    t2.adopt()
    assert t2.state == S.RUNNING and t2.info().pid == pid
    assert started2 == []
    with pytest.raises(TrainingError):
        t2.start()


def test_corrupt_state_file_readopts_from_tmux(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command="sleep 60")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    pid = t.info().pid
    (tmp_path / "state" / "training.json").write_text('{"state": "RUNN')  # torn write
    t2, _, _ = make(tmp_path)
    t2.adopt()
    assert t2.state == S.RUNNING
    assert t2.poll() is None and t2.state == S.RUNNING
    assert any("corrupt" in p for p in t2.ctx.store.problems)
    os.kill(pid, signal.SIGTERM)
    info = settle(t2)
    assert info.state == S.FAILED and info.signal == "SIGTERM"


def test_job_that_ended_while_daemon_was_down_is_settled(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command="sleep 0.5; exit 7")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (tmp_path / "state" / "runs" / "1" / "exit.json").exists(), what="exit record")
    t2, _, ended = make(tmp_path)
    t2.adopt()
    assert t2.state == S.FAILED and t2.info().exit_code == 7
    assert len(ended) == 1


def test_reboot_marks_run_stopped_not_failed(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command="sleep 60")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    runner = psutil.Process(t.doc.runner_pid)
    procs = [runner, *runner.children(recursive=True)]
    for p in procs:  # a reboot ends them all at once: frozen first, so the runner cannot record the
        p.suspend()  # death of its child as an exit (under load it sometimes did: a flaky FAILED)
    for p in procs:
        p.kill()
    subprocess.run(["tmux", "-S", t.tmux.socket, "kill-server"], capture_output=True)
    doc = json.loads((tmp_path / "state" / "training.json").read_text())
    doc["boot_id"] = "a-previous-boot"
    (tmp_path / "state" / "training.json").write_text(json.dumps(doc))
    t2, _, ended = make(tmp_path)
    t2.adopt()
    assert t2.state == S.STOPPED and "rebooted" in t2.status()["note"]
    assert ended == []


def test_on_failure_restarts_with_backoff_up_to_max(tmp_path, cleanup):
    clock = FakeClock()
    t, started, ended = make(tmp_path, clock=clock, command="exit 1", restart="on-failure",
                             max_restarts=2, restart_backoff="10s")
    cleanup.append(t)
    t.start()
    for n in (1, 2):
        wait_until(lambda: (t.poll(), t.state == S.FAILED)[1], what="FAILED")
        assert t.doc.next_restart_at is not None
        clock.advance(10 * 2 ** (n - 1) + 1)
        t.poll()
        assert t.info().restarts == n
    info = settle(t)
    wait_until(lambda: (t.poll(), t.state == S.FAILED)[1], what="final FAILED")
    assert info.restarts == 2 and len(started) == 3 and len(ended) == 1


def test_adhoc_run_command_and_missing_command(tmp_path, cleanup):
    t, _, _ = make(tmp_path)
    cleanup.append(t)
    with pytest.raises(TrainingError, match="no training command"):
        t.start()
    t.start(command="echo adhoc-run", adhoc=True)
    info = settle(t)
    assert info.command == "echo adhoc-run" and info.state == S.FINISHED


def test_env_and_workdir_reach_the_job(tmp_path, cleanup):
    t, _, _ = make(tmp_path, command='echo "$HF_HOME in $(pwd)"', env={"HF_HOME": "/tmp/hf"})
    cleanup.append(t)
    t.start()
    settle(t)
    assert f"/tmp/hf in {tmp_path}" in (tmp_path / "train.log").read_text()


# --- a damaged training.json ---------------------------------------------------------------------

def _wrong_value(tp) -> object:
    """A JSON value of the wrong type for a field annotated `tp`."""
    text = str(tp)
    if "TrainingState" in text:
        return "RUNNIN"
    if "str" in text:
        return 7
    return "7" if "int" in text or "float" in text else "yes"


def _wrong_cases() -> list[tuple[str, object]]:
    import dataclasses
    import typing

    from supervisor.training.job import TrainingDoc

    hints = typing.get_type_hints(TrainingDoc)
    cases = [(f.name, _wrong_value(hints[f.name])) for f in dataclasses.fields(TrainingDoc)]
    # and wrong values of the right type, and the two the issue found
    cases += [("runner_pid", "abc"), ("run_id", "7"), ("runner_pid", True), ("runner_pid", -1), ("child_pid", 0),
              ("run_id", -3), ("stop_phase", "SIGHUP"), ("started_at", [1.0]), ("state", None)]
    return cases


def test_every_field_of_training_json_with_a_wrong_type_is_set_aside_and_the_job_readopted(tmp_path, cleanup):
    """Each damaged field in turn, under a live job: the daemon never crashes on it, never judges the job
    by it (a string run_id once marked a live job FAILED), says so in status and re-adopts from tmux."""
    t, _, _ = make(tmp_path, command="sleep 120")
    cleanup.append(t)
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    good = json.loads((tmp_path / "state" / "training.json").read_text())
    pid, run_id = t.info().pid, t.info().run_id
    state = tmp_path / "state"
    for name, value in _wrong_cases():
        for old in state.glob("training.json.corrupt-*"):
            old.unlink()
        (state / "training.json").write_text(json.dumps({**good, name: value}))
        t2, _, ended = make(tmp_path)
        t2.adopt()
        t2.poll()
        assert (t2.state, t2.info().pid, t2.info().run_id) == (S.RUNNING, pid, run_id), (name, value)
        assert ended == [], (name, value)
        assert any(name in p and "set aside" in p for p in t2.ctx.store.problems), (name, t2.ctx.store.problems)
        assert list(state.glob("training.json.corrupt-*")), name
        assert json.loads((state / "training.json").read_text())["state"] == "RUNNING"   # rewritten whole


def test_damaged_state_without_a_job_starts_a_fresh_run_folder(tmp_path, cleanup):
    """training.json lost its run_id: the next run must not reuse runs/1, whose exit record would end it."""
    t, _, _ = make(tmp_path, command="exit 0")
    cleanup.append(t)
    t.start()
    settle(t)
    # the exit record comes a moment before the runner's tmux pane closes: a session still there
    # would be adopted as run 1 (a real daemon restart that races the pane's end)
    wait_until(lambda: not t.tmux.has_session(t.cfg.session), 15, what="the first run's tmux session gone")
    (tmp_path / "state" / "training.json").write_text('{"state": "FINISHED", "run_id": "1"}')
    t2, _, _ = make(tmp_path, command="sleep 60")
    cleanup.append(t2)
    t2.adopt()
    assert t2.state == S.STOPPED
    t2.start()
    wait_until(lambda: (t2.poll(), t2.state == S.RUNNING)[1], what="RUNNING")
    assert t2.info().run_id == 2 and t2.state == S.RUNNING
