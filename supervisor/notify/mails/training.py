"""The training's end, in words: finished or failed, what it left, and what happens next."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_bytes, format_duration
from supervisor.notify.mails import Mail, describe_exit, n_files
from supervisor.notify.mails.idle import held_text, not_whole_text
from supervisor.notify.mails.sync import Unselected
from supervisor.timefmt import hm, when


@dataclass(frozen=True)
class RunEnd:
    finished: bool               # FINISHED (exit 0); else FAILED
    run_id: int
    exit_code: int | None
    signal: str | None
    command: str
    started_at: float | None
    ended_at: float | None
    log_path: str
    workdir: str
    log_tail: tuple[str, ...] = ()   # a failed run's last lines (its own, after its banner)
    cause: str = ""                  # what it died of, when known ("disk full"): the subject says it
    cause_text: str = ""             # ... and the body opens with the facts


@dataclass(frozen=True)
class LastProgress:
    step: int | None = None
    max_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    spent: float | None = None
    currency: str = ""
    source: str = ""                        # where the step was read (log, tensorboard, mlflow, ...)
    tracker_end: tuple[str, ...] = ()       # the trackers' own end states ("MLflow run .../abc: FINISHED")


@dataclass(frozen=True)
class Outputs:
    """Where the run's outputs are: after a final sync (`synced` set) or synced continuously."""

    ok: bool | None = None       # None: no final sync was made
    files: int = 0
    bytes: int = 0
    target: str = ""
    error: str = ""
    unsynced: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()  # the final sync's folders
    sync_target: str = ""        # the configured target, for "synced continuously"
    damaged: tuple[str, ...] = ()        # files sent as they are although they fail their format check
    partial_units: tuple[str, ...] = ()  # checkpoints sent as they are although never finished
    newest: tuple[str, ...] = ()         # the newest checkpoint of each run folder the target holds
    unselected: tuple[str, ...] = ()     # training output no include selects (up to 20 names): never synced
    finals: tuple[str, ...] = ()         # each run folder's final save (save_model's), or that it left none
    unselected_files: int = 0            # ... every such file counted, and their bytes
    unselected_bytes: int = 0
    unselected_hold: bool = False        # a checkpoint among them newer than anything selected: a stop waits

    @property
    def left(self) -> Unselected:
        return Unselected(self.unselected, self.unselected_files or len(self.unselected), self.unselected_bytes,
                          self.unselected_hold)


@dataclass(frozen=True)
class Next:
    """What on_finish does now."""

    mode: str                    # stop | idle | none
    stop_at: float | None = None
    finish_grace_s: float = 0.0
    warn_after_s: float = 0.0
    stop_after_warning_s: float = 0.0
    stop_under_way: bool = False  # a stop had already begun when the run ended
    warned: bool = False          # the grace runs: the subject says when the machine stops


@dataclass(frozen=True)
class Ended:
    run: RunEnd
    progress: LastProgress | None
    outputs: Outputs
    next: Next
    run_total: str = ""   # a run across machines: its money and machine-hours (money.runledger)


def _progress_text(p: LastProgress | None) -> str:
    if p is None:
        return ""
    bits = []
    if p.step is not None:
        bits.append(f"step {p.step}" + (f"/{p.max_steps}" if p.max_steps else ""))
    if p.epoch is not None:
        bits.append(f"epoch {p.epoch:.2f}")
    if p.loss is not None:
        bits.append(f"loss {p.loss:.4g}")
    src = f" (from {p.source})" if p.source and p.source not in ("tsup", "tqdm", "log") else ""
    out = f"Last progress: {', '.join(bits)}{src}\n" if bits else ""
    for t in p.tracker_end:
        out += f"Tracker: {t}\n"
    if p.spent is not None:
        out += f"Cost so far: {p.spent:.2f} {p.currency}\n"
    return out


def _outputs_text(o: Outputs, workdir: str) -> str:
    left = o.left
    if o.ok is None:
        return f"Outputs: {workdir or '(workdir not set)'}; synced continuously to " \
               f"{o.sync_target or '(no sync target)'}\n{left.block()}"
    if o.ok:
        where = o.target or "(no target: nothing leaves this machine)"
        folders = ", ".join(o.paths) or "(none)"
        if left and not o.files:  # none of the run's output was ever selected: nothing here is "verified"
            return (f"Outputs: NOTHING of this run's output is on {where}: no sync.include glob selects it "
                    f"(final sync of {folders}: 0 files).\n{left.block()}")
        if left:
            head = (f"Outputs: final sync: {n_files(o.files)} ({format_bytes(o.bytes)}) verified at {where}; NOT SELECTED "
                    f"(stay on this machine): {left.count()}, named below; folders {folders}\n")
        else:
            head = (f"Outputs: final sync verified, {n_files(o.files)} ({format_bytes(o.bytes)}) at {where}; folders "
                    f"{folders}\n")
        return (f"{head}{_finals_text(o.finals)}{held_text(o.newest)}{left.block()}"
                f"{not_whole_text(o.damaged, o.partial_units)}")
    return (f"Outputs: the final sync FAILED ({o.error}); not yet safe:\n"
            + "\n".join(f"  {p}" for p in o.unsynced[:20]) + "\n" + left.block())


def _finals_text(finals: tuple[str, ...]) -> str:
    if not finals:
        return ""
    return "Final save (verified on the target):\n" + "".join(f"  {f}\n" for f in finals[:20])


def _next_text(n: Next, held: bool = False) -> str:
    if n.mode == "stop":
        if n.stop_under_way:
            return "\nA stop was already under way.\n"
        if held:  # the stop gate waits for output no include selects (stop/driver.py)
            return (f"\nNext: the stop due at {when(n.stop_at)} WAITS while the output NOT SELECTED above is newer "
                    "than anything on the target (unless stop.stop_even_if_sync_fails is set): select it as said "
                    "above, or move it into a synced folder. To keep the machine: supervisorctl keepalive 2h\n")
        return (f"\nNext: this machine stops at {when(n.stop_at)} (in {format_duration(n.finish_grace_s)}), "
                "after a verified final sync.\nTo keep it: log in over SSH (the stop then waits until "
                f"{format_duration(n.finish_grace_s)} after you leave) or run\n\n    supervisorctl keepalive 2h\n")
    if n.mode == "idle":
        return (f"\nNext: idle protection decides: a warning after {format_duration(n.warn_after_s)} "
                f"idle, the stop {format_duration(n.stop_after_warning_s)} later.\n")
    if n.mode == "early-fail":
        return ("\nIt failed within its first minute while you were logged in, so the machine is not stopped for it "
                "(on_finish applies to runs that got going): fix it and start it again. Idle protection still stops an "
                "idle machine.\n")
    return "\non_finish = \"none\": nothing is stopped because the training ended.\n"


def ended(f: Ended) -> Mail:
    r = f.run
    how = describe_exit(r.exit_code, r.signal)
    ran = ""
    if r.started_at and r.ended_at:
        ran = f"Ran: {when(r.started_at)} -> {when(r.ended_at)} ({format_duration(r.ended_at - r.started_at)})\n"
    subject = f"training {'finished' if r.finished else 'FAILED'}" + (f": {r.cause}" if r.cause else "") + f" ({how})"
    left = f.outputs.left
    if left:
        subject += f"; {n_files(left.files)} NOT selected for sync"
    if f.next.mode == "stop" and f.next.warned:
        subject += f"; stopping at {hm(f.next.stop_at)}"
    tail = "".join(f"  {x}\n" for x in r.log_tail)
    body = (f"Training {'finished' if r.finished else 'failed'}: {how} (run {r.run_id}).\n"
            + (f"\n{r.cause_text}\n" if r.cause_text else "") +
            f"Command: {r.command}\n{ran}{_progress_text(f.progress)}" + (f"{f.run_total}\n" if f.run_total else "")
            + f"{_outputs_text(f.outputs, r.workdir)}"
            f"Log: {r.log_path}\n" + (f"Last lines of the log:\n{tail}" if tail else "")
            + _next_text(f.next, left.hold and f.outputs.ok is not False))
    return Mail(subject, body)


def final_sync_failing(finished: bool, error: str, units: tuple[str, ...], pending_files: int,
                       target: str) -> Mail:
    """The training ended and its final sync cannot reach the target: at once, not when the final
    sync gives up (final_sync_timeout), for the machine must not stop with work only on its disk."""
    if units or pending_files:
        n = f"{len(units)} checkpoint{'s' if len(units) != 1 else ''}" if units else n_files(pending_files)
        what = f"{n} not on the target; the machine will not stop until they are"
    else:  # all sent before, but the target cannot be asked whether it still holds them
        what = "the target cannot confirm it holds the checkpoints; the machine will not stop until it does"
    end = "finished" if finished else "FAILED"
    # the subject is cut at 150 characters: the error (a path, a URL) goes first in the body
    subject = f"training {end}; final sync FAILING; {what}"
    body = (f"training {end}; final sync FAILING: {error}; {what}.\n\nTarget: {target or '(unknown)'}\n"
            + (("Not on the target:\n" + "".join(f"  {u}\n" for u in units[:20]) + "\n") if units else "")
            + "The machine will not stop until they are: the daemon keeps retrying, and says so here when "
              "they are safe.\nCheck the target (credentials, bucket, network); `supervisorctl status` shows "
              "the sync's last error, `supervisorctl sync --wait` retries now.\n")
    return Mail(subject, body)


def restarted(exit_code: int | None, signal: str | None, delay_s: float, command: str, log_path: str) -> Mail:
    """The run failed and restart = "on-failure" starts it again after `delay_s`."""
    return Mail(f"training failed ({describe_exit(exit_code, signal)}); restarting in {int(delay_s)}s",
                f"Command: {command}\nLog: {log_path}\n")
