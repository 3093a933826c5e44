"""The newest complete checkpoint already on this machine: a `checkpoint-N` folder in (or one level
below) a watched folder that holds the completion marker (`trainer_state.json`, written last by the
Trainer); else another trainer's save (other_trainers). Its path is what the training gets in
TRAIN_SUPERVISOR_RESUME_FROM, and while there is one no restore from the target is made over it."""

from __future__ import annotations

import os
import re
import stat

from supervisor.saves.manifest_doc import STATE_MAX
from supervisor.sync.policy import is_cache_dir
from supervisor.training.checkpoints import checkpoint_step, named_step
from supervisor.training.finder import find_checkpoints
from supervisor.untrusted import ZIP_TAIL, Unreadable, finite_int, json_object, zip_ends_whole

OTHER_DEPTH = 3          # folders below a watched folder looked into for another trainer's saves
OTHER_ENTRIES = 20000    # directory entries looked at in all (a dataset folder is not an output folder)
OTHER_CHECKED = 32       # torch files whose end record is read, newest first
TORCH_SAVE = re.compile(r"\.(ckpt|pt|pth)$", re.IGNORECASE)
ACCELERATE_DIR = re.compile(r"^checkpoint_\d+$")
ACCELERATE_LAST = "random_states_0.pkl"


def newest_local(folders: list[str], marker: str = "trainer_state.json") -> tuple[str, int | None] | None:
    """(path, step) of the newest complete checkpoint under the folders; None when there is none.
    The step is None for a save whose name states none (nanoGPT's `ckpt.pt`, `last.ckpt`)."""
    best: tuple[int, str] | None = None
    for folder in folders:
        for d in _candidates(folder):
            if not os.path.isfile(os.path.join(d, marker or "trainer_state.json")):
                continue
            step = _step(d)
            if step is not None and (best is None or step > best[0]):
                best = (step, d)
    if best:
        return best[1], best[0]
    return other_trainers(folders)


def other_trainers(folders: list[str]) -> tuple[str, int | None] | None:
    """The newest save of a trainer that writes no `checkpoint-N/`: a torch file (Lightning's
    `.ckpt`, nanoGPT's `ckpt.pt`) whole by its zip end record, or an Accelerate `checkpoint_N/`
    holding its first process's random states (written last). Ranked by the step its name states,
    then its time. A restore from the target must never land over these (it would set the newer
    local save aside for an older one), so finding one is enough to hold the restore back."""
    files: list[tuple[float, str]] = []
    dirs: list[tuple[float, str]] = []
    budget = [OTHER_ENTRIES]
    for folder in dict.fromkeys(os.path.normpath(f) for f in folders if f):
        _look(folder, 0, files, dirs, budget)
    found = [(t, p) for t, p in dirs]
    for t, p in sorted(files, reverse=True)[:OTHER_CHECKED]:
        if _torch_whole(p):
            found.append((t, p))
    if not found:
        return None
    t, p = max(found, key=lambda tp: (named_step(os.path.basename(tp[1])) or -1, tp[0]))
    return p, named_step(os.path.basename(p))


def _look(d: str, level: int, files: list, dirs: list, budget: list[int]) -> None:
    try:
        with os.scandir(d) as it:
            entries = []
            for e in it:
                budget[0] -= 1
                if budget[0] < 0:
                    break
                entries.append(e)
    except OSError:
        return
    for e in entries:
        try:
            if e.is_symlink() or e.name.startswith("."):
                continue
            if e.is_file(follow_symlinks=False) and TORCH_SAVE.search(e.name):
                st = e.stat(follow_symlinks=False)
                if st.st_size > 0:
                    files.append((st.st_mtime, e.path))
            elif e.is_dir(follow_symlinks=False) and not is_cache_dir(e.name):
                if checkpoint_step(e.name) is not None:
                    continue  # an HF Trainer's checkpoint-N/ counts by its own rule (trainer_state.json) or
                              # not at all: its rng_state.pth or optimizer.pt is no save of its own
                if ACCELERATE_DIR.match(e.name):
                    st = os.stat(os.path.join(e.path, ACCELERATE_LAST), follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        dirs.append((st.st_mtime, e.path))
                elif level < OTHER_DEPTH:
                    _look(e.path, level + 1, files, dirs, budget)
        except OSError:
            continue


def _torch_whole(path: str) -> bool:
    """Does the torch file end with a consistent zip end record (torch.save finished it)? Opened
    without following a link or blocking on a FIFO; only its tail is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        n = min(st.st_size, ZIP_TAIL)
        return zip_ends_whole(os.pread(fd, n, st.st_size - n))
    except OSError:
        return False
    finally:
        os.close(fd)


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
