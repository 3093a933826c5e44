"""When is the disk full? From free space, the size of the last checkpoint and the interval
between saves: how many more saves fit, when the one that would not fit starts, and whether that
is soon enough to alert now (before that save, not after it fails).

Pure: no I/O, no clock reads; `now` and every figure are handed in."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MIN_ALERT_BEFORE = 900.0    # the default alert_before is 2 save intervals, but never under 15 minutes
MARGIN_FRACTION = 0.25      # a checkpoint may grow (a new shard, more optimizer state): room for a quarter more
HISTORY = 8                 # saves remembered per filesystem for the interval


@dataclass(frozen=True)
class Save:
    """One complete checkpoint seen on a filesystem."""

    name: str
    bytes: int
    at: float        # wall seconds its last file was written


@dataclass(frozen=True)
class Forecast:
    free: int
    total: int
    per_checkpoint: int | None   # bytes of the newest checkpoint
    interval: float | None       # seconds between saves (median of the last few)
    need: int | None             # free space the next save needs: its size plus a margin
    saves_left: int | None       # saves that still fit (counting what pruning may free)
    full_in: float | None        # seconds until the save that would not fit starts
    alert_before: float
    reasons: tuple[str, ...]     # why to alert now: "forecast", "short" (the next save does not fit), "low"
    reclaimable: int = 0         # bytes pruning may free (verified off the machine, not kept)
    keeps_up: bool = False       # prune on, sync healthy, room for the kept ones and two saves: never full

    @property
    def alert(self) -> bool:
        return bool(self.reasons)

    @property
    def short(self) -> bool:
        """Free space (without pruning) is below what the next save needs: time to prune."""
        return self.need is not None and self.free < self.need


def need_for(per_checkpoint: int) -> int:
    """What the next save needs free: the last one's size plus a margin."""
    return per_checkpoint + math.ceil(per_checkpoint * MARGIN_FRACTION)


def remember(history: list[Save], seen: Iterable[Save]) -> list[Save]:
    """The saves remembered for the interval: those seen now merged with earlier ones (pruned
    checkpoints still count for the rhythm), by name, the newest HISTORY by time."""
    by_name = {s.name: s for s in history}
    for s in seen:
        by_name[s.name] = s
    return sorted(by_name.values(), key=lambda s: s.at)[-HISTORY:]


def rate(saves: list[Save]) -> tuple[int | None, float | None]:
    """(bytes per checkpoint, seconds between saves): the newest checkpoint's size and the median
    gap between the saves remembered; None where there is not enough to say."""
    ordered = sorted(saves, key=lambda s: s.at)
    if not ordered:
        return None, None
    per = ordered[-1].bytes or None
    gaps = sorted(b.at - a.at for a, b in zip(ordered, ordered[1:], strict=False) if b.at > a.at)
    if not gaps:
        return per, None
    mid = len(gaps) // 2
    interval = gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
    return per, interval


def keeps_up(free: int, checkpoint_bytes: int, per: int | None, kept: int) -> bool:
    """With prune on and a sync that is not failing, every save makes an older checkpoint deletable
    once it is off the machine: the disk never fills if it holds the `kept` checkpoints that must
    stay (keep_local and the best) plus one being written and one waiting for the sync, with margin.
    `checkpoint_bytes`: what the checkpoints here take now (free again once pruned)."""
    if not per:
        return False
    return free + checkpoint_bytes >= kept * per + need_for(per) + per


def alert_window(configured: float | None, interval: float | None) -> float:
    """disk.alert_before, or by default 2 save intervals and at least 15 minutes."""
    if configured is not None:
        return configured
    return max(2 * interval, MIN_ALERT_BEFORE) if interval else MIN_ALERT_BEFORE


def forecast(free: int, total: int, saves: list[Save], now: float, alert_before: float | None = None,
             reclaimable: int = 0, min_free_pct: float = 0.0, steady: bool = False) -> Forecast:
    """The forecast for one filesystem. `reclaimable`: what pruning may free (0 when it is off);
    `min_free_pct`: alerts.disk_free_min_pct, the plain "almost full" threshold folded in here;
    `steady`: keeps_up() holds (prune on, sync healthy): no "full in", only a next save that does
    not fit now alerts."""
    per, interval = rate(saves)
    window = alert_window(alert_before, interval)
    reasons: list[str] = []
    if total and 100.0 * free / total < min_free_pct:
        reasons.append("low")
    if per is None:
        return Forecast(free, total, None, interval, None, None, None, window, tuple(reasons), reclaimable)
    need = need_for(per)
    avail = free + reclaimable
    left = max(0, (avail - (need - per)) // per)
    full_in: float | None = None
    if left == 0:
        full_in = 0.0
    elif interval is not None:
        last = max(s.at for s in saves)
        next_at = max(last + interval, now)   # an overdue save counts as about to start
        full_in = next_at - now + left * interval
    if avail < need:
        reasons.insert(0, "short")
    elif steady:
        full_in = None
    elif full_in is not None and full_in < window:
        reasons.insert(0, "forecast")
    return Forecast(free, total, per, interval, need, left, full_in, window, tuple(reasons), reclaimable,
                    steady and avail >= need)


# --- a run that died of a full disk -----------------------------------------------------------------

# What a full disk looks like in a training's last lines: the errno's words, and torch's own when a
# save runs out of room (its PytorchStreamWriter names no errno).
ENOSPC_WORDS = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded", "[Errno 122]")
WRITE_FAILED_WORDS = ("file write failed", "PytorchStreamWriter failed", "unexpected pos")
NEARLY_FULL_BYTES = 64 * 1024**2


def died_of_full_disk(tail: Iterable[str], free: int, total: int, per: int | None) -> bool:
    """A failed run's end, judged from its last log lines and the free space of a watched
    filesystem now: the errno's words say it; a write that failed says it when the disk has less
    than the next save needs (or almost nothing) free."""
    lines = list(tail)
    if any(w in line for line in lines for w in ENOSPC_WORDS):
        return True
    tight = free < max(NEARLY_FULL_BYTES, total // 200) or (per is not None and free < need_for(per))
    return tight and any(w in line for line in lines for w in WRITE_FAILED_WORDS)
