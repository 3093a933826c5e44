"""Fitting into a fleet: `supervisorctl idle-check` (the verdict a scheduler asks for, and the two
stoppers note under SkyPilot or dstack), and `supervisorctl status --host` against two real daemons
behind the loopback sshd, plus a host that does not answer."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from supervisor.fleet.hosts import (
    DEFAULT_REMOTE,
    Host,
    HostResult,
    VerdictError,
    host_line,
    idle_verdict,
    interpret,
    parse_hosts_file,
    quote_remote,
    ssh_argv,
    verdict_text,
)
from supervisor.idle.orchestrator import detect
from tests.fixtures.daemon import REPO
from tests.waiting import wait_until

NOW = 1_800_000_000.0


def status(**idle) -> dict:
    return {"now": NOW, "idle": {"state": "ACTIVE", "idle_since": None, "reasons": ["gpu: 97% over 5m"], **idle},
            "training": {"state": "RUNNING"}}


# --- the pure verdict ----------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["IDLE", "WARNED", "STOPPING", "STOPPED"])
def test_every_state_but_active_is_idle_and_says_for_how_long(state):
    v = idle_verdict(status(state=state, idle_since=NOW - 3900, stop_at=NOW + 600, reasons=[]))
    assert v["idle"] and v["idle_for_s"] == 3900 and v["state"] == state
    assert verdict_text(v).startswith(f"idle for 1h05m ({state}); stop ")


def test_active_says_why():
    v = idle_verdict(status())
    assert not v["idle"] and v["idle_for_s"] is None and v["idle_since"] is None
    assert verdict_text(v) == "active: gpu: 97% over 5m"


@pytest.mark.parametrize("bad", [{}, {"idle": None}, {"idle": {"state": "MAYBE"}}, {"idle": {"state": 3}}])
def test_no_usable_state_is_an_error_not_a_guess(bad):
    with pytest.raises(VerdictError):
        idle_verdict(bad)


def test_orchestrators_are_detected_from_env_or_processes():
    assert detect([{}], ["/usr/bin/python3 -m sky.skylet.skylet"])["name"] == "skypilot"
    assert detect([{}, {"DSTACK_RUN_NAME": "fine-tune-1"}], [])["evidence"] == "DSTACK_RUN_NAME in the environment"
    assert detect([{}], ["/usr/local/bin/dstack-shim --home /root/.dstack"])["name"] == "dstack"
    found = detect([{"SKYPILOT_TASK_ID": "sky-2025"}], [])
    assert found["name"] == "skypilot" and "two stoppers" in found["note"]
    assert detect([{"SKYPILOT_TASK_ID": ""}, {"PATH": "/bin"}], ["bash", "sshd: root"]) is None


# --- pure pieces of status --host ----------------------------------------------------------------------

def test_ssh_is_unattended_and_a_host_is_never_an_option():
    argv = ssh_argv(Host("user@gpu2"), ssh_config="/x/ssh_config", ssh_options=["Port=2222"])
    assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-T", "-F"]
    i = argv.index("--")
    assert argv[i + 1] == "user@gpu2" and argv[i + 2] == f"{DEFAULT_REMOTE} status --json"
    assert argv[i - 2:i] == ["-o", "Port=2222"]


def test_hosts_file():
    hosts = parse_hosts_file("# fleet\ngpu1\n\nuser@gpu2   /opt/ts/bin/supervisorctl --config /etc/ts.toml  # b\n")
    assert hosts == [Host("gpu1"), Host("user@gpu2", "/opt/ts/bin/supervisorctl --config /etc/ts.toml")]
    with pytest.raises(ValueError, match="line 1"):
        parse_hosts_file("-oProxyCommand=evil")


@pytest.mark.parametrize("rc,out,err,ok,says", [
    (0, '{"now": 1}', "", True, ""),
    (3, '{"now": 1}', "", True, ""),
    (255, "", "ssh: connect to host 10.0.0.9 port 22: Connection refused\n", False,
     "unreachable: ssh: connect to host 10.0.0.9 port 22: Connection refused"),
    (127, "", "bash: supervisorctl: command not found", False, "supervisorctl not found there"),
    (4, "", "supervisorctl: cannot reach train-supervisord", False, "daemon not running"),
    (0, "Welcome to Ubuntu!\n", "", False, "not status JSON"),
    (0, "[1]", "", False, "not status JSON"),
    (1, "", "", False, "exit 1: no message"),
])
def test_what_an_ssh_run_means(rc, out, err, ok, says):
    r = interpret("gpu1", rc, out, err)
    assert r.ok == ok and says in r.error


def test_one_line_per_machine():
    st = {"now": NOW, "training": {"state": "RUNNING", "progress": {"step": 1200, "max_steps": 3750,
                                                                     "percent": 32.0, "eta_s": 4320}},
          "gpus": [{"util_pct": 97}, {"util_pct": 93}], "idle": {"state": "ACTIVE"},
          "cost": {"spent": 4.214, "eta_cost": 4.68, "currency": "EUR"}, "sync": {"state": "failing"},
          "alerts": [{"key": "sync"}]}
    line = host_line(HostResult("gpu1", True, st), 6)
    assert line == ("gpu1   RUNNING    step 1200/3750 32% ETA 1h12m  GPU 95% x2  idle ACTIVE  "
                    "4.21 EUR (+4.68 to finish)  SYNC FAILING  1 alert")
    idle = {"now": NOW, "training": {"state": "FINISHED"}, "gpus": [], "gpu_error": "NVML library not found",
            "idle": {"state": "WARNED", "idle_since": NOW - 7300, "stop_at": NOW + 3500}}
    assert "FINISHED   no GPU  idle WARNED 2h01m, stop " in host_line(HostResult("gpu2", True, idle), 6)
    assert host_line(HostResult("gpu3", False, error="unreachable: timed out"), 6) == \
        "gpu3   UNREACHABLE unreachable: timed out"


# --- against real daemons ------------------------------------------------------------------------------

pytestmark_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def quiet_config(tmp_path, **extra) -> dict:
    """A daemon on a box where nothing counts as activity: idle within a poll."""
    return {"training": {"command": "sleep 300", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                         "on_finish": "none"},
            "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")},
            "idle": {"count_ssh": False, "count_tmux_clients": False, "poll_interval": "0.2s"},
            "stop": {"action": "dry-run"}, **extra}


@pytestmark_tmux
def test_idle_check_through_a_daemon(tmp_path, make_daemon):
    d = make_daemon(quiet_config(tmp_path), start=False)
    d.env["SKYPILOT_TASK_ID"] = "sky-2025-01-01-train"
    d.start()
    wait_until(lambda: d.status()["idle"]["state"] == "IDLE", 30, what="IDLE")
    r = d.ctl("idle-check")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("idle for ") and "two stoppers" in r.stdout
    v = json.loads(d.ctl("idle-check", "--json").stdout)
    assert v["idle"] is True and v["idle_for_s"] >= 0 and v["orchestrator"]["name"] == "skypilot"
    assert "SkyPilot" in d.ctl("status").stdout
    assert d.ctl("keepalive", "1h").returncode == 0
    wait_until(lambda: d.status()["idle"]["state"] == "ACTIVE", 30, what="ACTIVE after keepalive")
    r = d.ctl("idle-check")
    assert r.returncode == 1 and r.stdout.startswith("active: keepalive")
    d.terminate()
    r = d.ctl("idle-check")
    assert r.returncode not in (0, 1)  # no daemon: the caller must treat it as active


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytestmark_tmux
def test_status_of_many_machines_over_ssh(tmp_path, make_daemon, sshd_server):
    for w in ("w1", "w2"):
        (tmp_path / w).mkdir()
    d1 = make_daemon(quiet_config(tmp_path / "w1", price_per_hour=2.5, currency="EUR"), sub="d1")
    d2 = make_daemon(quiet_config(tmp_path / "w2"), sub="d2")
    assert d2.ctl("start").returncode == 0
    d2.wait_training("RUNNING")
    s = sshd_server
    (tmp_path / "ssh_config").write_text(f"""
Host dead
  HostName 127.0.0.1
  Port {_closed_port()}
Host d1 d2 dead
  HostName 127.0.0.1
  Port {s.port}
  User {s.user}
  IdentityFile {s.client_key}
  IdentitiesOnly yes
  UserKnownHostsFile {s.known_hosts}
  StrictHostKeyChecking accept-new
""")

    def remote(d) -> str:
        return quote_remote(["env", f"PYTHONPATH={REPO}", sys.executable, "-m", "supervisor.cli.main",
                             "--config", str(d.config_path)])

    (tmp_path / "hosts").write_text(f"d1 {remote(d1)}\nd2 {remote(d2)}\ndead\n")
    r = d1.ctl("status", "--hosts-file", str(tmp_path / "hosts"), "--ssh-config", str(tmp_path / "ssh_config"),
               timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 4, r.stdout + r.stderr  # one machine did not answer
    assert len(lines) == 3
    assert lines[0].startswith("d1 ") and "STOPPED" in lines[0] and "idle " in lines[0]
    assert lines[1].startswith("d2 ") and "RUNNING" in lines[1]
    assert lines[2].startswith("dead ") and "UNREACHABLE" in lines[2] and "refused" in lines[2]
    r = d1.ctl("status", "--hosts-file", str(tmp_path / "hosts"), "--ssh-config", str(tmp_path / "ssh_config"),
               "--json", timeout=120)
    out = json.loads(r.stdout)
    assert [(o["host"], o["ok"]) for o in out] == [("d1", True), ("d2", True), ("dead", False)]
    assert out[1]["status"]["training"]["pid"] == d2.status()["training"]["pid"]
    assert out[0]["status"]["cost"]["currency"] == "EUR"
    # every machine reachable: exit 0; --host works like a one-line hosts file
    r = d1.ctl("status", "--host", "d2", "--remote-command", remote(d2), "--ssh-config",
               str(tmp_path / "ssh_config"), timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("d2 ") and "RUNNING" in r.stdout


def test_a_host_that_looks_like_an_option_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "status", "--host=-oProxyCommand=touch x"],
                       capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"})
    assert r.returncode == 2 and "not a host" in r.stderr


def test_odd_figures_from_another_version_never_hide_the_other_lines():
    from hypothesis import given, settings
    from hypothesis import strategies as hs

    from supervisor.fleet.hosts import render_hosts

    leaf = hs.none() | hs.booleans() | hs.integers() | hs.floats() | hs.text(max_size=5)
    anyj = hs.recursive(leaf, lambda k: hs.lists(k, max_size=3) | hs.dictionaries(hs.text(max_size=5), k, max_size=3),
                        max_leaves=10)
    keys = hs.sampled_from(["now", "training", "gpus", "gpu_error", "idle", "cost", "sync", "alerts"])

    @settings(max_examples=200, deadline=None)
    @given(hs.dictionaries(keys, anyj, max_size=8))
    def check(garbage):
        out = render_hosts([HostResult("odd", True, garbage), HostResult("ok", True, {"idle": {"state": "ACTIVE"}})])
        assert out.splitlines()[-1].startswith("ok ")
        try:
            idle_verdict(garbage)
        except VerdictError:
            pass

    check()
