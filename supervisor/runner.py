"""The process that sits in the tmux pane: runs the training command, copies its output to the pane
and to the log file, and records how it ended.

Run as `python -m supervisor.runner SPEC.json`. It is deliberately separate from the daemon so the
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
from pathlib import Path

from .redact import redact
from .statefile import Reserve, atomic_write


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"SIG{n}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    try:
        os.chmod(args[0], 0o600)  # it holds training.env; older daemons wrote it 0644
    except OSError:
        pass
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_IGN)
    # the daemon's reserve (state_dir/.reserve): freed if the exit record finds the disk full
    Reserve(Path(spec["run_dir"]).parent.parent).register()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # otherwise Python jobs hold output back from a pipe
    env.update(spec.get("env") or {})
    log_path = spec["log"]
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the job
    # the log is readable by the socket group: the command's keys and tokens are not repeated there
    banner = (f"\n===== train-supervisor run {spec.get('run_id')} started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
              f"{redact(spec['command'])}\n")
    log.write(banner.encode())
    kwargs: dict = {}
    if spec.get("user"):
        try:
            kwargs = as_user(str(spec["user"]), env, set(spec.get("env") or {}))
        except KeyError:
            msg = f"train-supervisor: cannot start the training: training.user {spec['user']!r} does not exist\n"
            log.write(msg.encode())
            sys.stdout.write(msg)
            _record(spec, 127, None)
            return 127
    try:
        child = subprocess.Popen(
            [spec.get("shell") or "/bin/bash", "-c", spec["command"]],
            cwd=spec.get("workdir") or None, env=env, stdin=None,
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
    tail = f"===== train-supervisor run {spec.get('run_id')} ended: " + (
        f"killed by {sig}" if sig else f"exit code {rc}") + "\n"
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
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)


def _p(spec: dict, name: str) -> Path:
    return Path(spec["run_dir"]) / name


def _record(spec: dict, code: int, sig: str | None) -> None:
    data = {"exit_code": code, "signal": sig, "ended_at": time.time(), "run_id": spec.get("run_id")}
    atomic_write(_p(spec, "exit.json"), json.dumps(data).encode())


if __name__ == "__main__":
    sys.exit(main())
