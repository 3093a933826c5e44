"""The idle state machine, over generated signal sequences with a fake clock.

Properties: it never stops while a signal is active or a keepalive holds; an idle stop always
follows its warning mail and the full stop_after_warning in force when warning; otherwise it stops
within one poll of the threshold; wall-clock jumps and daemon restarts change nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.clock import FakeClock
from supervisor.idle.machine import (
    AbortStop,
    BeginStop,
    IdleMachine,
    Now,
    Refused,
    SendCancelled,
    SendWarning,
    Signal,
    Signals,
    Thresholds,
    begin_finish,
    cancel_keepalive,
    commit_stop,
    due,
    idle_cost,
    idle_for,
    keepalive,
    mark_stopped,
    projection,
    step,
    stop_failed,
)
from supervisor.states import IdleState as I

POLL = 30.0
TH = Thresholds(warn_after=600.0, stop_after_warning=300.0, poll_interval=POLL, finish_grace=120.0)
BOOT = "boot-a"


def sig(*active: str, training_alive: bool = False) -> Signals:
    names = ("ssh", "jupyter", "gpu", "training_output")
    return Signals(tuple(Signal(n, n in active, f"{n}: {'on' if n in active else 'off'}") for n in names),
                   training_alive=training_alive)


IDLE = sig()


def now_of(clock: FakeClock, boot: str = BOOT, uptime: float = 0.0) -> Now:
    return Now(clock.time(), clock.monotonic(), boot, uptime)


# --- the generated sequences ---------------------------------------------------------------------
@dataclass
class Tick:
    dt: float
    active: tuple[str, ...]
    jump: float = 0.0


@dataclass
class IdleRun:
    """n quiet polls in a row: the stretches that lead to warnings and stops."""

    n: int


@dataclass
class Keep:
    seconds: float


@dataclass
class CancelKeep:
    pass


@dataclass
class Restart:
    down_s: float


@dataclass
class Reconfigure:
    warn_after: float
    stop_after_warning: float


signal_names = st.sampled_from(["ssh", "jupyter", "gpu", "training_output"])
ticks = st.builds(Tick, dt=st.sampled_from([1.0, 10.0, 30.0, 30.0, 30.0, 45.0, 60.0, 600.0, 7200.0]),
                  active=st.one_of(st.just(()), st.just(()), st.just(()),
                                   st.lists(signal_names, min_size=1, max_size=2).map(tuple)),
                  jump=st.one_of(st.just(0.0), st.just(0.0), st.sampled_from([-7200.0, -60.0, 3600.0, 86400.0])))
events = st.one_of(
    ticks, ticks, ticks, ticks, ticks, ticks,
    st.builds(IdleRun, st.integers(1, 40)), st.builds(IdleRun, st.integers(1, 40)),
    st.builds(Keep, st.sampled_from([60.0, 900.0, 7200.0])),
    st.builds(CancelKeep),
    st.builds(Restart, st.sampled_from([0.0, 5.0, 3600.0])),
    st.builds(Reconfigure, st.sampled_from([60.0, 480.0, 600.0, 1800.0]), st.sampled_from([0.0, 60.0, 300.0, 900.0])),
)


@dataclass
class Record:
    mono: float
    active: bool       # a signal was active or a keepalive held at this tick
    state: I
    actions: list
    th: Thresholds


def simulate(evts, th=TH, jumps=True, commit_every: int = 2):
    """Run events through the machine the way the guard does; a BeginStop is carried out (committed
    and stopped) on every `commit_every`-th stop, otherwise the final sync 'keeps failing'."""
    clock = FakeClock()
    m = IdleMachine()
    out: list[Record] = []
    stops = 0
    expanded = []
    for e in evts:
        expanded += [Tick(POLL, ())] * e.n if isinstance(e, IdleRun) else [e]
    for e in expanded:
        if isinstance(e, Tick):
            clock.advance(e.dt)
            if jumps and e.jump:
                clock.jump(e.jump)
            n = now_of(clock)
            holds = m.keepalive_mono is not None and n.mono < m.keepalive_mono
            m, acts = step(m, sig(*e.active), n, th)
            out.append(Record(n.mono, bool(e.active) or holds, m.state, acts, th))
            for a in acts:
                if isinstance(a, BeginStop):
                    stops += 1
                    if stops % commit_every == 0:
                        m = mark_stopped(commit_stop(m), dry_run=True)
        elif isinstance(e, Keep):
            try:
                m, acts = keepalive(m, e.seconds, now_of(clock))
            except Refused:
                acts = []
            out.append(Record(clock.monotonic(), True, m.state, acts, th))
        elif isinstance(e, CancelKeep):
            m = cancel_keepalive(m)
        elif isinstance(e, Restart):
            m = IdleMachine.from_dict(json.loads(json.dumps(m.to_dict())))
            clock.advance(e.down_s)
            if jumps:
                clock.jump(-e.down_s / 2)
        elif isinstance(e, Reconfigure):
            th = replace(th, warn_after=e.warn_after, stop_after_warning=e.stop_after_warning)
    return out, m


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, min_size=1, max_size=120))
def test_never_stops_while_active_and_always_warns_first(evts):
    recs, _ = simulate(evts)
    warned: dict[int, int] = {}
    for n, r in enumerate(recs):
        for a in r.actions:
            if isinstance(a, SendWarning):
                warned[a.cycle] = n
            if isinstance(a, BeginStop):
                assert not r.active, "a stop began while a signal was active or a keepalive held"
                assert a.reason == "idle"
                assert a.cycle in warned, "a stop without its warning mail"
                w = recs[warned[a.cycle]]
                assert r.mono - w.mono >= w.th.stop_after_warning, "stopped before the promised wait"
                # no activity between the warning and the stop
                assert not any(x.active for x in recs[warned[a.cycle] + 1:n + 1])
        if r.active:
            assert r.state != I.STOPPING or not any(isinstance(a, BeginStop) for a in r.actions)
            assert r.state in (I.ACTIVE, I.STOPPED), r


@settings(max_examples=300, deadline=None)
@given(st.lists(events, min_size=1, max_size=80))
def test_wall_clock_jumps_and_restarts_never_change_a_decision(evts):
    with_jumps, _ = simulate(evts, jumps=True)
    without, _ = simulate(evts, jumps=False)
    strip = [(r.state, [type(a).__name__ for a in r.actions]) for r in with_jumps]
    assert strip == [(r.state, [type(a).__name__ for a in r.actions]) for r in without]


@settings(max_examples=200, deadline=None)
@given(prefix=st.lists(ticks, max_size=30),
       dts=st.lists(st.sampled_from([1.0, 7.0, 15.0, 30.0]), min_size=1, max_size=5),
       th=st.builds(Thresholds, warn_after=st.sampled_from([0.0, 30.0, 600.0, 1800.0]),
                    stop_after_warning=st.sampled_from([0.0, 30.0, 300.0, 900.0]),
                    poll_interval=st.just(POLL), finish_grace=st.just(60.0)))
def test_stops_within_one_poll_of_the_threshold(prefix, dts, th):
    """After the last activity, with polls at most poll_interval apart, the warning comes at the
    first poll past warn_after and the stop at the first poll past stop_after_warning after it."""
    clock = FakeClock()
    m = IdleMachine()
    for t in prefix:
        clock.advance(t.dt)
        m, _ = step(m, sig(*t.active), now_of(clock), th)
    if m.state in (I.STOPPING, I.STOPPED):
        return
    m, _ = step(m, sig("ssh"), now_of(clock), th)  # the last activity
    assert m.state == I.ACTIVE
    clock.advance(dts[0])
    m, _ = step(m, IDLE, now_of(clock), th)
    assert m.state == I.IDLE
    t0 = clock.monotonic()
    warn_t = stop_t = None
    i = 0
    while stop_t is None:
        clock.advance(dts[i % len(dts)])
        i += 1
        m, acts = step(m, IDLE, now_of(clock), th)
        if any(isinstance(a, SendWarning) for a in acts):
            warn_t = clock.monotonic()
            assert warn_t - t0 >= th.warn_after
            assert warn_t - t0 < th.warn_after + POLL + 1e-6
        if any(isinstance(a, BeginStop) for a in acts):
            stop_t = clock.monotonic()
        assert i < 5000
    assert warn_t is not None and stop_t > warn_t
    assert stop_t - warn_t >= th.stop_after_warning
    assert stop_t - warn_t < th.stop_after_warning + POLL + 1e-6
    assert m.state == I.STOPPING


@settings(max_examples=200, deadline=None)
@given(st.lists(ticks, min_size=1, max_size=60), st.sampled_from([600.0, 3600.0, 7200.0]))
def test_a_keepalive_holds_until_it_ends(evts, seconds):
    clock = FakeClock()
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = keepalive(m, seconds, now_of(clock))
    end = clock.monotonic() + seconds
    for e in evts:
        clock.advance(e.dt)
        clock.jump(e.jump)
        m, acts = step(m, sig(*e.active), now_of(clock), TH)
        if clock.monotonic() < end:
            assert m.state == I.ACTIVE and not acts
            assert any(r.startswith("keepalive until") for r in m.reasons)


# --- the field notes, one example each -----------------------------------------------------------
def idle_ticks(m, clock, seconds, th=TH, signals=IDLE, every=POLL):
    acts_all = []
    for _ in range(int(seconds // every)):
        clock.advance(every)
        m, acts = step(m, signals, now_of(clock), th)
        acts_all += acts
    return m, acts_all


def test_threshold_lowered_after_idle_time_still_warns_and_waits_in_full(clock):
    """30 min -> 8 min after 10 idle minutes: a warning now, the stop only a full wait later."""
    th30 = Thresholds(warn_after=1800, stop_after_warning=3600, poll_interval=POLL)
    m, _ = step(IdleMachine(), IDLE, now_of(clock), th30)
    m, acts = idle_ticks(m, clock, 600, th30)
    assert m.state == I.IDLE and not acts
    th8 = replace(th30, warn_after=480, stop_after_warning=60)  # and a shorter wait, after a restart
    m = IdleMachine.from_dict(m.to_dict())
    clock.advance(POLL)
    m, acts = step(m, IDLE, now_of(clock), th8)
    assert [type(a) for a in acts] == [SendWarning] and m.state == I.WARNED
    # the warning promised 60 s (the config in force); nothing earlier than that
    m, acts = idle_ticks(m, clock, 30, th8)
    assert m.state == I.WARNED and not acts
    m, acts = idle_ticks(m, clock, 30, th8)
    assert [type(a) for a in acts] == [BeginStop]
    # and a wait shortened *after* the warning is ignored: the promise stands
    m2, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m2, acts = idle_ticks(m2, clock, TH.warn_after)
    assert isinstance(acts[-1], SendWarning)
    short = replace(TH, stop_after_warning=30)
    m2, acts = idle_ticks(m2, clock, TH.stop_after_warning - POLL, short)
    assert m2.state == I.WARNED and not acts


def test_ntp_jump_forward_never_triggers_a_warning_or_stop(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, 120)
    clock.jump(10 * 86400)  # the wall clock leaps ten days
    m, acts = idle_ticks(m, clock, 60)
    assert m.state == I.IDLE and not acts
    assert m.idle_s == pytest.approx(180)


def test_a_daemon_outage_counts_at_most_one_long_tick(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, 60)
    m = IdleMachine.from_dict(json.loads(json.dumps(m.to_dict())))
    clock.advance(86400)  # down for a day (same boot): unknown, not billed as idle
    m, acts = step(m, IDLE, now_of(clock), TH)
    assert m.idle_s == pytest.approx(60 + TH.max_tick) and m.state == I.IDLE and not acts


def test_reboot_starts_the_clock_at_boot_and_forgets_a_stop(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, TH.warn_after + TH.stop_after_warning + 2 * POLL)
    assert m.state == I.STOPPING
    m = mark_stopped(commit_stop(m), dry_run=False)
    clock.advance(3600)
    m2, acts = step(m, IDLE, now_of(clock, boot="boot-b", uptime=45.0), TH)
    assert m2.state == I.IDLE and m2.idle_s == pytest.approx(45.0) and not acts
    assert m2.cycle == m.cycle  # mail keys stay unique across boots
    assert m2.idle_since == pytest.approx(clock.time() - 45.0)
    m3, _ = step(m, sig("ssh"), now_of(clock, boot="boot-b", uptime=45.0), TH)
    assert m3.state == I.ACTIVE
    # the very first start (no state at all) counts from now, not from boot
    m4, _ = step(IdleMachine(), IDLE, now_of(clock, boot="boot-b", uptime=9999.0), TH)
    assert m4.idle_s == 0


def test_activity_cancels_with_a_mail_only_after_a_warning(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, 120)
    m, acts = step(m, sig("jupyter"), now_of(clock), TH)
    assert m.state == I.ACTIVE and acts == []
    m, _ = idle_ticks(m, clock, TH.warn_after + 2 * POLL)
    assert m.state == I.WARNED
    clock.advance(POLL)
    m, acts = step(m, sig("ssh"), now_of(clock), TH)
    assert m.state == I.ACTIVE and [type(a) for a in acts] == [SendCancelled]
    assert acts[0].reasons == ("ssh: on",)


def test_stopping_is_cancelled_by_activity_until_the_action_begins(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, TH.warn_after + TH.stop_after_warning + 2 * POLL)
    assert m.state == I.STOPPING
    clock.advance(POLL)
    m1, acts = step(m, sig("ssh"), now_of(clock), TH)
    assert m1.state == I.ACTIVE
    assert [type(a) for a in acts] == [SendCancelled, AbortStop] and acts[0].during_stop
    committed = commit_stop(m)
    m2, acts = step(committed, sig("ssh"), now_of(clock), TH)
    assert m2.state == I.STOPPING and not acts
    with pytest.raises(Refused, match="too late"):
        keepalive(committed, 3600, now_of(clock))
    # a failed action re-opens the door
    m3, acts = step(stop_failed(committed), sig("ssh"), now_of(clock), TH)
    assert m3.state == I.ACTIVE
    with pytest.raises(Refused):
        commit_stop(m3)


def test_keepalive_cancels_a_warning_at_once_and_cancel_ends_it(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, TH.warn_after + POLL)
    assert m.state == I.WARNED
    m, acts = keepalive(m, 7200, now_of(clock))
    assert m.state == I.ACTIVE and [type(a) for a in acts] == [SendCancelled]
    assert m.keepalive_until == pytest.approx(clock.time() + 7200)
    m, _ = idle_ticks(m, clock, 3600)
    assert m.state == I.ACTIVE
    m = cancel_keepalive(m)
    m, _ = idle_ticks(m, clock, POLL)
    assert m.state == I.IDLE
    # a keepalive survives a restart and, by its wall-clock end, a reboot
    m, _ = keepalive(m, 3600, now_of(clock))
    m = IdleMachine.from_dict(m.to_dict())
    clock.advance(600)
    m2, _ = step(m, IDLE, now_of(clock, boot="boot-b", uptime=30), TH)
    assert m2.state == I.ACTIVE and m2.keepalive_mono == pytest.approx(clock.monotonic() + 3000)


def test_finish_grace_stops_without_the_idle_wait_and_a_login_extends_it(clock):
    m, _ = step(IdleMachine(), sig("gpu", training_alive=True), now_of(clock), TH)
    m = begin_finish(m, now_of(clock), TH, run_id=3)
    assert m.state == I.WARNED and m.stop_reason == "finished" and m.finish_run == 3
    assert projection(m, TH, clock.time())["stop_at"] == pytest.approx(clock.time() + TH.finish_grace)
    m, acts = idle_ticks(m, clock, 60)
    assert m.state == I.WARNED and not acts
    m, acts = step(m, sig("ssh"), now_of(clock), TH)  # a login: the grace is extended, no mail
    assert m.state == I.ACTIVE and acts == []
    m, acts = idle_ticks(m, clock, 3600, signals=sig("ssh"))
    assert m.state == I.ACTIVE
    m, acts = idle_ticks(m, clock, POLL)  # logged out: the grace starts over
    assert m.state == I.WARNED and not acts
    m, acts = idle_ticks(m, clock, TH.finish_grace)
    assert [type(a) for a in acts] == [BeginStop] and acts[0].reason == "finished"


def test_a_new_run_during_the_grace_returns_to_idle_protection(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m = begin_finish(m, now_of(clock), TH, run_id=1)
    m, _ = step(m, Signals((Signal("training", True, "training: starting"),), training_alive=True),
                now_of(clock), TH)
    assert m.state == I.ACTIVE and m.mode == "idle"
    m, acts = idle_ticks(m, clock, TH.finish_grace + 2 * POLL)
    assert m.state == I.IDLE and not acts


def test_finish_does_not_disturb_a_stop_under_way(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, TH.warn_after + TH.stop_after_warning + 2 * POLL)
    assert m.state == I.STOPPING
    m2 = begin_finish(m, now_of(clock), TH, run_id=9)
    assert m2.state == I.STOPPING and m2.stop_reason == "idle" and m2.finish_run == 9


def test_dry_run_stop_starts_over_on_activity_but_a_real_one_does_not(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = idle_ticks(m, clock, TH.warn_after + TH.stop_after_warning + 2 * POLL)
    dry = mark_stopped(commit_stop(m), dry_run=True)
    real = mark_stopped(commit_stop(m), dry_run=False)
    assert step(dry, sig("ssh"), now_of(clock), TH)[0].state == I.ACTIVE
    assert step(real, sig("ssh"), now_of(clock), TH)[0].state == I.STOPPED
    with pytest.raises(Refused, match="already stopped"):
        keepalive(real, 60, now_of(clock))


def test_idle_cost_and_projection(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    assert idle_cost(m, None) is None
    m, _ = idle_ticks(m, clock, 300)
    assert idle_cost(m, 3.6) == pytest.approx(0.3)
    p = projection(m, TH, clock.time())
    assert p["warn_at"] == pytest.approx(clock.time() + 300)
    assert p["stop_at"] == pytest.approx(clock.time() + 300 + TH.stop_after_warning)
    m, _ = step(m, sig("gpu"), now_of(clock), TH)
    assert idle_cost(m, 3.6) == 0.0 and projection(m, TH, clock.time()) == {"warn_at": None, "stop_at": None}


@pytest.mark.parametrize("bad", [[], "x", {"state": "NAPPING"}, {"idle_s": "long"}, {"reasons": [1]},
                                 {"warn_sent": 1}, {"cycle": 1.5}, {"mode": "party"}])
def test_unusable_persisted_state_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match="idle state"):
        IdleMachine.from_dict(bad)


def test_while_the_stop_interrupts_the_training_only_people_count(clock):
    from supervisor.idle.machine import people_only

    s = Signals((Signal("gpu", True, "gpu: 90% over 5m"), Signal("training", True, "training: stopping"),
                 Signal("ssh", False, "ssh: nobody logged in")), training_alive=True)
    quiet = people_only(s, "the stop is interrupting the training")
    assert not quiet.active and quiet.training_alive
    assert quiet.notes()[0] == "gpu: 90% over 5m (the stop is interrupting the training)"
    person = people_only(Signals((Signal("ssh", True, "ssh: root (pts/0)"),)), "x")
    assert person.reasons() == ["ssh: root (pts/0)"]


# --- announced times are the times things happen (issue 12.6: the demo said "stopping at 23:36:37"
# 4 s after the training ended with a 15 s grace, then stopped 15 s later than that) -------------------
def test_the_grace_counts_from_the_end_not_from_the_poll_before_it(clock):
    m, _ = step(IdleMachine(), sig("gpu", training_alive=True), now_of(clock), TH)
    clock.advance(20)  # the run ends 20 s after the last poll
    end = clock.time()
    m = begin_finish(m, now_of(clock), TH, run_id=1)
    assert projection(m, TH, clock.time())["stop_at"] == pytest.approx(end + TH.finish_grace)
    for _ in range(4):  # polls every 29.75 s: the last one a second before the announced time
        clock.advance((TH.finish_grace - 1) / 4)
        assert not due(m, TH, clock.monotonic())
        m, acts = step(m, IDLE, now_of(clock), TH)
        assert m.state == I.WARNED and acts == []
    clock.advance(1)
    assert due(m, TH, clock.monotonic())
    m, acts = step(m, IDLE, now_of(clock), TH)
    assert [type(a) for a in acts] == [BeginStop]
    assert clock.time() == pytest.approx(end + TH.finish_grace)


def test_due_says_when_a_poll_would_warn_or_stop(clock):
    m, _ = step(IdleMachine(), IDLE, now_of(clock), TH)
    m, _ = step(m, IDLE, now_of(clock), TH)
    assert m.state == I.IDLE and not due(m, TH, clock.monotonic())
    m, _ = idle_ticks(m, clock, TH.warn_after - POLL)
    clock.advance(POLL - 1)
    assert not due(m, TH, clock.monotonic())
    clock.advance(1)
    assert due(m, TH, clock.monotonic())
    m, acts = step(m, IDLE, now_of(clock), TH)
    assert [type(a) for a in acts] == [SendWarning] and not due(m, TH, clock.monotonic())
    warned = clock.time()
    assert projection(m, TH, clock.time())["stop_at"] == pytest.approx(warned + TH.stop_after_warning)
    m, acts = idle_ticks(m, clock, TH.stop_after_warning - POLL)
    assert acts == []
    clock.advance(POLL - 1)
    assert not due(m, TH, clock.monotonic())
    clock.advance(1)
    assert due(m, TH, clock.monotonic())
    m, acts = step(m, IDLE, now_of(clock), TH)
    assert [type(a) for a in acts] == [BeginStop]
    assert clock.time() == pytest.approx(warned + TH.stop_after_warning)
    assert not due(commit_stop(m), TH, clock.monotonic())


def test_idle_for_moves_between_polls_and_stops_at_the_cap(clock):
    m, _ = step(IdleMachine(), sig("gpu"), now_of(clock), TH)
    clock.advance(10)
    assert idle_for(m, TH, clock.monotonic()) == 0.0  # active
    m, _ = step(m, IDLE, now_of(clock), TH)
    m, _ = step(m, IDLE, now_of(clock), TH)
    clock.advance(7)
    assert idle_for(m, TH, clock.monotonic()) == pytest.approx(m.idle_s + 7)
    clock.advance(3600)  # a stalled scheduler does not turn into an hour of idleness on screen
    assert idle_for(m, TH, clock.monotonic()) == pytest.approx(m.idle_s + TH.max_tick)
