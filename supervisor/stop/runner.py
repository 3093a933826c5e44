"""The one door to a stop: every wing asks here, with a reason and a sentence, and takes its reason
back here when its cause is gone; no wing touches the idle machine or the stop record itself. The
daemon hands each wing `runner.request` and `runner.withdraw` (GPU health's on_bad = "stop", the
money caps, a lost node, waste, a spot notice), and the idle guard behind it carries the request into
its machine (idle.machine.request_stop) and its stop sequence. A wing whose reason cuts the final
sync short (stop.rules: `cuts_sync_short`) names its moment here (`moment_for`), and the stop asks it
(`moment`). `supervisorctl stop-machine` (root) asks for `manual`."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from supervisor.interfaces import RequestError, Verb
from supervisor.requests import checked_bool
from supervisor.stop.rules import STOP_WORDS, StopReason, stop_reason, stop_rule

log = structlog.get_logger("stop")

Moment = Callable[[], tuple[float | None, str]]


class UnknownReason(ValueError):
    """A word that names no reason of the table."""


class StopRunner:
    def __init__(self, request: Callable[[str, str], bool], withdraw: Callable[[str], None]):
        self._request = request
        self._withdraw = withdraw
        self._moments: dict[StopReason, Moment] = {}

    def request(self, word: str, why: str = "") -> bool:
        """Stop the machine for `word` (a StopReason value, or a wing's own word the table maps:
        "max_cost", "gpu_bad"); True when a stop began or took over, False when the reason stands
        beside a stop that ranks as high (or waits for its notice)."""
        if word not in STOP_WORDS or not word:
            raise UnknownReason(f"{word!r} is not a reason to stop (see supervisor.stop.rules.STOP_RULES)")
        log.info("stop_asked", reason=stop_reason(word).value, word=word, why=why)
        return self._request(word, why)

    def withdraw(self, word: str) -> None:
        """The cause went away (a cap moved by `budget`, a node back, the waste gone): a stop it
        leads ends if its action has not begun."""
        self._withdraw(word)

    # --- the moments of the reasons that cut the final sync short --------------------------------
    def moment_for(self, reasons: tuple[StopReason, ...], fn: Moment) -> None:
        for r in reasons:
            if not stop_rule(r.value).cuts_sync_short:
                raise UnknownReason(f"{r.value} does not cut the final sync short: it has no moment")
            self._moments[r] = fn

    def moment(self, word: str) -> tuple[float | None, str]:
        """Seconds a final sync for `word` may still take, and the moment in words; (None, "") when
        its wing names none."""
        fn = self._moments.get(stop_reason(word))
        return fn() if fn is not None else (None, "")

    # --- supervisorctl stop-machine ----------------------------------------------------------------
    def stop_machine(self, a: dict) -> dict:
        """`stop-machine` (root): the manual stop, saving first; `--cancel` takes it back before its
        action begins."""
        if checked_bool(a, "cancel"):
            self.withdraw("manual")
            return {"message": "the manual stop is withdrawn (a stop already acting goes on)"}
        why = a.get("why") or "supervisorctl stop-machine"
        if not isinstance(why, str):
            raise RequestError('stop-machine: "why" must be a sentence')
        why = why[:200]
        began = self.request("manual", why)
        return {"message": "stopping the machine: the training is interrupted, its outputs synced and verified, "
                           "then the stop action runs" if began else
                           "a stop is already acting; the manual stop stands beside it"}

    def verbs(self) -> dict[str, Verb]:
        return {"stop-machine": self.stop_machine}  # root only: not in MEMBER_COMMANDS
