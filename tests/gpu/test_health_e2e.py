"""GPU health through the real daemon: the real pynvml against the fake libnvidia-ml (each health
field scripted by its key, unset = NotSupported through ctypes), the real Training in tmux, the
control socket and supervisorctl. Each verdict of issue 27: a missing GPU, a failed remap (BAD;
on_bad = "refuse" starts nothing and says so; "stop" stops the machine through the stop
sequence), a x4 link (DEGRADED), a GPU lost mid-run (alert), an unsupported field (unknown, no alert)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from supervisor.daemon.control import RequestError
from tests.fixtures.nvml import HEALTH_KEYS, HEALTHY, gpu
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

assert set(HEALTHY) == set(HEALTH_KEYS)


def cfg(tmp_path: Path, fake_nvml, **health) -> dict:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return {"gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
            "training": {"command": f"{sys.executable} -c 'import time; time.sleep(600)'", "workdir": str(work),
                         "on_finish": "none"},
            "stop": {"action": "dry-run"},
            "alerts": {"first_delay": "0s"},
            "health": health}


def health_alerts(d) -> list[dict]:
    return [e for e in d.req("alerts", {"n": 200})["recent"] if e.get("kind") == "gpu_health"
            and e.get("what") in ("event", "raised")]


def checked(d, verdict: str) -> dict:
    def ok():
        h = d.status()["health"]
        return h if h.get("verdict") == verdict else None
    return wait_until(ok, 15, interval=0.1, what=f"health {verdict}")


def test_missing_gpu_is_bad_against_the_first_boot_count(tmp_path, make_daemon, fake_nvml):
    fake_nvml.write([gpu(**HEALTHY) for _ in range(4)])
    d = make_daemon(cfg(tmp_path, fake_nvml))
    h = checked(d, "OK")
    assert h["count"] == 4 and h["expect_gpus"] == 4 and h["expect_source"] == "the count at first boot"
    assert json.loads((d.state_dir / "health.json").read_text())["first_count"] == 4
    assert not health_alerts(d)
    d.terminate()
    fake_nvml.write([gpu(**HEALTHY) for _ in range(3)])  # the next boot: one GPU gone
    d.start()
    h = checked(d, "BAD")
    assert h["reasons"] == ["3 of 4 GPUs present"]
    assert "ask the provider for another machine; this one is billing" in h["advice"]
    a = wait_until(lambda: health_alerts(d), 10, what="the health alert")
    assert a[0]["severity"] == "critical" and "3 of 4 GPUs present" in a[0]["subject"]
    r = d.ctl("health")
    assert r.returncode == 1 and "verdict   BAD" in r.stdout, r.stdout + r.stderr
    assert "3 of 4 expected (the count at first boot)" in r.stdout


def test_failed_remap_refuse_starts_nothing_and_says_so(tmp_path, make_daemon, fake_nvml):
    fake_nvml.write([gpu(**HEALTHY), gpu(**{**HEALTHY, "remap_failed": 1, "ecc_uncorrected_volatile": 2})])
    d = make_daemon(cfg(tmp_path, fake_nvml, on_bad="refuse", expect_gpus=2))
    h = checked(d, "BAD")
    assert h["advice"] == ("GPU 1: 2 uncorrectable ECC errors, row remapping failed — ask the provider for "
                           "another machine; this one is billing")
    with pytest.raises(RequestError) as e:
        d.req("start")
    assert "GPU health is BAD" in str(e.value) and "no training started" in str(e.value)
    assert 'health.on_bad = "refuse"' in str(e.value)
    r = d.ctl("run", "--", "sleep", "100")
    assert r.returncode == 1 and "GPU health is BAD" in r.stderr and "row remapping failed" in r.stderr
    st = d.status()
    assert st["training"]["state"] == "STOPPED" and not (d.state_dir / "runs").exists()
    assert st["health"]["refused"]
    screen = d.ctl("status").stdout
    assert "health    BAD: GPU 1: 2 uncorrectable ECC errors, row remapping failed" in screen
    alert = wait_until(lambda: health_alerts(d), 10, what="the health alert")[0]
    assert "refuse" in alert["body"] and "row remapping failed" in alert["body"]
    # the provider fixed it: the next start goes ahead
    fake_nvml.write([gpu(**HEALTHY), gpu(**HEALTHY)])
    d.req("start")
    d.wait_training("RUNNING")


def test_bad_with_on_bad_stop_stops_the_machine_after_the_alert(tmp_path, make_daemon, fake_nvml):
    fake_nvml.write([gpu(**{**HEALTHY, "retired_pending": 1})])
    d = make_daemon(cfg(tmp_path, fake_nvml, on_bad="stop", expect_gpus=1))

    def stopped():
        s = d.status()["stop"]
        return s if s.get("phase") == "done" else None
    s = wait_until(stopped, 20, interval=0.2, what="the dry-run stop")
    assert s["reason"] == "health" and s["pending"] == []  # served by the stop that ran
    recent = d.req("alerts", {"n": 200})["recent"]
    kinds = [e["kind"] for e in recent if e.get("what") == "event"]
    assert kinds.index("gpu_health") < kinds.index("stopping")  # the alert first, then the stop's words
    stopping = next(e for e in recent if e.get("kind") == "stopping")
    assert "GPU health BAD" in stopping["subject"]
    with pytest.raises(RequestError):
        d.req("start")


def test_x4_link_is_degraded_and_still_starts(tmp_path, make_daemon, fake_nvml):
    fake_nvml.write([gpu(**{**HEALTHY, "pcie_width": 4})])
    d = make_daemon(cfg(tmp_path, fake_nvml, on_bad="refuse"))
    h = checked(d, "DEGRADED")
    assert h["reasons"] == ["GPU 0: PCIe link x4 (max x16)"]
    a = wait_until(lambda: health_alerts(d), 10, what="the DEGRADED alert")[0]
    assert a["severity"] == "warning" and "x4" in a["subject"]
    d.req("start")
    d.wait_training("RUNNING")
    out = json.loads(d.ctl("health", "--json").stdout)
    assert out["verdict"] == "DEGRADED" and out["gpus"][0]["pcie_width"] == 4


def test_gpu_lost_mid_run_alerts_with_advice(tmp_path, make_daemon, fake_nvml):
    fake_nvml.write([gpu(**HEALTHY), gpu(**HEALTHY)])
    d = make_daemon(cfg(tmp_path, fake_nvml))
    checked(d, "OK")
    d.req("start")
    d.wait_training("RUNNING")
    fake_nvml.write([gpu(**HEALTHY), gpu(**HEALTHY, lost=1)])
    h = checked(d, "BAD")
    assert h["reasons"] == ["GPU 1: GPU is lost (fell off the bus?)"]
    a = wait_until(lambda: [x for x in d.status()["alerts"] if x["kind"] == "gpu_failed"], 10, what="GPU lost alert")
    assert a[0]["severity"] == "critical"
    body = next(e["body"] for e in d.req("alerts", {"n": 200})["recent"] if e.get("kind") == "gpu_failed")
    assert "ask the provider to replace the machine" in body
    assert d.status()["training"]["state"] == "RUNNING"  # a lost GPU alerts; it never stops the run by itself


def test_unsupported_fields_read_unknown_and_alert_nothing(tmp_path, make_daemon, fake_nvml):
    # GPU 0 lacks one field (ECC mode: NotSupported through ctypes); GPU 1 lacks every health field
    fake_nvml.write([gpu(**{k: v for k, v in HEALTHY.items() if k != "ecc_mode"}), gpu(util=0)])
    d = make_daemon(cfg(tmp_path, fake_nvml, on_bad="refuse"))
    h = checked(d, "OK")
    g0, g1 = h["gpus"]
    assert g0["ecc_mode"] is None and g0["pcie_width"] == 16
    assert all(g1[k] is None for k in ("ecc_mode", "pcie_width", "throttle", "nvlink_down", "temp_c", "power_w"))
    assert [u for u in h["unknown"] if u.startswith("GPU 0")] == ["GPU 0: ecc_mode"]
    assert len([u for u in h["unknown"] if u.startswith("GPU 1")]) == 11
    d.req("start")
    d.wait_training("RUNNING")
    assert not health_alerts(d)
    r = d.ctl("health")
    assert r.returncode == 0 and "verdict   OK" in r.stdout and "ECC ?" in r.stdout, r.stdout
    assert "health    OK (2 GPU(s), 12 field(s) unknown)" in d.ctl("status").stdout


def test_burn_in_runs_before_autostart_and_is_said_when_skipped(tmp_path, make_daemon, fake_nvml):
    c = cfg(tmp_path, fake_nvml, burn_in="1s")
    venv = tmp_path / "work" / ".venv" / "bin"
    venv.mkdir(parents=True)
    order = tmp_path / "order.txt"
    (venv / "python").write_text(f"#!/bin/sh\necho burn-in >> {order}\n"
                                 "echo '{\"skipped\": \"torch is not importable (ModuleNotFoundError)\"}'\n")
    (venv / "python").chmod(0o755)
    c["training"]["autostart"] = True
    c["training"]["command"] = f"echo training >> {order}; sleep 600"
    fake_nvml.write([gpu(**HEALTHY)])
    d = make_daemon(c)
    d.wait_training("RUNNING")
    wait_until(lambda: order.exists() and len(order.read_text().split()) == 2, 10, what="both ran")
    assert order.read_text().split() == ["burn-in", "training"]
    b = d.status()["health"]["burn_in"]
    assert b["state"] == "skipped" and "torch is not importable" in b["note"]
    assert "burn-in   skipped: torch is not importable" in d.ctl("health").stdout
