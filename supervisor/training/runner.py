"""The process that sits in the tmux pane: runs the training command, copies its output to the pane
and to the log file, and records how it ended.

Run as `python -m supervisor.training.runner SPEC.json`. It is deliberately separate from the daemon so the
daemon can die, restart or be upgraded while the training keeps running: the exit code is written to
a file the next daemon reads, not returned to a parent that may be gone.

Signals: like a shell waiting for a foreground job, the runner ignores SIGINT/SIGTERM/SIGHUP and lets
them reach the job (it shares the runner's process group, which is what the daemon signals); it
exits only after the job has, so the exit status is always captured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from supervisor import records
from supervisor.notify.mails import describe_exit
from supervisor.redact import redact, register, secret_name
from supervisor.statefile import Reserve, atomic_write
from supervisor.timefmt import when
from supervisor.training.jobenv import base
from supervisor.training.safeopen import open_log

BANNER_PREFIX = "===== train-supervisor run "
# Signals meant for the job: the runner lets them pass and outlives them (USR1/USR2: a spot notice's
# preemption.training_signal, whose default action would otherwise end the runner too).
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
BANNER_COMMAND_MAX = 2000   # the command as the banner repeats it, cut beyond this


# The module the tmux pane runs; the name before the wings is kept so a daemon upgraded while a
# training runs still re-adopts the runner the older version started.
RUNNER_MODULES = ("supervisor.training.runner", "supervisor.runner")
# Where the training is told to resume from: set by the daemon alone (the resume wing), for each start.
RESUME_ENV = "TRAIN_SUPERVISOR_RESUME_FROM"


@dataclass(frozen=True)
class RunSpec:
    """runs/N/spec.json: what the daemon asks the runner to run; also how a daemon that lost
    training.json recognises the run in the tmux pane."""

    run_id: int
    command: str
    log: str
    run_dir: str
    shell: str | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    started_at: float | None = None
    # `supervisorctl run`: `env` is the caller's whole environment (their PATH, venv, exports), not
    # additions to the daemon's; kept here so a restart after a daemon restart runs it the same way
    env_exact: bool = False
    # `env` is the job's whole environment, built by the daemon (jobenv): the runner adds nothing of
    # its own (the tmux server's) environment. Specs of older daemons lack it.
    env_whole: bool = False

    def __post_init__(self) -> None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("spec.json: env should map names to strings")

    @classmethod
    def read(cls, path: str | Path) -> RunSpec:
        """ValueError (naming the field) or OSError when the file is not a spec this code wrote."""
        return _load_file(cls, path, "spec.json")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExitRecord:
    """runs/N/exit.json: how the job ended, written the moment it did."""

    exit_code: int | None = None     # negative: killed by that signal number, as Popen reports it
    signal: str | None = None
    ended_at: float | None = None
    run_id: int | None = None

    @classmethod
    def read(cls, path: str | Path) -> ExitRecord:
        return _load_file(cls, path, "exit.json")


def banner(run_id: int, started: float, command: str) -> str:
    """The run's first line in the log. One line whatever the command holds (a newline in it would
    start a line of its own that the OOM detector could take for the job's output)."""
    shown = redact(command).replace("\r", "\\r").replace("\n", "\\n")
    if len(shown) > BANNER_COMMAND_MAX:
        shown = shown[:BANNER_COMMAND_MAX] + "..."
    return f"{BANNER_PREFIX}{run_id} started {when(started)}: {shown}"


def run_banner(run_id: int | None) -> str | None:
    """How the banner of run `run_id` starts (None: no run yet)."""
    return f"{BANNER_PREFIX}{run_id} started" if run_id else None


def is_banner(line: str) -> bool:
    """A line the runner wrote about the run (its start or end), not the job's output."""
    return line.startswith(BANNER_PREFIX)


def run_log_tail(path: str, run_id: int | None, n: int, user: str | None = None) -> list[str]:
    """The last `n` lines run `run_id` wrote to the log (after its banner, the banners left out):
    what a failure mail and `run` show. [] when the log cannot be read, or not safely: the log is
    opened as the runner writes it (safeopen), so a training user who swapped it for a link to a
    root-only file gets that file's lines into no mail."""
    if not path:
        return []
    try:
        with os.fdopen(open_log(path, os.O_RDONLY, user or None), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            lines = f.read().decode("utf-8", "replace").replace("\r", "\n").splitlines()
    except OSError:  # UnsafeLog too
        return []
    start = f"{BANNER_PREFIX}{run_id} started"
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(start):
            lines = lines[i + 1:]
            break
    return [ln[:300] for ln in lines if ln.strip() and not is_banner(ln)][-n:]


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"SIG{n}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = RunSpec.read(args[0])
    try:
        os.chmod(args[0], 0o600)  # it holds training.env; older daemons wrote it 0644
    except OSError:
        pass
    for s in JOB_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    # never the runner's own environment (the daemon's, through tmux): an older spec gets only
    # the harmless names of it
    env = {} if spec.env_exact or spec.env_whole else base(os.environ, bool(spec.user))
    env.setdefault("PYTHONUNBUFFERED", "1")  # otherwise Python jobs hold output back from a pipe
    # the daemon's reserve (state_dir/.reserve): freed if the exit record finds the disk full
    Reserve(Path(spec.run_dir).parent.parent).register()
    # set only by the daemon for this start (where to resume from); one inherited from the daemon's
    # own environment would point a fresh run at a checkpoint that may no longer be there
    env.pop(RESUME_ENV, None)
    env.update(spec.env)
    # the banner is redacted in this process: the daemon's registry of secret values is not here
    register(*[v for k, v in spec.env.items() if secret_name(k)])
    # opened so that root never follows a path the training user controls (safeopen's docstring)
    try:
        fd = open_log(spec.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, spec.user, make_dirs=True)
    except OSError as e:
        msg = f"train-supervisor: cannot start the training: cannot open its log safely: {e}\n"
        sys.stdout.write(msg)
        _record(spec, 127, None)
        return 127
    log = os.fdopen(fd, "ab", buffering=0)  # noqa: SIM115 - lives as long as the job
    log.write(f"\n{banner(spec.run_id, time.time(), spec.command)}\n".encode(errors="replace"))
    kwargs: dict = {}
    if spec.user:
        try:
            # a `run` caller's HOME, USER and LOGNAME are theirs, not training.user's: those follow the user
            kwargs = as_user(str(spec.user), env, set() if spec.env_exact else set(spec.env))
        except KeyError:
            msg = f"train-supervisor: cannot start the training: training.user {spec.user!r} does not exist\n"
            log.write(msg.encode())
            sys.stdout.write(msg)
            _record(spec, 127, None)
            return 127
    try:
        child = subprocess.Popen(
            [spec.shell or "/bin/bash", "-c", spec.command],
            cwd=spec.workdir or None, env=env, stdin=None,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            # restore default dispositions in the job: SIG_IGN would otherwise be inherited
            preexec_fn=_reset_signals, **kwargs,
        )
    except OSError as e:
        msg = f"train-supervisor: cannot start the training: {e}\n"
        log.write(msg.encode())
        sys.stdout.write(msg)
        _record(spec, 127, None)
        return 127
    atomic_write(_p(spec, "pid"), str(child.pid).encode())
    out = sys.stdout.buffer
    assert child.stdout is not None
    fd = child.stdout.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        for sink in (log, out):
            try:
                sink.write(chunk)
                sink.flush()
            except OSError:
                pass  # a full disk or a closed pane must not kill the training
    rc = child.wait()  # negative: killed by signal -rc (kept negative in the record, as Popen does)
    sig = _signame(-rc) if rc < 0 else None
    tail = f"{BANNER_PREFIX}{spec.run_id} ended: {describe_exit(rc, sig)}\n"
    for sink in (log, out):
        try:
            sink.write(tail.encode())
            sink.flush()
        except OSError:
            pass
    _record(spec, rc, sig)
    return 0


def as_user(user: str, env: dict[str, str], from_config: set[str]) -> dict:
    """Popen arguments that run the job as `user` with that user's own groups. `user=` alone only
    changes the uid: the job would keep root's gid 0 and supplementary groups. HOME, USER and
    LOGNAME follow the user (caches land in their home), unless training.env sets them."""
    import pwd

    pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    if pw.pw_uid == os.geteuid() != 0:
        return {}  # already that user (a daemon not run as root): setgroups would fail for nothing
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    for k, v in (("HOME", pw.pw_dir), ("USER", pw.pw_name), ("LOGNAME", pw.pw_name)):
        if k not in from_config:
            env[k] = v
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": groups}


def _reset_signals() -> None:
    for s in JOB_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


def _p(spec: RunSpec, name: str) -> Path:
    return Path(spec.run_dir) / name


def _record(spec: RunSpec, code: int, sig: str | None) -> None:
    data = ExitRecord(exit_code=code, signal=sig, ended_at=time.time(), run_id=spec.run_id)
    atomic_write(_p(spec, "exit.json"), json.dumps(asdict(data)).encode())


def _load_file(cls, path, what: str):
    """records.load of a JSON file: ValueError naming `what` when it is not JSON or not the
    record, OSError when it cannot be read."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what}: not JSON ({e})") from None
    return records.load(cls, raw, what)


if __name__ == "__main__":
    sys.exit(main())
