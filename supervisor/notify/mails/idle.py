"""The idle guard's mails: the warning, stop cancelled, stopping now, final sync failed (not
stopping), stop action failed, still up after the stop. Each is a pure function of its facts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from supervisor.durations import format_bytes, format_duration
from supervisor.notify.mails import Mail, n_files
from supervisor.notify.mails.sync import Unselected
from supervisor.timefmt import hm, when


@dataclass(frozen=True)
class IdleCost:
    amount: float
    currency: str
    price_per_hour: float


@dataclass(frozen=True)
class StopPlan:
    """What a stop does: which folders go where first, and the action."""

    paths: tuple[str, ...]
    target: str          # as the sync engine shows it; "" = no sync target
    action: str          # stop.describe_action's words


@dataclass(frozen=True)
class LiveTraining:
    """A training that is still alive while the machine counts as idle: the stop interrupts it."""

    run_id: int
    pid: int | None
    started_at: float | None
    signs: tuple[str, ...] = ()  # what its probes read: "no output for 2h00m", "GPU 3%", "CPU 0%"
    stop_grace_s: float = 30.0


@dataclass(frozen=True)
class Interrupted:
    """The live training this stop interrupted before its final sync."""

    run_id: int
    at: float
    ended: str           # how it ended ("exit code 0"); "" = still alive after every signal
    waited_s: float = 0.0


def cost_text(cost: IdleCost | None) -> str:
    if cost is None:
        return ""
    return (f"Cost while idle: {cost.amount:.2f} {cost.currency} "
            f"(at {cost.price_per_hour:.2f} {cost.currency}/hour).\n")


def not_whole_text(damaged: list[str] | tuple[str, ...], partial: list[str] | tuple[str, ...]) -> str:
    """What the final sync sent as it was although it is not whole: named, never hidden behind "verified"."""
    out = ""
    if partial:
        out += ("Incomplete checkpoints, uploaded as they are (not marked complete on the target):\n"
                + "".join(f"  {p}\n" for p in partial[:20]))
    if damaged:
        out += ("Files that fail their format check (cut short, damaged or a format this daemon cannot read), "
                "uploaded as they are:\n" + "".join(f"  {p}\n" for p in damaged[:20]))
    return out


def held_text(newest: list[str] | tuple[str, ...]) -> str:
    """Which training the target holds: the newest checkpoint of each run folder, so a stale one
    stands out (what it never will, no include selecting it: sync.Unselected.block)."""
    if not newest:
        return ""
    return "Newest checkpoint of each run folder on the target:\n" + "".join(f"  {n}\n" for n in newest[:20])


def not_whole_count(damaged: list[str] | tuple[str, ...], partial: list[str] | tuple[str, ...]) -> str:
    """"1 damaged file, 2 incomplete checkpoints" ("" when everything is whole)."""
    bits = []
    if damaged:
        bits.append(f"{len(damaged)} damaged file{'s' if len(damaged) != 1 else ''}")
    if partial:
        bits.append(f"{len(partial)} incomplete checkpoint{'s' if len(partial) != 1 else ''}")
    return ", ".join(bits)


def target_text(plan: StopPlan) -> str:
    paths = ", ".join(plan.paths) or "(no folders configured)"
    return f"{paths} to {plan.target}" if plan.target else "nothing (no sync.target configured)"


def _live_text(t: LiveTraining | None, stop_at: float) -> str:
    if t is None:
        return ""
    since = f", started {when(t.started_at)}" if t.started_at else ""
    signs = f": {', '.join(t.signs)}" if t.signs else ""
    return (f"\nRun {t.run_id} is still running (pid {t.pid}{since}){signs}; it looks stalled; it will be "
            f"interrupted at {hm(stop_at)} unless you act. It gets SIGINT, then SIGTERM and SIGKILL "
            f"{format_duration(t.stop_grace_s)} apart, as `supervisorctl stop` does; what it saves on the way "
            "out is synced before the machine stops.\n")


def _interrupted_text(i: Interrupted | None) -> str:
    if i is None:
        return ""
    head = f"\nRun {i.run_id} was still running and looked stalled: it was interrupted at {hm(i.at)}"
    if i.ended:
        return f"{head} and ended ({i.ended}) before the final sync, so what it saved on the way out is included.\n"
    return (f"{head} and was still alive {format_duration(i.waited_s)} later, after SIGINT, SIGTERM and "
            "SIGKILL; the final sync went ahead without waiting longer.\n")


@dataclass(frozen=True)
class IdleWarning:
    idle_s: float
    idle_since: float | None
    stop_at: float
    stop_in_s: float
    plan: StopPlan
    cost: IdleCost | None = None
    stalled: LiveTraining | None = None
    checked: tuple[str, ...] = ()
    unselected: Unselected = Unselected()   # training output no include selects: it stays here


def warning(f: IdleWarning) -> Mail:
    checked = "\n".join(f"  {n}" for n in f.checked) or "  (no probes)"
    subject = f"idle for {format_duration(f.idle_s)}: stopping at {hm(f.stop_at)} unless you act"
    if f.stalled is not None:
        subject += " (training looks stalled)"
    if f.unselected:
        subject += f"; {f.unselected.count()} NOT selected for sync"
    body = (f"This machine has been idle for {format_duration(f.idle_s)} (since {when(f.idle_since)}).\n"
            f"{cost_text(f.cost)}"
            f"\nIt will stop at {when(f.stop_at)} (in {format_duration(f.stop_in_s)}), after a verified final "
            f"sync of {target_text(f.plan)}.\nStop action: {f.plan.action}.\n"
            f"\nTo prevent it, run on the machine:\n\n    supervisorctl keepalive 2h\n\n"
            "Logging in over SSH, attaching to the training, Jupyter activity or GPU load also cancel it.\n"
            f"{_live_text(f.stalled, f.stop_at)}" + (f"\n{f.unselected.block()}" if f.unselected else "")
            + f"\nWhat was checked:\n{checked}\n")
    return Mail(subject, body)


@dataclass(frozen=True)
class Cancelled:
    at: float
    reasons: tuple[str, ...]
    during_stop: bool
    warn_after_s: float
    withdrawn: bool = False   # its wing took the reason back (a cap moved), not activity


def cancelled(f: Cancelled) -> Mail:
    why = "; ".join(f.reasons) or "activity"
    what = "stop that was under way" if f.during_stop else "idle stop announced earlier"
    cause = "its reason was withdrawn" if f.withdrawn else "of activity"
    body = (f"The {what} is cancelled at {when(f.at)} because {cause}:\n  " + "\n  ".join(f.reasons) +
            f"\n\nThe idle clock starts again once the machine is idle; the next warning comes "
            f"{format_duration(f.warn_after_s)} after that.\n")
    return Mail(f"stop cancelled: {why}", body)


@dataclass(frozen=True)
class SyncFailed:
    """The final sync did not verify, so the machine is NOT stopped (yet)."""

    stop_reason: str
    plan: StopPlan
    error: str
    unsynced: tuple[str, ...]
    retry_s: float
    cost: IdleCost | None = None


def sync_failed(f: SyncFailed) -> Mail:
    unsynced = "\n".join(f"  {p}" for p in f.unsynced[:20]) or "  (unknown)"
    subject = f"NOT stopping: final sync failed ({(f.error or '?')[:80]})"
    body = (f"The machine is due to stop ({f.stop_reason or 'idle'}), but the final sync of "
            f"{target_text(f.plan)} did not verify:\n  {f.error or 'not verified'}\n\nNot yet safe:\n{unsynced}\n\n"
            f"Nothing is stopped while work is unsynced. The daemon retries every "
            f"{format_duration(f.retry_s)}.\n{cost_text(f.cost)}"
            "To stop anyway, set stop.stop_even_if_sync_fails = true (or max_idle_cost) and restart the daemon; "
            "to keep the machine, run `supervisorctl keepalive 2h`.\n")
    return Mail(subject, body)


@dataclass(frozen=True)
class UnselectedHeld:
    """The final sync is done, but a checkpoint no include selects is newer than anything on the
    target: the machine is NOT stopped (yet), for stopping would lose it."""

    stop_reason: str
    plan: StopPlan
    unselected: Unselected
    retry_s: float
    cost: IdleCost | None = None


def unselected_held(f: UnselectedHeld) -> Mail:
    u = f.unselected
    subject = f"NOT stopping: {u.count()} of training output NOT selected for sync"
    body = (f"The machine is due to stop ({f.stop_reason or 'idle'}). The final sync of {target_text(f.plan)} is "
            "done, but training output that no sync.include glob selects is newer than anything on the target: "
            "stopping now would lose it.\n\n" + replace(u, hold=False).block() +
            f"\nNothing is stopped while it is only here. The daemon looks again every {format_duration(f.retry_s)}, "
            f"and stops once it is selected and on the target.\n{cost_text(f.cost)}"
            "To stop anyway (it is lost with the machine), set stop.stop_even_if_sync_fails = true (or max_idle_cost) "
            "and restart the daemon; to keep the machine, run `supervisorctl keepalive 2h`.\n")
    return Mail(subject, body)


@dataclass(frozen=True)
class Stopping:
    at: float
    finished: bool                 # the stop is training.on_finish's, not idleness
    idle_s: float
    synced: dict = field(default_factory=dict)   # the stop record's summary of the final sync
    forced: str = ""               # why it stops although the final sync did not verify
    plan: StopPlan = StopPlan((), "", "")
    cost: IdleCost | None = None
    interrupted: Interrupted | None = None
    reason: str = ""               # the reason in the rule table's words (states.STOP_RULES); "" for idleness
    cap: str = ""                  # the stop is a cap's (supervisor.money): which, in words
    also: tuple[str, ...] = ()     # the other reasons that stood when it stopped, in words
    why: str = ""                  # the asking wing's sentence ("GPU 0: row remapping failed")


def stopping(f: Stopping) -> Mail:
    s = f.synced
    left = Unselected.of(s)
    files, where = s.get("files", 0), s.get("target") or "(no target)"
    if s.get("ok"):
        if left and not files:  # none of it was ever selected: nothing here is "verified"
            head = f"Final sync: NOTHING selected for {where} (0 files).\n"
        elif left:
            head = (f"Final sync: {n_files(files)}, {format_bytes(s.get('bytes', 0))} verified at {where} "
                    f"({s.get('uploaded_files', 0)} uploaded just now); NOT SELECTED (stay on this machine): "
                    f"{left.count()}.\n")
        else:
            head = (f"Final sync verified: {n_files(files)}, {format_bytes(s.get('bytes', 0))} "
                    f"at {where} ({s.get('uploaded_files', 0)} uploaded just now).\n")
        what = (f"{head}Folders: {', '.join(f.plan.paths) or '(none)'}\n{held_text(s.get('newest') or [])}"
                + (f"{left.block()}" + (f"The machine stops anyway because {f.forced}.\n" if f.forced else "")
                   if left else "")
                + f"{not_whole_text(s.get('damaged') or [], s.get('partial_units') or [])}")
    else:
        unsynced = "\n".join(f"  {p}" for p in (s.get("unsynced") or [])[:20])
        what = (f"The final sync did NOT verify ({s.get('error') or '?'}), and the machine stops anyway "
                f"because {f.forced}.\nNot synced:\n{unsynced or '  (unknown)'}\n{left.block()}")
    reason = f.cap or f.reason or ("training finished" if f.finished else f"idle for {format_duration(f.idle_s)}")
    not_whole = not_whole_count(s.get("damaged") or [], s.get("partial_units") or [])
    if not s.get("ok"):
        result = "final sync FAILED, stopping anyway"
    elif left:  # what stays here first: the subject is cut at 150 characters
        result = (f"{left.count()} NOT selected for sync stay here; "
                  + (f"{n_files(files)} verified at {s.get('target') or 'no target'}" if files else "nothing selected"))
    else:
        result = f"final sync verified, {n_files(files)} at {s.get('target') or 'no target'}"
    subject = f"stopping now ({reason}): {result}" + (f" ({not_whole} among them)" if not_whole and s.get("ok") else "")
    body = (f"Stopping this machine at {when(f.at)} ({reason}).\n"
            + (f"Why: {f.why}\n" if f.why else "") + f"\n{what}"
            f"Stop action: {f.plan.action}.\n{cost_text(f.cost)}{_interrupted_text(f.interrupted)}"
            + (f"Also standing, served by this stop: {'; '.join(f.also)}.\n" if f.also else ""))
    return Mail(subject, body)


def stop_failed(action: str, error: str, retry_s: float) -> Mail:
    return Mail(f"stop action failed: {error[:100]}",
                f"The stop action ({action}) failed:\n  {error}\n\n"
                f"The machine is still running (and billing). The daemon tries again every "
                f"{format_duration(retry_s)}; any activity or `supervisorctl keepalive 2h` cancels the stop.\n")


def still_up(up_for_s: float, result: str) -> Mail:
    return Mail(f"still running {format_duration(up_for_s)} after the stop action",
                f"The stop action reported: {result}\nbut this machine is still up and may "
                f"still be billing. Check the provider's console.\n")
