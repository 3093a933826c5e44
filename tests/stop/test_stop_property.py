"""A property over whole stop sequences, through the guard with a fake clock: runs that start and go
quiet, activity, final syncs that fail and recover, trainings slow or unable to die, daemon restarts
and keepalives, in any order. Whenever the stop action runs: no training is alive, the final sync it
relies on ran after the training had ended and verified (or the stop was forced by the configured
rule), and it runs once per stop. The one exception is a training that outlives SIGINT, SIGTERM
and SIGKILL (uninterruptible): the stop then goes ahead after 2 x stop_grace + 1m, and says so."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.clock import FakeClock
from supervisor.daemon.control import RequestError
from supervisor.states import TRAINING_ALIVE
from supervisor.states import TrainingState as T
from tests.idle.test_guard import FakeSync, H


class WatchedSync(FakeSync):
    def __init__(self, training):
        super().__init__()
        self.training = training
        self.alive_at_call: list[bool] = []

    def final_sync(self, paths, timeout_s):
        self.alive_at_call.append(self.training.state in TRAINING_ALIVE)
        return super().final_sync(paths, timeout_s)


EVENTS = st.sampled_from(["poll", "polls", "polls", "busy", "quiet", "run", "sync_fail", "sync_ok",
                          "restart", "slow_stop", "stuck_stop", "keepalive", "person_leaves"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(EVENTS, min_size=5, max_size=40), st.booleans())
def test_the_action_runs_only_after_the_training_ended_and_its_outputs_were_synced(events, capped):
    tmp = Path(tempfile.mkdtemp(prefix="stop-prop-"))
    try:
        _run_events(tmp, events, capped)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # hypothesis runs it 60 times: leave no folder behind


def _run_events(tmp: Path, events, capped) -> None:
    h = H(tmp, FakeClock(), config={"max_idle_cost": 1.5} if capped else {})
    h.sync = WatchedSync(h.training)
    acted: list[str] = []
    broken: list[str] = []  # the guard catches what the action raises: collect, assert at the end

    def action(_cfg) -> str:
        rec = h.guard.stopper.rec
        unkillable = rec.interrupted_run == h.training.run_id and rec.interrupted_at is not None \
            and not rec.interrupt_ended and any("still alive" in x for x in rec.history)
        if h.training.state in TRAINING_ALIVE and not unkillable:
            broken.append(f"the stop action ran while run {h.training.run_id} lived")
        if not h.sync.alive_at_call or (h.sync.alive_at_call[-1] and not unkillable):
            broken.append("the final sync ran before the training ended")
        if not rec.synced or not (rec.synced["ok"] or rec.forced):
            broken.append("acted without a verified (or forced) final sync")
        if rec.id in acted:
            broken.append(f"the action ran twice for stop {rec.id}")
        acted.append(rec.id)
        return "stopped (test)"

    def restart() -> None:
        h.restart({"stop": {"action": "poweroff"}})
        h.guard.sync = h.sync
        h.guard.stopper.runners["poweroff"] = action

    restart()
    run_id = 0
    for e in events:
        if e == "poll":
            h.poll()
        elif e == "polls":
            h.poll(12)
        elif e == "busy":
            h.gpu.util = 80.0
        elif e in ("quiet", "person_leaves"):
            h.gpu.util = 0.0
        elif e == "run" and h.training.state not in TRAINING_ALIVE:
            run_id += 1
            h.training.state, h.training.run_id, h.training.exit_code = T.RUNNING, run_id, None
        elif e == "sync_fail":
            h.sync.ok = False
        elif e == "sync_ok":
            h.sync.ok = True
        elif e == "restart":
            restart()
        elif e == "slow_stop":
            h.training.polls_to_end = 3
        elif e == "stuck_stop":
            h.training.polls_to_end = None
        elif e == "keepalive":
            try:
                h.guard.keepalive(90)
            except RequestError:
                pass  # too late or already stopped: refused, never an error
    h.gpu.util, h.sync.ok = 0.0, True
    h.until("STOPPED", max_polls=200)
    assert acted and not broken, (events, broken)
