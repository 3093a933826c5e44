"""Is a running training stuck? Judged by the step, not by utilisation.

A hung NCCL collective or a deadlocked data loader can keep the GPU at 100% and the CPU busy while
no step advances, for hours; utilisation calls that "busy" for ever. The step counter cannot be
fooled that way. Pure: the tracker supplies when each step was seen, this decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FLOOR_S = 1800.0     # never call a run stalled sooner than this: checkpoint saves and evals take minutes
FACTOR = 10.0        # ... nor sooner than this many typical step times


@dataclass(frozen=True)
class Stall:
    step: int
    since: float         # when that step was seen (wall)
    for_s: float
    threshold_s: float


def threshold(step_times: Sequence[float], configured_s: float | None) -> float | None:
    """Seconds without a new step that make a run stalled: the configured value, else the larger of
    30 min and 10x the median time between the steps seen so far. None before the first step: a run
    still loading its model has not started stepping, and is not judged here."""
    if configured_s:
        return float(configured_s)
    if not step_times:
        return None
    gaps = [b - a for a, b in zip(step_times, step_times[1:], strict=False) if b > a]
    typical = _median(gaps) if gaps else 0.0
    return max(FLOOR_S, FACTOR * typical)


def _median(xs: list[float]) -> float:
    """statistics.median without importing statistics (decimal and fractions: ~0.5 MiB at rest)."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def judge(step: int | None, step_at: float | None, now: float, threshold_s: float | None,
          running: bool) -> Stall | None:
    """The stall, when a running training's last step is older than the threshold."""
    if not running or step is None or step_at is None or threshold_s is None:
        return None
    waited = now - step_at
    if waited < threshold_s:
        return None
    return Stall(step, step_at, waited, threshold_s)


@dataclass(frozen=True)
class View:
    """What status shows of one run: seconds since its step last moved, the threshold in force,
    and the stall when there is one."""

    since_step_s: float | None
    threshold_s: float | None
    stall: Stall | None


def view(step: int | None, step_at: float | None, step_times: Sequence[float], now: float,
         configured_s: float | None, running: bool) -> View:
    """The run as status and the alert see it. `running`: the run is live and has not said it
    finished (a finished run may spend an hour in push_to_hub without a step; that is no hang)."""
    if not running or step is None or step_at is None:
        return View(None, None, None)
    th = threshold(step_times, configured_s)
    return View(max(0.0, now - step_at), th, judge(step, step_at, now, th, running))


def counts_as_idle(s: Stall | None, action: str) -> bool:
    """With progress.stalled_action = "stop" a stalled run's GPU load, output and CPU are not
    work: the machine is judged on its people (and keepalives) alone, like any idle machine."""
    return s is not None and action == "stop"
