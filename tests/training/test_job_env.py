"""The job's environment is the job's (issue 35, finding 2): the daemon's keys never reach a
training that runs as the training user, neither through tmux nor through the runner.

Pure rules first (training/jobenv.py), then a real daemon with the keys in its environment, a
real second uid as training.user, and the job's own /proc/<pid>/environ read back."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from supervisor.training.jobenv import base, job_env
from tests.daemon.test_security import member, open_dir  # noqa: F401 - fixtures
from tests.fixtures.daemon import DaemonProc
from tests.waiting import wait_until

DAEMON_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "xterm", "HOME": "/root",
              "USER": "root", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0001", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIsecret",
              "HF_TOKEN": "hf_abcdefghijklmnop", "TRAIN_SUPERVISOR_SMTP_PASSWORD": "smtp-pass-123",
              "WANDB_API_KEY": "wandb-key-0123456", "PYTHONPATH": "/opt/x"}
SECRETS = {"wJalrXUtnFEMIsecret", "hf_abcdefghijklmnop", "smtp-pass-123", "wandb-key-0123456", "AKIAEXAMPLEKEYID0001"}


def build(caller=None, pass_env=(), config_env=None, other=True):
    return job_env(DAEMON_ENV, caller=caller, config_env=config_env or {}, extra={"TRAIN_SUPERVISOR_RESUME_FROM": "/o/c-20"},
                   pass_env=pass_env, secrets=SECRETS, as_other_user=other, reserved=("TRAIN_SUPERVISOR_RESUME_FROM",))


def test_a_configured_job_gets_harmless_names_and_no_key():
    env, withheld = build()
    assert env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "xterm",
                   "TRAIN_SUPERVISOR_RESUME_FROM": "/o/c-20"}
    assert withheld == []


def test_the_daemons_own_user_keeps_home():
    env, _ = build(other=False)
    assert env["HOME"] == "/root" and env["USER"] == "root"


def test_pass_env_passes_on_purpose():
    env, withheld = build(pass_env=["HF_TOKEN", "WANDB_API_KEY", "NOT_SET"])
    assert env["HF_TOKEN"] == "hf_abcdefghijklmnop" and env["WANDB_API_KEY"] == "wandb-key-0123456"
    assert "NOT_SET" not in env and withheld == []


def test_a_run_callers_env_is_theirs_but_the_daemons_secrets_are_withheld():
    caller = {**DAEMON_ENV, "VIRTUAL_ENV": "/work/.venv", "MY_FLAG": "1", "TRAIN_SUPERVISOR_RESUME_FROM": "/stale"}
    env, withheld = build(caller=caller)
    assert env["VIRTUAL_ENV"] == "/work/.venv" and env["MY_FLAG"] == "1" and env["PYTHONPATH"] == "/opt/x"
    assert env["TRAIN_SUPERVISOR_RESUME_FROM"] == "/o/c-20"  # the daemon's answer, never the caller's stale one
    assert withheld == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "TRAIN_SUPERVISOR_SMTP_PASSWORD",
                        "WANDB_API_KEY"]
    assert not SECRETS & set(env.values())


def test_training_env_and_pass_env_win_over_the_withholding():
    env, withheld = build(caller=dict(DAEMON_ENV), pass_env=["HF_TOKEN"], config_env={"WANDB_API_KEY": "wandb-key-0123456"})
    assert env["HF_TOKEN"] == "hf_abcdefghijklmnop" and env["WANDB_API_KEY"] == "wandb-key-0123456"
    assert "HF_TOKEN" not in withheld and "WANDB_API_KEY" not in withheld


def test_base_keeps_only_the_listed_names():
    assert base({"PATH": "p", "LC_TIME": "x", "AWS_PROFILE": "p", "SSH_AUTH_SOCK": "/s"}, True) == {"PATH": "p", "LC_TIME": "x"}


# --- a real daemon, a real second uid ----------------------------------------------------------------

def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_the_training_users_job_holds_none_of_the_daemons_secrets(member, open_dir):  # noqa: F811
    work = open_dir / "work"
    work.mkdir()
    work.chmod(0o777)
    probe = work / "probe.txt"
    # the job, as the second uid, looks where the keys were: its own environment, the runner's
    # (its parent, root's) and the tmux server's
    cmd = (f"(env; echo ---; cat /proc/$PPID/environ; echo; echo rc=$?) > {shlex.quote(str(probe))} 2>&1; "
           "sleep 300")
    cfg = {"training": {"command": cmd, "workdir": str(work), "user": member.name, "on_finish": "none",
                        "pass_env": ["WANDB_API_KEY"]},
           "sync": {"target": "s3://bucket/run", "endpoint_url": "http://127.0.0.1:9", "watch": [str(work / "out")]},
           "gpu": {"nvml_library": str(open_dir / "no-such-libnvidia-ml.so.1")}, "stop": {"action": "dry-run"}}
    d = DaemonProc(open_dir / "d", cfg)
    (open_dir / "d").chmod(0o755)
    d.env.update({k: v for k, v in DAEMON_ENV.items() if k not in ("PATH", "HOME", "USER", "PYTHONPATH", "TERM")})
    try:
        d.start()
        r = d.ctl("start")
        assert r.returncode == 0, r.stderr
        tr = d.wait_training("RUNNING")
        wait_until(lambda: probe.exists() and "rc=" in probe.read_text(), 20, what="the job's probe")
        text = probe.read_text()
        job = _environ(tr["pid"])
        for name, value in DAEMON_ENV.items():
            if value in SECRETS and name != "WANDB_API_KEY":
                assert value not in text, f"the job saw {name}"
                assert name not in job, f"{name} in the job's environ"
        assert job.get("WANDB_API_KEY") == "wandb-key-0123456"  # passed on purpose
        assert "Permission denied" in text  # the runner's environ is root's to read
        runner = _environ(d.status()["training"].get("runner_pid") or int(Path(f"/proc/{tr['pid']}/stat").read_text().split()[3]))
        assert not (SECRETS - {"wandb-key-0123456"}) & set(runner.values())  # nor does the runner (tmux's) hold them

        # `supervisorctl run` from a root shell that exported the same keys
        assert d.ctl("stop").returncode == 0
        wait_until(lambda: d.status()["training"]["state"] in ("STOPPED", "FAILED"), 30, what="the job stopped")
        probe.unlink()
        r = d.ctl("run", "--", "sh", "-c", cmd)
        assert r.returncode == 0, r.stderr
        assert "AWS_SECRET_ACCESS_KEY" in r.stderr and "training.pass_env" in r.stderr
        tr = d.wait_training("RUNNING")
        wait_until(lambda: probe.exists() and "rc=" in probe.read_text(), 20, what="the run's probe")
        job = _environ(tr["pid"])
        assert not (SECRETS - {"wandb-key-0123456"}) & set(job.values())
        assert job.get("PYTHONPATH") == d.env["PYTHONPATH"]  # the rest of the caller's environment is theirs
    finally:
        d.cleanup()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_a_tmux_server_started_by_the_daemon_holds_no_key(make_daemon, tmp_path):
    d = make_daemon({"training": {"command": "sleep 300", "on_finish": "none"}, "stop": {"action": "dry-run"},
                     "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")}}, start=False)
    d.env.update({"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIsecret", "HF_TOKEN": "hf_abcdefghijklmnop"})
    d.start()
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")
    import psutil

    servers = [p for p in psutil.process_iter(["name", "cmdline"]) if (p.info["name"] or "").startswith("tmux")
               and str(d.state_dir / "tmux.sock") in " ".join(p.info["cmdline"] or [])]
    assert servers
    for p in servers:
        env = _environ(p.pid)
        assert "AWS_SECRET_ACCESS_KEY" not in env and "HF_TOKEN" not in env, env
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != "wJalrXUtnFEMIsecret"
