"""Issue 23, item 5: secrets that no pattern knows are kept out of every message, by value.

A real daemon whose stop.command carries a password, an AWS secret, a mysql -p password, an API key
and a Slack hook URL, and whose training.env holds a secret the training prints into its OOM
traceback; mails are read back from a real SMTP server (aiosmtpd), status and the journal too."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from supervisor import redact
from supervisor.store.hf_rules import find_token
from tests.fixtures.nvml import gpu
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

SECRETS = ["Hunter2pw", "wJalrXUtnFEMIK7MDENGbPxRfiCY", "S3cretPw9", "abcdef0123456789",
           "https://hooks.slack.com/services/T0AAAA/B0BBBB/XyZsecretHookPath", "wandb-0f9e8d7c6b5a"]


def _mails(smtp) -> list[str]:
    out = []
    for m in list(smtp.messages):
        body = m.get_payload(decode=True).decode("utf-8", "replace")
        out.append(str(m["Subject"]) + "\n" + body)
    return out


def test_secrets_by_value_never_reach_mails_webhooks_status_or_journal(tmp_path: Path, make_daemon, smtp_server,
                                                                       fake_nvml, receiver):
    fake_nvml.write([gpu(util=0)])
    whsec = tmp_path / "whsec"
    whsec.write_text("whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode() + "\n")
    stopped = tmp_path / "stopped.txt"
    stop_cmd = (f"true sshpass -p {SECRETS[0]} ssh root@box; true aws configure set aws_secret_access_key "
                f"{SECRETS[1]}; true mysql -p{SECRETS[2]}; true provider stop --key {SECRETS[3]}; "
                f"true curl -d x {SECRETS[4]}; echo stopped >> {stopped}")
    job = ('echo "logging in with $WANDB_API_KEY"; '
           'echo "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (run $WANDB_API_KEY)"; exit 1')
    d = make_daemon({
        "training": {"command": job, "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                     "on_finish": "none", "env": {"WANDB_API_KEY": SECRETS[5]}},
        "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
        "idle": {"warn_after": "2s", "stop_after_warning": "2s", "poll_interval": "0.3s", "gpu_window": "1s",
                 "activity_window": "1s", "count_training_output": False},
        "stop": {"action": "command", "command": stop_cmd, "retry_interval": "1s"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp_server.port, "security": "none"},
        "notify": {"webhook_url": f"http://127.0.0.1:{receiver.port}/hook", "webhook_secret_file": str(whsec)},
        "alerts": {"first_delay": "0s"},
    })
    assert d.ctl("start").returncode == 0
    wait_until(lambda: stopped.exists(), 40, interval=0.2, what="the stop command to run")

    def mailed():
        ms = _mails(smtp_server)
        has = [any(w in m.lower() for m in ms) for w in ("out of memory", "idle", "stop")]
        return ms if all(has) else None
    mails = wait_until(mailed, 20, interval=0.2, what=f"OOM, idle and stop mails; got {smtp_server.subjects()}")
    # the secret the job printed reached the log, and the log reached a mail ...
    assert SECRETS[5] in (tmp_path / "train.log").read_text()
    assert any("out of memory" in m.lower() for m in mails)
    # ... but no secret did, and the stop is described without the command's text
    for m in mails:
        for s in SECRETS:
            assert s not in m, f"{s!r} in a mail:\n{m}"
        assert "sshpass" not in m and "aws configure" not in m
    assert any("run the configured stop.command" in m for m in mails), mails
    hooks = wait_until(lambda: (lambda g: g if len(g) >= len(mails) else None)(receiver.got()), 20,
                       interval=0.2, what="the webhook deliveries")
    for h in hooks:
        text = h.body.decode("utf-8", "replace")
        for s in SECRETS:
            assert s not in text and s.replace("/", "\\/") not in text, f"{s!r} in a webhook delivery"
    st = json.dumps(d.status())
    journal = d.log_text()
    for s in SECRETS:
        assert s not in st, f"{s!r} in status"
        assert s not in journal, f"{s!r} in the journal"
    assert "stop_command_started" in journal


def test_a_hub_error_that_echoes_the_token_is_masked(tmp_path: Path):
    tok = "tokWithoutAnyKnownShape123"
    f = tmp_path / "token"
    f.write_text(tok + "\n")
    try:
        assert find_token(str(f), {})[0] == tok
        msg = f"401 Client Error: Invalid credentials in Authorization header for {tok}"
        assert tok not in redact.redact(msg)
        assert tok not in json.dumps(redact.redact_obj({"sync": {"last_error": msg}}))
    finally:
        redact.forget_registered()


@pytest.mark.parametrize("command,secret", [
    ("sshpass -p Hunter2pw ssh root@h poweroff", "Hunter2pw"),
    ("aws configure set aws_secret_access_key wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI/K7MDENG"),
    ("mysql -pS3cretPw -e 'stop'", "S3cretPw"),
    ("provider stop --key abcdef0123456789", "abcdef0123456789"),
    ("curl -d '{}' https://hooks.slack.com/services/T0/B0/XyZ", "https://hooks.slack.com/services/T0/B0/XyZ"),
])
def test_stop_command_secrets_are_registered_and_masked(command, secret):
    try:
        redact.register(*redact.command_secrets(command))
        assert secret not in redact.redact(f"the stop failed: {command} exited 1")
    finally:
        redact.forget_registered()
