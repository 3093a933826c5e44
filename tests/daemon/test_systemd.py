"""The systemd unit (checked by `systemd-analyze verify`, whose exit code ignores unknown keys:
we read its stderr) and install.sh, run for real into a temporary prefix."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.daemon.control import ClientError, RequestError, request
from tests.fixtures.procs import kill_under
from tests.fixtures.toml_writer import to_toml
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "train-supervisor.service"
INSTALL = REPO / "systemd" / "install.sh"
START = REPO / "systemd" / "train-supervisor-start"
README = REPO / "README.md"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)")


def unit_settings(text: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        assert key not in out[section], f"{key} set twice in [{section}]"
        out[section][key] = value
    return out


def verify(path: Path) -> list[str]:
    """Problems systemd-analyze reports about `path` (it exits 0 on many of them)."""
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)
    lines = (r.stdout + r.stderr).splitlines()
    problems = [line for line in lines if path.name in line or str(path) in line]
    if r.returncode != 0:
        problems.append(f"exit {r.returncode}: {r.stderr.strip()}")
    return problems


def daemon_exe() -> str:
    p = Path(sys.executable).with_name("train-supervisord")
    return str(p) if p.exists() else "/bin/true"


def unit_copy(tmp_path: Path, extra: str = "") -> Path:
    """The unit with ExecStart on an executable that exists here (verify checks it)."""
    text = UNIT.read_text()
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={daemon_exe()}", text, count=1, flags=re.M)
    text = text.replace("[Install]", extra + "\n[Install]") if extra else text
    p = tmp_path / "train-supervisor.service"
    p.write_text(text)
    return p


@needs_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path):
    assert verify(unit_copy(tmp_path)) == []


@needs_analyze
def test_verify_check_does_see_mistakes(tmp_path):
    """The check above is only worth something if a typo makes it fail."""
    problems = verify(unit_copy(tmp_path, "[Service]\nKillMod=process\nWatchdogSec=soon\n"))
    assert any("KillMod" in p for p in problems) and any("soon" in p for p in problems), problems


def test_unit_contract():
    s = unit_settings(UNIT.read_text())
    svc = s["Service"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["ExecStart"] == "/opt/train-supervisor/bin/train-supervisord"
    assert svc["WatchdogSec"] in ("60", "60s") and svc["Restart"] == "on-failure"
    assert svc["KillMode"] in ("process", "mixed")
    assert svc["RuntimeDirectory"] == "train-supervisor" and svc["RuntimeDirectoryPreserve"] == "yes"
    assert svc["StateDirectory"] == "train-supervisor" and svc["ConfigurationDirectory"] == "train-supervisor"
    assert s["Install"]["WantedBy"] == "multi-user.target"
    assert s["Unit"].get("StartLimitIntervalSec") == "0"  # never gives up restarting


def test_hardening_confines_the_daemon_and_leaves_what_it_needs():
    """The daemon is sandboxed (issue 49); the training is not in its unit (a transient service of
    its own, tests/daemon/test_unit_hardening.py), so nothing here reaches sudo, pip or CUDA in the run.
    What stays open is what the daemon itself needs: restore and prune anywhere (home folders,
    /tmp), NVML's /dev/nvidia*, the network, /dev/kmsg, poweroff over systemd's socket."""
    svc = unit_settings(UNIT.read_text())["Service"]
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "full"  # never strict: restore writes into the training's folders
    for key in ("ProtectHome", "PrivateDevices", "PrivateNetwork", "PrivateTmp", "ProtectKernelLogs"):
        assert svc[key] == "no", f"{key}: restore/prune in home folders, NVML, uploads, /tmp, the OOM log"
    for key in ("PrivateUsers", "DynamicUser", "MemoryDenyWriteExecute", "ProtectClock", "User"):
        assert svc.get(key, "no") == "no", f"{key}: root's files, JIT in a hook, the GPU device nodes"
    for key in ("DevicePolicy", "DeviceAllow", "InaccessiblePaths", "ReadOnlyPaths"):
        assert key not in svc, f"{key}: would hide the GPUs or the training's folders from the daemon"
    caps = set(svc["CapabilityBoundingSet"].split())
    assert caps == {"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_KILL",
                    "CAP_SETUID", "CAP_SETGID", "CAP_SYS_PTRACE", "CAP_SYSLOG"}
    assert svc["SystemCallFilter"].split() == ["@system-service", "ptrace"]  # py-spy dump attaches
    assert svc["SystemCallErrorNumber"] == "EPERM" and svc["SystemCallArchitectures"] == "native"
    assert set(svc["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    for key in ("ProtectKernelModules", "ProtectKernelTunables", "ProtectControlGroups", "ProtectHostname",
                "RestrictNamespaces", "RestrictRealtime", "LockPersonality", "RestrictSUIDSGID", "PrivateMounts"):
        assert svc[key] == "yes", key
    assert svc["MemoryHigh"] == "384M" and svc["MemoryMax"] == "512M"  # the daemon alone
    for key in ("LimitMEMLOCK", "TasksMax"):
        assert key not in svc, f"{key} is the training's (its transient service sets it), not the daemon's"


def test_each_setting_is_explained():
    lines = UNIT.read_text().splitlines()
    bare = []
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            j = i - 1
            while j >= 0 and "=" in lines[j] and not lines[j].startswith("#"):
                j -= 1  # a group of settings shares the comment above it
            if j < 0 or not lines[j].startswith("#") or i - j > 4:
                bare.append(line)
    assert not bare, f"settings without a comment saying why: {bare}"


# --- install.sh ---------------------------------------------------------------------------------

def _copy_checkout(dst: Path) -> Path:
    shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".ruff_cache",
        ".hypothesis", "*.pyc"))
    return dst


def _install(src: Path, prefix: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "TRAIN_SUPERVISOR_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(Path(sys.executable).parent)))
    return subprocess.run(["bash", str(src / "systemd" / "install.sh"), "--prefix", str(prefix), *args],
                          capture_output=True, text=True, timeout=600, env=env)


def test_install_usage_errors(tmp_path):
    r = subprocess.run(["bash", str(INSTALL), "--bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "unknown option: --bogus" in r.stderr and "usage:" in r.stderr
    r = subprocess.run(["bash", str(INSTALL), "--prefix", str(tmp_path), "--group", "Bad Name"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "not a valid group name" in r.stderr
    r = subprocess.run(["bash", str(INSTALL), "--prefix", str(tmp_path), "--python", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "not found" in r.stderr
    assert not (tmp_path / "opt").exists()


@pytest.mark.slow
def test_install_into_a_prefix_then_upgrade(tmp_path):
    src = _copy_checkout(tmp_path / "checkout")
    prefix = tmp_path / "root"
    r = _install(src, prefix, "--group", "train")
    assert r.returncode == 0, r.stdout + r.stderr
    venv = prefix / "opt" / "train-supervisor"
    config = prefix / "etc" / "train-supervisor" / "config.toml"
    unit = prefix / "etc" / "systemd" / "system" / "train-supervisor.service"
    ctl = prefix / "usr" / "local" / "bin" / "supervisorctl"
    assert ctl.is_symlink() and os.readlink(ctl) == str(venv / "bin" / "supervisorctl")
    starter = prefix / "usr" / "local" / "bin" / "train-supervisor-start"
    assert starter.is_symlink() and os.readlink(starter) == str(venv / "bin" / "train-supervisor-start")
    assert os.access(starter, os.X_OK) and starter.read_text() == START.read_text()
    assert 'socket_group = "train"' in config.read_text() and "[idle]" in config.read_text()
    # the venv's supervisorctl accepts the config it wrote
    c = subprocess.run([str(ctl), "check-config", str(config)], capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stderr
    # the unit points into this venv and verifies as installed
    assert f"ExecStart={venv}/bin/train-supervisord\n" in unit.read_text()
    wants = prefix / "etc" / "systemd" / "system" / "multi-user.target.wants" / "train-supervisor.service"
    assert wants.is_symlink() and os.readlink(wants) == "/etc/systemd/system/train-supervisor.service"
    if ANALYZE:
        assert verify(unit) == []

    # upgrade: new code, an edited (here: broken) config that must be kept, a foreign supervisorctl
    marker = "# upgrade marker 7f3a\n"
    with open(src / "supervisor" / "durations.py", "a") as f:
        f.write(marker)
    config.write_text('[idle]\nwarn_after = "soon"\n')
    ctl.unlink()
    ctl.write_text("#!/bin/sh\necho supervisord's\n")
    r = _install(src, prefix)
    assert r.returncode == 1 and 'idle.warn_after: expected a duration like "2h", got "soon"' in r.stderr
    assert "has problems" in r.stderr
    assert config.read_text() == '[idle]\nwarn_after = "soon"\n'
    assert not ctl.is_symlink() and "is not ours" in r.stdout
    installed = list(venv.glob("lib/python3*/site-packages/supervisor/durations.py"))
    assert installed and installed[0].read_text().endswith(marker)
    assert "using the existing venv" in r.stdout


# --- without systemd as PID 1 (containers) --------------------------------------------------------

def readme_start_line() -> str:
    """The command the README's "Without systemd" section tells people to put in a start script."""
    text = README.read_text()
    section = text[text.index("## Without systemd (containers)"):]
    section = section[:section.index("\n## ", 1)]
    block = section[section.index("```sh\n") + 6:]
    line = block[:block.index("```")].splitlines()[0]
    return line.split("#", 1)[0].strip()


def test_install_sh_says_how_the_daemon_starts_without_systemd():
    text = INSTALL.read_text()
    assert "train-supervisor-start" in text and readme_start_line() == "train-supervisor-start"
    assert "systemd is not running here" in text


def test_without_systemd_the_readme_start_line_runs_restarts_and_readopts(tmp_path):
    """The documented start line, as a container's start script runs it: the daemon comes up, a
    second call is a no-op, a kill -9 of the daemon brings a new one that re-adopts the training
    (same pid, one tmux session), and --stop ends the daemon while the training runs on."""
    line = readme_start_line()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "train-supervisor-start").symlink_to(START)
    sock = tmp_path / "run" / "control.sock"
    config = tmp_path / "config.toml"
    config.write_text(to_toml({"state_dir": str(tmp_path / "state"), "socket": str(sock),
                               "training": {"log": str(tmp_path / "train.log")}}))
    rundir, log = tmp_path / "supervise", tmp_path / "daemon.log"
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "TRAIN_SUPERVISOR_CONFIG": str(config), "TRAIN_SUPERVISORD": f"{sys.executable} -m supervisor.daemon",
           "TRAIN_SUPERVISOR_LOG": str(log), "TRAIN_SUPERVISOR_RUN_DIR": str(rundir),
           "TRAIN_SUPERVISOR_RESTART_SEC": "0.5", "TRAIN_SUPERVISOR_NO_SCOPE": "1"}

    def start(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", " ".join([line, *args])], capture_output=True, text=True,
                              env=env, timeout=60, stdin=subprocess.DEVNULL)

    def up() -> bool:
        try:
            return bool(request(str(sock), "ping", timeout=2))
        except (ClientError, RequestError):
            return False

    def daemon_pid() -> int | None:
        try:
            return int((rundir / "daemon.pid").read_text())
        except (OSError, ValueError):
            return None

    try:
        r = start()
        assert r.returncode == 0 and "started train-supervisord" in r.stdout, r.stdout + r.stderr
        wait_until(up, 30, what=f"the daemon up (log: {log})")
        r = start()
        assert r.returncode == 0 and "already running" in r.stdout, r.stdout + r.stderr

        request(str(sock), "run", {"argv": ["sleep", "300"]}, timeout=15)
        tr = wait_until(lambda: (lambda t: t if t["state"] == "RUNNING" else None)(
            request(str(sock), "status", timeout=15)["training"]), 30, what="training RUNNING")
        job = tr["pid"]

        first = daemon_pid()
        assert first
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: daemon_pid() not in (None, first) and up(), 30, what="a new daemon after kill -9")
        tr = request(str(sock), "status", timeout=15)["training"]
        assert tr["state"] == "RUNNING" and tr["pid"] == job, tr
        sessions = subprocess.run(["tmux", "-S", str(tmp_path / "state" / "tmux.sock"), "list-sessions"],
                                  capture_output=True, text=True).stdout.strip().splitlines()
        assert len(sessions) == 1, sessions
        assert "exited with status" in log.read_text() and "restarting in 0.5s" in log.read_text()

        # a config typo at --restart: the running daemon is kept, and the script says why
        second = daemon_pid()
        good = config.read_text()
        config.write_text(good.replace("[training]", "[training]\nautostrat = true", 1))
        r = start("--restart")
        assert r.returncode == 2 and "NOT restarted" in r.stderr and "autostrat" in r.stderr, r.stdout + r.stderr
        assert daemon_pid() == second and up()
        config.write_text(good)
        r = start("--restart")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: daemon_pid() not in (None, second) and up(), 30, what="the restarted daemon")

        second = daemon_pid()
        r = start("--stop")
        assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
        assert not up() and second is not None and not _alive(second)
        assert _alive(job), "stopping the daemon must leave the training running"
    finally:
        subprocess.run(["bash", str(START), "--stop"], env=env, capture_output=True, timeout=120)
        subprocess.run(["tmux", "-S", str(tmp_path / "state" / "tmux.sock"), "kill-server"], capture_output=True)
        kill_under(tmp_path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
