"""The SSH side of the rsync target that needs no connection: the cipher order, and the private
folder for the ControlMaster socket, checked (owner, mode, not a symlink) on every use."""

from __future__ import annotations

import os
import stat
from pathlib import Path

# OpenSSH's default ciphers with AES-GCM first: where the CPU has AES instructions it costs both
# ends about a third less CPU than chacha20-poly1305 (the default), which counts on a box whose
# cores are busy with training; the server still picks from the same set
AES_FIRST = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
              "aes128-ctr,aes192-ctr,aes256-ctr")


def _cpu_has_aes() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return "aes" in line.split(":", 1)[-1].split()
    except OSError:
        pass
    return False


AES_IN_CPU = _cpu_has_aes()

TMP_ROOT = "/tmp"   # the fallback's parent (a test points it at a sticky folder of its own)


def control_dir(work: Path) -> str:
    """A private folder for the SSH control socket, short enough for a unix socket path."""
    for d in (work.parent / "cm", Path(TMP_ROOT) / f"tsync-ssh-{os.getuid()}"):
        if len(str(d)) + 1 + 20 + 17 >= 108:  # ssh binds "<path>.<16 random>" first; sun_path is 108
            continue
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if private_dir(str(d)):
            return str(d)
    return ""


def private_dir(d: str) -> bool:
    """Make `d` (0700) if missing; True only when it is a real folder (not a symlink) that we own
    and nobody else may enter: otherwise root's ControlMaster socket would sit in a folder that a
    local user made first in a shared /tmp."""
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
