"""The newest complete checkpoint already on this machine: a `checkpoint-N` folder in (or one level
below) a watched folder that holds the completion marker (`trainer_state.json`, written last by the
Trainer). Its path is what the training gets in TRAIN_SUPERVISOR_RESUME_FROM."""

from __future__ import annotations

import os
import stat

from supervisor.sync.manifest_doc import STATE_MAX
from supervisor.training.checkpoints import checkpoint_step
from supervisor.training.finder import find_checkpoints
from supervisor.untrusted import Unreadable, finite_int, json_object


def newest_local(folders: list[str], marker: str = "trainer_state.json") -> tuple[str, int] | None:
    """(path, step) of the newest complete checkpoint under the folders; None when there is none."""
    best: tuple[int, str] | None = None
    for folder in folders:
        for d in _candidates(folder):
            if not os.path.isfile(os.path.join(d, marker or "trainer_state.json")):
                continue
            step = _step(d)
            if step is not None and (best is None or step > best[0]):
                best = (step, d)
    return (best[1], best[0]) if best else None


def _candidates(folder: str) -> list[str]:
    # one level down too: a watched folder above several runs' output_dirs
    return [f.path for f in find_checkpoints([folder], depth=1)]


def _step(path: str) -> int | None:
    """The step in the folder's trainer_state.json, opened without following a link or blocking on
    a FIFO (the folder is the training user's; status asks this on every call)."""
    try:
        fd = os.open(os.path.join(path, "trainer_state.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("not a regular file")
            doc = json_object(fh.read(STATE_MAX + 1), limit=STATE_MAX, what="trainer_state.json")
            return finite_int(doc.get("global_step"), what="global_step")
    except (OSError, Unreadable):
        return checkpoint_step(os.path.basename(path))
