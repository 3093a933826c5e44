"""The hardened unit (issue 49): the daemon is sandboxed, the training is not.

- `systemd-analyze security --offline=true` rates the unit under 5.0 (it was 9.6, UNSAFE).
- The training's tmux server starts as a transient SERVICE (a scope's processes are our children
  and keep our unit's sandbox and memory cap; a service is started by systemd afresh), with the
  limits the training needs, and a restarted daemon re-adopts it: same pid, one session, never a
  second `systemd-run`. Here systemd is not PID 1, so a stand-in `systemd-run` on PATH records its
  command line and starts the command the way systemd would (a clean environment plus --setenv);
  the tmux server and the job are real."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.notify.alerts import Alerts
from supervisor.statefile import StateStore
from supervisor.states import TrainingState as S
from supervisor.training import tmux as tmux_mod
from supervisor.training.job import Training, TrainingError
from supervisor.training.tmux import TRAINING_PROPERTIES, Tmux, TmuxError, transient_service
from tests.fixtures.context import ConfiguredContext
from tests.fixtures.procs import kill_under
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "train-supervisor.service"
ANALYZE = shutil.which("systemd-analyze")
SECRET = "wJalrXUtnFEMIsecret-unit49"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def exposure(unit: Path) -> float:
    r = subprocess.run([ANALYZE, "security", "--offline=true", "--no-pager", str(unit)], capture_output=True,
                       text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)")
def test_systemd_analyze_rates_the_unit_under_5(tmp_path):
    assert exposure(UNIT) < 5.0
    # the measure is worth something: the unit without its sandbox lines is the old 9.6
    bare = tmp_path / "train-supervisor.service"
    start = UNIT.read_text().index("# --- The sandbox")
    end = UNIT.read_text().index("# Sync workers, sockets")
    bare.write_text(UNIT.read_text()[:start] + UNIT.read_text()[end:])
    assert exposure(bare) > 9.0


def test_the_command_line_is_a_transient_service_never_a_scope():
    argv = transient_service("train-supervisor-run-3-1700000000", "train-supervisor training (tmux)",
                             ["tmux", "-S", "/s", "new-session", "-d", "-s", "train", "--", "python", "x"],
                             properties=TRAINING_PROPERTIES, env={"PATH": "/usr/bin", "LANG": "C.UTF-8"})
    assert argv[0] == "systemd-run" and "--scope" not in argv
    opts = argv[:argv.index("--")]
    assert "--unit=train-supervisor-run-3-1700000000" in opts and "--collect" in opts
    assert {"--property=Type=forking", "--property=LimitMEMLOCK=infinity", "--property=LimitNOFILE=65536",
            "--property=TasksMax=infinity", "--property=OOMPolicy=continue"} <= set(opts)
    assert {"--setenv=PATH=/usr/bin", "--setenv=LANG=C.UTF-8"} <= set(opts)
    assert argv[argv.index("--") + 1:] == ["tmux", "-S", "/s", "new-session", "-d", "-s", "train", "--", "python", "x"]


# --- the real tmux through a stand-in systemd-run -----------------------------------------------------

@pytest.fixture
def systemd(tmp_path, monkeypatch):
    """A `systemd-run` first on PATH that records each command line (one JSON list a line) and runs
    the command as systemd would run a service's ExecStart: from /, with systemd's PATH and only
    what --setenv gives. `under_systemd()` answers yes."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    calls = tmp_path / "systemd-run.calls"
    fake = bindir / "systemd-run"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if os.path.exists({str(tmp_path / "systemd-run.fail")!r}):
    print("Job for x.service failed because the control process exited with error code.", file=sys.stderr)
    sys.exit(1)
i = args.index("--")
env = {{"PATH": {SYSTEMD_PATH!r}}}
for a in args[:i]:
    if a.startswith("--setenv="):
        k, _, v = a[len("--setenv="):].partition("=")
        env[k] = v
os.chdir("/")
os.execvpe(args[i + 1], args[i + 1:], env)
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("TRAIN_SUPERVISOR_NO_SCOPE", raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setattr(tmux_mod, "under_systemd", lambda: True)

    def recorded() -> list[list[str]]:
        return [json.loads(ln) for ln in calls.read_text().splitlines()] if calls.exists() else []

    yield recorded
    sock = tmp_path / "state" / "tmux.sock"
    subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True)
    kill_under(tmp_path, settle=0)


def make(tmp_path, **training) -> Training:
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "ctl.sock"),
                     "training": {"log": str(tmp_path / "train.log"), "workdir": str(tmp_path), **training}})
    clock = SystemClock()
    ctx = ConfiguredContext(clock, StateStore(cfg.state_dir), Alerts(cfg.alerts, clock, cfg.state_dir), cfg)
    return Training(ctx, ctx.config.training)


def tmux_servers(sock: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if (p.info["name"] or "").startswith("tmux") and str(sock) in cmd and "new-session" in cmd:
            out.append(p)
    return out


def test_the_training_runs_in_a_transient_service_and_a_restarted_daemon_readopts_it(tmp_path, systemd):
    t = make(tmp_path, command="sleep 120")
    t.start()
    wait_until(lambda: (t.poll(), t.state == S.RUNNING)[1], what="RUNNING")
    pid = t.info().pid
    calls = systemd()
    assert len(calls) == 1, calls
    argv = calls[0]
    opts, cmd = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert "--scope" not in opts and "--property=Type=forking" in opts and "--collect" in opts
    assert any(re.fullmatch(r"--unit=train-supervisor-run-1-\d+", o) for o in opts), opts
    assert cmd[:4] == ["tmux", "-S", t.tmux.socket, "new-session"] and "-d" in cmd
    assert SECRET not in json.dumps(argv)  # the command line (and so the unit) holds no key

    # the tmux server is the service's main process: daemonized away from us, none of our keys
    sock = Path(t.tmux.socket)
    servers = tmux_servers(sock)
    assert len(servers) == 1 and servers[0].ppid() != os.getpid()
    assert SECRET not in json.dumps(servers[0].environ())
    assert psutil.Process(pid).ppid() != os.getpid()

    # a restarted daemon (a fresh Training over the same state) re-adopts: same pid, no second copy
    t2 = make(tmp_path)
    t2.adopt()
    assert t2.state == S.RUNNING and t2.info().pid == pid
    with pytest.raises(TrainingError):
        t2.start()
    assert len(systemd()) == 1
    sessions = subprocess.run(["tmux", "-S", str(sock), "list-sessions"], capture_output=True, text=True)
    assert len(sessions.stdout.strip().splitlines()) == 1


def test_a_failed_service_start_says_where_its_output_went(tmp_path, systemd):
    (tmp_path / "systemd-run.fail").touch()
    tm = Tmux(tmp_path / "state" / "tmux.sock")
    with pytest.raises(TmuxError, match=r"failed: Job for .* \(its output: journalctl -u train-supervisor-run-9-1\)"):
        tm.new_session("train", ["sleep", "1"], str(tmp_path), scope_unit="train-supervisor-run-9-1")


def test_without_systemd_tmux_starts_directly(tmp_path, monkeypatch):
    """The container path (train-supervisor-start, no systemd): no systemd-run at all."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    monkeypatch.setattr(tmux_mod, "under_systemd", lambda: False)
    tm = Tmux(tmp_path / "tmux.sock")
    try:
        tm.new_session("train", ["sleep", "30"], str(tmp_path), scope_unit="train-supervisor-run-1-1")
        assert tm.has_session("train") and tm.pane_pid("train")
    finally:
        subprocess.run(["tmux", "-S", str(tmp_path / "tmux.sock"), "kill-server"], capture_output=True)
