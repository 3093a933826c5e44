"""The stop for a cap and the hooks at a stop, mixed into IdleGuard.

A cap (supervisor.money) asks `cap_stop(reason, why)`: the same stop sequence as an idle stop (the
interrupt, the final sync, the mail, the action), with a reason that activity does not cancel. A cap
also cuts through a final sync that hangs: the sync is given only the time left to the cap's moment
(or to `max_idle_cost`), and at that moment the stop goes ahead, the mail naming what did not make it
off the machine. Required `stop` hooks hold the stop as a failed final sync does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from supervisor.idle import machine as idle
from supervisor.idle.machine import CAP_REASONS
from supervisor.idle.stop import StopRecord, may_act_without_sync
from supervisor.interfaces import FinalSyncResult

log = structlog.get_logger("idle")

CUT_FLOOR_S = 1.0  # a final sync is always given at least this long


class CapStops:
    """Needs of the host: conf, clock, m, th, _lock, _now, _carry_out, _save, poll_soon, stopper."""

    conf: Any
    clock: Any
    m: Any
    th: Any
    _lock: Any
    stopper: Any
    hooks: Any = None                 # supervisor.hooks.runner.Hooks (IdleGuard's constructor)
    cap_why: str = ""                 # the cap this stop is for, in words (the stopping mail)
    # seconds left to the cap's moment and its words, or (None, ""): the money guard's (IdleGuard's constructor)
    cap_moment: Callable[[], tuple[float | None, str]] | None = None

    def request_stop(self, word: str, why: str) -> bool:
        """The stop runner's door into the machine (stop.runner): the reason stands, and begins or
        takes over a stop as the rule table says. False when no new stop began (one that ranks as
        high is under way or acting: the reason stands beside it)."""
        now = self._now()  # type: ignore[attr-defined]
        with self._lock:
            self.m, actions = idle.request_stop(self.m, now, word, why)
            began = any(isinstance(a, idle.BeginStop) for a in actions)
            if began and word in CAP_REASONS:
                self.cap_why = why
            log.warning("stop_requested", reason=word, why=why, began=began, state=self.m.state.value)
            self._carry_out(actions, now)  # type: ignore[attr-defined]
            self._save()  # type: ignore[attr-defined]
        self.poll_soon()  # type: ignore[attr-defined]
        return began

    def withdraw_stop(self, word: str) -> None:
        with self._lock:
            self.m = idle.withdraw_stop(self.m, word)
            self._save()  # type: ignore[attr-defined]
        self.poll_soon()  # type: ignore[attr-defined]

    def cap_stop(self, reason: str, why: str) -> bool:
        """Stop now for a cap (the money guard's word for request_stop)."""
        return self.request_stop(reason, why)

    def _cap_left(self) -> tuple[float | None, str]:
        if self.m.stop_reason not in CAP_REASONS or self.cap_moment is None:
            return None, ""
        try:
            return self.cap_moment()
        except Exception:  # noqa: BLE001 - no figure: the configured timeout applies
            log.exception("cap_moment_failed")
            return None, ""

    def _idle_cost_left(self) -> float | None:
        """Seconds until the idle cost reaches max_idle_cost (None = no such cap)."""
        price, cap = self.conf.price_per_hour, self.conf.max_idle_cost
        if not price or cap is None:
            return None
        spent = price * idle.idle_for(self.m, self.th, self.clock.monotonic()) / 3600.0
        return (cap - spent) / price * 3600.0

    def _sync_timeout(self) -> float:
        """The final sync's time: final_sync_timeout, cut to the moment a cap arrives."""
        lefts = [x for x in (self._cap_left()[0], self._idle_cost_left()) if x is not None]
        t = self.conf.stop.final_sync_timeout
        return max(CUT_FLOOR_S, min([t, *lefts]))

    def _cap_due(self) -> bool:
        """A cap's moment has come: the stop goes ahead now, whatever held it."""
        left = self._cap_left()[0]
        idle_left = self._idle_cost_left()
        return (left is not None and left <= CUT_FLOOR_S) or (idle_left is not None and idle_left <= 0)

    def _may_force(self) -> str:
        """Why the stop may go ahead although its final sync or a required hook failed ("" = it may not)."""
        left, words = self._cap_left()
        cap = f"{words} has come" if left is not None and left <= CUT_FLOOR_S else ""
        price = self.conf.price_per_hour
        # the idle cost as of now (the sync may have taken long since the last poll), not the last poll's
        cost = None if price is None else price * idle.idle_for(self.m, self.th, self.clock.monotonic()) / 3600.0
        return may_act_without_sync(self.conf.stop, cost, self.conf.max_idle_cost, self.conf.currency, cap)

    def _hook_facts(self, rec: StopRecord | None, r: FinalSyncResult | None = None) -> dict[str, object]:
        synced = (rec.synced if rec is not None else None) or {}
        ok = r.ok if r is not None else synced.get("ok")
        return {"reason": rec.reason if rec is not None else self.m.stop_reason,
                "target": (r.target if r is not None else synced.get("target")) or self.conf.sync_target,
                "final_sync_ok": "" if ok is None else str(bool(ok)), "action": self.conf.stop.action,
                "unsynced": " ".join(synced.get("unsynced") or [])[:4000]}

    def _fire(self, event: str, facts: dict[str, object]) -> None:
        if self.hooks is not None:
            self.hooks.fire(event, facts)

    def _stop_hooks_hold(self, rec: StopRecord) -> str:
        """Run the `stop` hooks (outside the guard's lock); why a required one holds the stop, or ""."""
        if self.hooks is None or not self.hooks.for_event("stop"):
            return ""
        # a cap's moment bounds the hooks too: a hanging hook must not carry the stop past the cap
        results = self.hooks.run_blocking("stop", self._hook_facts(rec), limit=self._sync_timeout())
        bad = [f"`{r.run}` {r.why}" for r in results if r.required and not r.ok]
        return f"required stop hook failed: {'; '.join(bad)}" if bad else ""
