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
    """True when we can put the tmux server in a transient service of its own, outside the daemon's
    unit: `systemctl restart train-supervisor` (which kills the unit's cgroup) spares the training,
    and none of the unit's sandbox or memory cap falls on it."""
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


# What the training's transient service sets that a service would not have by default: the limits the
# training needs (NCCL over InfiniBand/RoCE locks large buffers, DataLoader workers outgrow 1024
# descriptors, workers x threads outgrow a task cap), and an OOM kill of one worker leaves the rest
# to the training (the daemon alerts on it) instead of stopping the whole service.
TRAINING_PROPERTIES = ("Type=forking", "LimitMEMLOCK=infinity", "LimitNOFILE=65536", "TasksMax=infinity",
                       "OOMPolicy=continue")


def transient_service(unit: str, description: str, argv: list[str], *, properties: tuple[str, ...] | list[str] = (),
                      env: Mapping[str, str] | None = None, wait: bool = False, pipe: bool = False) -> list[str]:
    """The systemd-run command line that runs `argv` as a transient SERVICE (never a scope: a scope's
    processes are our children and keep our unit's sandbox, a service is started by systemd afresh).
    `env`: harmless names only (they are on the command line, and in the unit for `systemctl show`)."""
    args = ["systemd-run", "--quiet", "--collect", f"--unit={unit}", f"--description={description}"]
    args += [f"--property={p}" for p in properties]
    args += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
    if wait:
        args.append("--wait")
    if pipe:
        args.append("--pipe")
    return [*args, "--", *argv]


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
        """The session `name` running `argv`; under systemd its server is the main process of the
        transient service `scope_unit` (the name is older than the service)."""
        unit = scope_unit
        Path(self.socket).parent.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "-S", self.socket, "new-session", "-d", "-s", name, "-x", "220", "-y", "50"]
        if cwd:
            args += ["-c", cwd]
        args += ["--", *argv]
        env = server_env(os.environ)
        if unit and under_systemd():
            # Type=forking: the tmux client forks the server and exits once the session exists; the
            # server (the service's main process) holds the panes. Where our server already runs, the
            # session joins it (in its own service) and this one ends empty, as a scope did.
            args = transient_service(unit, "train-supervisor training (tmux)", args,
                                     properties=TRAINING_PROPERTIES, env=env)
        try:
            cp = subprocess.run(args, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL, env=env)
        except FileNotFoundError as e:
            raise TmuxError(f"cannot run {e.filename}: not installed") from None
        except subprocess.TimeoutExpired:
            raise TmuxError("tmux new-session timed out") from None
        if cp.returncode != 0:
            hint = f" (its output: journalctl -u {unit})" if args[0] == "systemd-run" else ""
            raise TmuxError(f"tmux new-session failed: {(cp.stderr or cp.stdout).strip()}{hint}")
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
