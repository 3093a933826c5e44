"""Golden texts: every mail the idle guard sends and its status lines, word for word.

Each scenario drives the guard (the same harness as tests/idle/test_guard.py: fake clock, in-test training,
GPU and sync) and writes what a person would read into one transcript, compared with
tests/golden/guard/<scenario>.txt. The zone is pinned to a fixed non-UTC one (CET-1, no tzdata needed)
so a local/UTC mix-up shows. To accept a deliberate wording change: GOLDEN_UPDATE=1 pytest this file,
then read the diff before committing it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from supervisor.interfaces import TrainingInfo
from supervisor.states import TrainingState as T
from tests.idle.test_guard import FakeTraining, H

GOLDEN = Path(__file__).parents[1] / "golden" / "guard"


class Capture:
    """A mailer that keeps what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def send(self, subject: str, body: str) -> None:
        self.sent.append((subject, body))


class Training(FakeTraining):
    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.signal: str | None = None

    def info(self) -> TrainingInfo:
        i = super().info()
        return TrainingInfo(**{**i.__dict__, "signal": self.signal})


@pytest.fixture(autouse=True)
def fixed_zone():
    old = os.environ.get("TZ")
    os.environ["TZ"] = "CET-1"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


class Transcript:
    def __init__(self, h: H, cap: Capture):
        self.h, self.cap, self.out, self.seen = h, cap, [], 0

    def mails(self) -> None:
        for subject, body in self.cap.sent[self.seen:]:
            self.out.append(f"=== mail\nSubject: {subject}\n\n{body}".replace(str(self.h.tmp), "<tmp>"))
        self.seen = len(self.cap.sent)

    def lines(self, label: str) -> None:
        self.mails()
        self.out.append(f"=== status lines ({label})\n" + "\n".join(idle_lines(self.h)) + "\n")

    def history(self) -> None:
        """The stop record's history (stop.json), which a person reads when a stop went wrong."""
        self.mails()
        self.out.append("=== stop history\n" + "\n".join(self.h.guard.stopper.rec.history) + "\n")

    def note(self, text: str) -> None:
        self.mails()
        self.out.append(f"=== {text}\n")

    def check(self, name: str) -> None:
        self.mails()
        got = "\n".join(self.out)
        path = GOLDEN / f"{name}.txt"
        if os.environ.get("GOLDEN_UPDATE"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(got)
        assert path.exists(), f"no golden file {path}: run with GOLDEN_UPDATE=1 and read it"
        assert got == path.read_text(), f"{name}: the text differs from {path}"


def idle_lines(h: H) -> list[str]:
    return h.lines()


def make(tmp_path, clock, config=None, **kw) -> tuple[H, Transcript]:
    cap = Capture()
    h = H(tmp_path, clock, config=config, mailer=cap, training=kw.pop("training", None) or Training(tmp_path), **kw)
    return h, Transcript(h, cap)


def test_idle_cycle_warning_and_verified_stop(tmp_path, clock):
    h, t = make(tmp_path, clock)
    h.gpu.util = 97.0
    h.poll()
    t.lines("active")
    h.gpu.util = 1.0
    h.poll(2)
    t.lines("idle")
    h.until("WARNED")
    t.lines("warned")
    h.until("STOPPED")
    t.lines("stopped by dry-run")
    t.check("idle_cycle")


def test_cancelled_after_the_warning(tmp_path, clock):
    h, t = make(tmp_path, clock)
    h.until("WARNED")
    h.gpu.util = 80.0
    h.poll()
    t.lines("active again")
    t.check("cancelled_after_warning")


def test_final_sync_fails_then_activity_cancels_the_stop(tmp_path, clock):
    h, t = make(tmp_path, clock)
    h.sync.ok = False
    h.until("STOPPING")
    h.poll()
    t.lines("stopping, final sync failing")
    h.gpu.util = 50.0
    h.poll()
    h.poll()
    t.check("sync_failed_then_cancelled")


def test_final_sync_fails_and_the_cost_cap_forces_the_stop(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"max_idle_cost": 0.80})
    h.sync.ok = False
    h.until("STOPPED")
    t.lines("stopped although the sync failed")
    t.history()
    t.check("forced_stop")


def test_stalled_training(tmp_path, clock):
    h, t = make(tmp_path, clock)
    h.training.state, h.training.run_id = T.RUNNING, 1
    h.training.log.write_text("step 1\n")
    os.utime(h.training.log, (h.clock.time(), h.clock.time()))
    h.poll()
    t.lines("active: the log is written")
    h.until("WARNED", max_polls=60)
    t.lines("warned, stalled")
    h.training.polls_to_end = 2
    h.until("STOPPING")
    t.lines("interrupting the training")
    h.until("STOPPED")
    t.lines("stopped, stalled")
    t.check("stalled_training")


def test_stop_action_fails(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"stop": {"action": "command", "command": "echo 'no such pod' >&2; exit 3"}})
    h.until("WARNED")
    h.poll(10)
    t.lines("the action failed")
    t.check("stop_action_failed")


def test_still_up_after_the_stop_action(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"stop": {"action": "command", "command": "true"}})
    h.until("STOPPED")
    t.lines("stopped by a command")
    h.poll(21)
    t.check("still_up")


def test_keepalive_messages(tmp_path, clock):
    h, t = make(tmp_path, clock)
    h.until("WARNED")
    t.note(h.guard.keepalive(7200)["message"])
    t.lines("kept alive")
    t.note(h.guard.cancel_keepalive()["message"])
    t.note(h.guard.cancel_keepalive()["message"])
    t.check("keepalive")


def _end(h: H, state: T, code: int | None, run_id: int, signal: str | None = None) -> None:
    h.training.state, h.training.run_id, h.training.exit_code = state, run_id, code
    h.training.signal = signal
    h.guard.on_training_ended(h.training.info())
    assert h.guard.drain(10)
    h.ctx.alerts.tick(wait=True)


def test_training_finished_on_finish_stop(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"training": {"on_finish": "stop"}})
    h.training.state, h.training.run_id = T.RUNNING, 7
    h.gpu.util = 90.0
    h.poll()
    h.gpu.util = 0.0
    _end(h, T.FINISHED, 0, 7)
    t.lines("finish grace")
    h.until("STOPPED")
    t.lines("stopped after the grace")
    t.check("finished_on_finish_stop")


def test_training_finish_grace_held_by_activity(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"training": {"on_finish": "stop"}})
    h.gpu.util = 60.0
    _end(h, T.FINISHED, 0, 2)
    h.poll()
    t.lines("grace held by activity")
    t.check("finish_grace_held")


def test_training_failed_on_finish_stop_with_a_failing_sync(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"training": {"on_finish": "stop"}})
    h.sync.ok = False
    _end(h, T.FAILED, None, 4, signal="SIGKILL")
    t.check("failed_on_finish_stop_sync_failed")


def test_training_finished_while_a_stop_is_under_way(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"training": {"on_finish": "stop"}})
    h.sync.ok = False
    h.until("STOPPING")
    h.poll()
    h.sync.ok = True
    _end(h, T.FINISHED, 0, 9)
    t.check("finished_during_stop")


def test_final_syncs_that_sent_files_as_they_are_name_them(tmp_path, clock):
    h, t = make(tmp_path, clock, config={"training": {"on_finish": "stop"}})
    h.sync.damaged = ["/workspace/out/adapter/adapter_model.safetensors"]
    h.sync.partial_units = ["checkpoint-8 (never finished: no trainer_state.json)"]
    _end(h, T.FINISHED, 0, 5)
    h.until("STOPPED")
    t.lines("stopped; the final sync sent files as they are")
    t.check("not_whole")


@pytest.mark.parametrize("mode", ["idle", "none"])
def test_training_failed_on_finish_idle_and_none(tmp_path, clock, mode):
    h, t = make(tmp_path, clock, config={"training": {"on_finish": mode}})
    _end(h, T.FAILED, 3, 3)
    t.check(f"failed_on_finish_{mode}")
