"""supervisorctl's side of the control socket: one request, one JSON answer. It imports only the
standard library and supervisor.errors, so a `supervisorctl status` pays for no server, logger or
config it does not use."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from supervisor.errors import DEFAULT_PATH, DEFAULT_SOCKET, ENV_VAR, ClientError, RequestError


def socket_path(config: str | None = None) -> str:
    """The control socket the config names, read with tomllib alone: a `status` asks the daemon that
    runs, whatever else the file says. The full load, and its errors naming the problem, when the
    file cannot be read or does not name an absolute path plainly."""
    import tomllib

    p = config or os.environ.get(ENV_VAR) or DEFAULT_PATH
    explicit = bool(config or os.environ.get(ENV_VAR))
    try:
        with open(p, "rb") as f:
            v = tomllib.load(f).get("socket", DEFAULT_SOCKET)
        if isinstance(v, str) and os.path.isabs(v) and "\0" not in v:
            return v
    except FileNotFoundError:
        if not explicit:
            return DEFAULT_SOCKET  # a fresh install with no config: the daemon's default
    except (OSError, ValueError):
        pass
    from supervisor.config import load

    return load(config).socket


def _connect(s: socket.socket, path: str) -> None:
    """connect(), retrying while the listen backlog is full (EAGAIN on unix sockets)."""
    import errno
    import time

    deadline = time.monotonic() + 3.0
    while True:
        try:
            s.connect(path)
            return
        except BlockingIOError as e:
            if e.errno != errno.EAGAIN or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def request(path: str, cmd: str, args: dict | None = None, timeout: float = 10.0) -> Any:
    """Send one request; return the result or raise ClientError with supervisorctl's exit code:
    4 when the daemon cannot be reached, 1 when the socket refuses us (message says why)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            _connect(s, path)
        except FileNotFoundError:
            from supervisor.config.hints import daemon_hint, in_container

            raise ClientError(f"cannot reach train-supervisord: no socket at {path} "
                              f"(is the daemon running? {daemon_hint(in_container())})", 4) from None
        except ConnectionRefusedError:
            from supervisor.config.hints import in_container

            start = "train-supervisor-start" if in_container() else "systemctl start train-supervisor"
            raise ClientError(f"{path} refuses connections: the daemon is not running "
                              f"(stale socket; {start})", 1) from None
        except PermissionError:
            raise ClientError(f"permission denied on {path}: run as root, or join the socket's group "
                              "(socket_group in the config) to use status, tail, alerts, keepalive "
                              "and sync", 1) from None
        except OSError as e:
            raise ClientError(f"{path} is not a train-supervisor control socket ({e.strerror or e})", 1) from None
        buf = bytearray()
        try:
            s.sendall(json.dumps({"cmd": cmd, "args": args or {}}).encode() + b"\n")
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise ClientError(f"train-supervisord did not answer {cmd!r} within {timeout:g}s", 4) from None
        except OSError as e:  # reset, broken pipe: the daemon dropped us (busy, or going down)
            raise ClientError(f"the connection to train-supervisord broke during {cmd!r} "
                              f"({e.strerror or type(e).__name__}); try again", 4) from None
    finally:
        s.close()
    try:
        reply = json.loads(bytes(buf).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ClientError(f"{path} answered something that is not train-supervisor's protocol", 1) from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise ClientError(f"{path} answered something that is not train-supervisor's protocol", 1)
    if not reply["ok"]:
        raise RequestError(str(reply.get("error")))
    return reply.get("result")
