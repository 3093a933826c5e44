"""The control socket against garbage, oversized, half-sent and concurrent requests."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest

from supervisor.daemon.control import MAX_REQUEST, ClientError, ControlServer, RequestError, request
from tests.waiting import wait_until


@pytest.fixture
def server(tmp_path):
    release = threading.Event()
    calls = []

    def boom(a):
        raise ValueError("handler bug")

    def refuse(a):
        raise RequestError("cannot do that now")

    def slow(a):
        release.wait(10)
        return "slow done"

    def circular(a):
        loop: list = []
        loop.append(loop)
        return loop

    handlers = {"echo": lambda a: (calls.append(a), a)[1], "boom": boom, "refuse": refuse, "slow": slow,
                "circular": circular}
    path = str(tmp_path / "ctl.sock")
    s = ControlServer(path, handlers)
    s.start()
    s.release = release
    yield s
    release.set()
    s.close()


def raw(path: str, data: bytes, shutdown: bool = True, timeout: float = 10) -> dict:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(timeout)
    c.connect(path)
    try:
        c.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    if shutdown:
        c.shutdown(socket.SHUT_WR)
    buf = b""
    while True:
        try:
            chunk = c.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
    c.close()
    return json.loads(buf)


def test_socket_mode_is_0660(server):
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o660


def test_roundtrip(server):
    assert request(server.path, "echo", {"x": 1}) == {"x": 1}


@pytest.mark.parametrize("payload, needle", [
    (b"\n", "empty request"),
    (b"not json at all\n", "not JSON"),
    (b"\xff\xfe\x00garbage\n", "not JSON"),
    (b"[1,2,3]\n", "must be an object"),
    (b'{"cmd": 5}\n', "must be an object with a string"),
    (b'{"cmd": "echo", "args": [1]}\n', '"args" must be an object'),
    (b'{"cmd": "nope"}\n', "unknown command"),
    (b'{"cmd": "' + b"x" * 5000 + b'"}\n', "unknown command"),
    (b'{"cmd": "echo"', "not JSON"),  # half-sent, then closed
    (b"[" * 60000 + b"\n", "nested too deeply"),  # RecursionError in the decoder, once a silent hang-up
    (b'{"cmd": "echo", "args": {"a": ' + b"[" * 30000 + b"\n", "nested too deeply"),
    (b'{"cmd": "echo", "args": {"n": ' + b"1" * 5000 + b"}}\n", "not JSON"),  # int past Python's digit limit
    (b"\xef\xbb\xbf{}\n", "not JSON"),  # a UTF-8 byte order mark
    (b'{"cmd": "echo", "args": {"a": NaN, "b": [}\n', "not JSON"),
])
def test_garbage_gets_an_error_reply(server, payload, needle):
    reply = raw(server.path, payload)
    assert reply["ok"] is False and needle in reply["error"]
    assert request(server.path, "echo", {"alive": True}) == {"alive": True}


def test_oversized_request_is_refused(server):
    reply = raw(server.path, b'{"cmd": "echo", "args": {"a": "' + b"x" * (MAX_REQUEST * 2) + b'"}}\n')
    assert reply["ok"] is False and "larger than" in reply["error"]
    assert request(server.path, "echo", {}) == {}


def test_half_sent_request_times_out_without_blocking_others(server, monkeypatch):
    import supervisor.daemon.control as control

    monkeypatch.setattr(control, "READ_TIMEOUT", 0.5)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(server.path)
    c.sendall(b'{"cmd": "ec')  # and then nothing
    assert request(server.path, "echo", {"meanwhile": 1}) == {"meanwhile": 1}
    c.settimeout(5)
    reply = json.loads(c.recv(65536))
    assert reply["ok"] is False and "not complete" in reply["error"]
    c.close()


def test_handler_exception_is_an_error_reply_and_server_survives(server):
    with pytest.raises(RequestError, match="internal error in boom: ValueError: handler bug"):
        request(server.path, "boom")
    with pytest.raises(RequestError, match="cannot do that now"):
        request(server.path, "refuse")
    assert request(server.path, "echo", {"ok": 1}) == {"ok": 1}


def test_a_reply_that_cannot_be_encoded_is_an_error_reply(server):
    reply = raw(server.path, b'{"cmd": "circular"}\n')
    assert reply["ok"] is False and "could not be encoded" in reply["error"]
    assert request(server.path, "echo", {"after": 1}) == {"after": 1}


def test_slow_request_does_not_block_status(server):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("slow", request(server.path, "slow", timeout=20)))
    t.start()
    for _ in range(5):
        assert request(server.path, "echo", {"n": 1}) == {"n": 1}
    server.release.set()
    t.join(10)
    assert result["slow"] == "slow done"


def test_many_garbage_connections_in_a_row(server):
    for _ in range(200):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        wait_until(lambda c=c: c.connect_ex(server.path) == 0, 5)
        c.sendall(os.urandom(64))
        c.close()
    def answered():
        try:
            return request(server.path, "echo", {"i": 1}) == {"i": 1}
        except (RequestError, ClientError):  # busy while the garbage drains is fine
            return False
    wait_until(answered, 10)


def test_client_errors_and_exit_codes(tmp_path, server):
    with pytest.raises(ClientError) as e:
        request(str(tmp_path / "missing.sock"), "status")
    assert e.value.exit_code == 4 and "no socket" in str(e.value)
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a dead daemon leaves
    with pytest.raises(ClientError) as e:
        request(str(stale), "status")
    assert e.value.exit_code == 1 and "not running" in str(e.value)
    notsock = tmp_path / "file"
    notsock.write_text("x")
    with pytest.raises(ClientError) as e:
        request(str(notsock), "status")
    assert e.value.exit_code == 1


def test_permission_denied_message(tmp_path, server):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.chmod(os.path.dirname(server.path), 0o755)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody and knock
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            try:
                request(server.path, "echo")
                msg = "0 connected"
            except ClientError as e:
                msg = f"{e.exit_code} {e}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = os.read(r, 4096).decode()
    os.close(r)
    assert out.startswith("1 ") and "permission denied" in out


def test_second_server_on_live_socket_refuses(server):
    other = ControlServer(server.path, {})
    with pytest.raises(RuntimeError, match="already serving"):
        other.start()
    assert request(server.path, "echo", {}) == {}


def test_stale_socket_file_is_replaced(tmp_path):
    path = tmp_path / "ctl.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    srv = ControlServer(str(path), {"echo": lambda a: a})
    srv.start()
    try:
        assert request(str(path), "echo", {"k": 2}) == {"k": 2}
    finally:
        srv.close()


def test_refusal_rules():
    from supervisor.daemon.control import Peer, refusal

    members = {"status", "ping"}
    assert refusal("run", Peer(1, 0, 0), members, owner_uid=0) is None  # root
    assert refusal("run", Peer(1, 1234, 1234), members, owner_uid=1234) is None  # the daemon's own user
    assert refusal("status", Peer(1, 4321, 4321), members, owner_uid=0) is None
    assert refusal("run", Peer(1, 4321, 4321), None, owner_uid=0) is None  # no restriction asked for
    why = refusal("run", Peer(1, 4321, 4321), members, owner_uid=0)
    assert why is not None and "uid 4321" in why and "only root" in why and "status, tail" in why
    assert "ping" not in why.split("use:")[1]
    # the kernel did not say who: never treated as root
    assert "did not report" in (refusal("run", None, members, owner_uid=0) or "")


def test_server_reads_the_peer_and_applies_member_commands(tmp_path):
    path = str(tmp_path / "m.sock")
    srv = ControlServer(path, {"status": lambda a: "s", "run": lambda a: "ran"}, member_commands={"status"})
    srv.start()
    try:
        # this process is the daemon's own user (and root in CI containers): everything is allowed
        assert request(path, "run") == "ran"
        srv.owner_uid = -1  # pretend the daemon runs as someone else
        if os.geteuid() != 0:
            with pytest.raises(RequestError, match="only root"):
                request(path, "run")
        assert request(path, "status") == "s"
    finally:
        srv.close()


def test_supervisorctl_status_imports_nothing_it_does_not_use(tmp_path):
    """`supervisorctl status` finds the socket with tomllib and talks to it with the client alone: no
    logger, no server, no config schema, no wing (issue 41: its start-up was 0.14 s, now about 0.08 s)."""
    import socket as so
    import subprocess
    import sys
    import threading

    path = str(tmp_path / "s.sock")
    (tmp_path / "cfg.toml").write_text(f'socket = "{path}"\n')
    srv = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b'{"ok": true, "result": {"training": {"state": "RUNNING"}}}')

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    code = (f"import sys, supervisor.cli.main as c; rc = c.main(['--config', {str(tmp_path / 'cfg.toml')!r}, 'status', "
            "'--json']); print('@@', rc, ' '.join(sorted(sys.modules)))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        srv.close()
    rc, loaded = r.stdout.split("@@ ", 1)[1].split(" ", 1)
    assert rc == "0" and '"RUNNING"' in r.stdout, r.stdout + r.stderr
    heavy = {"structlog", "supervisor.daemon.control", "supervisor.config", "supervisor.config.schema", "supervisor.daemon.main",
             "supervisor.sync", "asyncio", "boto3", "psutil"}
    assert not heavy & set(loaded.split()), sorted(heavy & set(loaded.split()))
