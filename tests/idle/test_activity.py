"""Each activity probe against the real thing: sshd on loopback, tmux, a Jupyter Server with a
token and a real kernel, the fake NVML through the real GpuMonitor, real files and processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import structlog

from supervisor.idle import activity
from supervisor.idle.activity import (
    CpuProbe,
    GpuProbe,
    JupyterProbe,
    OutputProbe,
    probe_ssh,
    probe_tmux,
    safe,
)
from tests.fixtures.smtp import free_port
from tests.waiting import wait_until


def _ttys() -> set[str]:
    return {s["tty"] for s in activity.ssh_sessions()}


# --- SSH -----------------------------------------------------------------------------------------
def test_ssh_login_is_seen_on_the_very_next_probe_and_gone_after_logout(sshd):
    import psutil

    psutil.Process().terminal()  # fills psutil's memoized /dev map: a probe relying on it goes blind
    before = _ttys()
    assert not any(s for s in activity.ssh_sessions() if s["tty"] not in before)
    login = sshd.login()
    # no cache: the first probe after the login sees it (the bug that stopped a cluster under its user)
    new = wait_until(lambda: [s for s in activity.ssh_sessions() if s["tty"] not in before], 15,
                     what="the new ssh session")
    assert new[0]["user"] == "root" and new[0]["host"] == "127.0.0.1" and new[0]["tty"].startswith("pts/")
    active, reason = probe_ssh()
    assert active and f"ssh: root from 127.0.0.1 ({new[0]['tty']})" in reason
    login.terminate()
    wait_until(lambda: _ttys() == before, 15, what="the session gone")
    if not before:
        assert probe_ssh() == (False, "ssh: nobody logged in")


def test_ssh_tunnel_without_terminal_is_not_a_person(sshd):
    before = _ttys()
    t = sshd.tunnel()
    # the tunnel is up when sshd holds an established connection for it
    wait_until(lambda: any(c.status == "ESTABLISHED" and c.raddr and c.raddr.port == sshd.port
                           for c in __import__("psutil").net_connections("tcp")), 15, what="tunnel connected")
    assert _ttys() == before
    t.terminate()


def _server_side(sshd, client: int) -> set[int]:
    """The sshd processes holding the other end of `client`'s connection (other tests may use sshd
    on this machine at the same time)."""
    import psutil

    conns = [c for c in psutil.net_connections("tcp") if c.status == "ESTABLISHED" and c.raddr]
    ports = {c.laddr.port for c in conns if c.pid == client and c.raddr.port == sshd.port}
    return {c.pid for c in conns if c.laddr.port == sshd.port and c.raddr.port in ports}


def _ours(sshd, client: subprocess.Popen, kind: str, **kw) -> list[dict]:
    import psutil

    def under(pid: int) -> set[int]:
        try:
            return {pid} | {p.pid for p in psutil.Process(pid).parents()}
        except psutil.Error:
            return set()
    theirs = _server_side(sshd, client.pid)
    return [s for s in activity.ssh_sessions(**kw) if s["kind"] == kind and under(s["pid"]) & theirs]


def _processes_running(*argv: str) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if tuple(p.info["cmdline"] or ()) == argv]


def test_an_editor_session_without_a_terminal_holds_the_machine_until_its_window_closes(sshd):
    """VS Code Remote-SSH, Cursor, JetBrains Gateway: a shell over SSH without a terminal starts the
    editor's server detached (setsid: re-parented to init, owning its own pty) and stays, waiting on
    its input, for as long as the editor window is open."""
    import psutil

    marker = f"3600.{uuid.uuid4().int % 10**6}"  # the "editor server": a sleep nobody else runs
    editor = ("script", "-qfc", f"sleep {marker}", "/dev/null")
    client = sshd.session(f"setsid -f {' '.join(editor[:2])} 'sleep {marker}' /dev/null </dev/null >/dev/null 2>&1;"
                          " exec cat")
    server: list[int] = []
    try:
        # (root's ~/.bashrc runs first, sometimes slowly: the command is `bash -c ...` until it execs cat)
        found = wait_until(lambda: _ours(sshd, client, "session"), 60, what="the editor's ssh session")
        assert found[0]["host"] == "127.0.0.1" and found[0]["command"] in ("bash", "cat")
        # (script forks the sleep after it starts: wait for the pair, not for the first of them)
        server = wait_until(lambda: (lambda both: both if len(both) == 2 else [])(
            _processes_running(*editor) + _processes_running("sleep", marker)), 60,
            what="the detached editor server and its child")
        p = psutil.Process(server[1])
        assert not any(a.name() in activity.SSH_SERVERS for a in p.parents()), "it must run detached"
        # (read from /proc: psutil's terminal() map is memoized, see the first test)
        assert activity._proc_table()[p.pid]["tty"] in activity._pts_devices(), "it owns a pty of its own"
        wait_until(lambda: [s for s in _ours(sshd, client, "session") if s["command"] == "cat"], 60,
                   what="the shell waiting on its input, as the editor's does")
        active, reason = probe_ssh()
        assert active and "ssh: root from 127.0.0.1 (no terminal: cat)" in reason
        assert not [s for s in activity.ssh_sessions() if s["tty"] and s["pid"] in server]
        # the window closes: the connection ends, the lingering server is nobody
        client.terminate()
        client.wait(10)
        wait_until(lambda: not any(s["pid"] == found[0]["pid"] for s in activity.ssh_sessions()), 15,
                   what="the session gone")
        assert psutil.pid_exists(server[0])
    finally:
        client.kill()
        for pid in server or _processes_running(*editor) + _processes_running("sleep", marker):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def test_a_bare_tunnel_counts_only_when_asked_and_a_login_is_never_a_tunnel(sshd):
    import psutil

    t = sshd.tunnel()
    login = sshd.login()

    try:
        mine = wait_until(lambda: _ours(sshd, t, "tunnel", count_tunnels=True), 15, what="the tunnel seen")
        assert all(s["kind"] != "tunnel" for s in activity.ssh_sessions())
        assert activity.describe_session(mine[0]) == "ssh: root from 127.0.0.1 (tunnel, no session)"
        shell = wait_until(lambda: [s for s in activity.ssh_sessions() if s["kind"] == "pty"
                                    and s["host"] == "127.0.0.1"], 15, what="the login")
        above = {p.pid for p in psutil.Process(shell[0]["pid"]).parents()}
        assert not [s for s in activity.ssh_sessions(count_tunnels=True) if s["kind"] == "tunnel"
                    and s["pid"] in above], "the login's connection carries a session: not a tunnel"
    finally:
        t.terminate()
        login.terminate()


def test_stale_utmp_entries_do_not_count(monkeypatch):
    """This container has no utmp, so the records are handed in; their shape is psutil's."""
    import collections

    import psutil

    suser = collections.namedtuple("suser", ["name", "terminal", "host", "started", "pid"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    fake = [suser("ghost", "pts/77", "10.9.9.9", time.time() - 86400, dead.pid),
            suser("alice", "pts/78", "10.0.0.5", time.time(), os.getpid())]
    monkeypatch.setattr(psutil, "users", lambda: fake)
    sessions = {s["tty"]: s for s in activity.ssh_sessions()}
    assert "pts/77" not in sessions
    assert sessions["pts/78"]["user"] == "alice"
    assert "ssh: alice from 10.0.0.5 (pts/78)" in probe_ssh()[1]


# --- tmux ----------------------------------------------------------------------------------------
@pytest.fixture
def tmux_session(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    sock = str(tmp_path / f"tmux-{uuid.uuid4().hex[:8]}.sock")
    subprocess.run(["tmux", "-S", sock, "new-session", "-d", "-s", "train", "sleep 600"], check=True)
    yield sock
    subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)


def attach(sock: str) -> subprocess.Popen:
    """A tmux client on a terminal of its own, as `supervisorctl attach` gives one."""
    master, slave = os.openpty()
    p = subprocess.Popen(["tmux", "-S", sock, "attach-session", "-t", "=train"], stdin=slave, stdout=slave,
                         stderr=slave, env={**os.environ, "TERM": "xterm"}, start_new_session=True)
    os.close(slave)
    p._master = master  # type: ignore[attr-defined] - kept open while attached
    return p


def test_attached_tmux_client_counts_detached_does_not(tmux_session):
    assert probe_tmux(tmux_session, "train") == (False, "tmux: nobody attached to train")
    c = attach(tmux_session)
    try:
        active, reason = wait_until(lambda: (lambda r: r if r[0] else None)(probe_tmux(tmux_session, "train")),
                                    15, what="attached client")
        assert reason.startswith("tmux: 1 client attached to train (/dev/pts/")
    finally:
        c.kill()
        c.wait(5)
        os.close(c._master)
    wait_until(lambda: not probe_tmux(tmux_session, "train")[0], 15, what="client gone")
    assert probe_tmux("/nonexistent/sock", "train") == (False, "tmux: no training session")
    assert probe_tmux(tmux_session, "other")[0] is False


# --- Jupyter -------------------------------------------------------------------------------------
def test_jupyter_quiet_server_busy_kernel_and_recent_activity(jupyter, tmp_path):
    p = JupyterProbe(jupyter.url, str(jupyter.token_file))
    later = time.time() + 3600  # an hour from now, nothing recent is recent any more
    active, reason = p.probe(later, 600)
    assert not active and reason.startswith("jupyter: quiet for 1h")
    kid = jupyter.start_kernel()
    kc = jupyter.client(kid)
    try:
        active, reason = p.probe(time.time(), 600)
        assert active and reason.startswith("jupyter: kernel python3 active"), reason
        kc.execute("import time; time.sleep(30)")
        reason = wait_until(lambda: (lambda r: r[1] if r[0] and "busy" in r[1] else None)(p.probe(later, 600)),
                            20, what="busy kernel")
        assert reason == "jupyter: kernel python3 busy"
    finally:
        jupyter.api("POST", f"/api/kernels/{kid}/interrupt")
        kc.stop_channels()
        jupyter.shutdown_kernels()


def test_jupyter_polling_does_not_count_as_activity(jupyter):
    p = JupyterProbe(jupyter.url, str(jupyter.token_file))
    first = jupyter.settled()
    for _ in range(3):
        p.probe(time.time(), 600)
    assert jupyter.api("GET", "/api/status")["last_activity"] == first
    # ...whereas an ordinary request to /api/kernels does (that is why the flag matters)
    jupyter.api("GET", "/api/kernels")
    assert jupyter.api("GET", "/api/status")["last_activity"] != first


def test_jupyter_bad_token_unreachable_and_missing_token_file(jupyter, tmp_path):
    bad = tmp_path / "bad-token"
    bad.write_text("wrong\n")
    assert JupyterProbe(jupyter.url, str(bad)).probe(time.time(), 600) == (False, "jupyter: token rejected")
    assert JupyterProbe(jupyter.url, str(tmp_path / "none")).probe(time.time(), 600)[1].startswith(
        "jupyter: cannot read the token file")
    down = JupyterProbe(f"http://127.0.0.1:{free_port()}", str(jupyter.token_file), timeout=1)
    activity._logged.pop("jupyter", None)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert down.probe(time.time(), 600) == (False, "jupyter: unreachable (counted as no activity)")
    assert len([e for e in logs if e.get("probe") == "jupyter"]) == 1, logs
    assert not any(Jupyter_token_in(e) for e in logs)
    assert JupyterProbe("", "").probe(time.time(), 600) == (False, "jupyter: not configured")


def Jupyter_token_in(entry: dict) -> bool:  # noqa: N802
    from tests.fixtures.idle import Jupyter

    return Jupyter.TOKEN in repr(entry)


# --- GPU -----------------------------------------------------------------------------------------
class FakeGpu:
    def __init__(self, util, gpus=1, error=None):
        self.util, self.gpus, self.error = util, gpus, error

    def utilization(self, window_s):
        return self.util

    def status(self):
        return {"gpus": [{"index": i} for i in range(self.gpus)], "gpu_error": self.error}


def test_gpu_load_above_threshold_counts():
    g = GpuProbe()
    assert g.probe(FakeGpu(97.0), 0, 300, 5, False) == (True, "gpu: 97% over 5m00s")
    assert g.probe(FakeGpu(3.0), 0, 300, 5, True) == (False, "gpu: 3% over 5m00s (idle below 5%)")
    assert g.probe(FakeGpu(None, gpus=0, error="NVML library not found"), 0, 300, 5, True) == \
        (False, "gpu: none (NVML library not found)")


def test_gpu_unknown_while_training_runs_is_busy_but_not_forever():
    g = GpuProbe()
    unknown = FakeGpu(None, gpus=2)
    assert g.probe(unknown, 1000, 300, 5, False) == (False, "gpu: utilization unknown, no training running")
    assert g.probe(unknown, 1000, 300, 5, True)[0] is True
    assert g.probe(unknown, 1000 + 599, 300, 5, True)[0] is True
    active, reason = g.probe(unknown, 1000 + 600, 300, 5, True)
    assert not active and reason == "gpu: utilization unknown for 10m00s (no longer counted)"
    # a known reading resets it
    g.probe(FakeGpu(0.0), 1700, 300, 5, True)
    assert g.probe(unknown, 1800, 300, 5, True)[0] is True


def test_gpu_probe_through_the_real_monitor_and_fake_nvml(fake_nvml, tmp_path, clock):
    from supervisor.gpu.monitor import GpuMonitor
    from tests.fixtures.nvml import gpu, make_ctx

    ctx = make_ctx(tmp_path, clock, {"gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "5s"}})
    mon = GpuMonitor(ctx, ctx.config.gpu)
    try:
        probe = GpuProbe()
        fake_nvml.write([gpu(util=90), gpu(util=0)])
        mon.poll()
        # one sample does not cover half the window: unknown, which a running training turns into busy
        assert probe.probe(mon, clock.monotonic(), 60, 5, True) == \
            (True, "gpu: utilization unknown while training runs (counted as busy)")
        for _ in range(13):
            clock.advance(5)
            mon.poll()
        assert probe.probe(mon, clock.monotonic(), 60, 5, False) == (True, "gpu: 90% over 1m00s")
        fake_nvml.write([gpu(util=1), gpu(util=0)])
        for _ in range(13):
            clock.advance(5)
            mon.poll()
        assert probe.probe(mon, clock.monotonic(), 60, 5, True)[0] is False
    finally:
        mon.close()


# --- training output and CPU ---------------------------------------------------------------------
def test_training_log_growth_on_the_monotonic_clock(tmp_path):
    log = tmp_path / "train.log"
    p = OutputProbe()
    assert p.probe(str(log), 0, time.time(), 600) == (False, "training: no log output yet")
    log.write_text("step 1\n")
    assert p.probe(str(log), 10, time.time(), 600)[0] is True
    assert p.probe(str(log), 500, time.time() + 86400, 600)[0] is True  # a wall jump changes nothing
    assert p.probe(str(log), 700, time.time(), 600) == (False, "training: no log output for 11m30s")
    with open(log, "a") as f:
        f.write("step 2\n")
    assert p.probe(str(log), 720, time.time(), 600) == (True, "training: log written 0s ago")
    # a first look at an old log judges by its mtime
    os.utime(log, (time.time() - 3600, time.time() - 3600))
    assert OutputProbe().probe(str(log), 0, time.time(), 600)[0] is False


def test_training_cpu_of_a_busy_and_a_sleeping_tree():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "60"])
    try:
        pb, pi = CpuProbe(), CpuProbe()
        t0 = time.monotonic()
        assert pb.probe({busy.pid}, t0, 20)[1] == "training cpu: measuring"
        pi.probe({idle.pid}, t0, 20)
        wait_until(lambda: time.monotonic() - t0 > 0.5, 5)
        t1 = time.monotonic()
        active, reason = pb.probe({busy.pid}, t1, 20)
        assert active, reason
        assert pi.probe({idle.pid}, t1, 20)[0] is False
        assert pb.probe({999999999}, t1 + 1, 20)[0] is False  # vanished processes are skipped
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


def test_a_crashing_probe_is_inactive_with_its_reason():
    def boom():
        raise RuntimeError("kaputt")

    assert safe("ssh", boom) == (False, "ssh: probe failed (RuntimeError: kaputt)")
