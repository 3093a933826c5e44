"""Host memory and disk space: the two ways a machine kills a training that the GPU probe cannot see.

Host RAM almost exhausted comes right before the kernel OOM killer; a full disk makes the next
checkpoint save fail (or, worse, leaves a truncated one). Both are conditions: raised while they
hold, resolved once they clear with a little margin, so a value hovering at the threshold does not
send a mail every minute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import psutil
import structlog

from supervisor.context import Context
from supervisor.notify.mails import gpu as words

log = structlog.get_logger("hostcheck")

MARGIN_PCT = 1.0  # clear only this many points above the threshold


class HostCheck:
    def __init__(self, ctx: Context, paths: Iterable[str] = (),
                 virtual_memory: Callable[[], Any] = psutil.virtual_memory,
                 disk_usage: Callable[[str], Any] = psutil.disk_usage,
                 covered: Callable[[int], bool] = lambda dev: False):
        self.ctx = ctx
        self.paths = list(dict.fromkeys([*ctx.config.alerts.disk_paths, *paths]))
        self._vm = virtual_memory
        self._du = disk_usage
        self._mem_low = False
        self._disk_low: set[str] = set()
        # a filesystem the disk wing forecasts (checkpoints in sync.watch / training.workdir): its
        # alert folds "almost full" in, so this one stays quiet there (one alert, not two)
        self._covered = covered

    def poll(self) -> dict:
        cfg = self.ctx.config.alerts
        out: dict = {"memory": None, "disks": []}
        try:
            out["memory"] = self._check_memory(cfg.host_mem_min_pct)
        except Exception:  # noqa: BLE001 - a failed probe is logged, the other checks still run
            log.exception("host_memory_check_failed")
        try:
            out["disks"] = self._check_disks(cfg.disk_free_min_pct)
        except Exception:  # noqa: BLE001
            log.exception("disk_check_failed")
        return out

    # --- memory --------------------------------------------------------------------------------
    def _check_memory(self, min_pct: float) -> dict:
        vm = self._vm()
        pct = 100.0 * vm.available / vm.total if vm.total else 100.0
        info = {"available_bytes": int(vm.available), "total_bytes": int(vm.total), "available_pct": pct}
        low = pct < min_pct or (self._mem_low and pct < min(min_pct + MARGIN_PCT, 100.0))
        if low:
            mail = words.host_mem_low(int(vm.available), int(vm.total), pct, min_pct)
            self.ctx.alerts.fire("host:mem_low", "host_mem_low", "warning", mail.subject, mail.body)
            self._mem_low = True
        elif self._mem_low:
            self.ctx.alerts.resolve("host:mem_low")
            self._mem_low = False
        return info

    # --- disks ---------------------------------------------------------------------------------
    def _check_disks(self, min_pct: float) -> list[dict]:
        seen: dict[int, list[str]] = {}
        where: dict[int, str] = {}
        for p in self.paths:
            q = _existing(p)
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
            was = key in self._disk_low
            if self._covered(dev):
                continue
            if free_pct < min_pct or (was and free_pct < min(min_pct + MARGIN_PCT, 100.0)):
                low_now.add(key)
                mail = words.disk_full(int(du.free), int(du.total), free_pct, paths, min_pct)
                self.ctx.alerts.fire(key, "disk_full", "warning", mail.subject, mail.body)
        for key in self._disk_low - low_now:
            self.ctx.alerts.resolve(key)
        self._disk_low = low_now
        return out


def _existing(path: str) -> str | None:
    """The path, or its nearest existing parent (a checkpoint dir not created yet lives on the
    same filesystem as its parent)."""
    p = os.path.abspath(path)
    while True:
        if os.path.exists(p):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent

