"""Watching the final sync at a training's end: it may block for final_sync_timeout (30 min by
default) while the target is down, and the owner must hear at once, not when it gives up."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.interfaces import FinalSyncResult, SyncView, TrainingInfo
from supervisor.notify.mails import training as run_words
from supervisor.states import TrainingState

if TYPE_CHECKING:
    from supervisor.notify.alerts import Alerts

log = structlog.get_logger("idle")  # the name the journal has always shown for it

POLL_S = 0.5


def final_sync_watched(run: Callable[[], FinalSyncResult], sync_status: Callable[[], dict],
                       on_failing: Callable[[dict], None], poll_s: float = POLL_S) -> FinalSyncResult:
    """`run()` (the blocking final sync) in a thread; while it runs, `sync_status()` is read every
    `poll_s` and the first time it says the target is failing, `on_failing(status)` is called once."""
    box: list[FinalSyncResult] = []

    def target() -> None:
        try:
            box.append(run())
        except Exception as e:  # noqa: BLE001 - a crashing sync is a failed sync
            box.append(FinalSyncResult(ok=False, target="", error=f"final sync raised {type(e).__name__}: {e}"))

    t = threading.Thread(target=target, name="final-sync", daemon=True)
    t.start()
    told = False
    while True:
        t.join(poll_s)
        if not t.is_alive():
            return box[0]
        if told:
            continue
        try:
            st = sync_status() or {}
        except Exception:  # noqa: BLE001 - status is a courtesy; the sync goes on
            continue
        if st.get("state") == "failing":
            told = True
            on_failing(st)


# The training ended and its final sync cannot reach the target: the same condition (and alert) as
# a stop held by a failing final sync (the guard's), so the owner gets one first mail and one
# "resolved" for both.
FINAL_FAILING_KEY = "stop:failing"


class EndSync:
    """The final sync at a training's end, watched: a target that fails meanwhile is alerted at
    once, and the alert resolved when this final sync gets through after all."""

    def __init__(self, alerts: Alerts):
        self.alerts = alerts
        self.told = False

    @staticmethod
    def final(sync: SyncView, paths: list[str], timeout_s: float) -> FinalSyncResult:
        try:
            return sync.final_sync(paths, timeout_s)
        except Exception as e:  # noqa: BLE001 - a crashing sync is a failed sync, never a stop
            log.exception("final_sync_raised")
            return FinalSyncResult(ok=False, target="", error=f"final sync raised {type(e).__name__}: {e}")

    def run(self, sync: SyncView, final_sync: Callable[[], FinalSyncResult], info: TrainingInfo) -> FinalSyncResult:
        result = final_sync_watched(final_sync, sync.status, lambda st: self._failing(sync, info, st))
        if result.ok and self.told:
            self.told = False
            self.alerts.resolve(FINAL_FAILING_KEY)
        return result

    def _failing(self, sync: SyncView, info: TrainingInfo, st: dict) -> None:
        holdings = getattr(sync, "holdings", None)
        units = [h.unit for h in holdings() if not h.on_target] if callable(holdings) else []
        mail = run_words.final_sync_failing(info.state == TrainingState.FINISHED, st.get("last_error") or "?",
                                            tuple(units), st.get("pending_files") or 0, st.get("target") or "")
        self.told = True
        self.alerts.fire(FINAL_FAILING_KEY, "stop_failed", "critical", mail.subject, mail.body)
        log.error("final_sync_failing_at_training_end", run_id=info.run_id, error=st.get("last_error"),
                  units=len(units))
