"""The GPU burn-in runs the training user's Python (issue 49, "untrusted bytes"): it gets the job's
environment (jobenv: none of the daemon's secrets), runs as training.user, and nothing another user
controls ever runs as root: with no drop to a training user, a Python (or venv, or workdir) that is
not root's alone means no burn-in, said in status and the log.

Real processes throughout: a stand-in `.venv/bin/python` that writes down its environment and uid,
a real second uid, the real daemon with the keys in its environment."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from supervisor.gpu.healthwatch import BOOT, HealthWatch, burn_in_service
from supervisor.gpu.nvml import NvmlProbe
from supervisor.redact import register
from supervisor.states import TrainingState
from tests.daemon.test_security import member, open_dir  # noqa: F401 - fixtures
from tests.fixtures.daemon import DaemonProc
from tests.fixtures.nvml import HEALTHY, gpu, make_ctx
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uids and /proc")

KEYS = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0049", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIsecret49",
        "HF_TOKEN": "hf_burninsecret0049", "TRAIN_SUPERVISOR_SMTP_PASSWORD": "smtp-pass-0049"}
SMTP_FILE_PASSWORD = "smtp-file-pass-0049"


def need_root():
    if os.geteuid() != 0:
        pytest.skip("needs root: the burn-in's drop to training.user is root's")


def stand_in_python(work: Path, dump: Path) -> Path:
    """A `.venv` in `work` whose python writes its uid and environment to `dump` and answers as
    the burn-in does when torch is missing."""
    bin_ = work / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (work / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    py = bin_ / "python"
    py.write_text(f"#!/bin/sh\n{{ echo uid=$(id -u); env; }} > {dump}\n"
                  "echo '{\"skipped\": \"torch is not importable (ModuleNotFoundError)\"}'\n")
    py.chmod(0o755)
    return py


class Stopped:
    def info(self):
        from supervisor.interfaces import TrainingInfo
        return TrainingInfo(state=TrainingState.STOPPED, run_id=0)


@pytest.fixture
def watch(fake_nvml, tmp_path, clock, monkeypatch):
    """A HealthWatch with the daemon's keys in its environment, the SMTP password registered as a
    secret (the daemon does when it reads password_file), and one GPU to burn in."""
    for k, v in KEYS.items():
        monkeypatch.setenv(k, v)
    fake_nvml.write(1)
    made = []

    def factory(work: Path, user: str = "", **training):
        ctx = make_ctx(tmp_path, clock, {"health": {"burn_in": "1s"}})
        register(SMTP_FILE_PASSWORD, KEYS["AWS_SECRET_ACCESS_KEY"], KEYS["HF_TOKEN"], KEYS["TRAIN_SUPERVISOR_SMTP_PASSWORD"])
        ctx.config.training.workdir = str(work)
        ctx.config.training.user = user
        for k, v in training.items():
            setattr(ctx.config.training, k, v)
        probe = NvmlProbe(fake_nvml.lib_path, monotonic=clock.monotonic)
        made.append(probe)
        return HealthWatch(ctx, ctx.config.health, ctx.config.training, probe, Stopped())

    yield factory
    for p in made:
        p.close()


def seen(dump: Path) -> tuple[int, dict[str, str]]:
    lines = dump.read_text().splitlines()
    uid = int(lines[0].removeprefix("uid="))
    return uid, dict(ln.split("=", 1) for ln in lines[1:] if "=" in ln)


def assert_no_secret(env: dict[str, str]) -> None:
    values = set(env.values())
    for name, value in [*KEYS.items(), ("password_file", SMTP_FILE_PASSWORD)]:
        assert value not in values, f"the burn-in's python saw {name}"
        assert not any(value in v for v in values), f"the burn-in's python saw {name} inside another variable"
    for name in KEYS:
        assert name not in env, f"{name} reached the burn-in's python"


def test_the_burn_in_runs_as_training_user_with_no_secret(watch, member, open_dir):  # noqa: F811
    need_root()
    work = open_dir / "work"
    work.mkdir()
    work.chmod(0o777)
    dump = work / "env.txt"
    stand_in_python(work, dump)
    w = watch(work, user=member.name, env={"MY_FLAG": "on"}, pass_env=["NOT_SET_ANYWHERE"])
    w.preflight("at daemon start", burn_in=True)
    b = w.status()["burn_in"]
    assert b["state"] == "skipped" and "torch is not importable" in b["note"], b
    uid, env = seen(dump)
    assert uid == member.uid  # the training user, never root
    assert_no_secret(env)
    assert env["MY_FLAG"] == "on" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # training.env, as the job
    assert env["HOME"] == os.path.expanduser(f"~{member.name}") and env["USER"] == member.name


def test_the_burn_in_as_root_gets_the_jobs_environment_not_the_daemons(watch, tmp_path):
    """A root-run training (no training.user) with a venv that is root's alone: the burn-in runs,
    as the training would, and still sees none of the daemon's keys."""
    need_root()
    work = tmp_path / "work"
    work.mkdir()
    dump = tmp_path / "env.txt"
    stand_in_python(work, dump)
    w = watch(work, pass_env=["HF_TOKEN"])
    w.preflight("at daemon start", burn_in=True)
    assert w.status()["burn_in"]["state"] == "skipped"
    uid, env = seen(dump)
    assert uid == 0
    assert env.get("HF_TOKEN") == KEYS["HF_TOKEN"]  # passed on purpose, as the job gets it
    del env["HF_TOKEN"]
    assert_no_secret(env)


@pytest.mark.parametrize("owned", ["workdir", "venv", "python"])
def test_a_users_python_never_runs_as_root(watch, member, open_dir, owned):  # noqa: F811
    """No training.user: the workdir, the venv or the interpreter belongs to another user, so the
    burn-in would run that user's code as root. It is skipped, and status says why and what to set."""
    need_root()
    work = open_dir / "work"
    work.mkdir()
    dump = open_dir / "env.txt"
    py = stand_in_python(work, dump)
    target = {"workdir": work, "venv": work / ".venv", "python": py}[owned]
    os.chown(target, member.uid, member.gid)
    w = watch(work)
    w.preflight("at daemon start", burn_in=True)
    b = w.status()["burn_in"]
    assert b["state"] == "skipped", b
    assert b["note"].startswith(f"would run {py} as root (") and b["note"].endswith("set training.user to run "
                                                                                     "it as the training's user")
    assert str(target) in b["note"] and f"uid {member.uid}" in b["note"]
    assert not dump.exists(), "the user's python ran as root"


def test_training_user_root_is_no_drop(watch, member, open_dir):  # noqa: F811
    need_root()
    work = open_dir / "work"
    work.mkdir()
    os.chown(work, member.uid, member.gid)
    dump = open_dir / "env.txt"
    stand_in_python(work, dump)
    for user in ("root", "0"):
        w = watch(work, user=user)
        w.preflight("at daemon start", burn_in=True)
        assert w.status()["burn_in"]["note"].startswith("would run"), w.status()["burn_in"]
        assert not dump.exists()


def test_an_unknown_training_user_is_no_burn_in(watch, tmp_path):
    need_root()
    work = tmp_path / "work"
    work.mkdir()
    dump = tmp_path / "env.txt"
    stand_in_python(work, dump)
    w = watch(work, user="no-such-user-49")
    w.preflight("at daemon start", burn_in=True)
    b = w.status()["burn_in"]
    assert b["state"] == "skipped" and "'no-such-user-49' does not exist" in b["note"]
    assert not dump.exists()


def test_the_real_daemon_hands_the_burn_in_no_key(member, open_dir, fake_nvml):  # noqa: F811
    """The daemon as installed: keys in its environment (the S3 pair, HF_TOKEN, the SMTP password)
    and an SMTP password file; the burn-in's python at boot sees none of them."""
    need_root()
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    work = open_dir / "work"
    work.mkdir()
    work.chmod(0o777)
    dump = work / "env.txt"
    stand_in_python(work, dump)
    pw = open_dir / "smtp-password"
    pw.write_text(SMTP_FILE_PASSWORD + "\n")
    pw.chmod(0o600)
    fake_nvml.write([gpu(**HEALTHY)])
    cfg = {"gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
           "training": {"command": "sleep 300", "workdir": str(work), "user": member.name, "on_finish": "none"},
           "email": {"to": ["me@example.com"], "smtp_host": "127.0.0.1", "smtp_port": 9, "username": "me",
                     "password_file": str(pw)},
           "stop": {"action": "dry-run"}, "health": {"burn_in": "1s"}}
    d = DaemonProc(open_dir / "d", cfg)
    (open_dir / "d").chmod(0o755)
    d.env.update(KEYS)
    try:
        d.start()
        b = wait_until(lambda: (lambda x: x if x.get("state") not in (None, "pending", "running") else None)(
            d.status()["health"]["burn_in"]), 30, what="the burn-in done")
        assert b["state"] == "skipped" and "torch is not importable" in b["note"], b
        uid, env = seen(dump)
        assert uid == member.uid
        assert_no_secret(env)
    finally:
        d.cleanup()


def test_the_service_form_keeps_the_environment_off_the_command_line():
    """Under systemd the burn-in is a transient service (outside the daemon's sandbox and memory
    cap), dropped to the user by systemd; its environment goes on stdin, never argv or the unit."""
    argv = burn_in_service(["/w/.venv/bin/python", "-c", BOOT, "code", "1"], user="alice", workdir="/w", max_s=121)
    assert argv[0] == "systemd-run" and "--scope" not in argv
    assert {"--wait", "--pipe", "--collect", "--property=User=alice", "--property=WorkingDirectory=/w",
            "--property=RuntimeMaxSec=121"} <= set(argv)
    assert not any(a.startswith(("--setenv", "-E")) for a in argv)
    assert argv[argv.index("--") + 1:] == ["/w/.venv/bin/python", "-c", BOOT, "code", "1"]


def test_boot_reexecs_with_the_environment_from_stdin(tmp_path):
    """BOOT, run by a real interpreter: the burn-in code gets exactly the environment sent on stdin."""
    import subprocess

    code = "import json, os, sys; print(json.dumps({'env': dict(os.environ), 'argv': sys.argv[1:]}))"
    r = subprocess.run([sys.executable, "-c", BOOT, code, "7"], input=json.dumps({"ONLY": "this"}),
                       capture_output=True, text=True, env={"AWS_SECRET_ACCESS_KEY": "x"}, timeout=30)
    out = json.loads(r.stdout)
    assert out["argv"] == ["7"]
    assert {k: v for k, v in out["env"].items() if k != "LC_CTYPE"} == {"ONLY": "this"}
