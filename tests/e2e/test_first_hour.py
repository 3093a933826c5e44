"""The first hour on a rented box (issue 29), end to end through a real train-supervisord, driven
from outside as a new user would: a run folder one level inside the watched folder, a target with
nothing watched, `supervisorctl run` from a user's shell, the target down when the training ends.
Every wait is on a condition with a deadline."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.inproc import wait_mail
from tests.waiting import wait_until

pytestmark = [pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

REPO = str(Path(__file__).resolve().parents[2])


def writer_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {REPO!r})\n"
                      "from pathlib import Path\n"
                      "from tests.fixtures.hf_writer import HFWriter\n" + body)
    return script


def base_config(tmp_path: Path, smtp, fake_nvml, **sections) -> dict:
    cfg = {
        "training": {"command": "sleep 600", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                     "on_finish": "stop", "finish_grace": "1s"},
        "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
        "idle": {"poll_interval": "0.3s", "count_ssh": False, "count_training_output": False},
        "stop": {"action": "command", "command": f"echo stopped >> {tmp_path / 'stopped.txt'}",
                 "retry_interval": "1s", "final_sync_timeout": "5s"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp.port, "security": "none"},
        "alerts": {"first_delay": "0s"},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def test_a_run_folder_inside_the_watched_folder_is_synced_and_named(tmp_path, make_daemon, smtp_server,
                                                                     fake_nvml):
    """watch = out, output_dir = out/tiny: the nested checkpoints go up with their manifests, the
    mails name the newest checkpoint of each run folder, and a checkpoint folder an exclude glob
    leaves out is the user's choice: not named as unselected (what no include selects is named:
    tests/sync/test_unselected*.py)."""
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir()
    script = writer_script(tmp_path, f"HFWriter(Path({str(out / 'tiny')!r})).checkpoint(5)\n"
                                     f"HFWriter(Path({str(out / 'tiny')!r})).checkpoint(10)\n"
                                     f"HFWriter(Path({str(out / 'old')!r})).checkpoint(1)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": f"{sys.executable} {script}"},
                      sync={"target": str(target), "watch": [str(out)], "quiet_period": "1s",
                            "exclude": ["old/checkpoint-1/**"]},
                      stop={"final_sync": [str(out)]})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("FINISHED", timeout=60)
    subject, body = wait_mail(smtp_server, "training finished")
    assert "final sync verified" in body, body
    assert "tiny/checkpoint-10" in body and "tiny/checkpoint-5\n" not in body, body
    assert "NOT SELECTED" not in body and str(out / "old" / "checkpoint-1") not in body, body
    for step in (5, 10):
        assert (target / "tiny" / f"checkpoint-{step}" / "_MANIFEST.json").is_file()
        assert (target / "tiny" / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert not (target / "old").exists()
    st = d.status()
    assert st["sync"]["unselected"] == [] and st["sync"]["unselected_files"] == 0
    assert "NOT selected" not in d.ctl("status").stdout
    subject, body = wait_mail(smtp_server, "stopping now (training finished)")
    assert "tiny/checkpoint-10" in body and str(out / "old" / "checkpoint-1") not in body, body


def test_a_target_with_nothing_watched_watches_the_workdir_or_the_daemon_refuses(tmp_path, make_daemon, smtp_server,
                                                                                  fake_nvml):
    """Never "in sync, 0 files" while checkpoints sit on the machine: with no sync.watch the
    training's workdir is watched (its checkpoints reach the target and `sync --wait` says so);
    with no workdir either, check-config and the daemon refuse the config, naming sync.watch."""
    work, target = tmp_path / "work", tmp_path / "target"
    work.mkdir()
    script = writer_script(tmp_path, "HFWriter(Path('run')).checkpoint(3)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": f"{sys.executable} {script}", "workdir": str(work),
                                "on_finish": "none"},
                      sync={"target": str(target), "quiet_period": "1s"})
    d = make_daemon(cfg)
    assert "sync.watch not set: watching" in d.ctl("check-config").stdout
    assert d.status()["sync"]["watch"] == [str(work)]
    assert d.ctl("start").returncode == 0
    d.wait_training("FINISHED", timeout=60)
    r = d.ctl("sync", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "run" / "checkpoint-3" / "_MANIFEST.json").is_file()

    bad = base_config(tmp_path, smtp_server, fake_nvml, training={"command": "python train.py", "workdir": ""},
                      sync={"target": str(target)})
    b = make_daemon(bad, start=False, sub="bad")
    r = b.ctl("check-config")
    assert r.returncode == 2 and "sync.watch: empty" in r.stderr, r.stderr
    b.start(wait=False)
    assert b.proc.wait(30) == 2
    assert "sync.watch: empty" in b.log_text()


def ctl_from_shell(d, cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    """supervisorctl as a user's shell runs it: in their folder, with their environment."""
    return subprocess.run([sys.executable, "-m", "supervisor.cli.main", "--config", str(d.config_path), *args],
                          capture_output=True, text=True, env=env, cwd=str(cwd), timeout=60)


def test_run_starts_in_the_callers_folder_with_their_venv_and_exports(tmp_path, make_daemon, smtp_server,
                                                                      fake_nvml):
    """`supervisorctl run -- python train.py` from a shell with an activated venv and an exported
    variable: the job finds `python` on the venv's PATH and train.py in the caller's folder, sees
    the export; a restart after a daemon restart runs it the same way; a command that dies at once
    makes `run` say so with its last log lines and exit non-zero."""
    proj = tmp_path / "proj"
    venv_bin = proj / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    shim = venv_bin / "python"  # the venv's python: on the caller's PATH only
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    (proj / "train.py").write_text(
        "import os, json, sys, time\n"
        "n = sum(1 for _ in open('runs.txt')) if os.path.exists('runs.txt') else 0\n"
        "open('runs.txt', 'a').write(json.dumps({'cwd': os.getcwd(), 'my_var': os.environ.get('MY_VAR'),\n"
        "    'venv': os.environ.get('VIRTUAL_ENV'), 'config_env': os.environ.get('FROM_CONFIG')}) + '\\n')\n"
        "time.sleep(600)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": "", "workdir": "", "on_finish": "none", "env": {"FROM_CONFIG": "1"},
                                "stop_grace": "2s"})
    d = make_daemon(cfg)
    daemon_path = "/usr/bin:/bin"
    d.env["PATH"] = daemon_path  # the daemon's own PATH has no venv (as under systemd)
    d.terminate()
    d.start()
    shell = {**d.env, "PATH": f"{venv_bin}:{daemon_path}", "VIRTUAL_ENV": str(proj / ".venv"), "MY_VAR": "hello"}
    r = ctl_from_shell(d, proj, shell, "run", "--", "python", "train.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RUNNING" in r.stdout
    runs = proj / "runs.txt"
    wait_until(lambda: runs.exists() and runs.read_text().count("\n") == 1, 30, what="the job ran")
    first = json.loads(runs.read_text().splitlines()[0])
    assert first == {"cwd": str(proj), "my_var": "hello", "venv": str(proj / ".venv"), "config_env": "1"}

    d.kill9()  # a daemon restart: the run keeps going, and its restart runs it the same way
    d.start()
    assert d.status()["training"]["state"] == "RUNNING"
    assert d.ctl("restart").returncode == 0
    wait_until(lambda: runs.read_text().count("\n") == 2, 30, what="the restarted job ran")
    assert json.loads(runs.read_text().splitlines()[1]) == first
    assert d.ctl("stop").returncode == 0

    r = ctl_from_shell(d, proj, shell, "run", "--", "no-such-trainer", "--lr", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exit code 127: command not found" in r.stderr, r.stderr
    assert "no-such-trainer" in r.stderr and "last lines of" in r.stderr, r.stderr


def test_the_target_down_when_the_training_ends_is_told_at_once_and_holds_the_stop(tmp_path, make_daemon,
                                                                                   smtp_server, fake_nvml):
    """The final sync at the training's end cannot reach the target: within seconds a mail says the
    training finished, the final sync is FAILING with its error, which checkpoints are not on the
    target and that the machine will not stop until they are; the failure clock keeps running (the
    "sync failing" alert comes after fail_alert_after); once the target is back, they go up, the
    alert is resolved and the machine stops."""
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir()
    go = tmp_path / "go"
    script = writer_script(tmp_path, "import os, time\n"
                                     f"w = HFWriter(Path({str(out)!r}))\nw.checkpoint(1)\n"
                                     f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
                                     "w.checkpoint(2)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": f"{sys.executable} {script}"},
                      sync={"target": str(target), "watch": [str(out)], "quiet_period": "1s",
                            "fail_alert_after": "4s", "retry_max_backoff": "2s"},
                      stop={"final_sync": [str(out)], "final_sync_timeout": "120s"})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    wait_until(lambda: (target / "checkpoint-1" / "_MANIFEST.json").is_file(), 30, what="checkpoint-1 synced")
    target.rename(tmp_path / "target-away")
    target.write_text("the disk is not mounted\n")  # the target is down: its folder cannot be made
    go.touch()
    d.wait_training("FINISHED", timeout=60)
    subject, body = wait_mail(smtp_server, "final sync FAILING", timeout=20)
    assert "training finished; final sync FAILING; " in subject
    assert "1 checkpoint not on the target; the machine will not stop until they are" in subject, subject
    assert body.startswith("training finished; final sync FAILING: ") and "cannot create target folder" in body
    assert "checkpoint-2" in body, body
    # the failure clock runs on: the engine's own alert comes after fail_alert_after
    wait_until(lambda: any(a["kind"] == "sync_failing" for a in d.req("alerts")["active"]), 30,
               what="the sync failing alert")
    assert not (tmp_path / "stopped.txt").exists()

    target.unlink()
    (tmp_path / "target-away").rename(target)
    wait_until(lambda: (target / "checkpoint-2" / "_MANIFEST.json").is_file(), 60, what="checkpoint-2 synced")
    wait_until(lambda: (tmp_path / "stopped.txt").exists(), 60, what="the stop after the final sync")
    wait_until(lambda: not any(a["key"] == "stop:failing" for a in d.req("alerts")["active"]), 10,
               what="the alert resolved")


def test_a_final_sync_that_only_cannot_verify_keeps_its_failure_clock(tmp_path, make_daemon, smtp_server,
                                                                      fake_nvml):
    """Everything went up during the run, then the target went down: the final sync's check on
    the target fails, and with nothing left to send the engine used to call that "recovered"
    before each check, restarting the failure clock every ~1.5 s, so "sync failing" never came."""
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir()
    go = tmp_path / "go"
    script = writer_script(tmp_path, "import os, time\n"
                                     f"HFWriter(Path({str(out)!r})).checkpoint(1)\n"
                                     f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": f"{sys.executable} {script}"},
                      sync={"target": str(target), "watch": [str(out)], "quiet_period": "1s",
                            "fail_alert_after": "4s", "retry_max_backoff": "2s"},
                      stop={"final_sync": [str(out)], "final_sync_timeout": "120s"})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    wait_until(lambda: (target / "checkpoint-1" / "_MANIFEST.json").is_file(), 30, what="checkpoint-1 synced")
    shutil.rmtree(target)
    target.write_text("the disk is not mounted\n")
    go.touch()
    d.wait_training("FINISHED", timeout=60)
    subject, body = wait_mail(smtp_server, "final sync FAILING", timeout=20)
    assert "cannot confirm it holds the checkpoints" in subject, subject
    wait_until(lambda: any(a["kind"] == "sync_failing" for a in d.req("alerts")["active"]), 30,
               what="the sync failing alert (its clock must not restart)")
    assert d.status()["sync"]["failing_for_s"] >= 4
    assert not (tmp_path / "stopped.txt").exists()


def test_a_sync_failing_alert_raised_before_a_daemon_restart_is_resolved_after_it(tmp_path, make_daemon,
                                                                                  smtp_server, fake_nvml):
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir()
    target.write_text("the disk is not mounted\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml, training={"on_finish": "none"},
                      sync={"target": str(target), "watch": [str(out)], "quiet_period": "1s",
                            "fail_alert_after": "1s", "retry_max_backoff": "1s"})
    d = make_daemon(cfg)
    HFWriter(out).checkpoint(1)

    def failing_alert() -> bool:
        return any(a["key"] == "sync:failing" for a in d.req("alerts")["active"])

    wait_until(failing_alert, 30, what="the sync failing alert")
    d.terminate()
    target.unlink()
    d.start()
    wait_until(lambda: (target / "checkpoint-1" / "_MANIFEST.json").is_file(), 30, what="checkpoint-1 synced")
    wait_until(lambda: not failing_alert(), 15, what="the alert resolved by the new daemon")
    wait_mail(smtp_server, "RESOLVED", timeout=20)


def test_a_fixed_s3_credentials_file_works_without_a_restart(tmp_path, make_daemon, smtp_server, fake_nvml,
                                                             s3_server, s3_prefix):
    """The credentials file held a wrong secret: the store refuses (403); the owner fixes the
    file, and the next try reads it again (boto3 alone reads it once, at the client's birth)."""
    out = tmp_path / "out"
    out.mkdir()
    creds = tmp_path / "aws-credentials"
    good = s3_server.credentials_file.read_text()
    creds.write_text(good.replace("aws_secret_access_key = ", "aws_secret_access_key = wrong"))
    sync = s3_server.sync_config(s3_prefix, watch=[str(out)], quiet_period="1s", retry_max_backoff="1s")
    sync["credentials_file"] = str(creds)
    d = make_daemon(base_config(tmp_path, smtp_server, fake_nvml, training={"on_finish": "none"}, sync=sync))
    HFWriter(out).checkpoint(1)
    wait_until(lambda: d.status()["sync"]["state"] == "failing", 30, what="the store refusing the key")
    creds.write_text(good)
    wait_until(lambda: any(k.endswith("checkpoint-1/_MANIFEST.json") for k in s3_server.objects(s3_prefix)), 30,
               what="checkpoint-1 on the store with the fixed file")
    assert "s3_credentials_reread" in d.log_text()
    r = d.ctl("sync", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_run_failing_in_its_first_minute_with_nobody_here_mails_its_last_lines_and_gets_the_finish_stop(
        tmp_path, make_daemon, smtp_server, fake_nvml):
    """Nobody is logged in (a run started at boot): the early failure gets the finish stop after its
    grace like any failed run (issue 37, finding 5); with someone logged in it books none
    (tests/idle/test_early_fail.py)."""
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": "echo loading the model; no-such-trainer --lr 1e-4"})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("FAILED", timeout=30)
    subject, body = wait_mail(smtp_server, "training FAILED")
    assert "exit code 127: command not found" in subject, subject
    assert "Last lines of the log:" in body and "loading the model" in body and "no-such-trainer" in body, body
    assert "not stopped for it" not in body and "this machine stops at" in body, body
    wait_until(lambda: d.status()["idle"].get("mode") == "finish", 20, what="the finish grace")


def test_status_says_how_the_machine_will_stop_and_where_alerts_go(tmp_path, make_daemon, smtp_server, fake_nvml):
    import os

    cfg = base_config(tmp_path, smtp_server, fake_nvml, training={"on_finish": "none"},
                      stop={"action": "poweroff"})
    del cfg["email"]
    d = make_daemon(cfg)
    st = d.status()
    screen = d.ctl("status").stdout
    if os.path.isdir("/run/systemd/system"):
        assert st["stop"]["how"] == "by poweroff" and "stops by poweroff" in screen, screen
    else:
        assert st["stop"]["how"].startswith("by poweroff — cannot work here: no systemd"), st["stop"]
        assert "cannot work here: no systemd" in screen, screen
    assert "notify    none: alerts reach only `supervisorctl alerts`" in screen, screen
    d2 = make_daemon(base_config(tmp_path, smtp_server, fake_nvml, training={"on_finish": "none"},
                                 stop={"action": "command", "command": "no-such-cloud-cli stop"}), sub="d2")
    assert d2.status()["stop"]["how"] == "by `no-such-cloud-cli stop` — cannot work here: no-such-cloud-cli not found"
    assert "notify    email (" in d2.ctl("status").stdout


def test_sync_wait_during_a_run_returns_once_what_was_complete_is_up_and_fails_per_folder(
        tmp_path, make_daemon, smtp_server, fake_nvml):
    """A training saving a checkpoint every second: `sync --wait` returns once the checkpoints
    complete when it was called are on the target (a later one is the next call's, or it would
    never return during a run). With the target down it fails with one line per folder."""
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir()
    script = writer_script(tmp_path, "import time\n"
                                     f"w = HFWriter(Path({str(out)!r}))\n"
                                     "for step in range(1, 600):\n    w.checkpoint(step)\n    time.sleep(0.7)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml, training={"command": f"{sys.executable} {script}",
                                                                  "on_finish": "none"},
                      sync={"target": str(target), "watch": [str(out)], "quiet_period": "1s",
                            "retry_max_backoff": "1s"})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    wait_until(lambda: (out / "checkpoint-3" / "trainer_state.json").exists(), 30, what="three checkpoints")
    r = d.ctl("sync", "--wait", "--timeout", "40", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "checkpoint-2" / "_MANIFEST.json").is_file()
    assert d.status()["training"]["state"] == "RUNNING"

    shutil.rmtree(target)
    target.write_text("the disk is not mounted\n")
    r = d.ctl("sync", "--wait", "--timeout", "4", timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("  not synced: ")]
    assert lines and all("files not on the target" in ln for ln in lines), r.stderr
    assert len(lines) == len({ln.split(":")[1] for ln in lines}) < 100, r.stderr
    assert d.ctl("stop").returncode == 0
