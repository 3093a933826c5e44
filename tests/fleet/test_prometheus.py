"""The metrics with the real Prometheus parts: Debian's prometheus-node-exporter reads the daemon's
textfile, a real prometheus server scrapes it and the daemon's /metrics, and its HTTP API gives back
the figures `status --json` shows; promtool checks and unit-tests the shipped alerting rules."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.nvml import GIB, gpu
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "examples" / "prometheus" / "train_supervisor.rules.yml"
RULE_TESTS = REPO / "examples" / "prometheus" / "train_supervisor.rules.test.yml"
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt: prometheus)")


@needs_promtool
def test_shipped_rules_pass_promtool_check():
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_shipped_rules_fire_when_they_should():
    r = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], capture_output=True, text=True, timeout=120,
                       cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.p = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def query(base: str, expr: str) -> list[dict]:
    d = json.loads(_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert d["status"] == "success", d
    return d["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(NODE_EXPORTER is None or PROMETHEUS is None or shutil.which("tmux") is None,
                    reason="prometheus, prometheus-node-exporter or tmux is not installed")
def test_node_exporter_and_prometheus_see_what_status_shows(tmp_path, make_daemon, fake_nvml):
    fake_nvml.write([gpu(util=91, used=70 * GIB), gpu(util=37, used=12 * GIB)])
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    mport, neport, pport = _free_port(), _free_port(), _free_port()
    tsup = 'TSUP {"step": 120, "max_steps": 1000, "loss": 1.5, "epoch": 0.12}'
    d = make_daemon({
        "price_per_hour": 3.9, "currency": "EUR",
        "training": {"command": f"while true; do echo '{tsup}'; sleep 0.5; done", "workdir": str(tmp_path),
                     "log": str(tmp_path / "train.log"), "on_finish": "none", "autostart": True},
        "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.5s"},
        "stop": {"action": "dry-run"},
        "metrics": {"textfile": str(textdir / "train_supervisor.prom"), "listen": f"127.0.0.1:{mport}"},
    })
    d.wait_training("RUNNING")
    wait_until(lambda: d.status()["training"]["progress"]["step"] == 120, 30, what="step 120 in status")
    wait_until(lambda: (textdir / "train_supervisor.prom").exists(), 15, what="the textfile")

    procs = []
    try:
        procs.append(Proc([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{neport}", "--collector.disable-defaults",
                           "--collector.textfile", f"--collector.textfile.directory={textdir}"],
                          tmp_path / "node_exporter.log"))
        (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: node
    static_configs: [{{targets: ["127.0.0.1:{neport}"]}}]
  - job_name: train_supervisor
    static_configs: [{{targets: ["127.0.0.1:{mport}"]}}]
""")
        procs.append(Proc([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                           f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}"],
                          tmp_path / "prometheus.log"))
        base = f"http://127.0.0.1:{pport}"

        def both_jobs():
            try:
                return len(query(base, "train_supervisor_training_step")) == 2
            except OSError:
                return False

        wait_until(both_jobs, 90, interval=0.5, what=f"prometheus to scrape both (log: {tmp_path / 'prometheus.log'})")
        st = d.status()
        for job in ("node", "train_supervisor"):
            sel = f'{{job="{job}"}}'

            def one(name: str, sel: str = sel) -> float:
                (r,) = query(base, name + sel)
                return float(r["value"][1])

            assert one("train_supervisor_training_step") == st["training"]["progress"]["step"] == 120
            assert one("train_supervisor_training_max_steps") == 1000
            assert one("train_supervisor_training_loss") == 1.5
            assert one("train_supervisor_gpus") == len(st["gpus"]) == 2
            running = query(base, f'train_supervisor_training_state{{job="{job}",state="RUNNING"}}')
            assert float(running[0]["value"][1]) == 1
            gpus = {r["metric"]["gpu"]: float(r["value"][1])
                    for r in query(base, f"train_supervisor_gpu_memory_used_bytes{sel}")}
            assert gpus == {str(g["index"]): float(g["mem_used_bytes"]) for g in st["gpus"]}
            util = {r["metric"]["gpu"]: float(r["value"][1])
                    for r in query(base, f"train_supervisor_gpu_utilization_ratio{sel}")}
            assert util == {"0": 0.91, "1": 0.37}
            (price,) = query(base, f"train_supervisor_cost_price_per_hour{sel}")
            assert price["metric"]["currency"] == "EUR" and float(price["value"][1]) == 3.9
            idle_state = st["idle"]["state"]
            (idle,) = query(base, f'train_supervisor_idle_state{{job="{job}",state="{idle_state}"}}')
            assert float(idle["value"][1]) == 1
        # the shipped rules loaded into the real server
        groups = json.loads(_get(f"{base}/api/v1/rules"))["data"]["groups"]
        assert [g["name"] for g in groups] == ["train-supervisor"]
        assert {r["health"] for r in groups[0]["rules"]} <= {"ok", "unknown"}
        assert d.status()["metrics"]["error"] is None
    finally:
        for p in procs:
            p.stop()
