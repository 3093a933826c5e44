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

from supervisor.status.words import EXIT_MEANING as EXIT_MEANING  # one wording with the status text
from supervisor.status.words import describe_exit as describe_exit


@dataclass(frozen=True)
class Mail:
    subject: str
    body: str


def n_files(n: int) -> str:
    """`1 file`, `3 files`: a count the mails say (never "1 files")."""
    return f"{n} file{'' if n == 1 else 's'}"
