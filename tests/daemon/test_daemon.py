"""The daemon end to end: a real train-supervisord process, real tmux, supervisorctl as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

STATUS_KEYS = {
    "training": {"state", "pid", "started_at", "exit_code", "restarts", "progress"},
    "sync": {"target", "state", "last_ok_at", "last_error", "pending_bytes", "pending_files",
             "uploaded_files", "uploaded_bytes"},
    "idle": {"state", "idle_since", "warn_at", "stop_at", "reasons", "keepalive_until"},
    "stop": {"action", "planned_at"},
    "cost": {"price_per_hour", "currency", "spent", "eta_cost"},
    "disk": {"prune", "keep_local", "filesystems", "deleted", "freed_bytes", "recent", "last_prune"},
}
PROGRESS_KEYS = {"step", "max_steps", "epoch", "loss", "tokens_per_s", "eta_s"}


def base_config(tmp_path, **training) -> dict:
    return {
        "training": {"command": "sleep 300", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                     "on_finish": "none", **training},
        "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")},
        "stop": {"action": "dry-run"},
    }


def test_status_json_contract_and_exit_codes(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path))
    r = d.ctl("status")
    assert r.returncode == 3, r.stderr  # nothing running yet
    assert "STOPPED" in r.stdout
    assert d.ctl("start").returncode == 0
    tr = d.wait_training("RUNNING")
    r = d.ctl("status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    for block, keys in STATUS_KEYS.items():
        assert keys <= set(st[block]), (block, keys - set(st[block]))
    assert PROGRESS_KEYS <= set(st["training"]["progress"])
    assert st["gpus"] == [] and st["gpu_error"]
    assert isinstance(st["alerts"], list)
    assert st["training"]["pid"] == tr["pid"]
    human = d.ctl("status")
    assert human.returncode == 0 and "RUNNING" in human.stdout and f"pid {tr['pid']}" in human.stdout
    d.terminate()
    r = d.ctl("status")
    assert r.returncode == 4 and "cannot reach" in r.stderr


def test_kill9_daemon_readopts_same_training(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path))
    assert d.ctl("start").returncode == 0
    pid = d.wait_training("RUNNING")["pid"]
    d.kill9()
    assert os.path.exists(f"/proc/{pid}"), "the training must survive the daemon"
    d.start()
    tr = d.wait_training("RUNNING")
    assert tr["pid"] == pid
    sessions = subprocess.run(["tmux", "-S", str(d.state_dir / "tmux.sock"), "list-sessions"],
                              capture_output=True, text=True).stdout.strip().splitlines()
    assert len(sessions) == 1
    r = d.ctl("start")
    assert r.returncode == 1 and "already RUNNING" in r.stderr
    # and the adopted run still ends normally, with its exit status
    os.kill(pid, 15)
    tr = d.wait_training("FAILED")
    assert tr["signal"] == "SIGTERM"


def test_finished_and_failed_through_the_daemon(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path, command="echo done; exit 0"))
    d.ctl("start")
    tr = d.wait_training("FINISHED")
    assert tr["exit_code"] == 0
    assert d.ctl("status").returncode == 0  # FINISHED cleanly counts as OK
    r = d.ctl("run", "--", "sh", "-c", "exit 3")
    assert r.returncode == 1 and "FAILED within its first seconds: exit code 3" in r.stderr, r.stderr
    tr = d.wait_training("FAILED")
    assert tr["exit_code"] == 3 and tr["command"] == "sh -c 'exit 3'"
    assert d.ctl("status").returncode == 3
    tail = d.ctl("tail", "-n", "50")
    assert "done" in tail.stdout and "exit code 3" in tail.stdout


def test_stop_and_restart_verbs(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path))
    d.ctl("start")
    pid1 = d.wait_training("RUNNING")["pid"]
    r = d.ctl("restart")
    assert r.returncode == 0, r.stderr
    pid2 = d.wait_training("RUNNING")["pid"]
    assert pid2 != pid1 and not os.path.exists(f"/proc/{pid1}")
    r = d.ctl("stop")
    assert r.returncode == 0, r.stderr
    assert d.status()["training"]["state"] == "STOPPED"


def test_garbage_on_socket_leaves_daemon_and_state_intact(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path))
    d.ctl("start")
    pid = d.wait_training("RUNNING")["pid"]
    for payload in (b"\x00\xff" * 1000, b"{" * 70000, b'{"cmd": "keepalive", "args": {"duration": "soon"}}\n',
                    b'{"cmd": "run", "args": {"argv": "rm -rf /"}}\n', b'{"cmd": "alerts", "args": {"n": -1}}\n'):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(d.socket)
        try:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            c.recv(65536)
        except OSError:
            pass
        c.close()
    assert d.ready()
    assert d.status()["training"]["pid"] == pid
    r = d.ctl("keepalive", "soon")
    assert r.returncode == 1 and "duration" in r.stderr


def test_corrupt_state_files_are_set_aside_and_reported(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path), start=False)
    d.state_dir.mkdir(parents=True)
    for name in ("training", "alerts", "idle", "sync-ledger"):
        (d.state_dir / f"{name}.json").write_bytes(b'{"truncated": ')
    d.start()
    st = d.status()
    assert st["training"]["state"] == "STOPPED"
    assert any("corrupt" in p for p in st["daemon"]["problems"])
    assert list(d.state_dir.glob("training.json.corrupt-*"))
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")


def test_daemon_refuses_bad_config(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[idle]\nwarn_after = "soon"\n')
    r = subprocess.run([sys.executable, "-m", "supervisor.daemon.main", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and 'idle.warn_after: expected a duration like "2h", got "soon"' in r.stderr


def test_alerts_verb_without_smtp_lists_local_alerts(tmp_path, make_daemon):
    d = make_daemon(base_config(tmp_path, command="exit 5", restart="on-failure", max_restarts=1,
                                restart_backoff="1h"))
    d.ctl("start")
    d.wait_training("FAILED")
    r = wait_until(lambda: (lambda r: r if "training_restarted" in r.stdout else None)(d.ctl("alerts")), 10)
    assert "restarting" in r.stdout
