"""`supervisorctl run` reports the run it started (issue 37, finding 7): with [resume] from_target
the run waits for a restore from the target, and `run` used to print the previous run's state
and exit 0 at once. Through the real daemon and the real CLI: a first run on an empty target, a
second that restores checkpoint-20 first and is reported RUNNING with the restored folder, and
a target that cannot be reached (exit 3: not running yet, the daemon starts it later)."""

from __future__ import annotations

import sys
from pathlib import Path

from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.resume.gate import ENV
from supervisor.sync.engine import engine_for
from tests.fixtures.hf_writer import HFWriter

JOB = f"{sys.executable} -c \"import os,time; print('from', os.environ.get('{ENV}')); time.sleep(60)\""


def upload(tmp: Path, target: Path) -> None:
    """Machine A's checkpoint-20 on the target, as its sync leaves it."""
    w = HFWriter(tmp / "a-out")
    w.checkpoint(20)
    a = engine_for(from_dict({"state_dir": str(tmp / "state-a"), "sync": {
        "target": str(target), "watch": [str(w.out)], "quiet_period": "0.3s"}}), SystemClock())
    a.start()
    try:
        assert a.wait_idle(30).ok
    finally:
        a.close()


def config(target: Path, out: Path, if_unreachable: str = "wait") -> dict:
    return {"hostname": "box-b", "alerts": {"first_delay": "0"},
            "sync": {"target": str(target), "watch": [str(out)], "quiet_period": "0.3s"},
            "resume": {"from_target": True, "if_unreachable": if_unreachable}}


def test_run_follows_the_restore_to_the_run_it_started(make_daemon, tmp_path):
    target, out = tmp_path / "remote", tmp_path / "b-out"
    target.mkdir()
    d = make_daemon(config(target, out))
    r = d.ctl("run", "--", "true")  # the target is empty: a first run, started fresh
    assert r.returncode == 0 and "FINISHED at once" in r.stdout, (r.stdout, r.stderr)
    first = d.status()["training"]["run_id"]
    upload(tmp_path, target)
    r = d.ctl("run", "--", "sh", "-c", JOB)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "restoring the newest complete checkpoint" in r.stdout and "checkpoint-20" in r.stdout, r.stdout
    assert "FINISHED" not in r.stdout and r.stdout.rstrip().splitlines()[-1].startswith("train: RUNNING"), r.stdout
    tr = d.status()["training"]
    assert tr["state"] == "RUNNING" and tr["run_id"] != first
    assert (out / "checkpoint-20" / "trainer_state.json").is_file()


def test_run_says_not_started_yet_while_the_target_is_away(make_daemon, tmp_path):
    target, out = tmp_path / "remote-not-there", tmp_path / "b-out"
    d = make_daemon(config(target, out))
    r = d.ctl("run", "--", "sh", "-c", JOB)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "not started yet: the target cannot be reached" in r.stderr and "starts by itself" in r.stderr
    assert d.status()["training"]["state"] != "RUNNING"
