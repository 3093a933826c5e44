"""Stop actions and the persisted stop sequence: dry-run, a real shell command (exactly once across
a kill -9 of the process running it), ec2 through boto3 against moto in server mode with IMDSv2 on
loopback, and poweroff through a stand-in systemctl (this box must not actually power off)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.idle.stop import (
    StopActionError,
    StopSequence,
    ec2_stop,
    imds_instance,
    may_act_without_sync,
    poweroff,
)
from supervisor.interfaces import FinalSyncResult
from supervisor.statefile import StateStore
from tests.fixtures.smtp import free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def seq(tmp_path, **stop) -> StopSequence:
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "stop": stop})
    return StopSequence(cfg.stop, StateStore(cfg.state_dir), SystemClock(), state_dir=cfg.state_dir)


def test_dry_run_is_recorded_once_and_survives_a_reload(tmp_path):
    s = seq(tmp_path, action="dry-run")
    rec = s.begin("boot-1", 3, "idle", 1000.0)
    s.record_sync(FinalSyncResult(ok=True, target="s3://b/p", files=4, bytes=10), 1001.0, 5.0)
    assert "dry-run" in s.act(1002.0, 6.0)
    assert rec.phase == "done" and rec.action_attempts == 1
    again = seq(tmp_path, action="dry-run")
    assert again.rec.phase == "done" and again.rec.synced["files"] == 4
    # the same stop begun again (a restart after done) does not start over
    assert again.begin("boot-1", 3, "idle", 2000.0).action_attempts == 1
    # a stop of another boot is history
    assert again.current("boot-2") is None


def test_final_sync_failure_is_recorded_with_a_retry_time(tmp_path):
    s = seq(tmp_path, action="dry-run", retry_interval="2m")
    s.begin("b", 1, "idle", 0.0)
    s.record_sync(FinalSyncResult(ok=False, target="s3://b", error="connection refused", unsynced=["a/x"]), 10.0, 50.0)
    assert s.rec.phase == "final_sync" and s.rec.next_try_mono == 170.0
    assert s.rec.last_error == "final sync failed: connection refused"
    assert s.rec.synced["unsynced"] == ["a/x"]


def test_may_act_without_sync_only_when_allowed_or_capped():
    base = {"state_dir": "/tmp/x"}

    def may(cfg, cost):
        return may_act_without_sync(cfg.stop, cost, cfg.max_idle_cost, cfg.currency)
    assert may(from_dict(base), 1e9) == ""
    assert "stop_even_if_sync_fails" in may(from_dict({**base, "stop": {"stop_even_if_sync_fails": True}}), None)
    capped = from_dict({**base, "price_per_hour": 2.0, "max_idle_cost": 5.0, "currency": "EUR"})
    assert may(capped, 4.99) == ""
    assert may(capped, 5.0) == "the idle cost 5.00 EUR reached max_idle_cost 5.00 EUR"
    assert may(capped, None) == ""


def test_command_runs_with_the_training_env_and_reports_failure(tmp_path):
    out = tmp_path / "stopped.txt"
    s = seq(tmp_path, action="command", command=f'echo "stop $POD_ID" >> {out}')
    s.command_env = {"POD_ID": "pod-42"}  # training.env, as the guard hands it over
    s.begin("b", 1, "idle", 0.0)
    assert s.act(1.0, 1.0).startswith("stop command succeeded")
    assert out.read_text() == "stop pod-42\n"
    assert s.rec.phase == "done"
    bad = seq(tmp_path / "2", action="command", command="echo nope >&2; exit 3", retry_interval="1m")
    bad.begin("b", 1, "idle", 0.0)
    with pytest.raises(StopActionError, match="exited 3: nope"):
        bad.act(1.0, 100.0)
    assert bad.rec.phase == "final_sync" and bad.rec.next_try_mono == 160.0
    assert bad.rec.last_error.startswith("stop action failed: stop command exited 3")


ACT_SCRIPT = """
import sys
from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.statefile import StateStore
from supervisor.clock import SystemClock
from supervisor.idle.stop import StopSequence
cfg = from_dict({"state_dir": sys.argv[1], "stop": {"action": "command", "command": sys.argv[2]}})
s = StopSequence(cfg.stop, StateStore(cfg.state_dir), SystemClock(), state_dir=cfg.state_dir)
s.begin("boot-1", 1, "idle", 0.0)
s.act(1.0, 1.0)
"""


def _kill9_while_acting(tmp_path: Path, command: str) -> dict:
    """Run act() in a process of its own and kill -9 it once the command's PID is on disk."""
    state = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-c", ACT_SCRIPT, str(state), command], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        rec = wait_until(lambda: (lambda d: d if d and d.get("action_pid") else None)(
            StateStore(state).load("stop", None)), 20, what="action pid recorded")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert rec["phase"] == "acting"
    return rec


def test_kill9_while_the_command_runs_waits_for_it_instead_of_running_it_twice(tmp_path):
    out, go = tmp_path / "stopped.txt", tmp_path / "go"
    cmd = f"while [ ! -e {go} ]; do sleep 0.05; done; echo stopped >> {out}"
    rec = _kill9_while_acting(tmp_path, cmd)
    assert os.path.exists(f"/proc/{rec['action_pid']}"), "the command outlives the daemon"
    s = seq(tmp_path, action="command", command=cmd)
    assert s.begin("boot-1", 1, "idle", 5.0).phase == "acting"
    go.touch()
    assert s.act(6.0, 6.0).startswith("stop command succeeded")
    assert out.read_text() == "stopped\n"
    assert s.rec.action_attempts == 1


def test_kill9_after_the_command_finished_reads_its_exit_status(tmp_path):
    out, go = tmp_path / "stopped.txt", tmp_path / "go"
    cmd = f"while [ ! -e {go} ]; do sleep 0.05; done; echo stopped >> {out}"
    rec = _kill9_while_acting(tmp_path, cmd)
    go.touch()
    wait_until(lambda: Path(rec["exit_file"]).exists(), 10, what="exit status written")
    s = seq(tmp_path, action="command", command=cmd)
    s.begin("boot-1", 1, "idle", 5.0)
    s.act(6.0, 6.0)
    assert out.read_text() == "stopped\n" and s.rec.phase == "done" and s.rec.action_attempts == 1


def test_a_command_killed_with_the_daemon_is_run_again_once(tmp_path):
    out, go = tmp_path / "stopped.txt", tmp_path / "go"
    cmd = f"while [ ! -e {go} ]; do sleep 0.05; done; echo stopped >> {out}"
    rec = _kill9_while_acting(tmp_path, cmd)
    os.killpg(rec["action_pid"], signal.SIGKILL)  # e.g. the whole unit's cgroup was killed
    wait_until(lambda: not _alive(rec["action_pid"]), 10, what="command gone")
    go.touch()
    s = seq(tmp_path, action="command", command=cmd)
    s.begin("boot-1", 1, "idle", 5.0)
    s.act(6.0, 6.0)
    assert out.read_text() == "stopped\n" and s.rec.action_attempts == 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_poweroff_calls_systemctl_poweroff(tmp_path, monkeypatch):
    """A stand-in systemctl first on PATH records its arguments; the real one would end the test box."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert poweroff() == "systemctl poweroff accepted"
    assert calls.read_text() == "poweroff\n"
    fake.write_text("#!/bin/sh\necho 'Failed to connect to bus' >&2\nexit 1\n")
    with pytest.raises(StopActionError, match="exited 1: Failed to connect to bus"):
        poweroff()


# --- ec2 -----------------------------------------------------------------------------------------
@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)


def test_ec2_stop_instances_against_moto_with_imdsv2(moto_ec2, imds, aws_env, tmp_path):
    ec2 = moto_ec2.ec2("eu-central-1")
    iid = ec2.run_instances(ImageId="ami-03cf127a", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    imds.instance_id = iid
    s = seq(tmp_path, action="ec2", imds_url=imds.url, ec2_endpoint_url=moto_ec2.url)
    s.begin("b", 1, "idle", 0.0)
    result = s.act(1.0, 1.0)
    # the call's answer, then the state read back (issue 52: the stop is done when EC2 says stopped)
    assert result.startswith(f"ec2 StopInstances {iid} in eu-central-1: running -> stopping; confirmed stopped")
    state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("stopping", "stopped")
    # IMDSv2: a token first, and every read carried it
    assert imds.requests[0] == ("PUT", "/latest/api/token", True)
    assert all(ok for _, _, ok in imds.requests)
    # re-running it (a resumed stop) is harmless
    assert "ec2 StopInstances" in ec2_stop(s.cfg)


def test_ec2_errors_name_the_problem(moto_ec2, imds, aws_env, tmp_path):
    cfg = from_dict({"state_dir": str(tmp_path), "stop": {"action": "ec2", "imds_url": imds.url,
                                                          "ec2_endpoint_url": moto_ec2.url}})
    imds.instance_id = "i-00000000000000000"  # not an instance moto knows
    with pytest.raises(StopActionError, match="StopInstances i-00000000000000000 in eu-central-1 failed"):
        ec2_stop(cfg.stop)
    with pytest.raises(StopActionError, match="IMDSv2.*unavailable.*is this an EC2 instance"):
        imds_instance(f"http://127.0.0.1:{free_port()}", timeout=1)
    assert imds_instance(imds.url, region="us-west-2")[1] == "us-west-2"


def test_unusable_stop_record_is_reported_and_not_resumed(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "stop.json").write_text(json.dumps({"id": "b:1", "phase": "exploding"}))
    s = seq(tmp_path, action="dry-run")
    assert s.rec is None
    assert any("stop.json" in p for p in s.store.problems)


class FullStore(StateStore):
    """A store on a full disk: every save fails the way statefile reports it."""

    def save(self, name, data):
        from supervisor.statefile import StateWriteError

        raise StateWriteError(self.path(name), OSError(28, "No space left on device"))


def test_a_stop_record_that_cannot_be_saved_does_not_hold_the_stop(tmp_path):
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "stop": {"action": "dry-run"}})
    s = StopSequence(cfg.stop, FullStore(cfg.state_dir), SystemClock(), state_dir=cfg.state_dir)
    rec = s.begin("boot-1", 1, "idle", 1000.0)
    s.record_sync(FinalSyncResult(ok=True, target="s3://b/p", files=1, bytes=1), 1001.0, 5.0)
    assert "dry-run" in s.act(1002.0, 6.0)
    assert rec.phase == "done"
