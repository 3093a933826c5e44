"""The health shell (supervisor.gpu.healthwatch) with the real probe against the fake libnvidia-ml, a
fake clock and real Alerts: the first-boot count, the live faults during a run and their alerts, the
burn-in skipped (and said) where torch is not importable, and the words, screen and metrics."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from supervisor.cli.render import health_lines, render_health
from supervisor.fleet.metrics import exposition
from supervisor.gpu import health as H
from supervisor.gpu.healthwatch import HealthWatch
from supervisor.gpu.nvml import NvmlProbe
from supervisor.interfaces import TrainingInfo
from supervisor.states import TrainingState
from supervisor.training.job import TrainingError
from tests.fixtures.nvml import gpu, make_ctx


class Job:
    def __init__(self, state=TrainingState.STOPPED, run_id=0):
        self.state, self.run_id = state, run_id

    def info(self) -> TrainingInfo:
        return TrainingInfo(state=self.state, run_id=self.run_id)


@pytest.fixture
def make(fake_nvml, tmp_path, clock):
    made = []

    def factory(health=None, job=None, rate=None, stops=None):
        ctx = make_ctx(tmp_path, clock, {"health": health or {}, "alerts": {"first_delay": "0s"}})
        probe = NvmlProbe(fake_nvml.lib_path, monotonic=clock.monotonic)
        w = HealthWatch(ctx, ctx.config.health, ctx.config.training, probe, job or Job(), rate=rate,
                        stop_machine=((lambda word, why: stops.append(word)) if stops is not None else None))
        made.append(probe)
        return w, ctx

    yield factory
    for p in made:
        p.close()


def kinds(ctx, kind="gpu_health"):
    return [e for e in ctx.alerts.recent(200) if e.get("kind") == kind and e.get("what") in ("event", "raised")]


def test_first_boot_count_is_remembered_in_state_dir(make, fake_nvml, tmp_path):
    fake_nvml.write(2)
    w, ctx = make()
    assert w.expect() == (None, "")
    assert w.preflight().verdict == H.OK
    assert w.expect() == (2, "the count at first boot")
    assert ctx.store.load("health", None)["first_count"] == 2
    fake_nvml.write(1)
    w2, ctx2 = make()  # a later daemon on the same state_dir
    assert w2.preflight().reasons() == ["1 of 2 GPUs present"]
    w3, _ = make(health={"expect_gpus": 1})  # the config wins
    assert w3.preflight().verdict == H.OK and w3.expect() == (1, "health.expect_gpus")


def test_refuse_and_stop(make, fake_nvml):
    fake_nvml.write([gpu(remap_failed=1)])
    w, ctx = make(health={"on_bad": "refuse"})
    with pytest.raises(TrainingError, match="row remapping failed"):
        w.check_start()
    assert w.status()["refused"]
    stops: list[str] = []
    w, ctx = make(health={"on_bad": "stop"}, stops=stops)
    with pytest.raises(TrainingError):
        w.check_start()
    w.preflight("again")
    assert stops == ["gpu_bad"]  # once
    w, ctx = make(health={"on_bad": "alert"}, stops=stops)
    w.check_start()  # alert only: the start goes ahead
    assert kinds(ctx)


def test_bad_with_stop_while_a_run_is_alive_only_alerts(make, fake_nvml):
    fake_nvml.write([gpu(retired_pending=1)])
    stops: list[str] = []
    w, ctx = make(health={"on_bad": "stop"}, job=Job(TrainingState.RUNNING, 1), stops=stops)
    assert w.preflight("at daemon start").verdict == H.BAD
    assert stops == [] and kinds(ctx)[0]["severity"] == "critical"


def test_live_ecc_and_slowdown_alerts_then_resolved(make, fake_nvml, clock):
    job = Job(TrainingState.RUNNING, 7)
    rate = [(7, 2.0)]
    w, ctx = make(job=job, rate=lambda: rate[-1])
    fake_nvml.write([gpu(ecc_uncorrected_volatile=0, throttle=0x4, util=97)])
    w.poll()
    fake_nvml.write([gpu(ecc_uncorrected_volatile=1, throttle=0x40, util=97, temp=89)])
    w.poll()
    ev = kinds(ctx)
    assert [e["severity"] for e in ev] == ["critical"] and "1 new uncorrectable ECC error" in ev[0]["subject"]
    clock.advance(H.SUSTAIN_S + 1)
    fake_nvml.write([gpu(ecc_uncorrected_volatile=1, throttle=0x40, util=55, temp=89)])
    rate.append((7, 1.2))
    w.poll()
    keys = {a["key"] for a in ctx.alerts.active()}
    assert keys == {"health:live:slowdown:0", "health:live:slower"}
    st = w.status()
    assert {f["key"] for f in st["live"]} == {"ecc_new:0", "slowdown:0", "slower"}
    slower = next(f for f in st["live"] if f["key"] == "slower")
    assert slower["what"] == "training 40 % slower than at its start while GPU 0 throttles"
    assert "during the run: GPU 0: HW thermal slowdown" in "\n".join(health_lines({"health": st}))
    fake_nvml.write([gpu(ecc_uncorrected_volatile=1, throttle=0x4, util=97)])
    rate.append((7, 2.0))
    w.poll()
    assert not ctx.alerts.active()
    assert [f["key"] for f in w.status()["live"]] == ["ecc_new:0"]  # the errors stay news for this run
    assert len(kinds(ctx)) == 3  # one ECC mail (not one per poll), the slowdown and the slower run


def test_a_new_run_starts_a_new_baseline(make, fake_nvml):
    job = Job(TrainingState.RUNNING, 1)
    w, ctx = make(job=job, rate=lambda: (job.run_id, 1.0))
    fake_nvml.write([gpu(ecc_uncorrected_volatile=3)])
    w.poll()
    job.state = TrainingState.STOPPED
    w.poll()
    job.state, job.run_id = TrainingState.RUNNING, 2
    w.poll()
    assert kinds(ctx) == []  # 3 errors before the run are the preflight's to judge, not "new"


def test_burn_in_skipped_and_said_without_torch(make, fake_nvml, tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    py = bin_ / "python3"  # a "training environment" whose Python has no torch
    py.write_text("#!/bin/sh\nexec /usr/bin/env -i /usr/bin/python3 -I -S \"$@\"\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    fake_nvml.write(1)
    w, ctx = make(health={"burn_in": "1s"})
    ctx.config.training.env = {"PATH": f"{bin_}:{os.environ.get('PATH', '')}"}
    v = w.preflight("at daemon start", burn_in=True)
    b = w.status()["burn_in"]
    assert b["state"] == "skipped" and "torch is not importable" in b["note"] and str(py) in b["note"]
    assert v.verdict == H.OK
    assert "burn-in   skipped: torch is not importable (ModuleNotFoundError) in the training's environment" \
        in render_health(w.status())


def test_status_screen_metrics_and_words(make, fake_nvml):
    fake_nvml.write([gpu(pcie_width=4, pcie_width_max=16, temp=40, power_mw=65000), gpu()])
    w, ctx = make(health={"expect_gpus": 2})
    w.preflight("at daemon start")
    st = {"health": w.status()}
    assert health_lines(st)[0] == ("health    DEGRADED: GPU 0: PCIe link x4 (max x16) — host-to-GPU copies (data "
                                   "loading, offload, multi-GPU over PCIe) run slower; ask the provider to reseat "
                                   "the card or for another machine if it matters")
    screen = render_health(st["health"])
    assert "verdict   DEGRADED (at daemon start)" in screen and "width 4, width.max 16" in screen
    assert "GPU 1" in screen and "ECC ?" in screen
    text = exposition(st)
    assert 'train_supervisor_gpu_health{state="DEGRADED"} 1' in text
    assert 'train_supervisor_gpu_health_problem{gpu="0",check="pcie_width",level="DEGRADED"} 1' in text
    assert 'train_supervisor_gpu_temperature_celsius{gpu="0"} 40' in text
    assert 'train_supervisor_gpu_power_watts{gpu="0"} 65' in text
    mail = kinds(ctx)[0]
    assert mail["subject"].startswith("GPU health DEGRADED: GPU 0: PCIe link x4")
    assert "Machine: 2 GPU(s), driver 550.54.15, CUDA 12.4" in mail["body"]
    assert "left out (unknown, not a fault)" in mail["body"]


def test_unsupported_everything_is_ok_with_no_alert(make, fake_nvml):
    fake_nvml.write(1)
    w, ctx = make(job=Job(TrainingState.RUNNING, 1), rate=lambda: (1, 1.0))
    assert w.preflight().verdict == H.OK
    w.poll()
    assert kinds(ctx) == [] and health_lines({"health": w.status()}) == ["health    OK (1 GPU(s), 11 field(s) unknown)"]


def test_no_driver_without_expectation_is_unknown(make, fake_nvml):
    fake_nvml.write(1, init=9)
    w, ctx = make()
    assert w.preflight().verdict == H.UNKNOWN and kinds(ctx) == []
    assert Path(ctx.config.state_dir, "health.json").exists() is False


def test_many_machines_line_says_a_bad_machine():
    from supervisor.fleet.hosts import HostResult, host_line

    st = {"now": 0, "training": {"state": "STOPPED"}, "idle": {"state": "ACTIVE"}, "health": {"verdict": "BAD"}}
    assert host_line(HostResult("gpu1", True, st), 6).endswith("idle ACTIVE  health BAD")
    st["health"]["verdict"] = "OK"
    assert "health" not in host_line(HostResult("gpu1", True, st), 6)


def test_stop_now_skips_the_warning_and_activity_does_not_cancel_it(clock):
    """idle.machine.stop_now, the move health.on_bad = "stop" makes: STOPPING at once, and the rule
    table says activity does not cancel it (states.STOP_RULES[HEALTH])."""
    from supervisor.idle.machine import IdleMachine, Now, Signal, Signals, Thresholds, step, stop_now
    from supervisor.states import IdleState

    th = Thresholds(warn_after=600.0, stop_after_warning=300.0, poll_interval=30.0, finish_grace=120.0)

    def now():
        return Now(clock.time(), clock.monotonic(), "boot-a")

    ssh = Signals((Signal("ssh", True, "ssh: root (pts/0)"),))
    m, _ = step(IdleMachine(), ssh, now(), th)
    assert m.state == IdleState.ACTIVE
    m = stop_now(m, now(), "gpu_bad")
    from supervisor.states import stop_rule

    assert (m.state, m.stop_reason, m.cycle) == (IdleState.STOPPING, "gpu_bad", 1)
    assert not stop_rule(m.stop_reason).activity_cancels and not stop_rule(m.stop_reason).keepalive_moves
    clock.advance(30)
    m2, actions = step(m, ssh, now(), th)
    assert m2.state == IdleState.STOPPING and actions == []  # a person logged in does not cancel it
    assert stop_now(m2, now(), "gpu_bad") == m2  # asked twice: the one stop goes on


def test_burn_in_result_from_the_workdir_venv_judges_a_slow_gpu(make, fake_nvml, tmp_path):
    """The burn-in's output as torch would print it, from a stand-in for the training's venv Python:
    the workdir's .venv is the one used, GPUs are numbered in PCI bus order, a slow one is DEGRADED."""
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    py = work / ".venv" / "bin" / "python"
    py.write_text('#!/bin/sh\nif [ "$CUDA_DEVICE_ORDER" = PCI_BUS_ID ] && [ -z "${CUDA_VISIBLE_DEVICES+x}" ]; then\n'
                  'echo \'{"tflops": {"0": 700.0, "1": 540.0}, "torch": "2.5.1"}\'\n'
                  'else echo \'{"skipped": "CUDA numbering differs from NVML"}\'; fi\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    fake_nvml.write(2)
    w, ctx = make(health={"burn_in": "1s"})
    ctx.config.training.workdir = str(work)
    ctx.config.training.env = {"CUDA_VISIBLE_DEVICES": "1"}
    v = w.preflight("at daemon start", burn_in=True)
    assert w.status()["burn_in"] == {"state": "done", "seconds": 1.0, "torch": "2.5.1", "tflops": {0: 700.0, 1: 540.0}}
    assert v.verdict == H.DEGRADED
    assert v.reasons() == ["GPU 1: slow in burn-in: 540 TFLOP/s, 23 % below the others (700)"]


def test_burn_in_once_per_boot_never_beside_a_run_and_starts_wait_for_it(make, fake_nvml, tmp_path, clock):
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    runs = tmp_path / "runs.txt"
    py = work / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho run >> {runs}\necho \'{{"tflops": {{"0": 700.0, "1": 690.0}}}}\'\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    fake_nvml.write(2)

    def watch(job=None):
        w, ctx = make(health={"burn_in": "1s"}, job=job)
        ctx.config.training.workdir = str(work)
        return w

    watch().preflight("at daemon start", burn_in=True)
    w2 = watch()  # the daemon restarted in the same boot: the result is reused, the GPUs not loaded again
    w2.preflight("at daemon start", burn_in=True)
    assert runs.read_text().splitlines() == ["run"]
    assert w2.status()["burn_in"]["tflops"] == {0: 700.0, 1: 690.0}
    clock.set_boot("boot-2", 5.0)  # a new boot: measured again, but not while a training runs
    w3 = watch(Job(TrainingState.RUNNING, 1))
    w3.preflight("at daemon start", burn_in=True)
    assert w3.status()["burn_in"] == {"state": "skipped", "note": "a training is running on the GPUs"}
    assert runs.read_text().splitlines() == ["run"]
    w4 = watch()
    w4._burn = {"state": "running", "seconds": 1.0}  # a start asked for while the burn-in runs
    with pytest.raises(TrainingError, match="burn-in .* is still running; no training started"):
        w4.check_start()


def test_a_webhook_carries_the_health_block():
    from supervisor.notify.webhook import facts_for

    st = {"now": 5.0, "health": {"verdict": "BAD"}, "training": {"state": "STOPPED"}, "sync": {}}
    assert facts_for("gpu_health", st) == {"health": {"verdict": "BAD"}, "training": {"state": "STOPPED"}, "at": 5.0}
