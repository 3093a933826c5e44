"""Where restored files land, for a daemon that runs as root in folders the training user owns.

The restore writes into the watched folder, which on a rented box is usually the training user's
(`/workspace/out`). Root must not follow a path there (the user could put a link to
`/root/.ssh` in its place, or a FIFO where a file should be) and must leave what it made to the
user: the Trainer deletes old checkpoints as it saves new ones (`save_total_limit`) and cannot
delete a folder of root's. So files are read through descriptors without following links, and the
staging folder, root's own until its files are checked, is handed to the user before it is renamed
into place."""

from __future__ import annotations

import os
import pwd
import stat

from supervisor.training.safeopen import guarded
from supervisor.untrusted.fileopen import open_regular
from supervisor.untrusted.names import problem, remote_path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def owner_of(user: str | None) -> tuple[int, int] | None:
    """(uid, primary gid) the restored files are given to; None when the files stay ours (no
    training.user, the user is root, or this process is not root)."""
    ids = guarded(user)
    if ids is None or not user:
        return None
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def open_inside(folder: int, rel: str) -> int:
    """A read descriptor on the regular file `rel` under the folder descriptor `folder`: no link is
    followed on the way and no FIFO or device is opened (O_NONBLOCK, then the type is checked)."""
    if problem(rel):
        raise OSError(22, "not a path inside the unit", rel)
    parts = rel.split("/")
    fd = folder
    try:
        for name in parts[:-1]:
            nfd = os.open(name, _DIR, dir_fd=fd)
            if fd != folder:
                os.close(fd)
            fd = nfd
        return open_regular(parts[-1], dir_fd=fd)
    finally:
        if fd != folder:
            os.close(fd)


def hand_over(stage: int, owner: tuple[int, int] | None) -> None:
    """The checked staging folder (a descriptor), opened to reading like any output folder and,
    when there is a training user, given to them with everything in it."""
    if owner is not None:
        uid, gid = owner
        for _path, _dirs, files, dfd in os.fwalk(".", dir_fd=stage, follow_symlinks=False):
            os.fchown(dfd, uid, gid)
            for name in files:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
    os.fchmod(stage, 0o755)


class Staging:
    """The root-owned staging folder of one restore, as the readers write into it: every file is
    created through folder descriptors below it (openat, O_NOFOLLOW), never by joining a name from
    the target to a path, and only the files the unit's (checked) manifest lists may be created.
    `path` names the folder for a tool that takes a path (rsync), whatever is renamed around it."""

    def __init__(self, fd: int, allowed: set[str]):
        self.fd = fd
        self.allowed = frozenset(allowed)
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    def create(self, rel: str, size: int = 0) -> int:
        """A read-write descriptor on the file `rel`, new and empty (cut back to nothing when a
        retry made it before), `size` bytes long when size > 0 (the ranges are written in place)."""
        path = remote_path(rel, "a restored file")
        if path not in self.allowed:
            raise OSError(1, "not a file of the unit being restored", rel)
        parts = path.parts
        fd = self.fd
        try:
            for name in parts[:-1]:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, _DIR, dir_fd=fd)
                if fd != self.fd:
                    os.close(fd)
                fd = nfd
            out = os.open(parts[-1], os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                          dir_fd=fd)
        finally:
            if fd != self.fd:
                os.close(fd)
        try:
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise OSError(21, "not a regular file", rel)
            os.set_blocking(out, True)
            os.ftruncate(out, 0)
            if size > 0:
                os.ftruncate(out, size)
        except BaseException:
            os.close(out)
            raise
        return out

    def extras(self) -> list[str]:
        """Entries in the folder that the unit does not list (a reader that wrote more than it was
        asked: a hostile rsync peer's extra file, a link): none may be handed over."""
        want_dirs = {"/".join(p.split("/")[:i]) for p in self.allowed for i in range(1, p.count("/") + 1)}
        out = []
        for top, dirs, files, _dfd in os.fwalk(".", dir_fd=self.fd, follow_symlinks=False):
            base = "" if top == "." else top[2:]
            for name in files:
                rel = f"{base}/{name}" if base else name
                if rel not in self.allowed:
                    out.append(rel)
            for name in dirs:
                rel = f"{base}/{name}" if base else name
                if rel not in want_dirs:
                    out.append(rel + "/")
        return sorted(out)
