"""The daemon's folders for snapshots (snapshot.py), one per file system, and copying into them.

A hard link or a reflink needs the source's file system, so the folder is `state_dir/sync/snapshots`
when the state folder is on it, else `.train-supervisor-snapshots` at the top of that file system,
made 0700 through folder descriptors that follow no symlink (a folder the training user writes could
hold one) and checked to be ours, mode 0700, at each open; the walk never enters it (policy names it a
cache). A folder is held open while a pass uses it; targets read its files through /proc/PID/fd/N/...,
never through a path someone else could swap.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable
from contextlib import suppress as _suppress

from supervisor.store.base import write_all

STATE_SUBDIR = "snapshots"                 # under state_dir/sync, when on the source's file system
MOUNT_DIR = ".train-supervisor-snapshots"  # else at the top of the source's file system
MARGIN_MIN = 1 << 30       # a copy leaves at least this much free ...
MARGIN_SHARE = 0.05        # ... and this share of the file system (the training's next save needs room)
COPY_CHUNK = 64 << 20      # copy_file_range's piece (the consistency check is at the end, not per piece)
READ_CHUNK = 8 << 20       # read/write's piece where copy_file_range cannot
FICLONE = 0x40049409       # linux/fs.h _IOW(0x94, 9, int): share the source's blocks (btrfs, XFS)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def room(size: int, free: int, total: int, margin_min: int = MARGIN_MIN) -> bool:
    """Is there room for a copy of `size` bytes that still leaves the margin free?"""
    return free - size >= max(margin_min, int(total * MARGIN_SHARE))



class SnapDir:
    """A folder of ours on one file system, held open: files are made and removed through its
    descriptor, and `path` (/proc/PID/fd/N) names it for a target that takes a path."""

    def __init__(self, fd: int, where: str):
        self.fd = fd
        self.where = where
        self.path = f"/proc/{os.getpid()}/fd/{fd}"


def _ours(fd: int, dev: int) -> str:
    """Why the opened folder is not ours to keep snapshots in ("" when it is)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):o}, not 700"
    if st.st_dev != dev:
        return "it is on another file system"
    return ""


def open_state_dir(state_dir: str, dev: int) -> SnapDir | None:
    """state_dir/sync/snapshots when the state folder is on the file system `dev`."""
    base = os.path.join(state_dir, "sync")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        bfd = os.open(base, DIR_FLAGS)
        if os.fstat(bfd).st_dev != dev:
            os.close(bfd)
            return None
    except OSError:
        return None
    try:
        return _make(bfd, STATE_SUBDIR, dev, os.path.join(base, STATE_SUBDIR))
    except OSError:
        return None
    finally:
        os.close(bfd)


def mount_top(path: str, dev: int) -> str | None:
    """The top folder of the file system `dev` above `path` (its mount point, or the highest
    folder of it before a symlink); None when `path` is not on it."""
    p = os.path.normpath(os.path.abspath(path))
    top = None
    while True:
        try:
            st = os.lstat(p)
        except OSError:
            return top
        if st.st_dev != dev or stat.S_ISLNK(st.st_mode):
            return top
        top = p
        parent = os.path.dirname(p)
        if parent == p:
            return top
        p = parent


def open_mount_dir(top: str, dev: int) -> SnapDir:
    """MOUNT_DIR in `top`, reached from / one folder at a time, no symlink followed anywhere (a
    folder the training user writes could hold one); made 0700 when missing. OSError saying why
    when it cannot be (a link on the way, a folder there that is not ours)."""
    fd = os.open("/", DIR_FLAGS)
    try:
        for name in [p for p in top.split("/") if p]:
            nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return _make(fd, MOUNT_DIR, dev, os.path.join(top, MOUNT_DIR))
    finally:
        os.close(fd)


def _make(parent: int, name: str, dev: int, where: str) -> SnapDir:
    with _suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)  # a link put there is refused, not followed
    except OSError as e:
        raise OSError(e.errno, f"{where}: {e.strerror or e}") from None
    why = _ours(fd, dev)
    if why:
        os.close(fd)
        raise OSError(errno.EPERM, f"{where}: {why}")
    return SnapDir(fd, where)


def clear(d: SnapDir, name: str) -> None:
    """Remove the slot `name` and what is in it, through the folder's descriptor."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=d.fd)
    except FileNotFoundError:
        return
    except OSError:  # not a folder (nothing of ours): removed as a file
        with _suppress(OSError):
            os.unlink(name, dir_fd=d.fd)
        return
    try:
        for entry in os.listdir(fd):
            with _suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    with _suppress(OSError):
        os.rmdir(name, dir_fd=d.fd)


def copy_into(src: int, dst: int, size: int, on_piece: Callable[[int], None] | None = None) -> str:
    """Copy `size` bytes of src into the empty dst: a reflink where the file system shares blocks,
    else copy_file_range (in-kernel), else read and write. Returns how. `on_piece(bytes so far)`
    after each piece."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        if on_piece is not None:
            on_piece(size)
        return "reflink"
    except OSError:
        pass
    off, how = 0, "copy_file_range"
    while off < size:
        n = min(COPY_CHUNK if how == "copy_file_range" else READ_CHUNK, size - off)
        if how == "copy_file_range":
            try:
                got = os.copy_file_range(src, dst, n, off, off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                how = "read"
                continue
        else:
            data = os.pread(src, n, off)
            got = len(data)
            write_all(dst, data, off)
        if got == 0:
            break  # the source shrank: the check after the copy says so
        off += got
        if on_piece is not None:
            on_piece(off)
    return how
