"""MoneyGuard: the duty behind the caps. It reads what the decision needs (uptime, the progress
figures, the newest checkpoint's save time and size, the sync's rate), asks `plan.decide`, mails the
projection, and at the moment asks the one stop door to stop for the cap (the daemon hands in
`stop(reason, why)`). `supervisorctl budget` changes a cap here; the change is kept in money.json, and
a cap moved so that its stop is no longer due withdraws that stop (`withdraw(reason)`) until its action
begins: during the final sync, the stop ends and no action follows.

It reads the checkpoint folders with lstat/scandir only (no file is opened, no link followed): they
belong to the training's user."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from supervisor.clock import billing_origin
from supervisor.context import Context
from supervisor.durations import format_duration, parse_duration
from supervisor.interfaces import Duty, ProgressView, RequestError, SyncView, TrainingView, Verb
from supervisor.money import plan
from supervisor.money.plan import Act, Caps, Lead, MoneyState, Run, Warn
from supervisor.money.runmoney import as_one_machine
from supervisor.notify.mails import money as words
from supervisor.states import TRAINING_ALIVE
from supervisor.status import Block
from supervisor.status.money import BudgetBlock
from supervisor.timefmt import parse_moment, when
from supervisor.training.finder import find_checkpoints

if TYPE_CHECKING:
    from supervisor.config import BudgetConfig, Config
    from supervisor.money.runledger import RunLedger

log = structlog.get_logger("money")

ASSUMED_BPS = 50e6          # upload rate assumed before one is measured
MIN_FINAL_SYNC_S = 60.0     # the final sync's floor: a rescan, the verification, the manifests
ACTION_RESERVE_S = 30.0     # kept after a cut-off final sync for the mail and the action
MAX_FILES = 2000            # per checkpoint folder, when measuring its save


def save_figures(folder: str) -> tuple[float, int]:
    """(seconds the save took: newest minus oldest mtime of its files, total bytes) of one checkpoint."""
    lo, hi, size, seen = None, None, 0, 0
    stack = [folder]
    while stack and seen < MAX_FILES:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        lo = st.st_mtime if lo is None else min(lo, st.st_mtime)
                        hi = st.st_mtime if hi is None else max(hi, st.st_mtime)
                        size += st.st_size
                        seen += 1
        except OSError:
            continue
    return (hi - lo if lo is not None and hi is not None else 0.0), size


def checkpoints(dirs: list[str]) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoint-N/ folders (trainer_state.json present) in `dirs`."""
    return [(f.step, f.path) for f in find_checkpoints(dirs, depth=0)
            if os.path.lexists(os.path.join(f.path, "trainer_state.json"))]


@dataclass(frozen=True)
class MoneyConfig:
    """What the money wing reads of the config: its `[budget]` section and the few facts of others
    a cap needs (the price, the stop's grace, where saves land, how many machines bill)."""

    budget: BudgetConfig
    price_per_hour: float | None
    currency: str
    stop_grace: float
    save_dirs: tuple[str, ...]
    nodes: int = 1

    @classmethod
    def of(cls, c: Config) -> MoneyConfig:
        return cls(c.budget, c.price_per_hour, c.currency, c.training.stop_grace,
                   tuple(c.save_dirs), c.cluster.nodes)


class MoneyGuard:
    NAME = "money"

    def __init__(self, ctx: Context, conf: MoneyConfig, progress: ProgressView | None, sync: SyncView,
                 training: TrainingView,
                 stop: Callable[[str, str], bool] | None = None, run: RunLedger | None = None,
                 withdraw: Callable[[str], None] | None = None):
        self.cfg = conf
        self.run = run  # the run's ledger on the target: budget.scope = "run" counts every machine of it
        self.clock, self.store, self.alerts = ctx.clock, ctx.store, ctx.alerts
        self.progress, self.sync, self.training = progress, sync, training
        self.stop = stop
        self.withdraw = withdraw
        self._lock = threading.Lock()
        raw = self.store.load(self.NAME, None) or {}
        raw = raw if isinstance(raw, dict) else {}
        self.boot_id = self.clock.boot()[0]
        if raw and raw.get("boot_id") != self.boot_id:
            # a new boot: the money since boot starts at 0 again, so does everything decided for the
            # last one (a warning, a stop asked for, a cap changed at run time for that rental)
            log.info("money_new_boot", dropped_overrides=raw.get("overrides") or {})
            raw = {}
        self.state = MoneyState.from_dict(raw.get("state"))
        over = raw.get("overrides") if isinstance(raw.get("overrides"), dict) else {}
        self.overrides: dict[str, float] = {k: float(v) for k, v in over.items()
                                            if k in plan.KINDS
                                            and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._ck: tuple[str, float, int] = ("", 0.0, 0)   # newest checkpoint: path, save seconds, bytes
        self._rate: float | None = None
        self._last: plan.Projection | None = None
        self._lead = Lead(stop_grace=self.cfg.stop_grace, margin=self.cfg.budget.margin)

    # --- inputs -----------------------------------------------------------------------------------
    def caps(self) -> Caps:
        b = self.cfg.budget
        deadline = parse_moment(b.deadline) if b.deadline else None
        return Caps(max_cost=self.overrides.get("max_cost", b.max_cost),
                    deadline=self.overrides.get("deadline", deadline),
                    max_runtime=self.overrides.get("max_runtime", b.max_runtime),
                    warn_at=b.warn_at, price_per_hour=self.cfg.price_per_hour, currency=self.cfg.currency)

    def _run(self, now: float) -> Run:
        info = self.training.info()
        p = self.progress.snapshot(now) if self.progress is not None else {}
        cks = checkpoints(list(self.cfg.save_dirs))
        every = cks[-1][0] - cks[-2][0] if len(cks) >= 2 and cks[-1][0] > cks[-2][0] else None
        if cks and cks[-1][1] != self._ck[0]:
            secs, size = save_figures(cks[-1][1])
            self._ck = (cks[-1][1], secs, size)
        step = p.get("step")
        return Run(alive=info.state in TRAINING_ALIVE, step=step if isinstance(step, int) else None,
                   steps_per_s=p.get("steps_per_s"), eta_s=p.get("eta_s"), checkpoint_every=every,
                   last_checkpoint=cks[-1][0] if cks else None)

    def _measure_lead(self) -> Lead:
        s: dict = {}
        try:
            s = self.sync.status() or {}
        except Exception:  # noqa: BLE001 - no sync figures: the assumed rate
            log.exception("sync_status_failed")
        r = s.get("rate_bps")
        if isinstance(r, (int, float)) and r > 0:
            self._rate = max(float(r), self._rate or 0.0)  # the best seen: what the link can do
        rate = self._rate or ASSUMED_BPS
        left = (s.get("pending_bytes") or 0) + self._ck[2]
        return Lead(save_s=self._ck[1], stop_grace=self.cfg.stop_grace,
                    final_sync_s=max(MIN_FINAL_SYNC_S, left / rate), margin=self.cfg.budget.margin)

    def figures(self) -> tuple[Caps, float]:
        """The caps and the "uptime" plan.py counts: this machine's, or with budget.scope = "run"
        the whole run's as one machine billing nodes x price (runmoney.as_one_machine); this
        machine's alone until the ledger was read once."""
        caps, uptime = self.caps(), self.clock.boot()[1]
        m = self.run.money() if self.run is not None and self.cfg.budget.scope == "run" else None
        if m is None:
            return caps, uptime
        up, price = as_one_machine(m, self.cfg.nodes, caps.price_per_hour)
        return replace(caps, price_per_hour=price), up

    # --- the duty ---------------------------------------------------------------------------------
    def poll(self) -> None:
        caps, uptime = self.figures()
        if not caps.any:
            return
        now = self.clock.time()
        run = self._run(now)
        self._withdraw_moved()
        with self._lock:
            self._lead = lead = self._measure_lead()
            before = self.state
            self.state, actions = plan.decide(self.state, caps, lead, run, now, uptime)
            self._last = plan.project(caps, lead, run, now, uptime)
            if self.state != before:
                self._save()
        for a in actions:
            if isinstance(a, Warn):
                self._warn(a, caps)
            elif isinstance(a, Act):
                why = words.cap_reason(a.cap.kind, self._cap_text(a.cap.kind, caps), a.cap.at)
                log.warning("cap_reached_stopping", cap=a.cap.kind, cap_at=a.cap.at, lead_s=round(lead.total),
                            spent=a.projection.spent)
                if self.stop is not None:
                    self.stop(a.cap.kind, why)

    def _withdraw_moved(self) -> str:
        """The cap a stop was asked for moved out of reach (`budget`): take the stop back. Its kind, or ""."""
        caps, uptime = self.figures()
        with self._lock:
            self.state, kind = plan.withdrawn(self.state, caps, self._lead, self.clock.time(), uptime)
            if kind:
                self._save()
        if kind:
            log.warning("cap_stop_withdrawn", cap=kind, caps=self.overrides)
            if self.withdraw is not None:
                self.withdraw(kind)
        return kind

    def _warn(self, a: Warn, caps: Caps) -> None:
        p = a.projection
        mail = words.warning(self._projected(p, caps), a.again)
        self.alerts.event(f"budget:warning:{p.cap.key}:{int(self.clock.time())}", "budget_warning", "warning",
                          mail.subject, mail.body)
        log.warning("budget_warning", cap=p.cap.kind, used=round(p.used, 3), need_cost=p.need_cost, again=a.again)

    def _projected(self, p: plan.Projection, caps: Caps) -> words.Projected:
        return words.Projected(p.cap.kind, self._cap_text(p.cap.kind, caps), p.cap.at, p.cap.act_at,
                               self._lead.total, caps.currency, p.spent, p.need_cost, p.eta_at, p.fits,
                               p.last_checkpoint, p.used)

    def _cap_text(self, kind: str, caps: Caps) -> str:
        if kind == "max_cost":
            return words.money(caps.max_cost, caps.currency)
        if kind == "deadline":
            return when(caps.deadline)
        return f"{format_duration(caps.max_runtime or 0)} since boot"

    def moment(self) -> tuple[float | None, str]:
        """Seconds a final sync may still take before the cap (keeping time for the action), and
        the cap in words: what the stop sequence cuts a hanging sync at."""
        caps, uptime = self.figures()
        cap = plan.first_cap(caps, self._lead, self.clock.time(), uptime)
        if cap is None:
            return None, ""
        return plan.cut_in(cap, self.clock.time(), ACTION_RESERVE_S), words.cap_reason(
            cap.kind, self._cap_text(cap.kind, caps), cap.at)

    def _save(self) -> None:
        try:
            self.store.save(self.NAME, {"boot_id": self.boot_id, "state": self.state.to_dict(),
                                        "overrides": dict(self.overrides)})
        except OSError as e:
            log.error("money_state_save_failed", error=str(e))

    # --- supervisorctl budget ---------------------------------------------------------------------
    def change(self, a: dict) -> dict:
        """`budget +20` (amount "+20"; "50" sets it), `budget --deadline T`, `budget --runtime 12h`,
        or nothing (show). Says what the caps now mean."""
        caps = self.caps()
        amount, deadline, runtime = a.get("amount"), a.get("deadline"), a.get("runtime")
        with self._lock:
            if amount is not None:
                if not isinstance(amount, str) or not amount.strip():
                    raise RequestError('budget: the amount is a number like "+20" or "50"')
                try:
                    x = float(amount)
                except ValueError:
                    raise RequestError(f"budget: expected an amount like +20 or 50, got {amount!r:.40}") from None
                if self.cfg.price_per_hour is None:
                    raise RequestError("budget: a spend cap needs price_per_hour in the config")
                new = (caps.max_cost or 0.0) + x if amount.strip()[0] in "+-" else x
                if not 0 < new < 1e9:
                    raise RequestError(f"budget: the spend cap would be {new:g}; it must be positive")
                self.overrides["max_cost"] = new
            if deadline is not None:
                try:
                    self.overrides["deadline"] = parse_moment(str(deadline))
                except ValueError as e:
                    raise RequestError(f"budget --deadline: {e}") from None
            if runtime is not None:
                try:
                    self.overrides["max_runtime"] = parse_duration(str(runtime))
                except ValueError:
                    raise RequestError(f'budget --runtime: expected a duration like "12h", got {runtime!r:.40}') from None
            if amount is not None or deadline is not None or runtime is not None:
                self._save()
                log.warning("budget_changed", overrides=self.overrides)
        kind = self._withdraw_moved()
        st = self.status()
        out = self.meaning(st)
        if kind:
            out += f"; the stop asked for the {words.CAP_NAMES.get(kind, kind)} is withdrawn (a stop already acting goes on)"
        return {"message": out, "budget": st}

    def meaning(self, st: dict) -> str:
        cap = st.get("cap")
        if not cap:
            return "no cap is set (budget.max_cost, budget.deadline, budget.max_runtime)"
        c = self.caps()
        text = words.cap_reason(cap["kind"], self._cap_text(cap["kind"], c), cap["at"])
        out = (f"the first cap is {text}; the stop begins at {when(cap['act_at'])} "
               f"(in {format_duration(max(0.0, cap['act_left_s']))}; {format_duration(st['lead']['total_s'])} "
               "before the cap for the save, the final sync and the margin)")
        if st.get("spent") is not None:
            out += f"; spent so far {words.money(st['spent'], c.currency)}"
        pr = st.get("projection") or {}
        if pr.get("eta_at"):
            out += "; " + words.projection_line(self._projected(self._last, c)) if self._last else ""
        if st.get("acted"):
            out += f"; a stop for {st['acted']} was already asked for and goes on"
        return out

    def status(self) -> dict:
        caps, uptime = self.figures()
        now = self.clock.time()
        with self._lock:
            lead, last = self._lead, self._last
            state = self.state
        cap = plan.first_cap(caps, lead, now, uptime)
        return {
            "max_cost": caps.max_cost, "deadline": caps.deadline, "max_runtime_s": caps.max_runtime,
            "warn_at": caps.warn_at, "currency": caps.currency, "price_per_hour": self.cfg.price_per_hour,
            "overrides": dict(self.overrides), "spent": plan.spent(caps.price_per_hour, uptime) if caps.any else None,
            "uptime_s": (mine := self.clock.boot()[1]),
            # what the caps count from (clock.read_boot): the later of the boot and our PID 1's start
            "billing_since": now - mine, "billing_from": billing_origin(),
            "cap": None if cap is None else {"kind": cap.kind, "at": cap.at, "act_at": cap.act_at,
                                             "left_s": cap.at - now, "act_left_s": cap.act_at - now},
            "lead": {"save_s": round(lead.save_s, 1), "stop_grace_s": lead.stop_grace,
                     "final_sync_s": round(lead.final_sync_s, 1), "margin_s": lead.margin,
                     "total_s": round(lead.total, 1)},
            "projection": None if last is None else {
                "need_cost": last.need_cost, "eta_at": last.eta_at, "fits": last.fits,
                "last_checkpoint": last.last_checkpoint, "used": round(last.used, 4)},
            "warned_at": state.warned_at, "acted": state.acted or None, "acted_at": state.acted_at,
            "scope": self.cfg.budget.scope, **(self.run.status() if self.run is not None else {}),
        }

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("budget", 10.0, self.poll),)  # caps that save first

    def status_blocks(self) -> tuple[Block, ...]:
        return (BudgetBlock.of(self.status()),)

    def verbs(self) -> dict[str, Verb]:
        return {"budget": self.change}  # root only: not in MEMBER_COMMANDS
