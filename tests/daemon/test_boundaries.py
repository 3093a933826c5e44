"""Holes from outside (issue 23, items 1 and 2): a real second uid against the real daemon.

1. The training user (useradd) swaps its log for a symlink to a root-only file and exits 1; the
   restart must not have root append through the link, and the daemon must not read through it.
2. A socket_group member trickling 40 connections must not lock root out of the control socket.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.daemon.test_security import Member, group_daemon, member, open_dir  # noqa: F401 - fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_training_user_cannot_make_root_write_through_a_symlinked_log(member, group_daemon, open_dir):  # noqa: F811 - fixtures from test_security
    ws = open_dir / "ws"                       # the user's /workspace
    ws.mkdir()
    os.chown(ws, member.uid, member.gid)
    vault = open_dir / "rootonly"
    vault.mkdir(mode=0o700)
    target = vault / "authorized_keys"
    before = "ssh-ed25519 AAAA root@owner\nCUDA out of memory. Tried to allocate 2.00 GiB\n"
    target.write_text(before)
    log = ws / "train.log"
    # run 1: replace the root-made log with a link and fail; run 2 (the restart) would print a key
    cmd = f"if [ -L {log} ]; then echo ssh-ed25519 PWNED; sleep 300; fi; ln -sf {target} {log}; exit 1"
    d = group_daemon(user=member.name, command=cmd, log=str(log), restart="on-failure",
                     restart_backoff="1s", max_restarts=1)

    r = d.ctl("check-config")   # the user's own folder: nobody else can write it
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    ws.chmod(0o777)             # now anyone can swap the log
    r = d.ctl("check-config")
    assert r.returncode == 0 and "warning: training.log" in r.stderr and str(ws) in r.stderr, r.stderr
    ws.chmod(0o755)

    assert d.ctl("start").returncode == 0
    wait_until(lambda: log.is_symlink(), 20, what="the job's symlink")

    def restarted():
        tr = d.status()["training"]
        return tr if tr["restarts"] >= 1 and tr["state"] not in ("STARTING", "RUNNING", "BACKOFF") else None
    tr = wait_until(restarted, 30, interval=0.2, what="the restart to end")
    assert tr["exit_code"] == 127, tr           # the runner refused to open the log
    assert target.read_text() == before           # nothing of the job's reached root's file
    assert target.stat().st_uid == 0 and oct(vault.stat().st_mode & 0o777) == "0o700"
    text = d.log_text()
    assert "log_unsafe" in text                   # the follower refused the link too ...
    alerts = d.req("alerts", {"n": 50})
    assert not [a for a in alerts["recent"] + alerts["active"] if "out of memory" in json.dumps(a).lower()]


def _as(m: Member, fn) -> tuple[int, int]:
    """fork a child that becomes the member and runs fn(write_end); (pid, read end of its pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        rc = 1
        try:
            os.close(r)
            os.setgroups([m.group_gid])
            os.setgid(m.gid)
            os.setuid(m.uid)
            fn(w)
            rc = 0
        finally:
            os._exit(rc)
    os.close(w)
    return pid, r


def test_a_trickling_member_cannot_lock_root_out_of_the_socket(member, group_daemon):  # noqa: F811 - fixtures from test_security
    d = group_daemon()
    path = d.socket
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")

    def trickle(w: int) -> None:
        t0 = time.monotonic()
        conns = []
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2)
            try:
                s.connect(path)
                s.sendall(b"{")
                conns.append(s)
            except OSError:
                s.close()
        os.write(w, b"ready\n")
        open_until: dict[int, float] = {}
        last = 0.0
        while conns and time.monotonic() - t0 < 20:
            if time.monotonic() - last >= 1.0:   # one byte a second: well inside any per-read timeout
                last = time.monotonic()
                for s in list(conns):
                    try:
                        s.send(b" ")
                    except OSError:
                        pass
            ready, _, _ = select.select(conns, [], [], 0.2)
            for s in ready:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                open_until[s.fileno()] = time.monotonic() - t0
                if not data or data.endswith(b"\n"):
                    conns.remove(s)
                    s.close()
        os.write(w, json.dumps({"still_open": len(conns), "longest": max(open_until.values(), default=0)})
                 .encode() + b"\n")

    pid, r = _as(member, trickle)
    f = os.fdopen(r, "rb")
    try:
        assert f.readline() == b"ready\n"
        t0 = time.monotonic()
        for verb in (["status"], ["keepalive", "1h"], ["keepalive", "--cancel"], ["stop", "--no-wait"]):
            res = d.ctl(*verb, timeout=20)
            assert res.returncode == 0, (verb, res.returncode, res.stdout, res.stderr)
            assert "Traceback" not in res.stderr, res.stderr
        root_s = time.monotonic() - t0
        assert root_s < 8, f"root's four commands took {root_s:.1f}s"
        report = json.loads(f.readline())
        # the whole-request deadline (5 s) cuts every trickler, whatever it sends
        assert report["still_open"] == 0 and report["longest"] < 8, report
    finally:
        f.close()
        os.waitpid(pid, 0)


def test_cli_says_one_line_when_the_connection_breaks(tmp_path):
    """A socket that accepts and drops the connection: one line, exit 4, no traceback."""
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(8)
    import threading

    def drop() -> None:
        for _ in range(2):
            try:
                c, _ = srv.accept()
            except OSError:  # the test closed the server: the CLI asked once, not twice
                return
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            c.close()
    t = threading.Thread(target=drop, daemon=True)
    t.start()
    import subprocess

    res = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "--socket", path, "status"],
                         capture_output=True, text=True, timeout=20,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    srv.close()
    assert res.returncode in (1, 4) and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("supervisorctl: "), res.stderr
