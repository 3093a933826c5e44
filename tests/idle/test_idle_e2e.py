"""Idle protection end to end: a real train-supervisord with real tmux, a real sshd login over
loopback, a real Jupyter Server with a busy kernel, the fake NVML library under real pynvml,
SeaweedFS as the S3 target and aiosmtpd for the mails. Thresholds are seconds, not hours; every
wait is on a condition with a deadline."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.inproc import wait_mail
from tests.fixtures.nvml import gpu
from tests.idle.test_activity import attach
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def config(tmp_path: Path, s3, prefix: str, smtp, fake_nvml, **sections) -> dict:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cfg = {
        "price_per_hour": 3.6, "currency": "EUR",
        "training": {"command": "sleep 600", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                     "on_finish": "none", "finish_grace": "3s"},
        "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
        "sync": s3.sync_config(prefix, watch=[str(out)], quiet_period="1s"),
        "idle": {"warn_after": "3s", "stop_after_warning": "3s", "poll_interval": "0.3s", "gpu_window": "1s",
                 "activity_window": "2s", "count_training_output": False},
        "stop": {"action": "command", "command": f"echo stopped >> {tmp_path / 'stopped.txt'}",
                 "final_sync": [str(out)], "retry_interval": "1s", "final_sync_timeout": "4s"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp.port, "security": "none"},
        "alerts": {"first_delay": "0s"},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def idle_of(d) -> dict:
    return d.status()["idle"]


def wait_idle(d, pred, timeout: float = 30, what: str = "") -> dict:
    return wait_until(lambda: (lambda i: i if pred(i) else None)(idle_of(d)), timeout, interval=0.1,
                      what=what or "idle state")


def count_mails(smtp, text: str) -> int:
    return sum(text in str(m["Subject"]).replace("\r\n", "") for m in list(smtp.messages))


def lines(p: Path) -> list[str]:
    return p.read_text().splitlines() if p.exists() else []


def test_idle_cycle_with_tmux_ssh_keepalive_and_a_verified_stop(tmp_path, make_daemon, sshd, smtp_server,
                                                                 fake_nvml, s3_server, s3_prefix):
    fake_nvml.write([gpu(util=90)])
    d = make_daemon(config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml))
    wait_idle(d, lambda i: i["state"] == "ACTIVE" and any(r.startswith("gpu: 90%") for r in i["reasons"]),
              what="GPU load keeps it active")
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")
    HFWriter(tmp_path / "out").checkpoint(10)
    fake_nvml.write([gpu(util=0)])

    # someone watching the training in tmux is a person present
    client = attach(str(d.state_dir / "tmux.sock"))
    try:
        wait_idle(d, lambda i: any(r.startswith("tmux: 1 client attached to train") for r in i["reasons"]),
                  what="tmux client counted")
    finally:
        client.kill()
        client.wait(5)
        os.close(client._master)
    login = sshd.login()
    wait_idle(d, lambda i: any("ssh: root from 127.0.0.1 (pts/" in r for r in i["reasons"])
              and not any(r.startswith("gpu") for r in i["reasons"]), what="ssh counted, GPU quiet")
    login.terminate()

    # idle: the warning says how long, what it cost, when it stops, how to prevent it, that training looks stalled
    subject, body = wait_mail(smtp_server, "unless you act")
    assert "(training looks stalled)" in subject
    assert "supervisorctl keepalive 2h" in body and "Cost while idle:" in body and "EUR/hour" in body
    assert "Run 1 is still running" in body and "it will be interrupted at" in body
    assert idle_of(d)["state"] == "WARNED"
    st = d.status()
    assert st["idle"]["stop_at"] and st["stop"]["action"] == "command"
    human = d.ctl("status").stdout
    assert "idle      WARNED" in human and "prevent: supervisorctl keepalive 2h" in human

    login = sshd.login()
    subject, _ = wait_mail(smtp_server, "stop cancelled")
    assert "ssh: root from 127.0.0.1" in subject
    r = d.ctl("keepalive", "1h")
    assert r.returncode == 0 and r.stdout.startswith("kept alive until"), r
    login.terminate()
    wait_until(lambda: not any("ssh:" in x for x in idle_of(d)["reasons"]), 15, what="logout seen")
    i = idle_of(d)
    assert i["state"] == "ACTIVE" and i["keepalive_until"] and any(x.startswith("keepalive until") for x in i["reasons"])
    assert not lines(tmp_path / "stopped.txt")
    r = d.ctl("keepalive", "--cancel")
    assert r.returncode == 0 and "keepalive cancelled" in r.stdout

    # the second cycle runs to the end: warning, final sync to S3, "stopping now", the command, once
    wait_until(lambda: count_mails(smtp_server, "unless you act") == 2, 30, what="second warning")
    subject, body = wait_mail(smtp_server, "stopping now", timeout=40)
    assert "final sync verified" in subject and f"s3://{s3_server.bucket}/{s3_prefix}" in subject
    assert "Run 1 was still running and looked stalled: it was interrupted at" in body
    wait_until(lambda: lines(tmp_path / "stopped.txt") == ["stopped"], 20, what="stop command ran")
    wait_idle(d, lambda i: i["state"] == "STOPPED", what="STOPPED")
    objs = s3_server.objects(s3_prefix)
    assert any(k.endswith("checkpoint-10/trainer_state.json") for k in objs), objs
    st = d.status()
    assert st["stop"]["phase"] == "done" and st["stop"]["final_sync"]["ok"]
    assert st["training"]["state"] == "STOPPED"  # interrupted as `supervisorctl stop` does, before the final sync
    assert lines(tmp_path / "stopped.txt") == ["stopped"]


def test_s3_down_at_stop_time_then_kill9_mid_stop_resumes_and_stops_once(tmp_path, make_daemon, smtp_server,
                                                                         fake_nvml, s3_server, s3_prefix):
    fake_nvml.write([gpu(util=0)])
    HFWriter(tmp_path / "out").checkpoint(20)
    d = make_daemon(config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml,
                           idle={"count_ssh": False, "warn_after": "2s", "stop_after_warning": "2s"}))
    s3_server.stop()
    try:
        subject, body = wait_mail(smtp_server, "NOT stopping: final sync failed", timeout=60)
        assert "Nothing is stopped while work is unsynced" in body
        st = d.status()
        assert st["idle"]["state"] == "STOPPING" and st["stop"]["phase"] == "final_sync"
        assert st["stop"]["last_error"].startswith("final sync failed")
        assert not lines(tmp_path / "stopped.txt")
        d.kill9()
    finally:
        s3_server.start()
    d.start()
    wait_until(lambda: lines(tmp_path / "stopped.txt"), 60, what="stop command after the restart")
    wait_idle(d, lambda i: i["state"] == "STOPPED", what="STOPPED")
    st = d.status()
    assert st["stop"]["final_sync"]["ok"] and st["stop"]["attempts"] >= 2
    objs = s3_server.objects(s3_prefix)
    assert any(k.endswith("checkpoint-20/trainer_state.json") for k in objs), objs
    wait_mail(smtp_server, "stopping now")
    d.terminate()
    d.start()  # and one more restart after the stop does not stop again
    wait_idle(d, lambda i: i["state"] == "STOPPED", what="still STOPPED")
    assert lines(tmp_path / "stopped.txt") == ["stopped"]
    assert count_mails(smtp_server, "stopping now") == 1
    assert count_mails(smtp_server, "unless you act") == 1


def test_training_finish_mails_the_result_and_stops_after_a_grace_that_activity_extends(
        tmp_path, make_daemon, sshd, smtp_server, fake_nvml, s3_server, s3_prefix, jupyter):
    fake_nvml.write([gpu(util=0)])
    go = tmp_path / "go"
    script = tmp_path / "train.py"
    repo, out = str(Path(__file__).resolve().parents[2]), str(tmp_path / "out")
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {repo!r})\n"
        "from pathlib import Path\n"
        "from tests.fixtures.hf_writer import HFWriter\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
        f"HFWriter(Path({out!r})).checkpoint(30)\n"
        "print('{\"train_runtime\": 1.0, \"train_loss\": 0.5}', flush=True)\n")
    cfg = config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml,
                 training={"command": f"{sys.executable} {script}", "on_finish": "stop", "finish_grace": "3s"},
                 idle={"jupyter_url": jupyter.url, "jupyter_token_file": str(jupyter.token_file),
                       "warn_after": "1h"})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")
    login = sshd.login()  # someone is logged in when the run ends
    wait_idle(d, lambda i: any("ssh: root" in r for r in i["reasons"]), what="ssh counted")
    go.touch()
    d.wait_training("FINISHED", timeout=60)
    subject, body = wait_mail(smtp_server, "training finished (exit code 0)", timeout=40)
    assert "final sync verified" in body and f"s3://{s3_server.bucket}/{s3_prefix}" in body
    assert "supervisorctl keepalive 2h" in body
    wait_idle(d, lambda i: i["state"] == "ACTIVE" and i["mode"] == "finish", what="grace held by the login")

    # a busy notebook outlasts the grace: no stop until it is quiet again
    kid = jupyter.start_kernel()
    kc = jupyter.client(kid)
    try:
        kc.execute("import time; time.sleep(5)")
        wait_idle(d, lambda i: "jupyter: kernel python3 busy" in i["reasons"], what="busy kernel counted")
        login.terminate()
        wait_idle(d, lambda i: not any("ssh:" in r for r in i["reasons"]), what="logout seen")
        assert not lines(tmp_path / "stopped.txt")
        busy_until = wait_until(lambda: (lambda i: time.monotonic() if "jupyter: kernel python3 busy" not in
                                         i["reasons"] else None)(idle_of(d)), 30, what="kernel idle again")
        wait_until(lambda: lines(tmp_path / "stopped.txt"), 30, what="stop after the grace")
        assert time.monotonic() - busy_until >= 2.0  # the grace ran after the activity ended
    finally:
        kc.stop_channels()
        jupyter.shutdown_kernels()
    subject, body = wait_mail(smtp_server, "stopping now (training finished)")
    assert "final sync verified" in subject
    assert count_mails(smtp_server, "unless you act") == 0  # on-finish grace is the one exception
    objs = s3_server.objects(s3_prefix)
    assert any(k.endswith("checkpoint-30/trainer_state.json") for k in objs), objs
    assert lines(tmp_path / "stopped.txt") == ["stopped"]


def test_an_editor_session_without_a_terminal_holds_the_machine(tmp_path, make_daemon, sshd):
    """VS Code Remote-SSH / Cursor / JetBrains Gateway: no terminal under sshd, the editor's server
    detached (re-parented to init, its own pty), the SSH session open while the window is."""
    import psutil

    from tests.fixtures.idle import settle

    d = make_daemon({"idle": {"warn_after": "2s", "stop_after_warning": "2s", "poll_interval": "0.3s",
                              "count_tmux_clients": False}, "stop": {"action": "dry-run"}})
    marker = f"3600.{os.getpid()}"
    server = ("script", "-qfc", f"sleep {marker}", "/dev/null")
    editor = sshd.session(f"setsid -f script -qfc 'sleep {marker}' /dev/null </dev/null >/dev/null 2>&1; exec cat")
    try:
        # the session's command: the shell, `bash -c ...`, which execs `cat` once it has read ~/.bashrc
        wait_idle(d, lambda i: i["state"] == "ACTIVE" and "ssh: root from 127.0.0.1 (no terminal: cat)" in
                  "; ".join(i["reasons"]), timeout=90, what="the editor's session counted")
        settle(5)  # well past warn_after + stop_after_warning: nothing happens while the editor is open
        i = idle_of(d)
        assert i["state"] == "ACTIVE" and d.status()["stop"]["phase"] is None, i
        editor.terminate()  # the window closes; its server lingers, and is nobody
        wait_idle(d, lambda i: i["state"] != "ACTIVE", timeout=30, what="idle once the editor is closed")
    finally:
        editor.kill()
        for p in psutil.process_iter(["cmdline"]):
            if tuple(p.info["cmdline"] or ()) in (server, ("sleep", marker)):
                p.kill()
