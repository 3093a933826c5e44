"""A live but quiet training at the idle stop, through the real daemon (its real Training in real tmux,
its real sync engine to a local-folder target, its guard) with a fake clock where hours pass: the
duties run one by one as the scheduler would run them (Daemon.duties()), the clock moves 30 s per round.

The training saves a checkpoint when it is interrupted (on SIGINT, or only on SIGTERM): the stop must
interrupt it, wait for its process to end, sync what it saved, and only then run the action."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.config import from_dict
from tests.fixtures.inproc import run
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

REPO = Path(__file__).resolve().parents[2]
ROUND = 30.0

TRAINER = """
import signal, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.fixtures.hf_writer import HFWriter

def save(signum, frame):
    HFWriter(Path({out!r})).checkpoint(77)
    print("saved on", signal.Signals(signum).name, flush=True)
    sys.exit(0)

if sys.argv[1] == "SIGINT":
    signal.signal(signal.SIGINT, save)
else:  # a trainer that saves only on SIGTERM: the stop must escalate after training.stop_grace
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, save)
Path({ready!r}).touch()
while True:
    time.sleep(3600)  # quiet: no output, no GPU, no CPU
"""


@pytest.mark.parametrize("saves_on", ["SIGINT", "SIGTERM"])
def test_a_live_quiet_training_is_interrupted_its_save_synced_then_the_stop_runs(tmp_path, daemon, saves_on):
    out, target, ready = tmp_path / "out", tmp_path / "target", tmp_path / "ready"
    out.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(repo=str(REPO), out=str(out), ready=str(ready)))
    cfg = from_dict({
        "state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "control.sock"),
        "training": {"command": f"{sys.executable} {script} {saves_on}", "workdir": str(tmp_path),
                     "log": str(tmp_path / "train.log"), "on_finish": "none", "stop_grace": "30s"},
        "sync": {"target": str(target), "watch": [str(out)], "quiet_period": "1s"},
        "idle": {"warn_after": "2h", "stop_after_warning": "1h", "count_ssh": False, "count_tmux_clients": False},
        "stop": {"action": "dry-run", "final_sync": [str(out)]},
    })
    d = daemon(cfg)
    d.training.start()
    wait_until(ready.exists, 30, what="the trainer is up")
    wait_until(lambda: run(d, "training") or d.training.info().state.value == "RUNNING", 30, what="RUNNING")
    pid = d.training.info().pid
    assert pid and psutil.pid_exists(pid)

    # hours of a quiet, live training: warned, then the stop begins and interrupts it at once
    rounds = 0
    while d.guard.status()["idle"]["state"] != "STOPPING":
        d.clock.advance(ROUND)
        run(d, "training", "idle", "alerts")
        rounds += 1
        assert rounds < 400, d.guard.status()
    # the log the runner created counts as output for activity_window (10m); then 2h to the warning, 1h more
    assert 3 * 3600 <= rounds * ROUND <= 3 * 3600 + 600 + 2 * ROUND
    st = d.guard.status()
    assert st["stop"]["phase"] == "interrupting" and st["stop"]["interrupted_run"] == 1
    assert any("Run 1 is still running" in a.get("body", "") and "it will be interrupted at" in a["body"]
               for a in d.alerts.recent() if a.get("kind") == "idle_warning")

    if saves_on == "SIGTERM":
        # it ignores SIGINT: still alive, nothing synced, no action, until stop_grace has passed
        run(d, "training", "idle")
        assert psutil.pid_exists(pid) and d.guard.status()["stop"]["phase"] == "interrupting"
        d.clock.advance(ROUND)
    # its save takes real time; the daemon's duties keep running meanwhile
    wait_until(lambda: run(d, "training", "idle") or d.training.info().state.value == "STOPPED", 60,
               interval=0.1, what="the interrupted training ended")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert d.guard.status()["idle"]["state"] in ("STOPPING", "STOPPED")
    wait_until(lambda: run(d, "idle") or d.guard.drain(5) and d.guard.status()["idle"]["state"] == "STOPPED",
               60, interval=0.1, what="the stop ran")

    st = d.guard.status()["stop"]
    assert st["phase"] == "done" and st["final_sync"]["ok"] and st["interrupt_ended"] == "exit code 0"
    saved = list(target.rglob("checkpoint-77/trainer_state.json"))
    assert saved, sorted(str(p) for p in target.rglob("*"))
    history = " | ".join(d.guard.stopper.rec.history)
    assert history.index("interrupting run 1") < history.index("run 1 ended (exit code 0)") \
        < history.index("final sync verified") < history.index("dry-run: would have")
    assert f"saved on {saves_on}" in (tmp_path / "train.log").read_text()
    stopping = [a for a in d.alerts.recent() if a.get("kind") == "stopping" and a.get("what") == "event"]
    assert stopping and "it was interrupted at" in stopping[-1]["body"] and "ended (exit code 0)" in stopping[-1]["body"]
