"""The control socket: one JSON request per connection, one JSON reply.

Request:  {"cmd": "status", "args": {...}}\n   (at most MAX_REQUEST bytes, within READ_TIMEOUT)
Reply:    {"ok": true, "result": ...}  or  {"ok": false, "error": "what is wrong"}

Each connection gets its own thread (a `sync --wait` may block for minutes without holding up a
`status`), with a cap on concurrent connections. The request must be whole within READ_TIMEOUT in
all (not per read: a client trickling a byte at a time is cut off at the deadline). Slots are
counted per uid: a peer other than root and the daemon's user holds at most MEMBER_PER_UID, and all
such peers together never more than MAX_CONNECTIONS - ROOT_RESERVED, so a socket_group member can
never take the slots root needs to `status`, `keepalive` or `stop`. Whatever a client sends, the
worst it gets is an error reply: a handler's exception is caught and reported, never raised into
the server.

Who asks is read from the socket itself (SO_PEERCRED), never from the request. Root and the
daemon's own user may use every command; anyone else who can open the socket (a `socket_group`
member) only the commands in `member_commands`: the daemon runs as root, so a command that starts
or signals a process would be that member acting as root.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import socket
import struct
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from supervisor.cli.client import ClientError, request  # noqa: F401 - the client's side, for its older importers
from supervisor.interfaces import RequestError
from supervisor.redact import redact, redact_obj

log = structlog.get_logger("control")

MAX_REQUEST = 64 * 1024
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 32
ROOT_RESERVED = 8      # slots only root and the daemon's own user may take
MEMBER_PER_UID = 4     # concurrent connections one other uid may hold

Handler = Callable[[dict], Any]


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel reports it."""

    pid: int
    uid: int
    gid: int

    def name(self) -> str:
        try:
            return f"uid {self.uid} ({pwd.getpwuid(self.uid).pw_name})"
        except KeyError:
            return f"uid {self.uid}"


def peer_of(conn: socket.socket) -> Peer | None:
    """SO_PEERCRED of a unix socket connection; None where the kernel cannot say (then the
    peer is treated as a member, never as root)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
    except (OSError, AttributeError, struct.error):
        return None
    return Peer(pid, uid, gid)


def refusal(cmd: str, peer: Peer | None, member_commands: Collection[str] | None, owner_uid: int) -> str | None:
    """Why `peer` may not run `cmd`, or None when it may. Root and the daemon's own user may run
    everything; other peers only `member_commands` (None: no restriction)."""
    if member_commands is None or cmd in member_commands:
        return None
    if peer is not None and peer.uid in (0, owner_uid):
        return None
    who = peer.name() if peer is not None else "a peer whose identity the kernel did not report"
    allowed = ", ".join(sorted({*member_commands, "tail"} - {"ping"}))
    return (f"{cmd!r} is refused for {who}: it starts or stops a process, and the daemon runs as root; "
            f"only root may do that (sudo supervisorctl {cmd} ...). "
            f"Members of the socket group may use: {allowed}.")


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler], group: str = "",
                 member_commands: Collection[str] | None = None):
        self.path = path
        self.handlers = handlers
        self.group = group
        self.member_commands = frozenset(member_commands) if member_commands is not None else None
        self.owner_uid = os.geteuid()
        self._sock: socket.socket | None = None
        self._slots_lock = threading.Lock()
        self._held: dict[int, int] = {}   # uid (-1: unknown peer) -> connections it holds now
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            # a stale socket from a previous daemon; a live one would mean two daemons
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1)
            try:
                probe.connect(self.path)
                live = True
            except OSError:
                live = False
            finally:
                probe.close()
            if live:
                raise RuntimeError(f"another train-supervisord is already serving {self.path}")
            p.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # created 0660: no window where it is world-writable
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o660)
        if self.group:
            try:
                os.chown(self.path, 0 if os.geteuid() == 0 else -1, grp.getgrnam(self.group).gr_gid)
            except (KeyError, PermissionError) as e:
                log.error("socket_group_failed", group=self.group, error=str(e))
        s.listen(128)
        # accept() blocks without a timeout (a daemon at rest wakes for nothing); close() wakes it
        s.settimeout(None)
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()
        log.info("control_listening", socket=self.path)

    def close(self) -> None:
        self._stopping.set()
        if self._sock:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() at once
            except OSError:
                pass
            self._sock.close()
        if self._thread:
            self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            peer = peer_of(conn)
            why = self._take_slot(peer)
            if why:
                conn.settimeout(0.5)  # the refusal must not block the accept loop
                self._reply(conn, {"ok": False, "error": why})
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn, peer), name="control-conn", daemon=True).start()

    def _is_trusted(self, peer: Peer | None) -> bool:
        return peer is not None and peer.uid in (0, self.owner_uid)

    def _take_slot(self, peer: Peer | None) -> str:
        """'' when `peer` may hold one more connection now (and it is counted), else why not."""
        uid = peer.uid if peer is not None else -1
        with self._slots_lock:
            total = sum(self._held.values())
            if self._is_trusted(peer):
                if total >= MAX_CONNECTIONS:
                    return "too many connections; try again"
            else:
                others = sum(n for u, n in self._held.items() if u not in (0, self.owner_uid))
                if self._held.get(uid, 0) >= MEMBER_PER_UID:
                    return f"too many connections from uid {uid} (at most {MEMBER_PER_UID} at once); try again"
                if others >= MAX_CONNECTIONS - ROOT_RESERVED or total >= MAX_CONNECTIONS:
                    return "too many connections; try again"
            self._held[uid] = self._held.get(uid, 0) + 1
            return ""

    def _give_slot(self, peer: Peer | None) -> None:
        uid = peer.uid if peer is not None else -1
        with self._slots_lock:
            n = self._held.get(uid, 0) - 1
            if n > 0:
                self._held[uid] = n
            else:
                self._held.pop(uid, None)

    def _handle(self, conn: socket.socket, peer: Peer | None = None) -> None:
        try:
            try:
                reply = self._dispatch(self._read(conn), peer)
            except Exception as e:  # noqa: BLE001 - every request gets an answer, even one we did not foresee
                log.exception("control_request_failed")
                reply = {"ok": False, "error": f"request could not be handled: {type(e).__name__}"}
            self._reply(conn, reply)
        except Exception:  # noqa: BLE001 - the server must outlive any request
            log.exception("control_connection_failed")
        finally:
            conn.close()
            self._give_slot(peer)

    def _read(self, conn: socket.socket) -> bytes | dict:
        import time

        deadline = time.monotonic() + READ_TIMEOUT
        buf = bytearray()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                conn.settimeout(left)  # the whole request within READ_TIMEOUT, not each read
                chunk = conn.recv(8192)
            except TimeoutError:
                return {"ok": False, "error": f"request not complete within {READ_TIMEOUT:g}s"}
            except OSError as e:
                return {"ok": False, "error": f"read failed: {e}"}
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_REQUEST:
                return {"ok": False, "error": f"request larger than {MAX_REQUEST} bytes"}
        return bytes(buf)

    def _dispatch(self, raw: bytes | dict, peer: Peer | None = None) -> dict:
        if isinstance(raw, dict):
            return raw
        line = raw.split(b"\n", 1)[0]
        if not line.strip():
            return {"ok": False, "error": "empty request"}
        try:
            req = json.loads(line.decode("utf-8"))
        except RecursionError:  # `[` x 60000 fits in MAX_REQUEST and exhausts the decoder's stack
            return {"ok": False, "error": "request is not JSON we accept: nested too deeply"}
        except UnicodeDecodeError as e:
            return {"ok": False, "error": f"request is not JSON: {e}"}
        except ValueError as e:  # JSONDecodeError, and an integer of more than 4300 digits
            return {"ok": False, "error": f"request is not JSON: {str(e)[:200]}"}
        if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
            return {"ok": False, "error": 'request must be an object with a string "cmd"'}
        args = req.get("args", {})
        if not isinstance(args, dict):
            return {"ok": False, "error": '"args" must be an object'}
        fn = self.handlers.get(req["cmd"])
        if fn is None:
            return {"ok": False, "error": f"unknown command {req['cmd'][:40]!r}; known: {', '.join(sorted(self.handlers))}"}
        why = refusal(req["cmd"], peer, self.member_commands, self.owner_uid)
        if why is not None:
            log.warning("control_refused", cmd=req["cmd"], peer_uid=peer.uid if peer else None,
                        peer_pid=peer.pid if peer else None)
            return {"ok": False, "error": why}
        if self.member_commands is not None and req["cmd"] not in self.member_commands:
            log.info("control_command", cmd=req["cmd"], peer_uid=peer.uid if peer else None,
                     peer_pid=peer.pid if peer else None)
        # what goes back is shown (and socket_group members may ask): keys and tokens in commands,
        # URLs and errors are masked
        try:
            # a handler that acts for its caller (`run`: their folder and environment) is told who
            # the kernel says is calling, never who the request claims to be
            out = fn(args, peer) if getattr(fn, "wants_peer", False) else fn(args)
            return {"ok": True, "result": redact_obj(out)}
        except RequestError as e:
            return {"ok": False, "error": redact(str(e))}
        except Exception as e:  # noqa: BLE001
            log.exception("control_handler_failed", cmd=req["cmd"])
            return {"ok": False, "error": redact(f"internal error in {req['cmd']}: {type(e).__name__}: {e}")}

    @staticmethod
    def _reply(conn: socket.socket, reply: dict) -> None:
        try:
            data = json.dumps(reply, default=str).encode()
        except (ValueError, TypeError, RecursionError) as e:  # a result that cannot be sent as JSON
            log.error("control_reply_unserializable", error=f"{type(e).__name__}: {e}")
            data = json.dumps({"ok": False, "error": f"the reply could not be encoded: {type(e).__name__}"}).encode()
        try:
            conn.sendall(data + b"\n")
        except OSError:
            pass
