"""The small pure pieces of the sync engine: keep_last (retention.py), backoff (backoff.py), the
upload rate (status.py), the final sync's bookkeeping (final.py) and the waiter (waiter.py)."""

from __future__ import annotations

import threading

import pytest

from supervisor.saves.complete import Verdict
from supervisor.states import IllegalTransition, SyncState
from supervisor.sync import backoff, final, retention
from supervisor.sync import scan as sc
from supervisor.sync.ledger import Entry
from supervisor.sync.status import Board, rate
from supervisor.sync.waiter import Waiters

# --- retention -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key,prefix,step", [
    ("checkpoint-5", "", 5), ("run/checkpoint-5", "run", 5), ("run/checkpoint-5", "", None),
    ("other/checkpoint-5", "run", None), ("run", "run", None), ("tmp-checkpoint-5", "", None),
    ("checkpoint-5x", "", None), ("runner/checkpoint-1", "run", None),
])
def test_step_under(key, prefix, step):
    assert retention.step_under(key, prefix) == step


def test_kept_steps_counts_here_and_there():
    assert retention.kept_steps([10, 20], [30, 40], 2) == {30, 40}
    assert retention.kept_steps([10, 50], [30, 40], 2) == {40, 50}
    assert retention.kept_steps([10], [], 0) == {10}


def test_retired():
    assert retention.retired([10, 20, 30], [], "", 2) == {10}
    assert retention.retired([10, 20], ["checkpoint-30", "checkpoint-40", "lora"], "", 2) == {10, 20}
    assert retention.retired([10, 20], ["run/checkpoint-30", "checkpoint-40"], "run", 2) == {10}
    assert retention.retired([10, 20], ["checkpoint-30"], "", 0) == set()
    assert retention.retired([], ["checkpoint-30"], "", 1) == set()


def test_to_delete_never_the_folder_just_done():
    keys = ["checkpoint-10", "checkpoint-20", "checkpoint-30", "lora", "x/checkpoint-1"]
    assert retention.to_delete(keys, "", 2, "checkpoint-30") == ["checkpoint-10"]
    assert retention.to_delete(keys, "", 1, "checkpoint-20") == ["checkpoint-10"]
    assert retention.to_delete(keys, "", 0, "checkpoint-30") == []
    assert retention.to_delete(["a/checkpoint-2", "a/checkpoint-10", "b/checkpoint-1"], "a", 1, "a/checkpoint-10") == [
        "a/checkpoint-2"]  # numeric order, not text order


# --- backoff -------------------------------------------------------------------------------------

def test_delay_doubles_up_to_the_cap_with_jitter():
    assert [backoff.delay(n, 300, 1.0) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff.delay(9, 300, 1.0) == 300
    assert backoff.delay(10_000, 300, 0.5) == 150
    assert backoff.delay(0, 300, 1.0) == 2.0


def test_backoff_state():
    b = backoff.Backoff()
    assert not b.failing and b.failing_for(5) is None and b.retry_in(5) is None and not b.due(5)
    assert b.recovered(5) is None
    assert b.failed(100.0, 300, 1.0) == 2.0
    assert b.failing and b.since == 100.0 and b.next_try == 102.0
    assert b.waiting(101) and not b.due(101) and b.due(102)
    assert b.failed(103.0, 300, 0.5) == 2.0  # 4 s x 0.5
    assert b.since == 100.0 and b.failures == 2 and b.failing_for(110) == 10 and b.retry_in(104) == 1.0
    assert b.retry_in(200) == 0.0
    b.retry_now()
    assert b.due(103.5)
    assert b.recovered(130.0) == 30.0
    assert not b.failing and b.failures == 0


def test_a_request_during_a_failing_try_is_not_swallowed_by_its_failure():
    # CI: `supervisorctl sync` (or new keys) came while a try against a down server was under way;
    # that try's failure set the next try 8 s away and the request was lost with it
    b = backoff.Backoff()
    b.failed(100.0, 300, 1.0)
    b.begin_try()
    b.retry_now()                                   # asked while the try runs
    assert b.failed(150.0, 300, 1.0) == 0.0 and b.due(150.0)
    b.begin_try()                                   # the try after it answers the request
    assert b.failed(151.0, 300, 1.0) == 8.0 and not b.due(158.0) and b.due(159.0)
    b.retry_now()
    b.begin_try()                                   # asked before the try began: that try answers it
    assert b.failed(160.0, 300, 1.0) == 16.0
    b.begin_try()
    b.retry_now()                                   # a target's Retry-After still wins
    assert b.failed(170.0, 300, 1.0, retry_after=60.0) == 60.0 and not b.asked
    b.retry_now()
    b.recovered(200.0)
    assert not b.asked and b.failed(300.0, 300, 1.0) == 2.0


# --- status board --------------------------------------------------------------------------------

def test_rate():
    assert rate([], 10, True) is None and rate([(1, 10)], 10, True) is None
    assert rate([(0.0, 0), (1.0, 100)], 1.0, True) == 100.0
    assert rate([(0.0, 0), (1.0, 100)], 10.0, True) == 0.0
    assert rate([(0.0, 0), (1.0, 100)], 10.0, False) is None
    assert rate([(0.0, 0), (0.1, 100)], 0.1, True) is None  # too short to tell
    # only the last 10 s count
    assert rate([(0.0, 0), (20.0, 1000), (21.0, 2000), (22.0, 2200)], 22.0, True) == 600.0


def test_board_moves_and_shows_failing():
    b = Board(threading.RLock(), True)
    assert b.state == SyncState.IDLE
    b.move(SyncState.SCANNING, failing=False)
    b.move(SyncState.IDLE, failing=True)
    assert b.state == SyncState.FAILING
    b.move(SyncState.UPLOADING, failing=True)   # a retry: no upload until the target takes a file
    assert b.state == SyncState.FAILING
    b.uploaded(10)
    assert b.state == SyncState.UPLOADING
    b.move(SyncState.IDLE, failing=False)
    b.uploaded(10)                               # an upload not begun while failing moves nothing
    assert b.state == SyncState.IDLE
    b.move(SyncState.UPLOADING, failing=False)
    assert b.state == SyncState.UPLOADING
    off = Board(threading.RLock(), False)
    with pytest.raises(IllegalTransition):
        off.move(SyncState.SCANNING, failing=False)


def test_board_snapshot_is_plain_data():
    b = Board(threading.RLock(), True)
    b.error("x" * 600, 5.0)
    b.progress(10, 1.0)
    b.progress(10, 2.0)
    b.add_partial("checkpoint-1")
    b.add_partial("checkpoint-1")
    bo = backoff.Backoff()
    bo.failed(0.0, 300, 1.0)
    st = b.snapshot(2.0, bo, "s3://b/p", (3, 30), ["/w"])
    assert st["state"] == "idle" and st["last_error"] == "x" * 500 and st["last_error_at"] == 5.0
    assert st["rate_bps"] == 10.0 and st["sent_bytes"] == 20 and st["partial"] == ["checkpoint-1"]
    assert st["failing_for_s"] == 2.0 and st["next_retry_in_s"] == 0.0
    assert (st["uploaded_files"], st["uploaded_bytes"], st["watch"]) == (3, 30, ["/w"])


# --- final sync bookkeeping ----------------------------------------------------------------------

def _unit(rel: str, files: tuple[str, ...], verdict: Verdict, kind: str = "dir") -> sc.Unit:
    u = sc.Unit(sc.Root("/w", ""), kind, rel, rel, verdict=verdict)
    for n in files:
        u.selected.append(sc.Selected(f"/w/{rel}/{n}", f"{rel}/{n}", n, 7, 1, f"{rel}/{n}"))
    return u


def test_final_expected_and_manifests():
    done = _unit("checkpoint-1", ("a", "b"), Verdict(True, "complete"))
    part = _unit("checkpoint-2", ("c", "d"), Verdict(False, "truncated or damaged: d", partial=True, damaged=("d",)))
    never = _unit("checkpoint-3", ("e",), Verdict(False, "never finished: no trainer_state.json", partial=True))
    entries = {"checkpoint-1/a": Entry(7, 1, "sha-a", "etag-a"), "checkpoint-1/b": Entry(7, 1, "sha-b", "etag-b"),
               "checkpoint-2/c": Entry(7, 1, "sha-c", "etag-c"), "checkpoint-2/d": Entry(7, 1, "sha-d", "etag-d")}
    got = final.expected([done, part], lambda k, s, m: entries.get(k))
    assert got == {"checkpoint-1/a": (7, "etag-a"), "checkpoint-1/b": (7, "etag-b"), "checkpoint-2/c": (7, "etag-c"),
                   "checkpoint-2/d": (7, "etag-d")}  # a damaged file goes up and is checked like any other
    assert final.manifest_units([done, part, never]) == {"checkpoint-1": "dir", "checkpoint-2": "dir"}
    assert final.manifest_keys({"checkpoint-1", ""}) == {"checkpoint-1/_MANIFEST.json": (-1, ""),
                                                        "_MANIFEST.json": (-1, "")}
    assert final.manifest_keys({"out/ckpt.pt": "file"}) == {"out/ckpt.pt._MANIFEST.json": (-1, "")}
    assert final.partial_notes([done, part, never]) == [
        "checkpoint-2 (partial: truncated or damaged: d; uploaded with a manifest naming its damaged files)",
        "checkpoint-3 (partial: never finished: no trainer_state.json; uploaded without manifest)"]
    assert final.partial_units([done, part, never]) == ["checkpoint-2 (truncated or damaged: d)",
                                                       "checkpoint-3 (never finished: no trainer_state.json)"]
    assert final.damaged([done, part, never]) == ["/w/checkpoint-2/d"]
    assert final.uploaded([done, part], lambda u: True)
    assert not final.uploaded([done, _unit("checkpoint-3", ("e",), Verdict(False, "waiting"))], lambda u: True)
    assert not final.uploaded([done], lambda u: False)


@pytest.mark.parametrize("key,unit", [("_MANIFEST.json", ""), ("a/b/_MANIFEST.json", "a/b"), ("a/b/c", None),
                                      ("a/x_MANIFEST.json", None), ("a/ckpt.pt._MANIFEST.json", "a/ckpt.pt"),
                                      ("._MANIFEST.json", None)])
def test_manifest_unit(key, unit):
    assert final.manifest_unit(key) == unit


class _Ledger:
    def __init__(self):
        self.forgot, self.unman = [], []

    def forget(self, k):
        self.forgot.append(k)

    def manifest_forget(self, u):
        self.unman.append(u)


def test_forget_lost_forgets_files_and_their_folders_manifest():
    led = _Ledger()
    final.forget_lost(led, ["checkpoint-1/a", "checkpoint-2/_MANIFEST.json"], {"checkpoint-1", "checkpoint-3"})
    assert led.forgot == ["checkpoint-1/a"] and sorted(led.unman) == ["checkpoint-1", "checkpoint-2"]


# --- the waiter ----------------------------------------------------------------------------------

def test_waiter_answer_arrives_without_polling():
    w: Waiters[str, int] = Waiters()
    t = w.open("job")
    assert w.tickets() == [t] and t.spec == "job"
    threading.Timer(0.05, lambda: w.settle(t, 42)).start()
    assert w.wait(t, 10) == 42
    assert w.tickets() == [] and not w.settle(t, 43)


def test_waiter_timeout_withdraws_the_ticket():
    w: Waiters[str, int] = Waiters()
    t = w.open("job")
    assert w.wait(t, 0.01) is None
    assert w.tickets() == [] and not w.settle(t, 1)


def test_waiter_close_answers_open_and_later_tickets():
    w: Waiters[str, str] = Waiters()
    a, b = w.open("a"), w.open("b")
    w.settle(a, "done")
    w.close(lambda t: f"stopped {t.spec}")
    assert w.wait(a, 0) == "done" and w.wait(b, 0) == "stopped b"
    assert w.wait(w.open("c"), 0) == "stopped c" and w.tickets() == []


def test_waiter_serves_many_callers_at_once():
    w: Waiters[int, int] = Waiters()
    tickets = [w.open(i) for i in range(20)]
    results: dict[int, int | None] = {}
    threads = [threading.Thread(target=lambda t=t: results.__setitem__(t.spec, w.wait(t, 10))) for t in tickets]
    for th in threads:
        th.start()
    for t in w.tickets():
        w.settle(t, t.spec * 2)
    for th in threads:
        th.join(10)
    assert results == {i: i * 2 for i in range(20)}


# --- health: backoff, last success, the sync-failing alert ---------------------------------------

class _Alerts:
    def __init__(self):
        self.fired, self.resolved = [], []

    def fire(self, key, kind, severity, subject, body):
        self.fired.append((key, kind, severity, subject))

    def resolve(self, key):
        self.resolved.append(key)


def test_health_fails_alerts_once_due_and_resolves():
    from supervisor.clock import FakeClock
    from supervisor.sync.targethealth import Health

    clock, alerts = FakeClock(), _Alerts()
    board = Board(threading.RLock(), True)
    h = Health(board, clock, alerts, "s3://b/p", retry_max_backoff=300, fail_alert_after=60)
    h.evaluate_alert()
    assert alerts.fired == []
    h.failed("403 AccessDenied")
    assert board.state == SyncState.FAILING and board.last_error == "403 AccessDenied" and h.failing
    assert 1.0 <= h.backoff.retry_in(clock.monotonic()) <= 2.0
    clock.advance(59)
    h.evaluate_alert()
    assert alerts.fired == []
    clock.advance(1)
    h.evaluate_alert()
    assert alerts.fired == [("sync:failing", "sync_failing", "warning", "sync failing: s3://b/p for 1m00s")]
    h.recovered()
    assert board.state == SyncState.IDLE and board.last_ok_at == clock.time() and not h.failing
    assert alerts.resolved == ["sync:failing"]
    h.recovered()
    assert alerts.resolved == ["sync:failing"]  # once


def test_health_without_alerts_and_recovery_without_contact():
    from supervisor.clock import FakeClock
    from supervisor.sync.targethealth import Health

    clock = FakeClock()
    board = Board(threading.RLock(), True)
    h = Health(board, clock, None, "/t", 300, 0)
    h.failed("x")
    h.evaluate_alert()  # nowhere to send: nothing happens
    h.recovered(contacted=False)
    assert board.last_ok_at is None and board.state == SyncState.IDLE
