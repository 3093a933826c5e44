"""Credentials that come later (issue 37, finding 2), through the real daemon and a real S3 server:
a daemon started at boot with no keys tells it at once (the probe at start: a mail naming where it
looks, status saying it), and keys written down afterwards, in the environment file or in
~/.aws/credentials of the daemon's HOME, are used within seconds, with no restart. On the main
before this change the daemon kept its boot-time environment and said nothing for 5 minutes."""

from __future__ import annotations

import os

from supervisor.store.credentials import CredentialWatch, parse_env_file, read_env_file
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.inproc import wait_mail
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY
from tests.waiting import wait_until


def _config(tmp_path, s3, prefix, smtp) -> dict:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    sync = s3.sync_config(prefix, watch=[str(out)], quiet_period="1s")
    del sync["credentials_file"]
    return {"sync": sync, "alerts": {"first_delay": "0s"},
            "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                      "smtp_port": smtp.port, "security": "none"}}


def _keyless(d, tmp_path) -> tuple:
    home = tmp_path / "home"
    home.mkdir()
    env_file = tmp_path / "environment"
    d.env = {k: v for k, v in d.env.items() if not k.startswith("AWS_")}
    d.env.update(HOME=str(home), TRAIN_SUPERVISOR_ENV_FILE=str(env_file))
    return home, env_file


def _on_target(s3, prefix) -> bool:
    return any(k.endswith("checkpoint-10/_MANIFEST.json") for k in s3.objects(prefix))


def test_keys_written_to_the_environment_file_later_are_used_without_a_restart(tmp_path, make_daemon, s3_server,
                                                                                 s3_prefix, smtp_server):
    d = make_daemon(_config(tmp_path, s3_server, s3_prefix, smtp_server), start=False)
    _, env_file = _keyless(d, tmp_path)
    d.start()
    # told at once, by the probe at start, before any checkpoint: what is missing and where it looks
    subject, body = wait_mail(smtp_server, "no credentials", timeout=30)
    assert "nothing leaves this machine" in subject
    assert str(env_file) in body and "AWS_ACCESS_KEY_ID" in body and "save_total_limit" in body
    st = d.status()["sync"]
    assert st["probe"]["ok"] is False and "no S3 credentials" in st["probe"]["error"]
    assert st["state"] == "failing"
    HFWriter(tmp_path / "out").checkpoint(10)
    # the keys arrive later, in the file the start script and the unit document
    env_file.write_text(f"# written by the user after boot\nexport AWS_ACCESS_KEY_ID={ACCESS_KEY}\n"
                        f"AWS_SECRET_ACCESS_KEY='{SECRET_KEY}'\n")
    os.chmod(env_file, 0o600)
    wait_until(lambda: _on_target(s3_server, s3_prefix), 30, what="the checkpoint on the target with the new keys")
    wait_until(lambda: d.status()["sync"]["probe"].get("ok") is True, 30, what="the probe passing again")
    assert d.status()["sync"]["state"] != "failing"
    assert len(d.logs) == 1  # one daemon all along
    assert SECRET_KEY not in d.log_text()


def test_keys_added_to_the_daemons_aws_credentials_later_are_used(tmp_path, make_daemon, s3_server, s3_prefix,
                                                                    smtp_server):
    d = make_daemon(_config(tmp_path, s3_server, s3_prefix, smtp_server), start=False)
    home, _ = _keyless(d, tmp_path)
    d.start()
    wait_mail(smtp_server, "no credentials", timeout=30)
    HFWriter(tmp_path / "out").checkpoint(10)
    (home / ".aws").mkdir()
    creds = home / ".aws" / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    os.chmod(creds, 0o600)
    wait_until(lambda: _on_target(s3_server, s3_prefix), 30, what="the checkpoint on the target with ~/.aws keys")


def test_the_environment_file_is_read_as_systemd_reads_it():
    values, problems = parse_env_file(
        "# comment\n; also a comment\n\nexport A=1\nB = 'two words'\nC=\"x\"\nD=\n9X=bad\nnot a pair\n")
    assert values == {"A": "1", "B": "two words", "C": "x", "D": ""}
    assert problems == ["line 8: not KEY=VALUE", "line 9: not KEY=VALUE"]


def test_an_environment_file_others_may_write_is_not_read(tmp_path):
    f = tmp_path / "environment"
    f.write_text("AWS_ACCESS_KEY_ID=planted\nAWS_SECRET_ACCESS_KEY=planted-secret\n")
    os.chmod(f, 0o664)
    values, problem = read_env_file(str(f))
    assert values == {} and "writable by nobody else" in problem
    link = tmp_path / "link"
    link.symlink_to(f)
    assert read_env_file(str(link))[0] == {}  # a link is not followed
    os.chmod(f, 0o600)
    assert read_env_file(str(f))[0]["AWS_ACCESS_KEY_ID"] == "planted"
    assert read_env_file(str(tmp_path / "none")) == ({}, "")


def test_the_watch_sees_each_source_move_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TRAIN_SUPERVISOR_ENV_FILE", str(tmp_path / "env"))
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    w = CredentialWatch(kind="s3")
    assert w.changed() == []
    (tmp_path / "env").write_text("AWS_REGION=eu-west-1\nPATH=/evil\n")
    os.chmod(tmp_path / "env", 0o600)
    assert w.changed() == [str(tmp_path / "env")]
    assert w.env()["AWS_REGION"] == "eu-west-1" and w.env().get("PATH") != "/evil"  # credential names only
    assert w.changed() == []
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    assert w.changed() == [str(tmp_path / ".aws" / "credentials")]


def test_the_start_script_gives_each_daemon_the_environment_file_afresh(tmp_path):
    """`train-supervisor-start` (and so --restart) starts each daemon with the file's variables,
    not only the environment its boot loop inherited; a value is never run as code."""
    import subprocess

    from tests.fixtures.daemon import REPO

    fake = tmp_path / "daemon.sh"
    fake.write_text(f"#!/bin/sh\nenv > {tmp_path / 'seen.env'}\n")
    fake.chmod(0o755)
    env_file = tmp_path / "environment"
    env_file.write_text("# keys written after boot\nexport AWS_ACCESS_KEY_ID=later\nB = 'two words'\n"
                        f"C=\"$(touch {tmp_path / 'ran'})\"\nnot a pair\n")
    env_file.chmod(0o600)
    env = {**os.environ, "TRAIN_SUPERVISOR_ENV_FILE": str(env_file), "TRAIN_SUPERVISORD": str(fake),
           "TRAIN_SUPERVISOR_LOG": str(tmp_path / "log"), "TRAIN_SUPERVISOR_RUN_DIR": str(tmp_path / "run"),
           "AWS_ACCESS_KEY_ID": "from-boot"}
    subprocess.run(["bash", str(REPO / "systemd" / "train-supervisor-start"), "--foreground"], env=env,
                   check=True, timeout=30)
    seen = dict(line.split("=", 1) for line in (tmp_path / "seen.env").read_text().splitlines() if "=" in line)
    assert seen["AWS_ACCESS_KEY_ID"] == "later" and seen["B"] == "two words"
    assert not (tmp_path / "ran").exists()


def test_keys_that_come_later_reach_the_cluster_heartbeats_and_the_run_ledger(tmp_path, make_daemon, s3_server,
                                                                               s3_prefix, smtp_server):
    """A node of a run of two, keyless at boot: once the keys are in the environment file, its
    heartbeat and its money record reach the run's prefix too (their clients share the sync
    engine's credential sources), not only its checkpoints."""
    cfg = _config(tmp_path, s3_server, s3_prefix, smtp_server)
    cfg["cluster"] = {"nodes": 2, "rank": 0, "run_id": "r1", "heartbeat": "1s", "silent_after": "6s"}
    d = make_daemon(cfg, start=False)
    _, env_file = _keyless(d, tmp_path)
    d.start()
    wait_until(lambda: d.status()["cluster"]["error"], 30, what="the heartbeat refused without keys")
    env_file.write_text(f"AWS_ACCESS_KEY_ID={ACCESS_KEY}\nAWS_SECRET_ACCESS_KEY={SECRET_KEY}\n")
    os.chmod(env_file, 0o600)

    def reached() -> bool:
        keys = s3_server.objects(s3_prefix)
        return "_cluster/node-0.json" in keys and any(k.startswith("_run/ledger/") for k in keys)
    wait_until(reached, 60, interval=0.5, what=f"the heartbeat and the ledger record; {d.status()['cluster']}")
    wait_until(lambda: not d.status()["cluster"]["error"], 30, what="the cluster's error cleared")
