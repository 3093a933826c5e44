"""What the disk wing reads from this machine: filesystems, checkpoint folders, who writes into
them, the Trainer's best checkpoint. Root reads folders the training user controls here, so
nothing follows a symlink and every file read is capped."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from supervisor.sync.policy import is_cache_dir
from supervisor.training.checkpoints import checkpoint_step
from supervisor.training.finder import find_checkpoints
from supervisor.untrusted import Unreadable, json_object

STATE_FILE = "trainer_state.json"
STATE_MAX_BYTES = 16 << 20     # a trainer_state.json larger than this is not read (log_history grows)
UNREADABLE = "\0unreadable"    # files(): a folder that could not be read whole
FIND_DEPTH = 3                 # checkpoint-N folders this deep under a watched folder are found
# Folders walked below a checkpoint (or a folder sized for the mail) at most. Python 3.11's os.fwalk and
# os.walk recurse once per level: a folder the training nests ~1000 deep would raise RecursionError (no
# OSError) out of every look, and the disk guard would stop for the rest of the run.
WALK_DEPTH = 64


@dataclass(frozen=True)
class Folder:
    path: str
    name: str
    step: int
    bytes: int
    newest: float          # wall seconds of the newest file's mtime
    has_state: bool        # trainer_state.json is there (the Trainer writes it last)


def existing(path: str) -> str | None:
    """The path, or its nearest existing parent (a checkpoint folder not created yet lives on the
    same filesystem as its parent); None when not even / exists."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return p


def filesystem(path: str) -> tuple[int, str] | None:
    """(device, mount point) of the filesystem `path` (or its nearest existing parent) lives on."""
    p = existing(path)
    if p is None:
        return None
    try:
        dev = os.stat(p).st_dev
    except OSError:
        return None
    mount = p
    while True:
        parent = os.path.dirname(mount)
        if parent == mount:
            break
        try:
            if os.stat(parent).st_dev != dev:
                break
        except OSError:
            break
        mount = parent
    return dev, mount


def usage(path: str) -> tuple[int, int]:
    """(free bytes for an unprivileged writer, total bytes): the training does not run as root's reserve."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def files(folder: str, dir_fd: int | None = None) -> dict[str, tuple[int, int, int, int]]:
    """rel -> (size, mtime_ns, inode, ctime_ns) of every regular file under `folder` (relative to `dir_fd`
    when given), symlinks never followed: one is listed with size -1, so it never matches what was
    verified. A folder deeper than WALK_DEPTH is not entered: UNREADABLE is listed instead."""
    out: dict[str, tuple[int, int, int, int]] = {}
    try:
        # each fd fwalk yields is open only until the next step: stat inside the loop
        for top, dirs, names, fd in os.fwalk(folder, dir_fd=dir_fd, follow_symlinks=False):
            for n in names + dirs:
                try:
                    st = os.stat(n, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    continue
                rel = os.path.relpath(os.path.join(top, n), folder)
                out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns) if stat.S_ISREG(st.st_mode) \
                    else (-1, 0, 0, 0)
            if dirs and _depth(top, folder) >= WALK_DEPTH:
                out[UNREADABLE] = (-1, 0, 0, 0)   # not read whole: never matches what was verified
                dirs.clear()                      # topdown: fwalk does not go below
    except FileNotFoundError:
        return out
    except OSError:
        out[UNREADABLE] = (-1, 0, 0, 0)   # a walk that failed half-way never matches what was verified
    return out


def _depth(top: str, folder: str) -> int:
    """How many folders `top` (a path fwalk or walk gave, under `folder`) lies below `folder`."""
    rel = os.path.relpath(top, folder)
    return 0 if rel == os.curdir else rel.count(os.sep) + 1


def checkpoints(root: str, depth: int = FIND_DEPTH) -> list[Folder]:
    """Every `checkpoint-N` folder under `root` (not entering symlinks, nor a checkpoint's insides)."""
    out: list[Folder] = []
    for f in find_checkpoints([root], depth, skip=is_cache_dir):
        fs = files(f.path)
        newest = max((v[1] for v in fs.values()), default=0) / 1e9
        out.append(Folder(f.path, f.name, f.step, sum(max(0, v[0]) for v in fs.values()), newest,
                          fs.get(STATE_FILE, (-1,))[0] >= 0))
    return out


def best_checkpoint(folder: str) -> str | None:
    """`best_model_checkpoint` from the folder's trainer_state.json, as written (may be relative)."""
    p = os.path.join(folder, STATE_FILE)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, STATE_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        v = json_object(data, limit=STATE_MAX_BYTES, what=STATE_FILE).get("best_model_checkpoint")
    except Unreadable:
        return None
    return v if isinstance(v, str) and v else None


def writers(folders: list[str], proc: str = "/proc") -> set[str]:
    """The folders some process holds a file open in (written or about to be): /proc/*/fd. A
    process we may not look into is skipped (root sees them all)."""
    norm = [os.path.normpath(f) for f in folders]
    found: set[str] = set()
    if not norm:
        return found
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return found
    for pid in pids:
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            for f in norm:
                if target == f or target.startswith(f + "/"):
                    found.add(f)
    return found


def large_folders(roots: list[str], skip: set[str], top: int = 3, limit: int = 20000) -> list[tuple[str, int]]:
    """The largest folders right under `roots` that are not checkpoints (what else fills the
    disk), biggest first; each walk stops after `limit` files (an estimate for a huge cache)."""
    sizes: list[tuple[str, int]] = []
    for r in roots:
        try:
            entries = list(os.scandir(r))
        except OSError:
            continue
        for e in entries:
            if e.path in skip or checkpoint_step(e.name) is not None:
                continue
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            total, n = 0, 0
            for d, subdirs, names in os.walk(e.path):
                if _depth(d, e.path) >= WALK_DEPTH:
                    subdirs.clear()  # an estimate: what lies deeper is not counted (see WALK_DEPTH)
                if any(d == s or d.startswith(s + "/") for s in skip):
                    continue
                for name in names:
                    try:
                        total += os.lstat(os.path.join(d, name)).st_size
                    except OSError:
                        pass
                    n += 1
                if n > limit:
                    break
            sizes.append((e.path, total))
    return sorted(sizes, key=lambda x: -x[1])[:top]
