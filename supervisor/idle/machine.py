"""The idle decision: ACTIVE -> IDLE -> WARNED, and when a stop comes, as pure functions.

The idle machine owns ACTIVE/IDLE/WARNED and the idle clock; STOPPING and STOPPED are the stop
machine's (stop/machine.py: the stop's fields of the one record, idle.json, and its moves). Every
reason to stop stands in `pending` through the one door (stop.sequence.request): the idle clock's
own warning asks for `idle` (or `stalled`) like any wing, a run's end for `finished` or `failed`, the
other wings through `request_stop`. What a reason does is the rule table's (stop.rules): the notice
it waits (`warns`: WARNED counts it), whether activity or keepalive touch it, its rank. When the
decision (stop.sequence.advance) says a stop begins, the stop machine takes the record over; a stop
whose reason is withdrawn before its action hands it back (`withdraw`), and the clock starts again.

`step(machine, signals, now, thresholds)` is the only thing that moves the machine on a poll;
`keepalive`, `cancel_keepalive`, `run_ended`, `finish_handled`, `begin_finish`, `request_stop` and
`withdraw` are the only other moves (and the stop machine's `commit_stop`, `stop_failed`,
`mark_stopped`, re-exported here), each called by the guard under its lock. None of them reads a clock or
touches a file: the guard hands in `Now` and carries out the returned actions.

How time is measured, so that no clock trick can bring a stop forward:
- idle time is *accumulated* tick by tick from the monotonic clock, each tick counting at most
  `max_tick` (2 x poll_interval). An NTP jump moves only the wall clock and has no effect at all;
  a daemon that was down, or a scheduler that stalled, counts for at most one long tick (the
  machine's state during the gap is unknown, so it is not billed to idleness);
- the monotonic clock is comparable across daemon restarts within one boot; a new boot id means
  a reboot, and the clock then starts at boot (the uptime is credited as idle time);
- the wait between the warning and the stop is the one promised in the warning mail, or the
  configured one if that is longer: a config change can postpone a stop, never hasten it, and a
  stop on idleness always follows a warning and a full `stop_after_warning` (the on-finish grace
  is the one exception, announced by the training-finished mail).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from supervisor import records
from supervisor.config.schema import IdleConfig
from supervisor.states import IdleState, check_idle_move
from supervisor.stop import machine as stop
from supervisor.stop import sequence as stops
from supervisor.stop.machine import AbortStop, BeginStop, Refused
from supervisor.stop.rules import is_cap, notice, stop_rule
from supervisor.stop.sequence import Standing
from supervisor.timefmt import hm

I = IdleState  # noqa: E741 - short alias for the states, used throughout


@dataclass(frozen=True)
class Signal:
    """One probe's verdict. `reason` is what a user reads in status and mails."""

    name: str      # ssh | tmux | jupyter | gpu | training | training_output | training_cpu
    active: bool
    reason: str


@dataclass(frozen=True)
class Signals:
    items: tuple[Signal, ...] = ()
    training_alive: bool = False  # the training is STARTING/RUNNING/STOPPING (it may look stalled)
    training_signs: tuple[str, ...] = ()  # what its own probes read, in two words each ("GPU 3%"), for mails
    stalled: str = ""  # progress.stalled_action = "stop": the stall that makes the run count as idle, in words

    @property
    def active(self) -> bool:
        return any(s.active for s in self.items)

    def reasons(self) -> list[str]:
        return [s.reason for s in self.items if s.active]

    def notes(self) -> list[str]:
        """What the inactive probes saw, for the warning mail ("gpu: 0% over 5m")."""
        return [s.reason for s in self.items if not s.active]


# The signals that are a person at the machine (a keepalive is one too, kept by the machine itself).
PEOPLE = frozenset({"ssh", "tmux", "jupyter"})


def people_only(sig: Signals, why: str) -> Signals:
    """The signals with only people counting: while the stop interrupts the training, the training's
    own signs of life (STOPPING, the GPU load and output of its save, its CPU) are what the stop asked
    for, not activity that cancels it."""
    items = tuple(s if s.name in PEOPLE or not s.active else Signal(s.name, False, f"{s.reason} ({why})")
                  for s in sig.items)
    return replace(sig, items=items)


@dataclass(frozen=True)
class Now:
    wall: float       # for display and persisted timestamps only
    mono: float       # measures every interval
    boot_id: str
    uptime: float = 0.0  # seconds since boot; credited as idle time after a reboot


@dataclass(frozen=True)
class Thresholds:
    warn_after: float = 7200.0
    stop_after_warning: float = 3600.0
    poll_interval: float = 30.0
    finish_grace: float = 600.0

    @classmethod
    def of(cls, idle: IdleConfig, finish_grace: float) -> Thresholds:
        return cls(idle.warn_after, idle.stop_after_warning, idle.poll_interval, finish_grace)

    @property
    def max_tick(self) -> float:
        return 2.0 * max(self.poll_interval, 0.5)


IDLE_MODE = "idle"
FINISH_MODE = "finish"  # training ended with on_finish = "stop": a grace period instead of warn + wait


@dataclass
class IdleMachine:
    state: IdleState = I.ACTIVE
    mode: str = IDLE_MODE
    boot_id: str = ""
    last_mono: float | None = None
    last_wall: float | None = None
    idle_s: float = 0.0                # idle time of this stretch, accumulated (cost, warn threshold)
    idle_since: float | None = None    # wall, display only
    warned_s: float = 0.0              # idle time since the warning (or the start of the grace)
    warned_at: float | None = None     # wall, display only
    warn_sent: bool = False
    stop_after: float = 0.0            # the wait announced when warning; never shortened
    cycle: int = 0                     # +1 per warning or grace: makes every mail key unique
    keepalive_mono: float | None = None
    keepalive_until: float | None = None  # wall twin of keepalive_mono: display, and survives a reboot
    committed: bool = False            # the stop action has begun: nothing cancels it any more
    stop_reason: str = ""              # the word of the stop under way, or of the notice WARNED counts
    resettable: bool = False           # STOPPED by a dry-run: activity starts over
    reasons: list[str] = field(default_factory=list)
    finish_run: int = 0                # the training run whose end was handled
    finish_done: bool = False          # ... and its final sync and mail are done
    pending: list[dict] = field(default_factory=list)  # the stop reasons that still stand (stop.sequence)
    door: int = 1                      # 1: every reason stands in `pending` (absent: an older daemon's)

    @property
    def standing(self) -> tuple[Standing, ...]:
        return stop.standing(self)

    def stand(self, held: tuple[Standing, ...]) -> None:
        stop.stand(self, held)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_dict(cls, d: Any) -> IdleMachine:
        """ValueError naming the field when `d` is not a machine this code wrote."""
        m = records.load(cls, d, "idle state")
        if m.mode not in (IDLE_MODE, FINISH_MODE):
            raise ValueError(f"idle state: mode should be {IDLE_MODE!r} or {FINISH_MODE!r}, got {m.mode!r:.60}")
        held = m.standing  # raises ValueError naming the problem
        if "door" not in d and m.state in (I.WARNED, I.STOPPING) and m.stop_reason not in stops.words(held):
            # an older daemon kept its own idle and finish stops out of `pending`: they stand as they were
            m.stand(stops.request(held, m.stop_reason or "idle", "", m.warned_at or m.last_wall or 0.0))
        return m


# --- actions: plain data the guard carries out -------------------------------------------------
@dataclass(frozen=True)
class SendWarning:
    cycle: int
    idle_s: float
    stop_in_s: float


@dataclass(frozen=True)
class SendCancelled:
    cycle: int
    reasons: tuple[str, ...]
    during_stop: bool = False
    withdrawn: bool = False  # not activity: the asking wing took its reason back (a cap moved)


Action = SendWarning | SendCancelled | BeginStop | AbortStop


def keepalive_holds(m: IdleMachine, now: Now) -> bool:
    return m.keepalive_mono is not None and now.mono < m.keepalive_mono


def _rebooted(m: IdleMachine, now: Now) -> tuple[IdleMachine, float]:
    """The machine for a boot it has not seen, and the idle seconds to credit (time since boot)."""
    if m.boot_id == "":
        # no previous state at all: nothing is known about the past, count from now
        return replace(m, boot_id=now.boot_id, last_mono=None), 0.0
    fresh = IdleMachine(boot_id=now.boot_id, cycle=m.cycle, finish_run=m.finish_run, finish_done=True)
    if m.keepalive_until is not None and m.keepalive_until > now.wall:
        fresh.keepalive_until = m.keepalive_until
        fresh.keepalive_mono = now.mono + (m.keepalive_until - now.wall)
    credit = max(0.0, now.uptime)
    if credit > 0:
        _move(fresh, I.IDLE)
        fresh.idle_since = now.wall - credit
    return fresh, credit


def _this_boot(m: IdleMachine, now: Now) -> IdleMachine:
    """For the moves other than `step`: forget a previous boot's state first."""
    if m.boot_id == now.boot_id:
        return replace(m, reasons=list(m.reasons))
    m, _ = _rebooted(m, now)
    m.last_mono, m.last_wall = now.mono, now.wall
    return m


def _move(m: IdleMachine, new: IdleState) -> None:
    """The one assignment of an idle state (on a machine this move owns: step and the moves copy first)."""
    check_idle_move(m.state, new)
    m.state = new


def _to_active(m: IdleMachine, reasons: list[str], actions: list[Action], activity: bool = True) -> None:
    """Back to work: activity came (`activity`), or the stop's reason was withdrawn by its wing."""
    if m.state in (I.WARNED, I.STOPPING) and (not activity or (m.mode == IDLE_MODE and m.warn_sent)):
        actions.append(SendCancelled(m.cycle, tuple(reasons), during_stop=m.state == I.STOPPING,
                                     withdrawn=not activity))
    if m.state == I.STOPPING:
        actions.append(AbortStop(m.cycle, "; ".join(reasons)))
        if m.mode == FINISH_MODE:
            m.warn_sent = False
    _move(m, I.ACTIVE)
    m.idle_s = 0.0
    m.idle_since = None
    m.warned_s = 0.0
    m.warned_at = None
    if m.mode == IDLE_MODE:
        m.warn_sent = False
        m.stop_reason = ""
    m.resettable = False
    if activity:
        m.stand(stops.on_activity(m.standing))  # a reason activity does not cancel stands on
    grace = stops.lead([x for x in m.standing if stop_rule(x.word).warns == "grace"])
    if grace is not None and m.mode == IDLE_MODE:
        # a run's end asked while another stop was under way: its grace comes once the activity ends
        m.mode, m.stop_reason = FINISH_MODE, grace.word


def _start_notice(m: IdleMachine, now: Now, word: str, wait: float) -> None:
    """WARNED for `word`: its stop comes after `wait` seconds of quiet (the table's `warns`)."""
    _move(m, I.WARNED)
    m.cycle += 1
    m.warned_at, m.warned_s = now.wall, 0.0
    m.stop_after = wait
    m.warn_sent = True
    m.stop_reason = word
    m.mode = FINISH_MODE if stop_rule(word).warns == "grace" else IDLE_MODE
    if m.idle_since is None:
        m.idle_since = now.wall


def _notice_gone(m: IdleMachine, now: Now, th: Thresholds | None) -> None:
    """WARNED for a reason no longer standing (its wing withdrew it): back to the idle clock, or to
    the notice of the next reason that waits for one."""
    if m.state != I.WARNED or m.stop_reason in stops.words(m.standing):
        return
    _move(m, I.IDLE)
    m.warned_s, m.warned_at, m.warn_sent, m.stop_reason, m.mode = 0.0, None, False, "", IDLE_MODE
    nxt = stops.lead(stops.waiting(m.standing))
    if nxt is not None:
        t = th or Thresholds()
        _start_notice(m, now, nxt.word, notice(nxt.word, t.stop_after_warning, t.finish_grace))


def _ready(m: IdleMachine, th: Thresholds | None):
    """Has a waiting reason's notice run? Only the one WARNED counts, once its wait is over."""
    def ready(s: Standing) -> bool:
        return (th is not None and m.state == I.WARNED and s.word == m.stop_reason and m.warn_sent
                and m.warned_s >= stop_wait(m, th))
    return ready


def _advance(m: IdleMachine, now: Now, actions: list[Action], from_stopped: bool = False,
             th: Thresholds | None = None) -> None:
    """Begin, take over with, or end the stop the standing reasons ask for (stop.sequence.advance)."""
    adv = stops.advance(m.standing, m.state == I.STOPPING, m.stop_reason, m.committed,
                        m.state == I.STOPPED and not (from_stopped and m.resettable), _ready(m, th))
    if adv.abort_current and adv.begin is None:  # withdrawn: the stop machine hands the record back
        _to_active(m, [stop.ended(m)], actions, activity=False)
        return
    if adv.begin is None:
        return
    word = adv.begin.word
    actions.extend(stop.begin(m, word, own_notice=m.state == I.WARNED and m.stop_reason == word))
    m.mode = FINISH_MODE if stop_rule(word).warns == "grace" else IDLE_MODE
    m.last_mono, m.last_wall = now.mono, now.wall
    if m.idle_since is None:
        m.idle_since = now.wall


def step(m: IdleMachine, sig: Signals, now: Now, th: Thresholds) -> tuple[IdleMachine, list[Action]]:
    """One poll. Returns the new machine (the input is not modified) and what to do."""
    m = replace(m, reasons=list(m.reasons))
    actions: list[Action] = []
    if m.boot_id != now.boot_id:
        m, dt_s = _rebooted(m, now)
    else:
        dt_s = elapsed(m, now.mono, th)
    m.last_mono, m.last_wall = now.mono, now.wall

    if m.keepalive_mono is not None and not keepalive_holds(m, now):
        m.keepalive_mono = m.keepalive_until = None
    reasons = sig.reasons()
    if keepalive_holds(m, now):
        until = m.keepalive_until if m.keepalive_until is not None else now.wall
        reasons.append(f"keepalive until {hm(until)}")
    active = bool(reasons)
    m.reasons = reasons
    if sig.training_alive and m.mode == FINISH_MODE and m.state != I.STOPPING and not m.committed:
        # a new run started during the grace: it withdraws its predecessor's end (the table's
        # withdrawn_by), and the machine is back to ordinary idle protection
        m.mode = IDLE_MODE
        m.warn_sent = False
        m.stand(stops.cancel(m.standing, {x.word for x in m.standing if stop_rule(x.word).warns == "grace"}))
        if m.state != I.WARNED:
            m.stop_reason = ""
    _notice_gone(m, now, th)

    if m.state == I.STOPPED:
        # a dry run's stop, or one whose action left the machine up while a new run started on it:
        # the stop of that run is over, and the new one gets its own
        if (m.resettable and active) or sig.training_alive:
            _to_active(m, reasons, actions)
            _advance(m, now, actions, th=th)
        return m, actions
    if m.state == I.STOPPING:
        if active and not m.committed and stop_rule(m.stop_reason).activity_cancels:
            _to_active(m, reasons, actions)
        else:
            m.idle_s += dt_s  # the bill keeps running while the final sync retries
            if active:  # the idle stop this one took over is cancelled all the same; this one goes on
                stop.on_activity(m)
        _advance(m, now, actions, th=th)  # a reason asked meanwhile may take this stop over, or one withdrawn end it
        return m, actions
    if active:
        if m.state != I.ACTIVE:
            _to_active(m, reasons, actions)
        _advance(m, now, actions, th=th)
        return m, actions

    if m.state == I.ACTIVE:
        m.idle_s, m.idle_since = 0.0, now.wall
        asked = stops.lead(stops.waiting(m.standing))
        if m.mode == FINISH_MODE:
            # activity held the grace back; it starts over now that it has ended
            _move(m, I.WARNED)
            m.warned_s, m.warned_at = 0.0, now.wall
            m.warn_sent = True
        elif asked is not None:  # asked while someone worked (waste): its notice starts now
            _start_notice(m, now, asked.word, notice(asked.word, th.stop_after_warning, th.finish_grace))
        else:
            _move(m, I.IDLE)
        return m, actions

    m.idle_s += dt_s
    if m.state == I.IDLE:
        if m.idle_s >= th.warn_after:
            # the idle clock's warning: `idle` asks through the door, or `stalled` when a stalled run
            # is what counts as idle (progress.stalled_action = "stop"); the mail is its notice
            word = "stalled" if sig.stalled else "idle"
            m.stand(stops.request(m.standing, word, sig.stalled, now.wall))
            _start_notice(m, now, word, notice(word, th.stop_after_warning, th.finish_grace))
            m.idle_since = m.idle_since if m.idle_since is not None else now.wall
            actions.append(SendWarning(m.cycle, m.idle_s, m.stop_after))
        return m, actions

    # WARNED: the notice runs; when it is over, the stop begins (or one that ranks higher)
    m.warned_s += dt_s
    if m.warn_sent and m.warned_s >= stop_wait(m, th):
        _advance(m, now, actions, th=th)
    return m, actions


def elapsed(m: IdleMachine, now_mono: float, th: Thresholds) -> float:
    """Seconds since the last poll that count, capped: a suspended process or a stalled scheduler
    must not turn one late poll into hours of idleness."""
    if m.last_mono is None:
        return 0.0
    return min(max(now_mono - m.last_mono, 0.0), th.max_tick)


def due(m: IdleMachine, th: Thresholds, now_mono: float) -> bool:
    """Would a poll now cross a threshold (warn, or stop)? The shell asks this often and cheaply, so
    the warning and the stop happen at the times announced, not up to one poll interval later."""
    if m.committed:
        return False
    e = elapsed(m, now_mono, th)
    if m.state == I.IDLE:
        return m.idle_s + e >= th.warn_after
    if m.state == I.WARNED:
        return m.warn_sent and m.warned_s + e >= stop_wait(m, th)
    return False


def idle_for(m: IdleMachine, th: Thresholds, now_mono: float) -> float:
    """Idle seconds as of now (the last poll's figure plus the time since, as the next poll will
    count it), so status does not show a figure frozen between polls."""
    if m.state == I.ACTIVE:
        return 0.0
    if m.state == I.STOPPED:
        return m.idle_s
    return m.idle_s + elapsed(m, now_mono, th)


def stop_wait(m: IdleMachine, th: Thresholds) -> float:
    """Seconds between the warning (or the start of the grace) and the stop: the notice the table
    gives the reason WARNED counts for (stop.rules.notice), never shorter than the one announced."""
    return notice(m.stop_reason or "idle", th.stop_after_warning, th.finish_grace, m.stop_after)


# --- the other moves ---------------------------------------------------------------------------
def keepalive(m: IdleMachine, seconds: float, now: Now) -> tuple[IdleMachine, list[Action]]:
    """`supervisorctl keepalive 2h`: activity until then. Takes effect at once (a pending stop
    that has not begun its action is cancelled)."""
    if seconds <= 0:
        raise Refused("keepalive: the duration must be positive")
    m = _this_boot(m, now)
    if why := stop.keepalive_refusal(m):
        raise Refused(why)
    m.keepalive_mono = now.mono + seconds
    m.keepalive_until = now.wall + seconds
    actions: list[Action] = []
    reason = f"keepalive until {hm(m.keepalive_until)}"
    if m.state != I.ACTIVE:
        _to_active(m, [reason], actions)
    m.reasons = [r for r in m.reasons if not r.startswith("keepalive")] + [reason]
    return m, actions


def cancel_keepalive(m: IdleMachine) -> IdleMachine:
    """End a keepalive; the next poll judges the machine on its signals again."""
    return replace(m, keepalive_mono=None, keepalive_until=None,
                   reasons=[r for r in m.reasons if not r.startswith("keepalive")])


def run_ended(m: IdleMachine, run_id: int) -> IdleMachine:
    """A training run ended (FINISHED or FAILED, reported once): its final sync and mail are owed."""
    return replace(m, finish_run=run_id, finish_done=False, reasons=list(m.reasons))


def finish_handled(m: IdleMachine) -> IdleMachine:
    """The run end is dealt with (its mail is out, or a newer run made it moot)."""
    return replace(m, finish_done=True, reasons=list(m.reasons))


def begin_finish(m: IdleMachine, now: Now, th: Thresholds, run_id: int, word: str = "finished") -> IdleMachine:
    """Training ended with on_finish = "stop" and its result mail is out: `finished` (or `failed`)
    asks through the door, and its grace (the table's `warns`) starts."""
    m = _this_boot(m, now)
    m.finish_run, m.finish_done = run_id, True
    m.stand(stops.request(m.standing, word, "", now.wall))
    if m.state == I.STOPPING or m.committed:
        return m  # a stop is already on its way: it serves this reason too
    if m.state == I.STOPPED:
        # the stop before this run ran and the machine is still up (a dry run, or a provider command
        # that exited 0): that stop was the earlier run's; this run gets its own
        _move(m, I.ACTIVE)
        m.resettable, m.warned_at, m.warned_s, m.idle_s, m.idle_since = False, None, 0.0, 0.0, None
    # the grace is counted from now: without this the next poll would credit the time since the
    # last one to the grace, and the stop would come up to a poll interval before the announced time
    if m.state != I.ACTIVE:
        m.idle_s += elapsed(m, now.mono, th)
    m.last_mono, m.last_wall = now.mono, now.wall
    _start_notice(m, now, word, notice(word, th.stop_after_warning, th.finish_grace))
    return m


def request_stop(m: IdleMachine, now: Now, word: str, why: str = "",
                 th: Thresholds | None = None) -> tuple[IdleMachine, list[Action]]:
    """A wing asks for a stop (the stop runner): the reason stands from now on, and begins a stop,
    or takes over the one under way, as the rule table says (stop.sequence.advance). No wait for
    the reasons that warn "none" (a cap's projection mail was its warning; a bad GPU cannot do the
    work); one that warns (waste: its alert was the warning) starts its notice unless one that
    ranks as high runs (while someone works, it starts when the machine goes quiet). A stop already
    acting, or of a higher rank, goes on; the reason stands beside it."""
    m = _this_boot(m, now)
    m.stand(stops.request(m.standing, word, why, now.wall))
    rule, t = stop_rule(word), th or Thresholds()
    if rule.warns != "none" and not m.committed and (
            m.state == I.IDLE or (m.state == I.WARNED and rule.rank > stop_rule(m.stop_reason).rank)):
        _start_notice(m, now, word, notice(word, t.stop_after_warning, t.finish_grace))
    actions: list[Action] = []
    _advance(m, now, actions, from_stopped=True, th=th)
    return m, actions


def withdraw(m: IdleMachine, now: Now, word: str, th: Thresholds | None = None) -> tuple[IdleMachine, list[Action]]:
    """Its wing says the reason no longer holds (a cap moved, a node back, the waste gone): it stops
    standing, and a stop it leads that has not begun its action ends (another standing reason that
    is ready takes it over), a notice it ran for gives way to the idle clock."""
    m = _this_boot(m, now)
    m.stand(stops.cancel(m.standing, {word}))
    actions: list[Action] = []
    _notice_gone(m, now, th)
    if m.state == I.STOPPING:
        _advance(m, now, actions, th=th)
    return m, actions


def withdraw_stop(m: IdleMachine, word: str) -> IdleMachine:
    """`withdraw` without a clock: the reason stops standing now, and the stop it led ends at the
    next poll."""
    m = replace(m, reasons=list(m.reasons))
    m.stand(stops.cancel(m.standing, {word}))
    return m


def stop_now(m: IdleMachine, now: Now, reason: str) -> IdleMachine:
    """request_stop without its actions (the guard begins the record on its next poll)."""
    return request_stop(m, now, reason)[0]


def begin_cap_stop(m: IdleMachine, now: Now, reason: str) -> tuple[IdleMachine, list[Action]]:
    """A cap (supervisor.money) is near: request_stop for its kind."""
    if not is_cap(reason):
        raise Refused(f"not a cap: {reason!r}")
    return request_stop(m, now, reason)


# the stop machine's moves after the begin (stop/machine.py), under the names the guard has used
commit_stop = stop.commit
stop_failed = stop.failed
mark_stopped = stop.stopped


def idle_cost(m: IdleMachine, price_per_hour: float | None) -> float | None:
    if price_per_hour is None:
        return None
    if m.state == I.ACTIVE:
        return 0.0
    return price_per_hour * m.idle_s / 3600.0


def projection(m: IdleMachine, th: Thresholds, now_wall: float) -> dict[str, float | None]:
    """When the machine will warn and stop if nothing changes (wall times, for display). Counted
    from the last poll, as `step` counts; the shell polls when `due` says so, so these are the times
    things happen."""
    base = m.last_wall if m.last_wall is not None else now_wall
    warn_at = stop_at = None
    if m.state == I.IDLE:
        warn_at = base + max(0.0, th.warn_after - m.idle_s)
        stop_at = warn_at + th.stop_after_warning
    elif m.state == I.WARNED:
        warn_at = m.warned_at
        stop_at = base + max(0.0, stop_wait(m, th) - m.warned_s)
    elif m.state in (I.STOPPING, I.STOPPED):
        warn_at = m.warned_at
    return {"warn_at": warn_at, "stop_at": stop_at}
