"""A spot machine about to be taken, in words: the notice, what made it off the machine, and the
next boot's word about the previous machine."""

from __future__ import annotations

from supervisor.durations import format_duration
from supervisor.notify.mails import Mail
from supervisor.timefmt import hm, when

_SOURCES = {"ec2": "EC2 spot instance-action", "gcp": "GCP instance/preempted",
            "azure": "Azure Scheduled Events (Preempt)", "signal": "a SIGTERM to the daemon"}


def _source(provider: str, kind: str, detail: str) -> str:
    s = _SOURCES.get(provider, provider)
    return f"{s}: {detail}" if detail else f"{s} ({kind})"


def _list(items: list[str], empty: str) -> str:
    return "\n".join(f"  - {x}" for x in items) if items else f"  {empty}"


def notice(provider: str, kind: str, detail: str, noticed_at: float, deadline: float, signal: str,
           signal_error: str, newest: str, newest_on_target: bool, not_made: list[str], sync_target: str) -> Mail:
    """The machine will be taken at `deadline`: what is being done about it right now."""
    left = format_duration(max(0.0, deadline - noticed_at))
    if signal:
        asked = f"The training was sent {signal} so it saves a checkpoint now."
    elif signal_error:
        asked = f"The training could not be signalled: {signal_error}."
    else:
        asked = ("No signal was sent to the training (preemption.training_signal is not set); "
                 "only checkpoints it already wrote can be saved.")
    if not sync_target:
        sync = "No sync.target is configured: nothing can be copied off this machine."
    elif newest:
        state = "is already on the target" if newest_on_target else "goes up first, as soon as it is whole"
        sync = f"Emergency sync to {sync_target}: the newest checkpoint here, {newest}, {state}; the rest follow."
    else:
        sync = f"Emergency sync to {sync_target}: no checkpoint here yet."
    return Mail(
        f"PREEMPTION: this machine will be taken at {hm(deadline)} (in {left})",
        f"Notice at {when(noticed_at)} from {_source(provider, kind, detail)}.\n"
        f"The machine is expected to go at {when(deadline)}, {left} after the notice.\n\n"
        f"{asked}\n{sync}\n\n"
        f"Not on the target yet:\n{_list(not_made, '(nothing)')}\n\n"
        "A second mail says what made it off the machine, when the sync is done or the time is up.")


def outcome(noticed_at: float, deadline: float, result: str, at: float, newest: str, newest_on_target: bool,
            made_it: list[str], not_made: list[str], sync_target: str) -> Mail:
    """What made it off the machine after a notice (`result`: synced | deadline | exited)."""
    if newest and newest_on_target:
        head = f"newest checkpoint {newest} is off the machine"
    elif newest:
        head = f"newest checkpoint {newest} did NOT make it off the machine"
    else:
        head = "no complete checkpoint to save"
    why = {"synced": f"Everything complete was on {sync_target or 'the target'} at {when(at)}, "
                     f"{format_duration(max(0.0, deadline - at))} before the expected end.",
           "deadline": f"The machine's time ran out at {when(deadline)} with the sync still going.",
           "exited": f"The daemon had to exit at {when(at)} with the sync still going."}.get(result, "")
    return Mail(
        f"PREEMPTION: {head}",
        f"After the notice at {when(noticed_at)}:\n{why}\n\n"
        f"On the target:\n{_list(made_it, '(nothing)')}\n\n"
        f"Not on the target:\n{_list(not_made, '(nothing)')}")


def previous(noticed_at: float, provider: str, kind: str, detail: str, hostname: str, newest: str,
             newest_on_target: bool, made_it: list[str], not_made: list[str], result: str) -> Mail:
    """Said by the next boot: the machine before this one got a notice."""
    if newest and newest_on_target:
        head = f"newest checkpoint {newest} made it"
    elif newest:
        head = f"newest checkpoint {newest} did not make it"
    else:
        head = "it had no complete checkpoint"
    known = "" if result else ("\nThe previous daemon did not live to see the end of its sync; this is what it "
                              "knew last.")
    return Mail(
        f"The previous machine was preempted at {when(noticed_at)}; {head}",
        f"The machine this state came from{f' ({hostname})' if hostname else ''} got a notice at "
        f"{when(noticed_at)} from {_source(provider, kind, detail)}.{known}\n\n"
        f"On the target:\n{_list(made_it, '(nothing)')}\n\n"
        f"Not on the target (lost with that machine unless its disk was kept):\n{_list(not_made, '(nothing)')}\n\n"
        "To resume, start the training from the newest checkpoint on the target.")


def risk(provider: str, detail: str) -> Mail:
    """A rebalance recommendation: the machine may be taken; no deadline yet."""
    return Mail(
        "spot interruption risk is elevated",
        f"{_source(provider, 'rebalance', detail)}.\n"
        "No notice yet; the checkpoints are being synced now so less is at stake if one comes.")
