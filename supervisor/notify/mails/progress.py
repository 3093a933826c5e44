"""Words about a run's progress: the summary the finished / failed / idle mails include, and the
early estimate mail. Also the money and step-rate formats the status line shares."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_bytes, format_duration
from supervisor.notify.mails import Mail
from supervisor.status.words import money as money  # the status line says money alike
from supervisor.status.words import steps_rate as steps_rate
from supervisor.timefmt import when

TSUP_HINT = ("The supervisor cannot see the run's progress well enough to estimate. Print a "
             'line like: TSUP {"step": 120, "max_steps": 3750, "tokens": 1966080}')


@dataclass(frozen=True)
class RunFacts:
    """What is known about the run; None = unknown. `started_at` None: no run seen."""

    started_at: float | None
    step: int | None = None
    max_steps: int | None = None
    fraction: float | None = None
    epoch: float | None = None
    num_epochs: float | None = None
    loss: float | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    running: bool = False
    eta_s: float | None = None
    finish_at: float | None = None


@dataclass(frozen=True)
class CostFacts:
    """The `cost` block of status --json."""

    price_per_hour: float | None
    currency: str
    spent: float | None = None
    eta_cost: float | None = None
    total: float | None = None
    budget: float | None = None
    fits_budget: bool | None = None


def summary(run: RunFacts, cost: CostFacts) -> str:
    """A few lines for the finished / failed / idle mails."""
    if run.started_at is None:
        return "Progress: no training run seen."
    cur = cost.currency
    loss = f", loss {run.loss:.4g}" if run.loss is not None else ""
    lines = []
    if run.step is not None:
        of = f" of {run.max_steps:,}" if run.max_steps else ""
        pct = f" ({run.fraction * 100:.1f}%)" if run.fraction is not None else ""
        lines.append(f"Progress: step {run.step:,}{of}{pct}"
                     + (f", epoch {run.epoch:.2f}" if run.epoch is not None else "") + loss)
    elif run.epoch is not None:
        lines.append(f"Progress: epoch {run.epoch:.2f}" + (f" of {run.num_epochs:g}" if run.num_epochs else "")
                     + loss)
    else:
        lines.append("Progress: unknown (the log shows no progress lines; see docs/progress.md)")
    speed = []
    if run.steps_per_s is not None:
        speed.append(steps_rate(run.steps_per_s))
    if run.tokens_per_s is not None:
        speed.append(f"{run.tokens_per_s:,.0f} tokens/s")
    if speed:
        lines.append("Speed: " + ", ".join(speed))
    lines.append(f"Run time: {format_duration(run.elapsed_s)} (started {when(run.started_at)})")
    if run.running:
        if run.eta_s is not None:
            lines.append(f"Estimated finish: {when(run.finish_at)} (in {format_duration(run.eta_s)})")
        else:
            lines.append("Estimated finish: unknown")
    if cost.spent is not None:
        line = f"Cost: {money(cost.spent, cur)} so far at {money(cost.price_per_hour, cur)}/h"
        if run.running and cost.eta_cost is not None:
            line += f", about {money(cost.eta_cost, cur)} more to finish"
        lines.append(line)
    return "\n".join(lines)


def estimate(run: RunFacts, cost: CostFacts, peak_bytes: int | None, total_bytes: int | None) -> Mail:
    """The early estimate: projected finish and cost, peak GPU memory, the budget's verdict."""
    cur = cost.currency
    eta = run.eta_s
    if eta is not None:
        subject = f"Training estimate: done in {format_duration(eta)}"
        if cost.total is not None:
            subject += f", about {money(cost.total, cur)} in all"
    else:
        subject = "Training estimate: finish time unknown"
    if cost.fits_budget is False:
        subject += " (over budget)"
    lines = [summary(run, cost), ""]
    if eta is not None:
        lines.append(f"Projected finish: {when(run.finish_at)}")
    if cost.total is not None:
        lines.append(f"Projected cost of the run: {money(cost.total, cur)} "
                     f"({money(cost.spent, cur)} so far + {money(cost.eta_cost, cur)} to finish)")
    elif cost.price_per_hour is None:
        lines.append("Cost: unknown (set price_per_hour in the config)")
    if peak_bytes is not None:
        of = f" of {format_bytes(total_bytes)} ({100.0 * peak_bytes / total_bytes:.0f}%)" if total_bytes else ""
        lines.append(f"Peak GPU memory so far: {format_bytes(peak_bytes)}{of}")
    else:
        lines.append("Peak GPU memory so far: unknown")
    if cost.budget is not None:
        left = cost.budget - cost.spent if cost.spent is not None else None
        verdict = {True: "fits", False: "does NOT fit", None: "cannot be judged yet against"}[cost.fits_budget]
        lines.append(f"Budget: the run {verdict} the budget of {money(cost.budget, cur)}"
                     + (f" ({money(left, cur)} left)" if left is not None else ""))
    if eta is None:
        lines.append("")
        lines.append(TSUP_HINT)
    return Mail(subject, "\n".join(lines))

