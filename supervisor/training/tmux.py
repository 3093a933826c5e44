"""A thin wrapper over the tmux CLI, on a socket of our own so we never touch a user's tmux server."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import structlog

from supervisor.training.jobenv import base

log = structlog.get_logger("tmux")


class TmuxError(Exception):
    pass


def under_systemd() -> bool:
    """True when we can put the tmux server in a scope of its own, outside the daemon's cgroup, so
    that `systemctl restart train-supervisor` (which kills the unit's cgroup) spares the training."""
    return (os.geteuid() == 0 and os.path.isdir("/run/systemd/system") and shutil.which("systemd-run") is not None
            and os.environ.get("TRAIN_SUPERVISOR_NO_SCOPE") != "1")


# What the runner in the pane needs to start (the interpreter finds its packages); the job's own
# environment is built by the daemon and handed over in the run's spec.
RUNNER_NEEDS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH")


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The tmux server's environment (and so the runner's): never the daemon's keys, which a
    server started with the daemon's own environment would hold for every pane."""
    out = base(env, as_other_user=False)
    out.update({k: env[k] for k in RUNNER_NEEDS if k in env})
    return out


class Tmux:
    def __init__(self, socket_path: str | Path, binary: str = "tmux"):
        self.socket = str(socket_path)
        self.binary = binary

    def _run(self, *args: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
        cmd = [self.binary, "-S", self.socket, *args]
        try:
            cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise TmuxError("tmux is not installed (apt-get install tmux)") from None
        except subprocess.TimeoutExpired:
            raise TmuxError(f"tmux {' '.join(args)} timed out") from None
        if check and cp.returncode != 0:
            raise TmuxError(f"tmux {args[0]} failed: {(cp.stderr or cp.stdout).strip()}")
        return cp

    def has_session(self, name: str) -> bool:
        if not os.path.exists(self.socket):
            return False
        try:
            return self._run("has-session", "-t", f"={name}", check=False).returncode == 0
        except TmuxError:
            return False

    def new_session(self, name: str, argv: list[str], cwd: str | None, scope_unit: str | None = None) -> None:
        Path(self.socket).parent.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "-S", self.socket, "new-session", "-d", "-s", name, "-x", "220", "-y", "50"]
        if cwd:
            args += ["-c", cwd]
        args += ["--", *argv]
        if scope_unit and under_systemd():
            args = ["systemd-run", "--scope", "--quiet", "--collect", f"--unit={scope_unit}",
                    "--description=train-supervisor training (tmux)", "--", *args]
        try:
            cp = subprocess.run(args, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL,
                                env=server_env(os.environ))
        except FileNotFoundError as e:
            raise TmuxError(f"cannot run {e.filename}: not installed") from None
        except subprocess.TimeoutExpired:
            raise TmuxError("tmux new-session timed out") from None
        if cp.returncode != 0:
            raise TmuxError(f"tmux new-session failed: {(cp.stderr or cp.stdout).strip()}")
        # keep the training alive if its own tmux client disconnects or the server is asked to exit
        self._run("set-option", "-t", f"={name}", "remain-on-exit", "off", check=False)

    def pane_pid(self, name: str) -> int | None:
        cp = self._run("list-panes", "-t", f"={name}", "-F", "#{pane_pid}", check=False)
        if cp.returncode != 0:
            return None
        first = cp.stdout.strip().splitlines()[:1]
        return int(first[0]) if first and first[0].isdigit() else None

    def kill_session(self, name: str) -> None:
        self._run("kill-session", "-t", f"={name}", check=False)

    def list_clients(self, name: str) -> list[str]:
        if not os.path.exists(self.socket):
            return []
        cp = self._run("list-clients", "-t", f"={name}", "-F", "#{client_tty}", check=False)
        return [ln for ln in cp.stdout.splitlines() if ln.strip()] if cp.returncode == 0 else []

    def attach_argv(self, name: str) -> list[str]:
        return [self.binary, "-S", self.socket, "attach-session", "-t", f"={name}"]
