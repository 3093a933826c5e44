"""Hostile use of the real daemon: a socket_group member who is not root, garbage on the socket.

The member is a real second uid made here with useradd (root only; skipped with the reason
otherwise) and drives the real supervisorctl over the real socket."""

from __future__ import annotations

import grp
import io
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.cli import main as cli
from tests.fixtures.daemon import DaemonProc
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a second user and group (useradd/groupadd) and drops to them")
    for tool in ("useradd", "groupadd", "userdel", "groupdel"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} to create a second user")


class Member:
    def __init__(self, name: str, group: str):
        self.name, self.group = name, group
        pw = pwd.getpwnam(name)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        self.group_gid = grp.getgrnam(group).gr_gid

    def call(self, fn: Callable[[], int], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run fn in a forked child that became this user (uid, gid, groups): the interpreter lives
        under /root, which a second user cannot exec, so the child keeps the one already loaded.
        What it writes to sys.stdout/sys.stderr comes back, like subprocess.run's."""
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            rc = 99
            try:
                os.setgroups([self.group_gid])
                os.setgid(self.gid)
                os.setuid(self.uid)
                sys.stdout = io.TextIOWrapper(os.fdopen(os.dup(out.fileno()), "wb"), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(err.fileno()), "wb"), write_through=True)
                rc = fn()
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException as e:  # noqa: BLE001 - reported to the parent, never raised in a fork
                try:
                    os.write(err.fileno(), f"child failed: {type(e).__name__}: {e}".encode())
                finally:
                    rc = 98
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(rc)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError(f"{fn} as {self.name} did not finish within {timeout}s")
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([], os.waitstatus_to_exitcode(status),
                                           out.read().decode(), err.read().decode())


def _group_access_broken(m: Member) -> str:
    """Independent of the product: a 0660 root:group socket in a 0750 root:group folder, connected to
    by the member. Some sandboxes (a chroot under another tool's namespaces) do not honour the group
    of a forked child; there the socket tests below cannot say anything about our code."""
    import socket as _socket

    d = Path(tempfile.mkdtemp(prefix="tsv-grp-"))
    try:
        os.chmod(d, 0o755)
        inner = d / "run"
        inner.mkdir(mode=0o750)
        os.chown(inner, 0, m.group_gid)
        path = str(inner / "probe.sock")
        srv = _socket.socket(_socket.AF_UNIX)
        srv.bind(path)
        srv.listen(1)
        os.chown(path, 0, m.group_gid)
        os.chmod(path, 0o660)

        def probe() -> int:
            c = _socket.socket(_socket.AF_UNIX)
            try:
                c.connect(path)
            except OSError as e:
                sys.stderr.write(str(e))
                return 1
            finally:
                c.close()
            return 0

        r = m.call(probe, timeout=20)
        srv.close()
        return "" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def member():
    """A fresh user `tsu-XXXX` in a fresh group `tsg-XXXX` (the socket_group), removed afterwards."""
    _need_root()
    tag = secrets.token_hex(3)
    group, name = f"tsg-{tag}", f"tsu-{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", group, name],
                       check=True, capture_output=True)
        try:
            m = Member(name, group)
            why = _group_access_broken(m)
            if why:
                pytest.skip(f"this machine does not give a forked second user its group's access: {why}")
            yield m
        finally:
            subprocess.run(["userdel", name], capture_output=True)
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


@pytest.fixture
def open_dir():
    """A folder the second user can walk into (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="tsv-sec-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def group_daemon(member, open_dir):
    made: list[DaemonProc] = []

    def factory(**training) -> DaemonProc:
        work = open_dir / "work"
        work.mkdir(exist_ok=True)
        work.chmod(0o777)
        cfg = {"socket_group": member.group,
               "training": {"command": "sleep 300", "workdir": str(work), "on_finish": "none", **training},
               "gpu": {"nvml_library": str(open_dir / "no-such-libnvidia-ml.so.1")},
               "stop": {"action": "dry-run"}}
        d = DaemonProc(open_dir / f"d{len(made)}", cfg)
        (open_dir / f"d{len(made)}").chmod(0o755)
        made.append(d)
        d.start()
        return d

    yield factory
    for d in made:
        d.cleanup()


def ctl(member: Member, d: DaemonProc, *args: str) -> subprocess.CompletedProcess:
    return member.call(lambda: cli.main(["--socket", d.socket, *args]))


def test_member_reads_and_nudges_but_never_starts_a_process_as_root(member, group_daemon, open_dir):
    d = group_daemon()
    sock = Path(d.socket)
    assert sock.stat().st_gid == member.group_gid and oct(sock.stat().st_mode & 0o777) == "0o660"

    st = ctl(member, d, "status", "--json")
    assert st.returncode == 3, st.stderr  # readable, and nothing runs yet
    assert json.loads(st.stdout)["training"]["state"] == "STOPPED"
    assert ctl(member, d, "alerts").returncode == 0
    r = ctl(member, d, "keepalive", "1h")
    assert r.returncode == 0, r.stderr
    assert d.status()["idle"]["keepalive_until"]
    assert ctl(member, d, "keepalive", "--cancel").returncode == 0
    r = ctl(member, d, "sync")
    assert r.returncode == 0 and "sync requested" in r.stdout, r.stderr

    proof = open_dir / "work" / "ran-as-root"
    for verb in (["run", "--", "sh", "-c", f"id > {proof}"], ["start"], ["restart"]):
        r = ctl(member, d, *verb)
        assert r.returncode == 1, (verb, r.stdout, r.stderr)
        assert f"refused for uid {member.uid} ({member.name})" in r.stderr, r.stderr
        assert "only root" in r.stderr and "status" in r.stderr and "keepalive" in r.stderr
    assert d.status()["training"]["state"] == "STOPPED"
    assert not proof.exists()
    assert "control_refused" in d.log_text()

    # root may; then the member may not stop it either (stop ends someone's training)
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")
    r = ctl(member, d, "stop", "--no-wait")
    assert r.returncode == 1 and "refused" in r.stderr, r.stderr
    assert d.status()["training"]["state"] == "RUNNING"
    r = ctl(member, d, "attach")
    assert r.returncode == 1 and "attach is for root only" in r.stderr, r.stderr

    # the state folder is the group's to enter (the default log is there), its files are root's
    assert d.state_dir.stat().st_gid == member.group_gid and d.state_dir.stat().st_mode & 0o777 == 0o750
    wait_until(lambda: "train-supervisor run 1 started" in ctl(member, d, "tail", "-n", "5").stdout, 10,
               what="the member's tail of the default log")
    r = member.call(lambda: len(open(d.state_dir / "training.json").read()))
    assert r.returncode == 98 and "PermissionError" in r.stderr, r


def test_member_speaking_the_protocol_directly_is_refused_too(member, group_daemon):
    """The refusal is the daemon's (from the kernel's peer credentials), not the CLI's."""
    d = group_daemon()
    def speak() -> int:
        s = socket.socket(socket.AF_UNIX)
        s.connect(d.socket)
        s.sendall(json.dumps({"cmd": "run", "args": {"argv": ["id"], "uid": 0}}).encode() + b"\n")
        sys.stdout.write(s.makefile().readline())
        return 0
    r = member.call(speak)
    reply = json.loads(r.stdout)
    assert reply["ok"] is False and "only root" in reply["error"], r
    assert d.status()["training"]["state"] == "STOPPED"


def test_training_user_runs_the_job_as_that_user_with_its_own_groups(member, group_daemon, open_dir):
    d = group_daemon(user=member.name, command="id -u; id -g; id -G; echo HOME=$HOME; sleep 300")
    r = d.ctl("start")
    assert r.returncode == 0, r.stderr
    d.wait_training("RUNNING")
    log = Path(d.status()["training"]["log"])

    def ids():
        lines = [x for x in log.read_text().splitlines() if x and not x.startswith("=====")]
        return lines if len(lines) >= 4 else None
    uid, gid, groups, home = wait_until(ids, 20, what="the job's id output")[:4]
    assert int(uid) == member.uid
    assert int(gid) == member.gid != 0
    assert "0" not in groups.split() and str(member.group_gid) in groups.split()
    assert home == f"HOME={pwd.getpwnam(member.name).pw_dir}"


def test_deeply_nested_request_to_the_real_daemon_gets_an_error_reply(make_daemon, tmp_path):
    d = make_daemon({"stop": {"action": "dry-run"},
                     "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")}})
    for payload, needle in ((b"[" * 60000 + b"\n", "nested too deeply"),
                            (b'{"cmd": "status", "args": {"n": ' + b"9" * 5000 + b"}}\n", "not JSON"),
                            (b'{"cmd": "keepalive", "args": {"duration": ' + b"[" * 20000 + b"\n",
                             "nested too deeply")):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        c.connect(d.socket)
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        reply = json.loads(c.makefile("rb").readline())
        c.close()
        assert reply["ok"] is False and needle in reply["error"], reply
    assert d.req("ping")["pong"] is True


HF = "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNm01234567"


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_secrets_are_not_shown_logged_or_readable(make_daemon, tmp_path):
    secret = "S3cr3tV4lueX"
    env_secret = "EnvS3cr3tZZ"
    d = make_daemon({
        "training": {"command": f"HF_TOKEN={HF} sh -c 'echo started; sleep 300' x --api-key {secret}",
                     "workdir": str(tmp_path), "on_finish": "none", "env": {"WANDB_API_KEY": env_secret}},
        "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")},
        "stop": {"action": "dry-run"}})
    assert d.ctl("start").returncode == 0
    tr = d.wait_training("RUNNING")
    log = Path(tr["log"])
    wait_until(lambda: "started" in log.read_text(), 20, what="the job's first line")
    text = log.read_text()
    assert "--api-key ***" in text and "HF_TOKEN=***" in text  # the runner's banner
    shown = [text, d.ctl("status", "--json").stdout, d.ctl("status").stdout, d.ctl("alerts", "--json").stdout,
             json.dumps(d.status())]
    run_dir = d.state_dir / "runs" / "1"
    assert d.ctl("stop").returncode == 0  # it waits for the end
    r = d.ctl("run", "--", "sh", "-c", "sleep 300", "x", "--token", secret, f"--hub_token={HF}")
    assert r.returncode == 0, r.stderr
    shown.append(r.stdout + r.stderr)
    st = d.status()
    assert st["training"]["command"].endswith("--token *** --hub_token=***"), st["training"]["command"]
    shown.append(json.dumps(st))
    assert d.ctl("stop").returncode == 0
    shown.append(d.log_text())  # the journal
    assert "--api-key ***" in d.log_text()  # training.py logs the command; the log processor masks it
    for what in shown:
        for s in (secret, HF, env_secret):
            assert s not in what, (s, what[-2000:])

    # the files that do hold them are root's alone
    assert _mode(d.state_dir) == 0o700
    for p in (d.state_dir / "training.json", d.state_dir / "idle.json", d.state_dir / ".reserve",
              run_dir / "spec.json", run_dir / "pid", run_dir / "exit.json"):
        assert _mode(p) == 0o600, (p, oct(_mode(p)))
    assert env_secret in (run_dir / "spec.json").read_text()  # it is there, for the runner only


def test_older_0644_state_files_are_narrowed_at_start(make_daemon, tmp_path):
    d = make_daemon({"stop": {"action": "dry-run"},
                     "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")}}, start=False)
    old = d.state_dir / "runs" / "3"
    old.mkdir(parents=True)
    (old / "spec.json").write_text('{"env": {"HF_TOKEN": "x"}}')
    (old / "spec.json").chmod(0o644)
    (d.state_dir / "alerts.jsonl").write_text("{}\n")
    (d.state_dir / "alerts.jsonl").chmod(0o644)
    (d.state_dir / "train.log").write_text("log\n")
    (d.state_dir / "train.log").chmod(0o644)
    d.state_dir.chmod(0o755)
    d.start()
    assert _mode(d.state_dir) == 0o700
    assert _mode(old / "spec.json") == 0o600 and _mode(d.state_dir / "alerts.jsonl") == 0o600
    assert _mode(d.state_dir / "train.log") == 0o644  # the log keeps its mode: tail is the group's
