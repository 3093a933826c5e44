"""Rates, ETA and cost from timestamped counters. Pure: every function takes `now`.

A figure is returned only when the samples support it; otherwise None ("unknown"). In
particular: fewer than two samples, a window shorter than `min_span_s`, a counter that went
backwards (the caller starts a new series), or a rate of zero (no finish in sight) give None,
never a number that merely looks plausible.

Definitions used throughout (and in the README):
- rate = (v_last - v_first) / (t_last - t_first) over the samples of the last `window_s`, plus
  the last sample at or before the window's start, so the span covers the window even when
  samples are sparse (a checkpoint every 10 minutes still gives a rate).
- stalled: nothing changed for longer than both the window and three times the usual gap
  between samples; the rate is then 0 and the ETA unknown.
- ETA = (total - done) / rate, less the time since `done` was observed, never below 0.
- cost so far = price_per_hour x the run's machine time (from the moment the daemon saw the run
  start to now, or to its end). Cost to finish = price_per_hour x ETA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_SPAN_S = 20.0       # below this, arrival jitter of a 2 s log poll would dominate the rate
MERGE_S = 1.0           # samples closer than this collapse into the newest (bursts of backlog)
MAX_REL_ERR = 0.05      # a rate from values printed too coarsely to measure it is unknown


@dataclass(frozen=True)
class Sample:
    t: float            # wall time the value was true
    v: float            # the counter (steps, tokens, epochs)
    err: float = 0.0    # +- on v from rounding in print


class Series:
    """Samples of one counter that only grows within a run. Records changes only (the time of
    the last change is what stall detection needs); samples within MERGE_S of the one that
    opened the current bucket replace it, so a backlog read in one go counts as one moment."""

    def __init__(self, maxlen: int = 2048):
        self.maxlen = maxlen
        self._s: list[Sample] = []
        self._bucket_start: float | None = None

    def __len__(self) -> int:
        return len(self._s)

    @property
    def samples(self) -> list[Sample]:
        return list(self._s)

    @property
    def last(self) -> Sample | None:
        return self._s[-1] if self._s else None

    def clear(self) -> None:
        self._s.clear()
        self._bucket_start = None

    def add(self, t: float, v: float, err: float = 0.0) -> bool:
        """Record v at t. False (and nothing recorded) when v went backwards or t is older than
        the last sample: the caller decides whether that means a new series."""
        if not (math.isfinite(t) and math.isfinite(v)):
            return False
        last = self.last
        if last is not None:
            if v < last.v or t < last.t:
                return False
            if v == last.v:
                return True
            if self._bucket_start is not None and t - self._bucket_start < MERGE_S:
                self._s[-1] = Sample(t, v, err)
                return True
        self._s.append(Sample(t, v, err))
        self._bucket_start = t
        if len(self._s) > self.maxlen:
            del self._s[: len(self._s) - self.maxlen]
        return True

    def prune(self, before: float, keep: int = 2) -> None:
        """Drop samples older than `before`, keeping the newest `keep` and one anchor."""
        i = 0
        while i < len(self._s) - keep and self._s[i + 1].t < before:
            i += 1
        if i:
            del self._s[:i]

    def to_json(self, n: int = 64) -> list[list[float]]:
        return [[s.t, s.v, s.err] for s in self._s[-n:]]

    @classmethod
    def from_json(cls, data: object, maxlen: int = 2048) -> Series:
        s = cls(maxlen)
        if isinstance(data, list):
            for row in data:
                if (isinstance(row, list) and len(row) == 3
                        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)):
                    s.add(float(row[0]), float(row[1]), float(row[2]))
        return s


def _used(samples: Sequence[Sample], now: float, window_s: float) -> list[Sample]:
    pts = [s for s in samples if s.t <= now]
    if len(pts) < 2:
        return []
    start = now - window_s
    i = next((k for k, s in enumerate(pts) if s.t > start), len(pts))
    i = max(0, i - 1)  # the anchor: the last sample at or before the window's start
    used = pts[i:]
    return used if len(used) >= 2 else pts[-2:]


def window_rate(samples: Sequence[Sample], now: float, window_s: float,
                min_span_s: float = MIN_SPAN_S, max_rel_err: float = MAX_REL_ERR) -> float | None:
    """Units per second over the sliding window; None when the samples cannot tell."""
    used = _used(samples, now, window_s)
    if not used:
        return None
    first, last = used[0], used[-1]
    span = last.t - first.t
    if span < min_span_s or span <= 0:
        return None
    dv = last.v - first.v
    if dv < 0:
        return None
    if dv == 0:
        return 0.0
    if (first.err + last.err) / dv > max_rel_err:
        return None
    return dv / span


def stalled_since(samples: Sequence[Sample], now: float, window_s: float) -> float | None:
    """When the counter last moved, if it has been still for suspiciously long; else None."""
    pts = [s for s in samples if s.t <= now]
    if not pts:
        return None
    last = pts[-1]
    gap = now - last.t
    used = _used(pts, now, window_s)
    cadence = (used[-1].t - used[0].t) / (len(used) - 1) if len(used) >= 2 else 0.0
    return last.t if gap > max(window_s, 3.0 * cadence) else None


def eta_seconds(done: float | None, total: float | None, rate: float | None,
                since_done: float = 0.0) -> float | None:
    """Seconds to finish: 0 when done == total; None unless done < total and rate > 0 are known."""
    if done is None or total is None:
        return None
    if not (math.isfinite(done) and math.isfinite(total)) or total <= 0 or done < 0 or done > total:
        return None
    if done == total:
        return 0.0
    if rate is None or not math.isfinite(rate) or rate <= 0:
        return None
    return max(0.0, (total - done) / rate - max(0.0, since_done))


def fraction(done: float | None, total: float | None) -> float | None:
    if done is None or total is None or total <= 0 or done < 0 or done > total:
        return None
    return done / total


def money(price_per_hour: float | None, seconds: float | None) -> float | None:
    """price_per_hour x seconds / 3600; None when either is unknown."""
    if price_per_hour is None or seconds is None or seconds < 0:
        return None
    if not (math.isfinite(price_per_hour) and math.isfinite(seconds)):
        return None
    return price_per_hour * seconds / 3600.0


def fits_budget(spent: float | None, to_finish: float | None, budget: float | None) -> bool | None:
    """Whether spent + cost to finish stays within budget; None when any is unknown."""
    if spent is None or to_finish is None or budget is None:
        return None
    return spent + to_finish <= budget + 1e-9
