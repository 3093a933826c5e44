"""Open the training log as root without following a path the training user controls.

With `training.user` set the job runs as that user, but the runner (and the daemon's log follower)
run as root. A log in a folder the user can write (`/workspace/train.log`) could be replaced by the
job with a symlink to `/root/.ssh/authorized_keys`; a root that then appends the job's output there
hands the job root. So the path is walked one component at a time from `/`, each opened relative to
the folder before it: a symlink is followed only where the user could not have put it (a folder the
user cannot write, or a root-owned link in a sticky folder), the last component is opened with
O_NOFOLLOW|O_NONBLOCK (no FIFO can hold the runner), and what was opened must be a regular file with
one link, owned by root or the user. Anything else is refused with an error naming the component.
"""

from __future__ import annotations

import os
import pwd
import stat


class UnsafeLog(OSError):
    """The log's path leads somewhere root must not write or read for the training user."""


def user_ids(user: str) -> tuple[int, set[int]] | None:
    """(uid, every gid of the user) of `user` (a name or a number); None when there is no such user."""
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        return None
    try:
        gids = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except OSError:
        gids = {pw.pw_gid}
    return pw.pw_uid, gids


def open_to_others(st: os.stat_result) -> bool:
    """Whether anyone but root can change entries in a folder with this stat: its owner (who may
    chmod it), its group when group-writable and not root's, everyone when world-writable. The
    training user is one such someone; a stranger in a shared folder is another."""
    if st.st_uid != 0:
        return True
    if st.st_gid != 0 and st.st_mode & stat.S_IWGRP:
        return True
    return bool(st.st_mode & stat.S_IWOTH)


def guarded(user: str | None) -> tuple[int, set[int]] | None:
    """The ids to guard against, or None when no guard is needed (no training user, the user is us,
    or we are not root and cannot reach more than the user anyway)."""
    if not user or os.geteuid() != 0:
        return None
    ids = user_ids(user)
    if ids is None or ids[0] == 0:
        return None
    return ids


def open_log(path: str, flags: int, user: str | None, mode: int = 0o644, make_dirs: bool = False) -> int:
    """A descriptor on `path` opened with `flags` (O_CLOEXEC added), safely for the training user
    `user` (see the module). Missing folders are made (`make_dirs`) in the same guarded walk."""
    ids = guarded(user)
    if ids is None:
        if make_dirs:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return os.open(path, flags | os.O_CLOEXEC, mode)
    fd, name = _walk(path, make_dirs, None)
    try:
        out = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=fd)
        try:
            _check_file(out, path, ids[0])
            os.set_blocking(out, bool(~flags & os.O_NONBLOCK))
        except BaseException:
            os.close(out)
            raise
        return out
    finally:
        os.close(fd)


def open_folder(path: str, user: str | None, make_dirs: bool = False) -> int:
    """A descriptor (O_RDONLY|O_DIRECTORY) on the folder `path`, reached like open_log's file: a
    symlink is followed only where the training user could not have put it. Missing folders are
    made (`make_dirs`) and given to the training user, whose job writes into them (a restore on a
    fresh machine makes the output folder the Trainer then saves its checkpoints in)."""
    ids = guarded(user)
    if ids is None:
        if make_dirs:
            os.makedirs(path, exist_ok=True)
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    owner = (ids[0], _primary_gid(user) if user else -1)
    fd, name = _walk(path, make_dirs, owner)
    try:
        if name != "/" and make_dirs:
            _mkdir_for(fd, name, owner)
        out = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except NotADirectoryError:
        raise UnsafeLog(f"{path!r} is not a folder") from None
    finally:
        os.close(fd)
    return out


def _primary_gid(user: str) -> int:
    try:
        return (pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)).pw_gid
    except KeyError:
        return -1


def _mkdir_for(fd: int, name: str, owner: tuple[int, int] | None) -> None:
    try:
        os.mkdir(name, 0o755, dir_fd=fd)
    except FileExistsError:
        return
    if owner is not None:
        os.chown(name, owner[0], owner[1], dir_fd=fd, follow_symlinks=False)


def _walk(path: str, make_dirs: bool, owner: tuple[int, int] | None) -> tuple[int, str]:
    """(O_PATH descriptor on the folder that holds path's last component, that component's name),
    every link on the way resolved by the module's rule. Folders missing on the way are made when
    make_dirs (given to `owner` when set)."""
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    todo = [p for p in path.split("/") if p]
    if not todo:
        raise UnsafeLog(f"the path {path!r} names no file")
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    hops = 0
    try:
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            dst = os.fstat(fd)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                sticky_root_link = dst.st_mode & stat.S_ISVTX and st.st_uid == 0
                if open_to_others(dst) and not sticky_root_link:
                    raise UnsafeLog(f"the path {path!r}: {name!r} is a symlink in a folder others than "
                                    f"root can write; root does not follow it")
                hops += 1
                if hops > 40:
                    raise UnsafeLog(f"the path {path!r}: too many symlinks")
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                todo = [p for p in target.split("/") if p] + todo
                if not todo:
                    return fd, "/"
                continue
            if not todo:
                out, fd = fd, -1
                return out, name
            if st is None:
                if not make_dirs:
                    raise FileNotFoundError(2, "No such file or directory", path)
                _mkdir_for(fd, name, owner)
            nfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        raise UnsafeLog(f"the path {path!r} names no file")
    finally:
        if fd >= 0:
            os.close(fd)


def _check_file(fd: int, path: str, uid: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeLog(f"the log {path!r} is not a regular file")
    if st.st_nlink != 1:
        raise UnsafeLog(f"the log {path!r} has {st.st_nlink} hard links; root writes only a file with one")
    if st.st_uid not in (0, uid):
        raise UnsafeLog(f"the log {path!r} belongs to uid {st.st_uid}, neither root nor the training user")


def open_folder_warning(path: str, user: str | None) -> str:
    """check-config's words when the log's folder can be written by someone other than root and the
    training user ('' when not): such a someone could swap the log for a link root then refuses."""
    folder = os.path.dirname(os.path.abspath(path)) or "/"
    try:
        st = os.stat(folder)
    except OSError:
        return ""
    ids = user_ids(user) if user else None
    uid, gids = ids if ids else (0, {0})
    others = bool(st.st_mode & stat.S_IWOTH)
    group = bool(st.st_mode & stat.S_IWGRP) and st.st_gid not in gids | {0}
    stranger = st.st_uid not in (0, uid)
    if others or group or stranger:
        return (f"training.log {path!r}: its folder {folder} can be written by others than root and the "
                f"training user; keep the log in a folder only they can write")
    return ""
