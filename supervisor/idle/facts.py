"""What the idle guard works from and reports: its view of the config, the stop's worker it shares,
and the facts (run end, outputs, last progress, the `idle`/`stop` blocks of status) that its mails
and status are made of. Plain functions of plain data, apart from the worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from supervisor.config import Config, IdleConfig, StopConfig
from supervisor.idle import machine as idle
from supervisor.idle.machine import IdleMachine, Signals, Thresholds
from supervisor.interfaces import FinalSyncResult, ProgressView, TrainingInfo
from supervisor.notify.mails import training as run_words
from supervisor.notify.mails.stall import LOG_LINES
from supervisor.states import IdleState, TrainingState, stop_reason
from supervisor.stop.actions import stop_how
from supervisor.stop.record import StopRecord
from supervisor.stop.worker import Jobs  # noqa: F401 - the stop's worker, which the run's end uses too
from supervisor.training.runner import run_log_tail

log = structlog.get_logger("idle")

I = IdleState  # noqa: E741


@dataclass(frozen=True)
class GuardConfig:
    """What the guard reads of the config: its own sections and the few values it needs from others."""

    idle: IdleConfig
    stop: StopConfig
    on_finish: str
    finish_grace: float
    session: str
    final_paths: tuple[str, ...]      # stop.final_sync, else sync.watch
    sync_target: str
    state_dir: str
    training_env: dict[str, str]      # the stop command runs with it (provider ids, tokens)
    price_per_hour: float | None
    currency: str
    max_idle_cost: float | None
    stop_grace: float = 30.0          # training.stop_grace: how long each of SIGINT and SIGTERM may take
    stalled_action: str = "alert"     # progress.stalled_action: "stop" counts a stalled run as idle
    training_user: str = ""           # training.user: its log is read the way root may read it (safeopen)
    stop_plan: Any = None             # stop.choose.Plan: what stop.action means here (None: decided at the stop)

    @classmethod
    def of(cls, cfg: Config, stop_plan: Any = None) -> GuardConfig:
        return cls(cfg.idle, cfg.stop, cfg.training.on_finish, cfg.training.finish_grace, cfg.training.session,
                   tuple(cfg.stop.final_sync or cfg.sync.watch), cfg.sync.target, cfg.state_dir,
                   dict(cfg.training.env or {}), cfg.price_per_hour, cfg.currency, cfg.max_idle_cost,
                   cfg.training.stop_grace, cfg.progress.stalled_action, cfg.training.user or "", stop_plan)

    @property
    def interrupt_patience(self) -> float:
        """How long a stop waits for an interrupted training: SIGINT, SIGTERM, SIGKILL, and a margin."""
        return self.patience(self.stop_grace)

    @staticmethod
    def patience(grace: float) -> float:
        """The same wait when each of SIGINT and SIGTERM gets `grace`."""
        return 2 * grace + 60.0


# --- facts ---------------------------------------------------------------------------------------
def looks_stalled(sig: Signals) -> bool:
    """A training is alive, yet nothing (GPU, output, CPU, a person) counts as work."""
    return sig.training_alive and not sig.active


EARLY_FAIL_S = 60.0  # a run that fails this soon never got going: a typo, a missing file


def finish_mode(on_finish: str, info: TrainingInfo, someone_here: bool = True) -> str:
    """What a run's end does: training.on_finish, except that a run failing in its first minute
    while someone is logged in books no stop ("early-fail": the alert alone; the owner is typing).
    With nobody here (a run started at boot) it gets the finish stop after its grace like any failed
    run: otherwise the machine would bill the whole idle path (issue 37, finding 5)."""
    if (someone_here and info.state == TrainingState.FAILED and info.started_at is not None
            and info.ended_at is not None and info.ended_at - info.started_at < EARLY_FAIL_S
            and on_finish == "stop"):
        return "early-fail"
    return on_finish


def people_here(sig: Signals) -> bool:
    """Is a person at the machine by the last poll (an SSH login, a tmux client, Jupyter)?"""
    return any(s.active and s.name in idle.PEOPLE for s in sig.items)


def run_end(info: TrainingInfo, user: str = "") -> run_words.RunEnd:
    """`user`: the training user, who may have put a link where the log was (never followed)."""
    failed = info.state != TrainingState.FINISHED
    return run_words.RunEnd(not failed, info.run_id, info.exit_code, info.signal, info.command, info.started_at,
                            info.ended_at, info.log_path, info.workdir,
                            tuple(run_log_tail(info.log_path, info.run_id, LOG_LINES, user)) if failed else ())


def outputs(conf: GuardConfig, r: FinalSyncResult | None) -> run_words.Outputs:
    if r is None:
        return run_words.Outputs(sync_target=conf.sync_target, paths=conf.final_paths)
    return run_words.Outputs(r.ok, r.files, r.bytes, r.target, r.error, tuple(r.unsynced), conf.final_paths,
                             conf.sync_target, tuple(getattr(r, "damaged", None) or ()),
                             tuple(getattr(r, "partial_units", None) or ()),
                             tuple(getattr(r, "newest", None) or ()), tuple(getattr(r, "unselected", None) or ()),
                             tuple(getattr(r, "finals", None) or ()), r.unselected_files, r.unselected_bytes,
                             r.unselected_hold)


def last_progress(progress: ProgressView | None, wall: float, currency: str) -> run_words.LastProgress | None:
    if progress is None:
        return None
    p: dict = {}
    c: dict = {}
    try:  # a progress bug must not lose the result mail
        p = progress.snapshot(wall) or {}
        c = progress.cost(wall) or {}
    except Exception:  # noqa: BLE001
        log.exception("progress_for_mail_failed")
    return run_words.LastProgress(p.get("step"), p.get("max_steps"), p.get("epoch"), p.get("loss"),
                                  c.get("spent"), c.get("currency") or currency, p.get("source") or "",
                                  tuple(p.get("tracker_end") or ()))


def status_of(m: IdleMachine, sig: Signals, rec: StopRecord | None, th: Thresholds, conf: GuardConfig,
              now: float, now_mono: float) -> dict:
    """The `idle` and `stop` blocks of status --json."""
    proj = idle.projection(m, th, now)
    stop_at = proj["stop_at"]
    if m.state in (I.STOPPING, I.STOPPED) and rec is not None:
        stop_at = rec.done_at or rec.planned_at
    live = rec if m.state in (I.STOPPING, I.STOPPED) else None
    return {
        "idle": {
            "state": m.state.value,
            "mode": m.mode,
            "idle_since": m.idle_since if m.state != I.ACTIVE else None,
            "idle_for_s": idle.idle_for(m, th, now_mono),
            "warn_at": proj["warn_at"],
            "stop_at": stop_at,
            "reasons": list(m.reasons),
            "checked": sig.notes(),
            "keepalive_until": m.keepalive_until,
            "warn_after_s": th.warn_after,
            "stop_after_warning_s": idle.stop_wait(m, th) if m.state == I.WARNED else th.stop_after_warning,
            "finish_grace_s": th.finish_grace,
            "idle_cost": idle.idle_cost(m, conf.price_per_hour),
            "currency": conf.currency,
            "training_stalled": looks_stalled(sig),
        },
        "stop": {
            "action": conf.stop.action,
            "how": stop_how(conf.stop, conf.stop_plan),
            # the provider's stop (issue 52): who bills, what a stop ends there, what still bills
            "provider": conf.stop_plan.block() if conf.stop_plan is not None else None,
            "confirmed": confirmed_of(live),
            "planned_at": live.planned_at if live else stop_at,
            "phase": live.phase.value if live else None,
            # one of the SPEC's list (states.StopReason); `pending`: every reason that still stands
            "reason": stop_reason(live.reason).value if live else (stop_reason(m.stop_reason).value
                                                                    if m.stop_reason else None),
            "pending": pending_of(m),
            "attempts": live.attempts if live else 0,
            "last_error": live.last_error if live else "",
            "final_sync": live.synced if live else None,
            "result": live.result if live else "",
            "final_sync_paths": list(conf.final_paths),
            "interrupted_run": live.interrupted_run if live else 0,
            "interrupted_at": live.interrupted_at if live else None,
            "interrupt_ended": live.interrupt_ended if live else "",
        },
    }


def confirmed_of(rec: StopRecord | None) -> dict | None:
    """{state, at} once the provider reported the machine not billed (stop.confirm), else None."""
    got = (rec.provider or {}).get("confirmed") if rec is not None else None
    return {"state": got.get("state"), "at": got.get("at")} if isinstance(got, dict) else None


def pending_of(m: idle.IdleMachine) -> list[dict]:
    """The reasons that stand (stop.sequence), the stop under way's own first."""
    out = [x.to_json() for x in m.standing]
    if m.state in (I.WARNED, I.STOPPING) and m.stop_reason and all(p["word"] != m.stop_reason for p in out):
        out.insert(0, {"reason": stop_reason(m.stop_reason).value, "word": m.stop_reason, "why": "", "since": None})
    return out
