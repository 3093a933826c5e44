"""The one door to a stop: every wing asks here, with a reason and a sentence, and no wing touches
the idle machine or the stop record itself. The daemon hands each wing `runner.request` (GPU
health's on_bad = "stop", the money caps; a lost node and waste next) and the idle guard behind it
carries the request into its machine (idle.machine.request_stop) and its stop sequence."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from supervisor.states import STOP_WORDS, stop_reason

log = structlog.get_logger("stop")


class UnknownReason(ValueError):
    """A word that names no reason of the table."""


class StopRunner:
    def __init__(self, request: Callable[[str, str], bool], withdraw: Callable[[str], None]):
        self._request = request
        self._withdraw = withdraw

    def request(self, word: str, why: str = "") -> bool:
        """Stop the machine for `word` (a StopReason value, or a wing's own word the table maps:
        "max_cost", "gpu_bad"); True when a stop began or took over, False when the reason stands
        beside a stop that ranks as high."""
        if word not in STOP_WORDS or not word:
            raise UnknownReason(f"{word!r} is not a reason to stop (see supervisor.states.STOP_RULES)")
        log.info("stop_asked", reason=stop_reason(word).value, word=word, why=why)
        return self._request(word, why)

    def withdraw(self, word: str) -> None:
        """The cause went away (a cap moved by `budget`, a node back before the stop acted)."""
        self._withdraw(word)
