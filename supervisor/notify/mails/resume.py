"""Words about a run continuing on a new machine: the restore done (from which checkpoint, what was
lost), the target unreachable at a start, and the status line of both."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_bytes, format_duration
from supervisor.notify.mails import Mail
from supervisor.timefmt import hm, when


@dataclass(frozen=True)
class Resumed:
    host: str                            # this machine
    unit: str                            # "checkpoint-1200"
    step: int | None
    max_steps: int | None
    saved_at: float | None               # when the checkpoint's manifest was written
    saved_on: str                        # the machine that wrote it
    now: float
    path: str
    nbytes: int
    seconds: float
    skipped: tuple[tuple[str, str], ...] = ()    # newer units not usable: (unit, why)
    fallbacks: tuple[tuple[str, str], ...] = ()  # complete units that failed their check: (unit, why)


def resumed_line(r: Resumed) -> str:
    """`resumed on HOST from checkpoint-1200 (step 1200 of 5000), saved 14:02 on HOST-A; lost since
    that save: ~11 min of training`"""
    step = "" if r.step is None else f" (step {r.step}{f' of {r.max_steps}' if r.max_steps else ''})"
    line = f"resumed on {r.host} from {r.unit}{step}"
    if r.saved_at is not None:
        line += f", saved {hm(r.saved_at)[:5]}{' on ' + r.saved_on if r.saved_on else ''}"
        lost = max(0.0, r.now - r.saved_at)
        line += f"; lost since that save: ~{round(lost / 60)} min of training"
    return line


def resumed(r: Resumed) -> Mail:
    lines = [resumed_line(r) + ".", "",
             f"Restored into {r.path}: {format_bytes(r.nbytes)} in {format_duration(r.seconds)}, every file "
             "checked against the checkpoint's manifest (sha256).",
             f"The training was started with TRAIN_SUPERVISOR_RESUME_FROM={r.path}."]
    if r.saved_at is not None:
        lines.append(f"That checkpoint was saved {when(r.saved_at)}{' on ' + r.saved_on if r.saved_on else ''}.")
    if r.skipped:
        lines += ["", "Newer units on the target were skipped (not complete there):"]
        lines += [f"  {u}: {why}" for u, why in r.skipped]
    if r.fallbacks:
        lines += ["", "Complete units that failed their check on download (the one before was used):"]
        lines += [f"  {u}: {why}" for u, why in r.fallbacks]
    return Mail(f"{r.host}: {resumed_line(r)}", "\n".join(lines) + "\n")


def unreachable(host: str, target: str, error: str, next_try_s: float, if_unreachable: str) -> Mail:
    then = ("The training waits: it starts once the checkpoint is restored (resume.if_unreachable = \"wait\"); "
            f"next try in {format_duration(next_try_s)}. `supervisorctl start` again does not skip the wait; "
            "set resume.if_unreachable = \"start_fresh\" to start without it.")
    if if_unreachable == "start_fresh":
        then = "The training was started FROM SCRATCH (resume.if_unreachable = \"start_fresh\")."
    return Mail(f"{host}: cannot fetch the checkpoint to resume from ({target})",
                f"The training was about to start and this machine holds no complete checkpoint, but the "
                f"checkpoint could not be fetched from {target} and put in place:\n  {error}\n\n{then}\n")


def all_damaged(host: str, target: str, error: str, started_fresh: bool) -> Mail:
    then = ("The training was started FROM SCRATCH (resume.if_unreachable = \"start_fresh\")." if started_fresh else
            "The training was NOT started. Restore an older unit by hand (`supervisorctl resume --list`, then "
            "`supervisorctl resume --checkpoint NAME` and `supervisorctl start`), or set resume.from_target = false "
            "to start from scratch.")
    return Mail(f"{host}: every complete checkpoint on {target} failed its check",
                f"The training was about to start and this machine holds no complete checkpoint. The target holds "
                f"complete ones, but none matched its manifest when downloaded:\n  {error}\n\n{then}\n")


def nothing_on_target(host: str, target: str, why: str) -> str:
    return f"{host}: no complete checkpoint on {target} to resume from{' (' + why + ')' if why else ''}; started fresh"
