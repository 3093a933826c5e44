"""What a spot notice means, as pure functions of plain facts and `now`: the record kept in state_dir
(so the next boot can tell the owner), what made it off the machine, when the outcome is known,
whether a SIGTERM to the daemon is a notice, and what a new boot does with an old record.

The shell is spot_run.py (it asks the metadata services, signals the training, drives the sync
engine's emergency mode and sends the mails); the providers' replies are read in preemption.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from supervisor.interfaces import Holding
from supervisor.training.checkpoints import checkpoint_step

# A notice's outcome is not judged before this many seconds: the emergency pass must have scanned.
SETTLE_MIN_S = 3.0
# Container hosts that send SIGTERM to take an interruptible machine, by the variable they set.
CONTAINER_HOSTS = {"RUNPOD_POD_ID": "RunPod", "VAST_CONTAINERLABEL": "vast.ai"}


@dataclass
class NoticeRecord:
    """state_dir/preemption.json: the last final notice and what came of it."""

    provider: str = ""            # ec2 | gcp | azure | signal
    kind: str = ""                # terminate | stop | hibernate | preempt | sigterm
    detail: str = ""
    noticed_at: float = 0.0
    deadline: float = 0.0         # when the machine is expected to go
    boot_id: str = ""             # of the machine that got the notice
    hostname: str = ""
    signal: str = ""              # sent to the training ("" none)
    signal_error: str = ""        # why training_signal could not be sent
    newest_at_notice: str = ""    # the newest checkpoint folder here when the notice came (whole or not yet)
    newest: str = ""              # the newest complete checkpoint here at the last look
    newest_on_target: bool = False
    newest_off_at: float | None = None   # when the newest one was first seen whole on the target
    made_it: list[str] = field(default_factory=list)
    not_made: list[str] = field(default_factory=list)  # "unit: why"
    outcome: str = ""             # "" while syncing | synced | deadline | exited
    outcome_at: float | None = None
    told: bool = False            # the follow-up mail went out (on this machine)
    told_next_boot: bool = False  # a later boot told the owner


def newest_complete(holdings: list[Holding]) -> Holding | None:
    done = [h for h in holdings if h.complete]
    return max(done, key=_age_key) if done else None


def newest_unit(holdings: list[Holding]) -> Holding | None:
    """The newest checkpoint folder here, whole or still being written."""
    return max(holdings, key=_age_key) if holdings else None


def _age_key(h: Holding) -> tuple[int, float]:
    step = checkpoint_step(h.unit.rsplit("/", 1)[-1])
    return (step if step is not None else -1, h.mtime)


def tally(rec: NoticeRecord, holdings: list[Holding], now: float) -> None:
    """Update what made it off the machine and what did not, from the engine's latest look."""
    newest = newest_complete(holdings)
    rec.newest = newest.unit if newest else ""
    rec.newest_on_target = bool(newest and newest.on_target)
    if rec.newest_on_target and rec.newest_off_at is None:
        rec.newest_off_at = now
    elif not rec.newest_on_target:
        rec.newest_off_at = None
    ordered = sorted(holdings, key=_age_key, reverse=True)
    rec.made_it = [h.unit for h in ordered if h.on_target]
    rec.not_made = [f"{h.unit}: {_why_not(h)}" for h in ordered if not h.on_target]


def _why_not(h: Holding) -> str:
    if h.complete:
        return "complete here, not (wholly) on the target yet"
    return f"not complete here ({h.reason or 'unfinished'})"


def outcome(rec: NoticeRecord, holdings: list[Holding], now: float) -> str:
    """"" while the emergency sync should still be waited for; "synced" once every complete
    checkpoint is on the target and nothing is about to complete (and, when the training was asked
    to save, its new checkpoint made it); "deadline" once the machine's time is up."""
    if now >= rec.deadline:
        return "deadline"
    if now - rec.noticed_at < SETTLE_MIN_S:
        return ""
    if any(h.complete and not h.on_target for h in holdings) or any(h.settling for h in holdings):
        return ""
    if rec.signal and not any(
            h.on_target and h.mtime >= rec.noticed_at - 1 for h in holdings):
        return ""  # the training was asked to save: wait (up to the deadline) for what it saves
    return "synced"


def next_boot(rec: NoticeRecord | None, boot_id: str, hostname: str, now: float) -> str:
    """What a daemon starting now does with the record: "tell" (the machine that got the notice is
    gone or was restarted: mail the owner), "resume" (same boot, the notice's time not up: keep at
    the emergency), or "" (nothing to do)."""
    if rec is None or rec.told_next_boot or not rec.noticed_at:
        return ""
    same = bool(boot_id) and rec.boot_id == boot_id and rec.hostname == hostname
    if same and now < rec.deadline:
        return "resume"
    return "tell"


def sigterm_is_notice(mode: str, systemd_stopping: bool, watched: bool, container_host: str) -> bool:
    """A SIGTERM to the daemon: systemd stopping the unit or the machine (an upgrade, a restart, a
    poweroff) is a plain stop; otherwise with sigterm = "notice" it is a notice, with "auto" only
    where a metadata service answers or a known container host runs us (they take a machine with
    SIGTERM), so a `kill` on a workstation stays a plain stop."""
    if mode == "exit" or systemd_stopping:
        return False
    return mode == "notice" or watched or bool(container_host)


def container_host(env: dict[str, str]) -> str:
    return next((name for var, name in CONTAINER_HOSTS.items() if env.get(var)), "")


_UNIT_RE = re.compile(r"/([^/\s]+\.service)(?:/|$)")


def unit_of_cgroup(text: str) -> str | None:
    """The systemd service a process runs in, from /proc/self/cgroup (v1 or v2 lines)."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1] in ("", "name=systemd"):
            m = _UNIT_RE.findall(parts[2])
            if m:
                return m[-1]
    return None
