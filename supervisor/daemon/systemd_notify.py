"""sd_notify without a dependency: READY=1, WATCHDOG=1 and STATUS= lines to $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket


def notify(*lines: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds (systemd's advice), when the watchdog is on for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
