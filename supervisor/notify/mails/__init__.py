"""Every text a person receives, in one place: each mail is a pure function of plain facts that
returns a `Mail` (subject, body). No I/O, no clock reads, no config objects: the caller passes the
facts (times as epoch seconds, figures as numbers) and sends the result through `Alerts`.

One module per subject, so the words for a subsystem sit together:
  idle.py      idle warning, stop cancelled, stopping now, final sync failed, stop failed, still up
  training.py  training finished / failed, restarted
  progress.py  the early estimate
  sync.py      sync failing
  money.py     the caps' projection warning, the stop for a cap, a failed hook
  gpu.py       GPU memory at its limit, GPU lost, Xid meanings, CUDA/host OOM and NCCL advice, host checks
  disk.py      the disk forecast line and "disk full soon": what fills it, what would free space

Times are written with `supervisor.timefmt` (local time with its zone) and sizes/durations with
`supervisor.durations`, so every mail reads the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mail:
    subject: str
    body: str


def describe_exit(exit_code: int | None, signal: str | None) -> str:
    """How a process ended, in the words every mail and status line uses."""
    if signal:
        return f"killed by {signal}"
    if exit_code is None:
        return "exit status unknown"
    return f"exit code {exit_code}{EXIT_MEANING.get(exit_code, '')}"


# What the shell's own exit codes mean (the job runs under `bash -c`): the first thing to check.
EXIT_MEANING = {
    126: ": found but not executable (permission denied, or not a program)",
    127: ": command not found (not on the PATH the job ran with)",
}


def n_files(n: int) -> str:
    """`1 file`, `3 files`: a count the mails say (never "1 files")."""
    return f"{n} file{'' if n == 1 else 's'}"
