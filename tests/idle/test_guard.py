"""IdleGuard with a fake clock: the whole idle cycle, its mails through a real SMTP server, the stop
sequence, on-finish handling, restarts and reboots. Training, GPU and sync are small in-test
stand-ins for their interfaces (their own tests use the real things); the e2e file wires reals."""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import replace

import pytest

from supervisor.cli.render import idle_lines
from supervisor.daemon.control import RequestError
from supervisor.idle.guard import GuardConfig, IdleGuard
from supervisor.interfaces import FinalSyncResult, TrainingInfo
from supervisor.notify.mail import SmtpMailer
from supervisor.states import TrainingState as T
from tests.fixtures.idle import make_ctx

POLL = 30


class FakeTraining:
    def __init__(self, tmp_path):
        self.log = tmp_path / "train.log"
        self.state = T.STOPPED
        self.run_id = 0
        self.exit_code = None
        self.raise_info = False
        self.stops = 0
        self.polls_to_end: int | None = 1  # how many polls a stop takes (its save on SIGINT); None = never ends
        self._left: int | None = None

    def stop(self) -> dict:
        """As supervisorctl stop: SIGINT now, the end comes later (see tick)."""
        if self.state not in (T.STARTING, T.RUNNING, T.STOPPING):
            raise RuntimeError(f"training is not running ({self.state.value})")
        self.stops += 1
        if self.state != T.STOPPING:
            self.state, self._left = T.STOPPING, self.polls_to_end
        return {}

    def tick(self) -> None:
        if self.state == T.STOPPING and self._left is not None:
            self._left -= 1
            if self._left <= 0:
                self.state, self.exit_code = T.STOPPED, 0

    def info(self) -> TrainingInfo:
        if self.raise_info:
            raise RuntimeError("training module bug")
        alive = (T.STARTING, T.RUNNING, T.STOPPING)
        return TrainingInfo(state=self.state, pid=4242 if self.state in alive else None,
                            started_at=1_799_990_000.0, ended_at=1_800_000_000.0 if self.exit_code is not None else None,
                            exit_code=self.exit_code, command="python train.py", log_path=str(self.log),
                            workdir="/workspace", session="train", run_id=self.run_id)

    def pids(self) -> set[int]:
        return set()


class FakeGpu:
    def __init__(self, util: float | None = 0.0, gpus: int = 1):
        self.util, self.gpus = util, gpus

    def utilization(self, window_s):
        return self.util

    def status(self):
        return {"gpus": [{"index": i} for i in range(self.gpus)], "gpu_error": None if self.gpus else "no driver"}


class FakeSync:
    display = "s3://bucket/run1"

    def __init__(self):
        self.ok = True
        self.calls: list[list[str]] = []
        self.gate: threading.Event | None = None
        self.damaged: list[str] = []        # what a final sync sent as it is although it is not whole
        self.partial_units: list[str] = []

    def final_sync(self, paths, timeout_s):
        self.calls.append(list(paths))
        if self.gate is not None:
            self.gate.wait(10)
        if self.ok:
            r = FinalSyncResult(ok=True, target=self.display, files=3, bytes=3 * 1024 * 1024, uploaded_files=1)
            r.damaged, r.partial_units = list(self.damaged), list(self.partial_units)  # fields of newer engines
            return r
        return FinalSyncResult(ok=False, target=self.display, error="connection refused",
                               unsynced=["/workspace/out/checkpoint-30/model.safetensors"])

    def request_sync(self):
        pass

    def status(self):
        return {}


class FakeProgress:
    def snapshot(self, now):
        return {"step": 3750, "max_steps": 3750, "epoch": 3.0, "loss": 0.8123, "tokens_per_s": None, "eta_s": 0}

    def cost(self, now):
        return {"price_per_hour": 3.9, "currency": "EUR", "spent": 12.48, "eta_cost": None}


def merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class H:
    """The guard as the daemon runs it, with every poll POLL fake seconds apart."""

    def __init__(self, tmp_path, clock, smtp=None, config=None, training=None, gpu=None, sync=None, mailer=None):
        base = {
            "price_per_hour": 3.6, "currency": "EUR",
            "training": {"on_finish": "none", "finish_grace": "2m", "session": "train"},
            "sync": {"target": "s3://bucket/run1", "watch": ["/workspace/out"]},
            "idle": {"poll_interval": f"{POLL}s", "warn_after": "10m", "stop_after_warning": "5m", "gpu_window": "5m",
                     "count_ssh": False, "count_tmux_clients": False, "activity_window": "10m"},
            "stop": {"action": "dry-run", "retry_interval": "2m", "final_sync": ["/workspace/out"]},
            "alerts": {"first_delay": "0s"},
        }
        if smtp is not None:
            base["email"] = {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                             "smtp_port": smtp.port, "security": "none"}
        self.tmp, self.clock, self.smtp, self.mailer = tmp_path, clock, smtp, mailer
        self.config = merge(base, config or {})
        self.training = training or FakeTraining(tmp_path)
        self.gpu = gpu or FakeGpu(0.0)
        self.sync = sync or FakeSync()
        self.clock.set_boot("boot-1", 50.0)
        self.restart()

    def restart(self, config: dict | None = None) -> IdleGuard:
        """A new daemon: same state dir, same clock (monotonic is system-wide within a boot)."""
        if config:
            self.config = merge(self.config, config)
        mailer = self.mailer
        if self.smtp is not None:
            from supervisor.config import from_dict
            mailer = SmtpMailer(from_dict({"state_dir": "/tmp", "email": self.config["email"]}).email, "gpu-box")
        self.ctx = make_ctx(self.tmp, self.clock, self.config, mailer)
        self.guard = IdleGuard.of(self.ctx, GuardConfig.of(self.ctx.config), self.training, self.gpu, self.sync, FakeProgress())
        return self.guard

    def poll(self, n: int = 1) -> None:
        for _ in range(n):
            self.clock.advance(POLL)
            if hasattr(self.training, "tick"):
                self.training.tick()
            self.guard.poll()
            assert self.guard.drain(20)
            self.ctx.alerts.tick(wait=True)

    def until(self, state: str, max_polls: int = 200) -> int:
        for i in range(max_polls):
            if self.state == state:
                return i
            self.poll()
        raise AssertionError(f"never reached {state}; at {self.state}: {self.guard.status()}")

    def lines(self) -> list[str]:
        """The idle section of `supervisorctl status`, built from the status dict as the CLI does."""
        return idle_lines({"now": self.clock.time(), **self.guard.status()})

    @property
    def state(self) -> str:
        return self.guard.status()["idle"]["state"]

    def mails(self) -> list[tuple[str, str]]:
        out = []
        for m in self.smtp.messages if self.smtp else []:
            body = m.get_payload(decode=True).decode("utf-8", "replace")
            out.append((str(m["Subject"]).replace("\r\n", ""), body))
        return out


@pytest.fixture
def h(tmp_path, clock, smtp_server):
    return H(tmp_path, clock, smtp_server)


def test_full_idle_cycle_warning_then_verified_stop(h):
    h.gpu.util = 97.0
    h.poll()
    st = h.guard.status()["idle"]
    assert st["state"] == "ACTIVE" and st["reasons"] == ["gpu: 97% over 5m00s"] and st["warn_at"] is None
    h.gpu.util = 1.0
    h.poll()
    st = h.guard.status()
    assert st["idle"]["state"] == "IDLE" and st["idle"]["reasons"] == []
    assert st["idle"]["warn_at"] == pytest.approx(h.clock.time() + 600)
    assert st["idle"]["stop_at"] == pytest.approx(h.clock.time() + 900)
    assert st["stop"]["planned_at"] == pytest.approx(h.clock.time() + 900)
    assert any("gpu: 1% over 5m00s" in c for c in st["idle"]["checked"])
    polls = h.until("WARNED")
    assert polls == 20  # 600 s of idleness in 30 s polls: exactly at the threshold
    (subject, body), = h.mails()
    assert "idle for 10m00s: stopping at" in subject
    assert "supervisorctl keepalive 2h" in body
    assert "Cost while idle: 0.60 EUR (at 3.60 EUR/hour)" in body
    assert "in 5m00s" in body and "/workspace/out to s3://bucket/run1" in body
    assert "gpu: 1% over 5m00s (idle below 5%)" in body
    h.poll(9)
    assert h.state == "WARNED" and not h.sync.calls
    h.poll()  # 300 s after the warning
    assert h.state == "STOPPED"
    assert h.sync.calls == [["/workspace/out"]]
    subjects = [s for s, _ in h.mails()]
    assert len(subjects) == 2 and "stopping now (idle for 15m00s): final sync verified, 3 files at s3://bucket/run1" \
        in subjects[1]
    body = h.mails()[1][1]
    assert "3.0 MiB" in body and "Folders: /workspace/out" in body and "dry-run" in body
    st = h.guard.status()
    assert st["stop"]["phase"] == "done" and st["stop"]["result"].startswith("dry-run")
    assert st["stop"]["final_sync"]["files"] == 3
    assert any("dry-run" in ln for ln in h.lines())


def test_activity_after_the_warning_cancels_with_a_mail(h):
    h.until("WARNED")
    h.gpu.util = 80.0
    h.poll()
    assert h.state == "ACTIVE"
    subjects = [s for s, _ in h.mails()]
    assert len(subjects) == 2 and "stop cancelled: gpu: 80% over 5m00s" in subjects[1]
    h.gpu.util = 0.0
    h.until("WARNED")  # a second cycle warns again: unique mail keys, not deduplicated away
    assert len(h.mails()) == 3


def test_s3_down_at_stop_time_no_stop_alert_and_retry(h):
    h.sync.ok = False
    h.until("STOPPING")
    h.poll()
    assert h.state == "STOPPING" and len(h.sync.calls) == 1
    st = h.guard.status()["stop"]
    assert st["phase"] == "final_sync" and st["last_error"] == "final sync failed: connection refused"
    subjects = [s for s, _ in h.mails()]
    assert any("NOT stopping: final sync failed (connection refused)" in s for s in subjects)
    body = [b for s, b in h.mails() if "NOT stopping" in s][0]
    assert "checkpoint-30/model.safetensors" in body
    h.poll(2)  # 90 s after the failed attempt: before the 2 min retry
    assert len(h.sync.calls) == 1
    h.poll()
    assert len(h.sync.calls) == 2 and h.state == "STOPPING"
    assert not any("stopping now" in s for s, _ in h.mails())
    h.sync.ok = True
    h.poll(5)
    assert h.state == "STOPPED"
    assert any("stopping now" in s for s, _ in h.mails())
    assert not h.ctx.alerts.active()


def test_activity_while_the_final_sync_retries_cancels_the_stop(h):
    h.sync.ok = False
    h.until("STOPPING")
    h.poll()
    h.gpu.util = 50.0
    h.poll()
    assert h.state == "ACTIVE"
    assert h.guard.status()["stop"]["phase"] is None
    assert any("stop cancelled" in s for s, _ in h.mails())
    assert not h.ctx.alerts.active()


@pytest.mark.parametrize("extra, stops", [
    ({"stop": {"stop_even_if_sync_fails": True}}, True),
    ({"max_idle_cost": 0.80}, True),    # 3.60/h: 0.80 reached after 13m20s idle
    ({"max_idle_cost": 50.0}, False),
])
def test_failing_sync_blocks_the_stop_unless_allowed_or_capped(tmp_path, clock, extra, stops):
    h = H(tmp_path, clock, config=extra)
    h.sync.ok = False
    h.until("WARNED")
    h.poll(14)
    assert (h.state == "STOPPED") is stops
    if stops:
        rec = h.guard.stopper.rec
        assert rec.forced and rec.phase == "done"


def _quiet_run(h, run_id: int = 1) -> None:
    h.training.state, h.training.run_id = T.RUNNING, run_id
    h.training.log.write_text("step 1\n")
    os.utime(h.training.log, (h.clock.time(), h.clock.time()))


def test_stalled_training_is_interrupted_and_ends_before_the_final_sync_and_the_stop(h):
    _quiet_run(h)
    h.poll()
    st = h.guard.status()["idle"]
    assert st["state"] == "ACTIVE" and st["reasons"][0].startswith("training: log written")
    # no output for activity_window (10 min), GPU idle, no CPU: looks stalled
    h.until("WARNED", max_polls=60)
    subject, body = h.mails()[0]
    assert "(training looks stalled)" in subject
    assert "Run 1 is still running (pid 4242" in body and "no output for 20m00s, GPU 0%, CPU 0%" in body
    assert "it looks stalled; it will be interrupted at" in body and "SIGINT, then SIGTERM and SIGKILL" in body
    assert any("looks stalled" in ln for ln in h.lines())
    h.training.polls_to_end = 3
    h.until("STOPPING")
    assert h.training.stops == 1 and not h.sync.calls
    st = h.guard.status()["stop"]
    assert st["phase"] == "interrupting" and st["interrupted_run"] == 1
    assert any(ln.startswith("stop      interrupting run 1") for ln in h.lines())
    h.poll()  # its STOPPING state, the GPU load and the output of its save are not activity now
    h.gpu.util = 90.0
    h.poll()
    assert h.state == "STOPPING" and h.guard.status()["stop"]["phase"] == "interrupting" and not h.sync.calls
    h.poll()
    assert h.state == "STOPPED" and h.training.state == T.STOPPED
    assert h.training.stops == 1 and h.sync.calls == [["/workspace/out"]]
    _, body = h.mails()[1]
    assert "Run 1 was still running and looked stalled: it was interrupted at" in body
    assert "and ended (exit code 0) before the final sync" in body
    history = " | ".join(h.guard.stopper.rec.history)
    assert history.index("interrupting run 1") < history.index("run 1 ended (exit code 0)") \
        < history.index("final sync verified") < history.index("dry-run: would have")


def test_a_restart_mid_interrupt_waits_for_the_same_run_and_stops_once(h):
    _quiet_run(h)
    h.training.polls_to_end = 4
    h.until("STOPPING", max_polls=80)
    assert h.guard.status()["stop"]["phase"] == "interrupting"
    h.restart()  # kill -9 while the training saves
    h.poll()
    assert h.state == "STOPPING" and h.guard.status()["stop"]["phase"] == "interrupting" and not h.sync.calls
    h.until("STOPPED")
    assert h.training.stops == 1 and len(h.sync.calls) == 1
    assert len([s for s, _ in h.mails() if "stopping now" in s]) == 1


def test_a_training_that_outlives_every_signal_does_not_hold_the_stop_for_ever(h):
    _quiet_run(h)
    h.training.polls_to_end = None
    h.until("STOPPING", max_polls=80)
    h.poll(3)  # 2 x stop_grace (30s) + 60s = 2 min
    assert h.guard.status()["stop"]["phase"] == "interrupting" and not h.sync.calls
    h.until("STOPPED", max_polls=3)
    assert "was still alive 2m00s later, after SIGINT, SIGTERM and SIGKILL" in h.mails()[-1][1]


def test_a_person_cancels_an_interrupting_stop_the_training_does_not(h):
    _quiet_run(h)
    h.training.polls_to_end = None
    h.until("STOPPING", max_polls=80)
    h.gpu.util = 80.0
    h.poll(2)
    assert h.state == "STOPPING"
    h.guard.keepalive(3600)
    assert h.state == "ACTIVE" and h.guard.status()["stop"]["phase"] is None
    assert h.guard.stopper.rec.phase == "cancelled" and not h.sync.calls


def test_a_training_that_outlives_sigkill_counts_as_stopping_only_for_a_while(h):
    h.training.state, h.training.run_id = T.STOPPING, 6  # someone's `supervisorctl stop`, unkillable job
    h.poll()
    assert h.state == "ACTIVE" and h.guard.status()["idle"]["reasons"] == ["training: stopping"]
    h.poll(4)  # 2 x stop_grace (30s) + 1m
    st = h.guard.status()["idle"]
    assert st["state"] == "IDLE" and any("still alive after SIGKILL (no longer counted)" in c for c in st["checked"])


def test_training_starting_counts_as_work(h):
    h.training.state = T.STARTING
    h.poll(40)
    assert h.state == "ACTIVE" and h.guard.status()["idle"]["reasons"] == ["training: starting"]


def test_unknown_gpu_util_while_training_runs_is_not_idle_but_no_gpu_is(h):
    h.training.state, h.training.run_id = T.RUNNING, 1
    h.gpu.util = None
    h.config["idle"]["count_training_output"] = False
    h.restart()
    h.poll()
    assert h.state == "ACTIVE" and "utilization unknown while training runs" in h.guard.status()["idle"]["reasons"][0]
    h.poll(20)  # 2 x gpu_window later the unknown stops counting
    assert h.state == "IDLE"
    h2 = H(h.tmp / "nogpu", h.clock, gpu=FakeGpu(None, gpus=0))
    h2.training.state = T.RUNNING
    h2.poll(2)
    assert h2.state == "IDLE" and any("gpu: none" in c for c in h2.guard.status()["idle"]["checked"])


def test_keepalive_cancels_at_once_holds_and_can_be_cancelled(h):
    h.until("WARNED")
    res = h.guard.keepalive(7200)
    assert res["message"].startswith("kept alive until") and "the idle clock starts then" in res["message"]
    h.ctx.alerts.tick(wait=True)
    assert h.state == "ACTIVE" and any("stop cancelled: keepalive until" in s for s, _ in h.mails())
    st = h.guard.status()["idle"]
    assert st["keepalive_until"] == pytest.approx(h.clock.time() + 7200)
    h.poll(200)  # 100 minutes
    assert h.state == "ACTIVE"
    assert h.guard.cancel_keepalive()["message"].startswith("keepalive cancelled")
    h.poll()
    assert h.state == "IDLE"
    assert h.guard.cancel_keepalive()["message"] == "no keepalive was set"


def test_keepalive_is_refused_once_the_action_began(h, tmp_path):
    h.restart({"stop": {"action": "command", "command": f"touch {tmp_path / 'stopped'}"}})
    h.until("STOPPED")
    assert (tmp_path / "stopped").exists()
    with pytest.raises(RequestError, match="keepalive: the machine was already stopped"):
        h.guard.keepalive(60)
    h2 = H(h.tmp / "2", h.clock)
    h2.sync.ok = False
    h2.until("STOPPING")
    h2.guard.st.m = replace(h2.guard.m, committed=True)  # as between "stopping now" and the action
    with pytest.raises(RequestError, match="too late"):
        h2.guard.keepalive(60)


def test_a_dry_run_stop_comes_back_to_life_on_keepalive(h):
    h.until("STOPPED")
    h.guard.keepalive(600)
    assert h.state == "ACTIVE"


def test_restart_mid_warning_keeps_the_promised_stop_time(h):
    h.until("WARNED")
    promised = h.guard.status()["idle"]["stop_at"]
    # the new daemon comes with a config whose wait is shorter: the promise stands
    h.restart({"idle": {"stop_after_warning": "1m", "warn_after": "1m"}})
    h.poll(9)
    assert h.state == "WARNED"
    assert h.guard.status()["idle"]["stop_at"] == pytest.approx(promised)
    h.poll()
    assert h.state == "STOPPED"
    assert len([s for s, _ in h.mails() if "unless you act" in s]) == 1  # no second warning


def test_restart_mid_stop_resumes_instead_of_starting_over(h):
    h.sync.ok = False
    h.until("STOPPING")
    h.poll()
    first = h.guard.stopper.rec
    h.restart()
    h.sync.ok = True
    h.poll(5)
    assert h.state == "STOPPED"
    rec = h.guard.stopper.rec
    assert rec.id == first.id and rec.action_attempts == 1
    assert any("resumed after a daemon restart" in x for x in rec.history)
    assert len([s for s, _ in h.mails() if "stopping now" in s]) == 1


def test_reboot_forgets_a_stop_and_starts_the_clock_at_boot(h):
    h.until("STOPPED")
    h.clock.set_boot("boot-2", 40.0)
    h.restart()
    h.poll()
    st = h.guard.status()
    assert st["idle"]["state"] == "IDLE" and st["stop"]["phase"] is None
    assert st["idle"]["idle_for_s"] == pytest.approx(40.0)
    assert st["idle"]["idle_since"] == pytest.approx(h.clock.time() - 40.0)


def test_on_finish_stop_syncs_mails_the_result_and_stops_after_the_grace(h):
    h.restart({"training": {"on_finish": "stop"}})
    h.training.state, h.training.run_id = T.RUNNING, 7
    h.gpu.util = 90.0
    h.poll()
    h.training.state, h.training.exit_code = T.FINISHED, 0
    h.gpu.util = 0.0
    h.guard.on_training_ended(h.training.info())
    h.guard.on_training_ended(h.training.info())  # once per run, whatever the caller does
    assert h.guard.drain(10)
    h.ctx.alerts.tick(wait=True)
    assert h.sync.calls == [["/workspace/out"]]
    (subject, body), = h.mails()
    assert subject.endswith(subject.split("training finished (exit code 0); stopping at ")[-1])
    assert "training finished (exit code 0); stopping at" in subject
    assert "step 3750/3750, epoch 3.00, loss 0.8123" in body and "Cost so far: 12.48 EUR" in body
    assert "final sync verified, 3 files (3.0 MiB) at s3://bucket/run1" in body
    assert "supervisorctl keepalive 2h" in body and "Log: " in body
    assert h.state == "WARNED"
    h.poll(3)
    assert h.state == "WARNED"
    h.poll()  # 2 min grace
    assert h.state == "STOPPED" and h.guard.stopper.rec.reason == "finished"
    assert "stopping now (training finished)" in h.mails()[-1][0]


def test_on_finish_grace_is_extended_by_activity(h):
    h.restart({"training": {"on_finish": "stop"}})
    h.training.state, h.training.run_id, h.training.exit_code = T.FINISHED, 2, 0
    h.guard.on_training_ended(h.training.info())
    h.guard.drain(10)
    h.poll(2)
    h.gpu.util = 70.0  # someone runs an evaluation by hand
    h.poll(20)
    assert h.state == "ACTIVE"
    h.gpu.util = 0.0
    h.poll(4)
    assert h.state == "WARNED"
    h.poll(1)
    assert h.state == "STOPPED"
    assert not any("stop cancelled" in s for s, _ in h.mails())


@pytest.mark.parametrize("mode", ["idle", "none"])
def test_on_finish_idle_and_none_leave_it_to_idle_protection(h, mode):
    h.restart({"training": {"on_finish": mode}})
    h.training.state, h.training.run_id, h.training.exit_code = T.FAILED, 3, 3
    h.guard.on_training_ended(h.training.info())
    h.guard.drain(10)
    h.ctx.alerts.tick(wait=True)
    (subject, body), = h.mails()
    assert subject.endswith("training FAILED (exit code 3)")
    assert ("idle protection decides" in body) if mode == "idle" else ('on_finish = "none"' in body)
    assert h.sync.calls == ([["/workspace/out"]] if mode == "idle" else [])
    h.poll(10)
    assert h.state == "IDLE"


def test_a_run_end_cut_short_by_a_restart_is_handled_after_it(h):
    h.restart({"training": {"on_finish": "stop"}})
    stuck = FakeSync()
    stuck.gate = threading.Event()
    old = h.guard
    old.sync = old.stop.sync = stuck  # the old daemon "dies" inside its final sync: it never gets further
    h.training.state, h.training.run_id, h.training.exit_code = T.FINISHED, 5, 0
    old.on_training_ended(h.training.info())
    try:
        h.restart()
        h.poll()
        assert h.guard.drain(10)
        h.ctx.alerts.tick(wait=True)
        assert h.sync.calls == [["/workspace/out"]]
        assert h.guard.status()["idle"]["mode"] == "finish"
        assert len([s for s, _ in h.mails() if "training finished" in s]) == 1
        h.until("STOPPED")
    finally:
        stuck.gate.set()
        old.drain(10)


def test_corrupt_idle_state_starts_over_and_is_reported(tmp_path, clock):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "idle.json").write_text('{"state": "NAPPING"}')
    h = H(tmp_path, clock)
    assert any("idle.json" in p for p in h.ctx.store.problems)
    h.poll()
    assert h.state == "IDLE"


def test_poll_survives_a_broken_training_view(h):
    h.training.raise_info = True
    h.poll(2)
    assert h.state == "IDLE"


def test_a_failed_run_awaiting_its_restart_is_not_a_finish(h):
    """The training module does not report a FAILED run it will restart; the guard must not
    discover it on its own and stop the machine under the restart."""
    h.restart({"training": {"on_finish": "stop"}})
    h.training.state, h.training.run_id, h.training.exit_code = T.FAILED, 4, 1
    h.poll(10)
    st = h.guard.status()["idle"]
    assert st["state"] == "IDLE" and st["mode"] == "idle" and not h.mails() and not h.sync.calls


def test_announced_stop_time_is_when_the_stop_happens(h):
    """Issue 12.6, the demo's clock: the run ends between polls; the mail's "stopping at" is the end
    plus the grace, status counts idle seconds between polls, and the 1 s due-check (the daemon's
    1 s "training" duty) stops at that second, not at the next 30 s poll."""
    h.restart({"training": {"on_finish": "stop"}})
    h.training.state, h.training.run_id = T.RUNNING, 7
    h.gpu.util = 90.0
    h.poll()
    h.clock.advance(20)
    h.training.state, h.training.exit_code = T.FINISHED, 0
    h.gpu.util = 0.0
    ended = h.clock.time()
    h.guard.on_training_ended(h.training.info())
    assert h.guard.drain(10)
    stop_at = h.guard.status()["idle"]["stop_at"]
    assert stop_at == pytest.approx(ended + 120)
    h.guard.poll_soon()
    h.guard.poll_if_due()  # the run end is judged at once, not at the next poll
    assert h.guard.status()["idle"]["idle_for_s"] == pytest.approx(0.0)
    h.clock.advance(7)
    assert h.guard.status()["idle"]["idle_for_s"] == pytest.approx(7.0)  # not frozen between polls
    seconds = 7
    while h.state != "STOPPED":
        h.clock.advance(1)
        seconds += 1
        if seconds % int(POLL) == 0:
            h.guard.poll()
        h.guard.poll_if_due()
        assert h.guard.drain(20)
        assert seconds <= 130, h.guard.status()
    assert h.clock.time() == pytest.approx(stop_at)
