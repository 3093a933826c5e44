"""Open a file to read it only when it is a regular file, without ever blocking in the open.

A folder the training user writes can hold, between a scan and an open, a FIFO where a checkpoint
file was (an open of a FIFO for reading waits for a writer, forever) or a link to somewhere else.
So the open is O_NONBLOCK|O_NOFOLLOW, the type is checked on the descriptor, and only then is the
descriptor put back to blocking reads: a FIFO or device is refused at once, by name."""

from __future__ import annotations

import errno
import os
import stat

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegular(OSError):
    """The path names a FIFO, device, socket or folder, not a regular file."""


def open_regular(path: str, dir_fd: int | None = None) -> int:
    """A blocking read descriptor on the regular file `path` (relative to dir_fd when given);
    NotRegular for anything else, OSError(ELOOP) for a link, FileNotFoundError when gone."""
    fd = os.open(path, _FLAGS, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(errno.EINVAL, f"not a regular file ({kind(mode)})", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return word
    return "not a regular file"
