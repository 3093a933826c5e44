"""The free-space floor: a filesystem below `alerts.disk_free_min_pct` makes the next checkpoint save
fail (or, worse, leaves a truncated one). A condition: raised while it holds, resolved once it clears
with a little margin, so a value hovering at the threshold does not send a mail every minute.

The filesystems the forecast (`disk.watch`) covers get one alert from it, folding "almost full" in;
this floor speaks for the others (`alerts.disk_paths`, the state folder)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import psutil
import structlog

from supervisor.config import AlertsConfig
from supervisor.context import Context
from supervisor.disk.probe import existing
from supervisor.interfaces import Duty
from supervisor.notify.mails import disk as words

log = structlog.get_logger("disk")

MARGIN_PCT = 1.0  # clear only this many points above the threshold


class DiskFloor:
    def __init__(self, ctx: Context, conf: AlertsConfig, paths: Iterable[str] = (),
                 disk_usage: Callable[[str], Any] = psutil.disk_usage,
                 covered: Callable[[int], bool] = lambda dev: False):
        self.ctx = ctx
        self.cfg = conf
        self.paths = list(dict.fromkeys([*conf.disk_paths, *paths]))
        self._du = disk_usage
        self._low: set[str] = set()
        self._covered = covered
        self.last: list[dict] = []

    def poll(self) -> list[dict]:
        try:
            self.last = self._check(self.cfg.disk_free_min_pct)
        except Exception:  # noqa: BLE001 - a failed probe is logged and tried again next turn
            log.exception("disk_check_failed")
        return self.last

    def _check(self, min_pct: float) -> list[dict]:
        seen: dict[int, list[str]] = {}
        where: dict[int, str] = {}
        for p in self.paths:
            q = existing(p)
            if q is None:
                continue
            try:
                dev = os.stat(q).st_dev
            except OSError:
                continue
            seen.setdefault(dev, []).append(p)
            where.setdefault(dev, q)
        out = []
        low_now: set[str] = set()
        for dev, paths in seen.items():
            try:
                du = self._du(where[dev])
            except OSError as e:
                log.warning("disk_usage_failed", path=where[dev], error=str(e))
                continue
            free_pct = 100.0 * du.free / du.total if du.total else 100.0
            key = f"disk:low:{paths[0]}"
            out.append({"paths": paths, "free_bytes": int(du.free), "total_bytes": int(du.total),
                        "free_pct": free_pct})
            was = key in self._low
            if self._covered(dev):
                continue
            if free_pct < min_pct or (was and free_pct < min(min_pct + MARGIN_PCT, 100.0)):
                low_now.add(key)
                mail = words.disk_full(int(du.free), int(du.total), free_pct, paths, min_pct)
                self.ctx.alerts.fire(key, "disk_full", "warning", mail.subject, mail.body)
        for key in self._low - low_now:
            self.ctx.alerts.resolve(key)
        self._low = low_now
        return out

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("disk_floor", 15.0, self.poll),)

