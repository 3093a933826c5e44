"""The stop actions this daemon runs itself: `systemctl poweroff`, and the configured command run
detached under a wrapper that writes its exit status to a file (so a daemon killed meanwhile finds
it, and never runs it twice). The provider's own stop is `carry`. How the machine will stop, in the
words of status and the mails (`stop_how`, `describe_action`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from supervisor.config import StopConfig
from supervisor.proc import start_time
from supervisor.stop.choose import Plan
from supervisor.stop.providers.base import StopActionError

COMMAND_TIMEOUT_S = 600.0


def poweroff(timeout: float = 60.0) -> str:
    """`systemctl poweroff`: on EC2 (EBS-backed) this stops the instance; `halt` would keep billing."""
    try:
        cp = subprocess.run(["systemctl", "poweroff"], capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise StopActionError("systemctl not found: use stop.action = \"command\" with your own command") from None
    except subprocess.TimeoutExpired:
        raise StopActionError(f"systemctl poweroff did not return within {timeout:.0f}s") from None
    if cp.returncode != 0:
        raise StopActionError(f"systemctl poweroff exited {cp.returncode}: {(cp.stderr or cp.stdout).strip()[:300]}")
    return "systemctl poweroff accepted"


def proc_ctime(pid: int | None) -> float | None:
    # the wrapper is our child: exited but not yet reaped is exited
    return start_time(pid, zombie_is_gone=True)


def start_command(command: str, exit_file: Path, log_file: Path, env: dict[str, str]) -> int:
    """Start the stop command detached from the daemon (it outlives a kill -9 of the daemon); the
    wrapper shell writes the command's exit status to `exit_file` when it ends. Returns the PID."""
    wrapper = 'sh -c "$1"; rc=$?; printf "%s\\n" "$rc" > "$2.tmp" && mv "$2.tmp" "$2"'
    exit_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        p = subprocess.Popen(["/bin/sh", "-c", wrapper, "train-supervisor-stop", command, str(exit_file)],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, close_fds=True)
    return p.pid


def read_exit(exit_file: Path) -> int | None:
    try:
        txt = exit_file.read_text().strip()
    except OSError:
        return None
    return int(txt) if txt.lstrip("-").isdigit() else None


def stop_how(cfg: StopConfig, plan: Plan | None = None) -> str:
    """How this machine will stop, and whether that can work here: what `status` says, so a
    stop that cannot happen (poweroff in a container) is seen before it is due."""
    import shutil

    from supervisor.config import hints

    action = plan.action if plan is not None else cfg.action
    if plan is not None and action == "provider":
        return f"by {plan.line()}" + (f" — cannot work here: {plan.problem}" if plan.problem else "")
    if action == "poweroff" and hints.in_container():
        p = hints.provider(dict(os.environ)) or hints.GENERIC
        return (f"by poweroff — cannot work here: {f'a {p.name} container' if p.name else 'no systemd (a container?)'}"
                f"; set stop.action = \"command\" with {p.stop_command}")
    if action == "command":
        first = cfg.command.split()[0] if cfg.command.split() else ""
        if first and "=" not in first and not first.startswith(("$", "(", "{")) and shutil.which(first) is None \
                and not os.path.isfile(first):
            return f"by `{cfg.command}` — cannot work here: {first} not found"
        return f"by `{cfg.command}`"
    if plan is not None and action == "poweroff" and plan.info is not None:
        return f"by {plan.line()}"
    return f"by {action}"


def describe_action(cfg: StopConfig, plan: Plan | None = None) -> str:
    """The action in the mails' words; with the plan, what still bills and any warning."""
    action = plan.action if plan is not None else cfg.action
    if action == "command":
        # never the command's text: it often carries a password or an API key (issue 23)
        return "run the configured stop.command"
    if action == "dry-run":
        return "dry-run (nothing is stopped; the stop is only logged and recorded)"
    if plan is not None and action == "provider":
        verb = "terminate, once the final sync is verified (else stop)," if plan.mode == "terminate" else "stop"
        still = plan.still_billed()
        return (f"{plan.via()}: {verb} {plan.instance_words or 'this machine'} ({plan.ends_words()}"
                f"{'; ' + still if still else ''}), confirmed by reading its state back")
    if cfg.action == "ec2":
        return "ec2 StopInstances on this instance"
    if plan is not None and plan.warning:
        return f"systemctl poweroff. WARNING: {plan.warning}"
    if plan is not None and plan.info is not None:
        return f"systemctl poweroff ({plan.ends_words()} on {plan.info.label}; {plan.still_billed()})"
    return "systemctl poweroff"
