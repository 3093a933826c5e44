"""The `budget` block (money/guard.py, with the run ledger's figures for budget.scope = "run")."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.durations import format_duration
from supervisor.status import Block, Metric, Record, View, gauge
from supervisor.timefmt import clock, hm


@dataclass
class Cap(Record):
    kind: str | None = None
    at: float | None = None
    act_at: float | None = None
    left_s: float | None = None
    act_left_s: float | None = None


@dataclass
class Projection(Record):
    need_cost: float | None = None
    eta_at: float | None = None
    fits: bool | None = None
    last_checkpoint: int | None = None
    used: float | None = None


@dataclass
class BudgetBlock(Block):
    KEY = "budget"
    max_cost: float | None = None
    deadline: float | None = None
    max_runtime_s: float | None = None
    warn_at: float | None = None
    currency: str | None = None
    price_per_hour: float | None = None
    overrides: dict[str, object] = field(default_factory=dict)
    spent: float | None = None
    uptime_s: float | None = None
    billing_since: float | None = None
    billing_from: str | None = None
    cap: Cap | None = None
    lead: dict[str, float] = field(default_factory=dict)  # save_s, stop_grace_s, final_sync_s, margin_s, total_s
    projection: Projection | None = None
    warned_at: float | None = None
    acted: str | None = None
    acted_at: float | None = None
    scope: str | None = None
    # the run's ledger (money/runledger.py), with budget.scope = "run"
    run_spent: float | None = None
    machine_hours: float | None = None
    machines: list[object] = field(default_factory=list)
    ledger_error: str | None = None
    ledger_damaged: list[object] = field(default_factory=list)
    ledger_reads: int | None = None

    def lines(self, view: View) -> list[str]:
        """`budget  spend cap 50.00 USD at 12:10 (in 2h)  stop begins 11:55  spent 38.20 USD` and the projection."""
        cap = self.cap
        if cap is None or not cap.filled:
            return []
        now, cur = view.now, self.currency or ""
        kind = cap.kind
        name = {"max_cost": f"spend cap {self.max_cost or 0:.2f} {cur}", "deadline": "deadline",
                "max_runtime": f"runtime cap {format_duration(self.max_runtime_s or 0)}"}.get(kind or "", kind)
        head = f"budget    {name} at {clock(cap.at, now)}  stop begins {clock(cap.act_at, now)}"
        if self.spent is not None:
            head += f"  spent {self.spent:.2f} {cur}"
            if self.billing_since:
                head += f" (billing since {hm(self.billing_since)}, {self.billing_from or 'boot'})"
        out = [head]
        p = self.projection or Projection()
        if p.eta_at:
            need = f"{p.need_cost:.2f} {cur} " if p.need_cost is not None else ""
            fits = "fits" if p.fits else "does NOT fit: stops before the end"
            ck = f", last checkpoint before the stop about checkpoint-{p.last_checkpoint}" if p.last_checkpoint else ""
            out.append(f"          at this rate the run needs {need}(ETA {clock(p.eta_at, now)}): {fits}{ck}")
        if self.acted:
            out.append(f"          stop asked for {self.acted}")
        return out

    def metrics(self, view: View) -> list[Metric]:
        cap, proj = self.cap or Cap(), self.projection or Projection()
        bl = {"currency": self.currency or "", "cap": cap.kind or ""}
        return [gauge("budget_max_cost", "The spend cap (budget.max_cost, money since boot).", self.max_cost, bl),
                gauge("budget_spent", "Money since this machine booted at price_per_hour.", self.spent, bl),
                gauge("budget_cap_seconds_left", "Seconds until the first cap (spend, deadline, runtime).",
                      cap.left_s, bl),
                gauge("budget_stop_seconds_left", "Seconds until the stop for the first cap begins.", cap.act_left_s, bl),
                gauge("budget_projected_cost", "Money the run needs to its end at this rate, since boot.",
                      proj.need_cost, bl)]
