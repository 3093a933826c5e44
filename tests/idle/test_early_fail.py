"""A run that fails in its first minute (issue 37, finding 5): with someone logged in no stop is
booked (they are typing); with nobody there (a run started at boot) it gets the finish stop after
its grace like any failed run, instead of billing the whole idle path."""

from __future__ import annotations

from supervisor.idle.facts import EARLY_FAIL_S, finish_mode, people_here
from supervisor.idle.machine import Signal, Signals
from supervisor.interfaces import TrainingInfo
from supervisor.states import TrainingState


def failed(after: float) -> TrainingInfo:
    return TrainingInfo(state=TrainingState.FAILED, run_id=1, exit_code=127, started_at=1000.0,
                        ended_at=1000.0 + after)


def test_early_failure_with_nobody_here_gets_the_finish_stop():
    assert finish_mode("stop", failed(5), someone_here=False) == "stop"


def test_early_failure_with_someone_logged_in_books_no_stop():
    assert finish_mode("stop", failed(5), someone_here=True) == "early-fail"
    assert finish_mode("stop", failed(EARLY_FAIL_S + 1), someone_here=True) == "stop"
    assert finish_mode("idle", failed(5), someone_here=True) == "idle"


def test_who_counts_as_here():
    gpu = Signals((Signal("gpu", True, "gpu: 90%"), Signal("ssh", False, "ssh: nobody")))
    assert not people_here(gpu)
    assert people_here(Signals((Signal("ssh", True, "ssh: root (pts/0)"),)))
    assert people_here(Signals((Signal("tmux", True, "tmux: a client attached"),)))
