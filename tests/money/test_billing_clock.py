"""The billing clock is the machine's, not the kernel's (issue 37, finding 1): in a container the
caps count from the container's start, not the host's boot. Real namespaces: a PID namespace
(`unshare --pid --fork --mount-proc`, the container's own PID 1) and a time namespace (`unshare
--time --boottime`, which moves CLOCK_BOOTTIME), then the real daemon in a PID namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.clock import CONTAINER_AFTER_S, billing_since
from tests.fixtures.daemon import REPO, DaemonProc
from tests.waiting import wait_until

PROBE = "import json; from supervisor.clock import read_boot, billing_origin; print(json.dumps([read_boot()[1], billing_origin()]))"


def host_uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def run_in(prefix: list[str]) -> tuple[float, str]:
    r = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode != 0:
        pytest.skip(f"{prefix[0]} cannot make this namespace here: {r.stderr.strip()[-200:]}")
    up, origin = json.loads(r.stdout)
    return up, origin


def test_the_rule():
    assert billing_since(3600.0, None) == (3600.0, "boot")
    assert billing_since(3600.0, 1.5) == (3598.5, "boot")                 # a host's init
    assert billing_since(30 * 86400.0, 30 * 86400.0 - 3600.0) == (3600.0, "container start")
    assert billing_since(100.0, 500.0) == (100.0, "boot")                 # nonsense: the boot's figure
    assert CONTAINER_AFTER_S > 10


needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                   reason="needs unshare (util-linux) as root")


@needs_unshare
def test_a_pid_namespace_counts_from_its_own_pid_1():
    if host_uptime() < CONTAINER_AFTER_S + 5:
        pytest.skip("the host booted moments ago: a container start cannot be told from it")
    up, origin = run_in(["unshare", "--pid", "--fork", "--mount-proc"])
    assert origin == "container start" and up < 30, (up, origin)
    host_up, host_origin = run_in([])
    assert host_up > CONTAINER_AFTER_S and host_origin == "boot"


@needs_unshare
def test_a_time_namespace_moves_the_boot_clock():
    """A namespace whose CLOCK_BOOTTIME says the machine booted 100 s ago bills 100 s, whatever the
    host kernel's uptime (its PID 1, the host's, started before that boot: not counted)."""
    if host_uptime() < 300:
        pytest.skip("the host booted moments ago")
    up, origin = run_in(["unshare", "--time", "--boottime", str(-int(host_uptime() - 100)), "--fork"])
    assert 95 <= up < 160 and origin == "boot", (up, origin)


@needs_unshare
def test_the_daemon_in_a_container_bills_from_the_container_start(tmp_path):
    if host_uptime() < 600:
        pytest.skip("the host booted under 10 minutes ago")
    run_in(["unshare", "--pid", "--fork", "--mount-proc"])  # skips where no PID namespace can be made
    d = DaemonProc(tmp_path / "d", {"price_per_hour": 36.0, "currency": "USD",
                                    "budget": {"max_cost": 100.0},
                                    "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")},
                                    "stop": {"action": "dry-run"}})
    log = tmp_path / "daemon.log"
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "supervisor.daemon.main",
                             "--config", str(d.config_path)], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=d.env, cwd=str(d.tmp), start_new_session=True)
    d.proc = proc
    try:
        wait_until(d.ready, 30, what=f"daemon in a PID namespace (log: {log})")
        b = d.status()["budget"]
        assert b["billing_from"] == "container start", b
        assert b["uptime_s"] < 60 and b["spent"] < 1.0, b   # on the host's uptime it would be hours' worth
        human = d.ctl("status").stdout
        assert "container start" in human, human
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(15)
        d.cleanup()
