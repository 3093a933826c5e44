"""What happens while no daemon runs, against the real daemon and real tmux: kill -9, lines written to the
log meanwhile, a training that ends meanwhile, a damaged training.json under a live job; and the runner's
banner, which repeats the command, never taken for an out-of-memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
       "of 79.15 GiB of which 1.06 GiB is free.")
TRACEBACK = f'Traceback (most recent call last):\n  File "train.py", line 10, in <module>\n{OOM}\n'


def config(tmp_path: Path, **training) -> dict:
    return {
        "training": {"command": "echo ready; sleep 300", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                     "on_finish": "none", **training},
        "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")},
        "stop": {"action": "dry-run"},
    }


def events(d, kind: str) -> list[dict]:
    """Alerts of `kind` that were sent (not suppressed as repeats), over every daemon's lifetime."""
    p = d.state_dir / "alerts.jsonl"
    if not p.exists():
        return []
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("what") == "event" and r.get("kind") == kind]


def followed_to_end(d, log: Path) -> bool:
    """The daemon has handed on every line of the log and saved where it got to."""
    try:
        pos = json.loads((d.state_dir / "logfollow.json").read_text())
    except (OSError, ValueError):
        return False
    return pos.get("path") == str(log) and pos.get("offset") == log.stat().st_size


def test_oom_printed_while_the_daemon_was_down_is_alerted_once(tmp_path, make_daemon):
    d = make_daemon(config(tmp_path))
    log = tmp_path / "train.log"
    assert d.ctl("start").returncode == 0
    pid = d.wait_training("RUNNING")["pid"]
    wait_until(lambda: "ready" in log.read_text() and followed_to_end(d, log), 30, what="log followed")
    d.kill9()
    with open(log, "a") as f:   # the job runs out of memory in the gap (and keeps going: a rank of many)
        f.write(TRACEBACK)
    d.start()
    assert d.wait_training("RUNNING")["pid"] == pid
    wait_until(lambda: events(d, "cuda_oom"), 30, what="the OOM alert")
    with open(log, "a") as f:
        f.write(f"[rank1]: {OOM}\nstill going\n")
    wait_until(lambda: followed_to_end(d, log), 30, what="the new lines read")
    d.kill9()                  # once more: what was already read is not read (nor mailed) again
    d.start()
    with open(log, "a") as f:
        f.write("after the second restart\n")
    wait_until(lambda: followed_to_end(d, log), 30, what="the log read after the second restart")
    (ev,) = events(d, "cuda_oom")
    assert "GPU 0" in ev["subject"] and OOM in ev["body"]


def test_training_that_ended_with_an_oom_while_the_daemon_was_down(tmp_path, make_daemon):
    job = (f"echo ready; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; "
           f"echo 'Traceback (most recent call last):'; echo '{OOM}'; exit 1")
    d = make_daemon(config(tmp_path, command=job))
    log = tmp_path / "train.log"
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")
    wait_until(lambda: "ready" in log.read_text() and followed_to_end(d, log), 30, what="log followed")
    d.kill9()
    (tmp_path / "go").touch()
    wait_until(lambda: (d.state_dir / "runs" / "1" / "exit.json").exists(), 30, what="the job's exit record")
    d.start()
    tr = d.wait_training("FAILED")
    assert tr["exit_code"] == 1
    wait_until(lambda: events(d, "cuda_oom"), 30, what="the OOM alert")
    assert len(events(d, "cuda_oom")) == 1
    assert d.status()["training"]["progress"]["ended_at"] is not None


def test_the_banner_repeating_the_command_is_no_oom(tmp_path, make_daemon):
    d = make_daemon(config(tmp_path))
    log = tmp_path / "train.log"
    r = d.ctl("run", "--", "sh", "-c", f"true 'if it fails:\n{OOM}' 'or: Out of memory: Killed process 1'; echo fine")
    assert r.returncode == 0, r.stderr
    d.wait_training("FINISHED")
    wait_until(lambda: "ended: exit code 0" in log.read_text() and followed_to_end(d, log), 30, what="log read")
    assert OOM in log.read_text()
    assert events(d, "cuda_oom") == [] and events(d, "host_oom_kill") == []


@pytest.mark.parametrize("damage", [{"runner_pid": "abc"}, {"run_id": "7"}, {"state": 3}])
def test_damaged_training_json_under_a_live_job_is_readopted_running(tmp_path, make_daemon, damage):
    """With the default on_finish = "stop": a job judged FAILED from a damaged file would start the stop."""
    cfg = config(tmp_path, command="echo ready; while true; do echo tick; sleep 0.2; done", on_finish="stop")
    d = make_daemon(cfg)
    log = tmp_path / "train.log"
    assert d.ctl("start").returncode == 0
    tr = d.wait_training("RUNNING")
    d.kill9()
    path = d.state_dir / "training.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **damage}))
    d.start()
    st = d.status()
    assert (st["training"]["state"], st["training"]["pid"], st["training"]["run_id"]) == \
        ("RUNNING", tr["pid"], tr["run_id"])
    field = next(iter(damage))
    assert any("training.json" in p and field in p and "set aside" in p for p in st["daemon"]["problems"])
    assert list(d.state_dir.glob("training.json.corrupt-*"))
    # a few rounds of every duty later it is still running, and nothing is about to stop the machine
    size = log.stat().st_size
    wait_until(lambda: log.stat().st_size > size + 200 and followed_to_end(d, log), 30, what="duties ran")
    st = d.status()
    assert st["training"]["state"] == "RUNNING" and st["stop"]["planned_at"] is None
    assert st["idle"]["state"] in ("ACTIVE", "IDLE")
    assert events(d, "training_failed") == [] and events(d, "training_finished") == []
    assert d.ctl("stop").returncode == 0
    d.wait_training("STOPPED")
