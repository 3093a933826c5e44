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
    parts = [p for p in rel.split("/") if p and p != "."]
    if not parts or ".." in parts:
        raise OSError(22, "not a path inside the unit", rel)
    fd = folder
    try:
        for name in parts[:-1]:
            nfd = os.open(name, _DIR, dir_fd=fd)
            if fd != folder:
                os.close(fd)
            fd = nfd
        out = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        if fd != folder:
            os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(21, "not a regular file", rel)
    os.set_blocking(out, True)
    return out


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
