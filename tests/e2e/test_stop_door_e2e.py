"""Every reason through the one door (issue 51), through the real daemon: a failed run's stop is
named `failed`, a stall's `stalled`; a spot notice during a cap's stop takes it over and the one
action is the preemption's; `supervisorctl budget +20` during a cap stop's final sync withdraws the
stop, and no action follows.

The first test drives a train-supervisord subprocess from outside (real tmux, SMTP, a local target);
the others a real Daemon in this process on a fake clock where the hours pass (as test_money_e2e and
test_stall_e2e do), with real trainers in real tmux, a real local sync target, real SMTP and, for the
notice, the fake GCP metadata server."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from pathlib import Path

import pytest

from supervisor.config import from_dict
from supervisor.daemon.control import request
from tests.e2e.test_first_hour import base_config
from tests.fixtures.daemon import make_daemon  # noqa: F401 - the fixture
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.inproc import find_mail, mails, run, wait_mail
from tests.fixtures.metadata import metadata_servers  # noqa: F401 - the fixture
from tests.fixtures.nvml import GIB, H100_TOTAL, gpu
from tests.money.test_money_e2e import BillingClock, Feeder, start
from tests.money.test_money_e2e import config as money_config
from tests.progress.test_stall_e2e import DUTY_NAMES, TRAINER, rounds_until, start_stepping
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

REPO = Path(__file__).resolve().parents[2]


def lines(p: Path) -> list[str]:
    return p.read_text().splitlines() if p.exists() else []


def reasons(st: dict) -> list[str]:
    return [p["reason"] for p in st["stop"]["pending"]]


# --- failed ------------------------------------------------------------------------------------------
def test_a_failed_runs_stop_is_named_failed(tmp_path, make_daemon, smtp_server, fake_nvml):  # noqa: F811
    out = tmp_path / "out"
    HFWriter(out).checkpoint(3)
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": "echo training; sleep 1; exit 3", "finish_grace": "2s"},
                      sync={"target": str(tmp_path / "target"), "watch": [str(out)], "quiet_period": "1s"},
                      stop={"final_sync": [str(out)]})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("FAILED", timeout=30)
    # the run's end asks through the door like every other reason: it stands from the result mail on
    st = wait_until(lambda: (lambda s: s if "failed" in reasons(s) else None)(d.status()), 30, interval=0.1,
                    what="`failed` standing")
    assert st["stop"]["reason"] == "failed" and st["idle"]["mode"] == "finish", st["stop"]
    wait_until(lambda: lines(tmp_path / "stopped.txt"), 60, what="the failed run's stop action")
    subject, body = wait_mail(smtp_server, "stopping now (training failed)")
    assert "final sync verified" in subject, subject
    st = d.status()
    assert st["stop"]["reason"] == "failed" and st["stop"]["final_sync"]["ok"], st["stop"]
    assert lines(tmp_path / "stopped.txt") == ["stopped"]
    assert json.loads((d.state_dir / "stop.json").read_text())["reason"] == "failed"  # the record too
    assert not find_mail(smtp_server, "stopping now (training finished)")


# --- stalled -----------------------------------------------------------------------------------------
def stall_config(tmp_path: Path, fake_nvml, smtp) -> dict:
    (tmp_path / "out").mkdir(exist_ok=True)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(repo=str(REPO), tmp=str(tmp_path)))
    return {
        "state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "control.sock"),
        "training": {"command": f"{sys.executable} {script}", "workdir": str(tmp_path),
                     "log": str(tmp_path / "train.log"), "on_finish": "none", "stop_grace": "30s"},
        "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "30s"},
        "sync": {"target": str(tmp_path / "target"), "watch": [str(tmp_path / "out")], "quiet_period": "1s"},
        "idle": {"warn_after": "10m", "stop_after_warning": "5m", "count_ssh": False, "count_tmux_clients": False},
        "stop": {"action": "dry-run", "final_sync": [str(tmp_path / "out")]},
        "progress": {"stall_after": "2m", "stalled_action": "stop"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp.port, "security": "none"},
        "alerts": {"first_delay": "0s"},
    }


def test_a_stalled_runs_stop_is_named_stalled(tmp_path, daemon, fake_nvml, smtp_server):
    fake_nvml.write([gpu(util=100, used=70 * GIB, total=H100_TOTAL)])  # a hung collective keeps the GPU busy
    d = daemon(from_dict(stall_config(tmp_path, fake_nvml, smtp_server)))
    start_stepping(d, tmp_path)
    rounds_until(d, lambda: d.guard.status()["idle"]["state"] == "WARNED", 200, "the warning")
    st = d.status()
    assert reasons(st) == ["stalled"] and st["stop"]["reason"] == "stalled", st["stop"]
    assert "step 5 unchanged" in st["stop"]["pending"][0]["why"], st["stop"]["pending"]
    rounds_until(d, lambda: d.guard.status()["idle"]["state"] == "STOPPING", 100, "the stop")
    wait_until(lambda: run(d, *DUTY_NAMES) or d.guard.drain(5) and d.guard.status()["idle"]["state"] == "STOPPED",
               90, interval=0.1, what="the stop ran")
    st = d.guard.status()["stop"]
    assert st["reason"] == "stalled" and st["phase"] == "done" and st["interrupt_ended"] == "exit code 0", st
    assert d.guard.stopper.rec.reason == "stalled"
    subject, body = wait_until(lambda: find_mail(smtp_server, "stopping now (the training stalled)"), 30,
                               interval=0.1, what=f"the stopping mail; got {smtp_server.subjects()}")
    assert "Why: training stalled: step 5 unchanged" in body, body


# --- a cap's stop, then a spot notice; a cap's stop, then `budget +20` -------------------------------
class GatedSync:
    """The daemon's own final sync, held at a gate: the cap's stop is under way in its final sync
    for as long as the test needs."""

    def __init__(self, d) -> None:
        self.real, self.gate, self.entered = d.sync.final_sync, threading.Event(), threading.Event()
        self.timeouts: list[float] = []
        d.sync.final_sync = self

    def __call__(self, paths, timeout_s):
        self.timeouts.append(timeout_s)
        self.entered.set()
        self.gate.wait(60)
        return self.real(paths, timeout_s)


def tick(d, feeder: Feeder) -> None:
    """One fake second: the duties, then a moment for the stop's worker."""
    feeder.round(1)
    d.guard.drain(0.05)


def cap_stop_in_its_final_sync(d, feeder: Feeder) -> GatedSync:
    """Run until the cap's stop began, interrupted the training (it saves on SIGINT) and its final
    sync waits at the gate."""
    gated = GatedSync(d)
    while d.guard.status()["idle"]["state"] != "STOPPING":
        feeder.round(60)
        assert feeder.step < 300, d.status()["budget"]
    wait_until(lambda: tick(d, feeder) or gated.entered.is_set(), 60, interval=0.05, what="the cap stop's final sync")
    st = d.guard.status()["stop"]
    assert st["reason"] == "cost" and st["phase"] == "final_sync" and st["interrupt_ended"] == "exit code 0", \
        d.guard.stopper.rec.history
    return gated


def test_a_spot_notice_during_a_cap_stop_takes_it_over_and_one_action_runs(
        tmp_path, daemon, smtp_server, metadata_servers):  # noqa: F811
    stopped = tmp_path / "stopped.txt"
    gcp = metadata_servers["gcp"]
    cfg = money_config(tmp_path, smtp_server, {"max_cost": 5.0, "margin": "1m"},
                       preemption={"watch": ["gcp"], "metadata_urls": {"gcp": gcp.url}, "training_signal": "",
                                   "timeout": "2s"})
    cfg["stop"] = {**cfg["stop"], "action": "command", "command": f"echo stopped >> {stopped}"}
    d = daemon(from_dict(cfg), BillingClock())
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    gated = cap_stop_in_its_final_sync(d, feeder)

    gcp.notice = "TRUE"  # GCP preempts the machine: 30 s
    run(d, "preemption")
    st = d.status()
    assert st["preemption"]["notice"] is not None
    assert st["stop"]["reason"] == "preemption" and st["idle"]["state"] == "STOPPING", st["stop"]
    assert set(reasons(st)) == {"cost", "preemption"}, st["stop"]["pending"]
    gated.gate.set()  # the cap's final sync comes back: its stop was taken over, nothing acts on it

    wait_until(lambda: tick(d, feeder) or d.guard.status()["idle"]["state"] == "STOPPED", 60, interval=0.05,
               what="the preemption stop's action")
    st = d.status()
    assert st["stop"]["reason"] == "preemption" and st["stop"]["final_sync"]["ok"], st["stop"]
    assert lines(stopped) == ["stopped"]  # one action, for both
    stopping = mails(smtp_server, "stopping now")
    assert len(stopping) == 1 and "gcp" in stopping[0][0], [s for s, _ in stopping]
    assert "Also standing, served by this stop: the spend cap" in stopping[0][1], stopping[0][1]
    assert st["stop"]["pending"] == [] and d.guard.stopper.rec.reason == "preemption"
    # the preemption's final sync is the emergency sync with the notice's deadline (GCP: 30 s, less
    # the action's reserve), not stop.final_sync_timeout (30 min)
    assert len(gated.timeouts) == 2 and gated.timeouts[1] <= 25.0 < gated.timeouts[0], gated.timeouts


def test_budget_raising_the_cap_during_its_stops_final_sync_withdraws_the_stop(tmp_path, daemon, smtp_server):
    stopped = tmp_path / "stopped.txt"
    cfg = money_config(tmp_path, smtp_server, {"max_cost": 5.0, "margin": "1m"})
    cfg["stop"] = {**cfg["stop"], "action": "command", "command": f"echo stopped >> {stopped}"}
    d = daemon(from_dict(cfg), BillingClock())
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    gated = cap_stop_in_its_final_sync(d, feeder)

    res = request(d.cfg.socket, "budget", {"amount": "+20"})  # what `supervisorctl budget +20` sends
    assert "the first cap is the spend cap of 25.00 USD" in res["message"], res["message"]
    assert "the stop asked for the spend cap is withdrawn" in res["message"], res["message"]
    st = d.status()
    assert d.guard.stopper.rec.phase == "cancelled" and st["stop"]["pending"] == [], st["stop"]
    assert st["stop"]["phase"] is None and st["stop"]["reason"] is None  # no stop under way
    assert st["idle"]["state"] == "ACTIVE" and st["budget"]["acted"] is None
    gated.gate.set()  # the final sync comes back: nothing acts on it

    for _ in range(40):  # 40 fake seconds, the duties and the stop's worker as they would run
        tick(d, feeder)
    st = d.status()
    assert d.guard.stopper.rec.phase == "cancelled" and st["idle"]["state"] in ("ACTIVE", "IDLE"), st
    assert not lines(stopped) and d.guard.stopper.rec.done_at is None  # no action
    assert not mails(smtp_server, "stopping now")
    subject, body = wait_until(lambda: find_mail(smtp_server, "stop cancelled"), 20, interval=0.1,
                               what=f"the cancel mail; got {smtp_server.subjects()}")
    assert "the spend cap: withdrawn" in subject and "because its reason was withdrawn" in body, (subject, body)
    assert "cancelled: the spend cap: withdrawn" in " ".join(d.guard.stopper.rec.history)
    # the machine is protected as before: the idle clock runs, and the moved cap acts again when it comes
    assert d.status()["budget"]["cap"]["kind"] == "max_cost"
    # the owner raised the cap for more training: the run the stop interrupted starts again
    wait_until(lambda: d.status()["training"]["state"] == "RUNNING", 30, interval=0.1,
               what=f"the training started again; {d.status()['training']}")


# --- manual ------------------------------------------------------------------------------------------
def test_stop_machine_asks_for_the_manual_stop(tmp_path, make_daemon, smtp_server, fake_nvml):  # noqa: F811
    out = tmp_path / "out"
    HFWriter(out).checkpoint(4)
    cfg = base_config(tmp_path, smtp_server, fake_nvml, training={"on_finish": "none"},
                      idle={"warn_after": "2h"},
                      sync={"target": str(tmp_path / "target"), "watch": [str(out)], "quiet_period": "1s"},
                      stop={"final_sync": [str(out)]})
    d = make_daemon(cfg)
    res = d.req("stop-machine", {"why": "done for today"})
    assert res["message"].startswith("stopping the machine"), res
    wait_until(lambda: lines(tmp_path / "stopped.txt"), 60, what="the manual stop's action")
    subject, body = wait_mail(smtp_server, "stopping now (a stop was asked for)")
    assert "final sync verified" in subject and "Why: done for today" in body, (subject, body)
    st = wait_until(lambda: (lambda s: s if s["idle"]["state"] == "STOPPED" else None)(d.status()), 30,
                    interval=0.1, what="STOPPED")["stop"]
    assert st["reason"] == "manual" and st["pending"] == [] and lines(tmp_path / "stopped.txt") == ["stopped"]
