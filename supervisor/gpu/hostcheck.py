"""Host memory: almost exhausted comes right before the kernel OOM killer takes the training, which
the GPU probe cannot see. A condition: raised while it holds, resolved once it clears with a little
margin, so a value hovering at the threshold does not send a mail every minute. (Disk space is the
disk wing's: `supervisor.disk.floor`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil
import structlog

from supervisor.config import AlertsConfig
from supervisor.context import Context
from supervisor.interfaces import Duty
from supervisor.notify.mails import gpu as words

log = structlog.get_logger("hostcheck")

MARGIN_PCT = 1.0  # clear only this many points above the threshold


class HostCheck:
    def __init__(self, ctx: Context, conf: AlertsConfig,
                 virtual_memory: Callable[[], Any] = psutil.virtual_memory):
        self.ctx = ctx
        self.cfg = conf
        self._vm = virtual_memory
        self._mem_low = False

    def poll(self) -> dict:
        cfg = self.cfg
        out: dict = {"memory": None}
        try:
            out["memory"] = self._check_memory(cfg.host_mem_min_pct)
        except Exception:  # noqa: BLE001 - a failed probe is logged and tried again next turn
            log.exception("host_memory_check_failed")
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

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("host", 15.0, self.poll),)  # host RAM exhaustion is followed fast by the OOM killer
