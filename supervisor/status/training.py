"""The `training` block (the job, written by the daemon from the training wing, with the progress
tracker's `training.progress`), the `cost` block (the progress tracker) and the daemon's own fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.durations import format_duration, format_hms
from supervisor.states import TrainingState
from supervisor.status import Block, Metric, Record, View, enum, gauge
from supervisor.status.words import describe_exit, money, steps_rate
from supervisor.timefmt import clock, hm

TRAINING_STATES = [s.value for s in TrainingState]


@dataclass
class Progress(Record):
    """`training.progress`: None = unknown (the contract's keys and the tracker's own)."""

    step: float | None = None
    max_steps: float | None = None
    epoch: float | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    steps_per_s: float | None = None
    percent: float | None = None
    elapsed_s: float | None = None
    total_s: float | None = None
    learning_rate: float | None = None
    tokens: float | None = None
    num_epochs: float | None = None
    finished: bool | None = None
    stalled_since: float | None = None
    source: str | None = None
    run_id: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    finished_at: float | None = None
    since_step_s: float | None = None
    stall_after_s: float | None = None
    stalled: bool | None = None
    tracker_end: list[object] = field(default_factory=list)


@dataclass
class CostBlock(Block):
    """`cost`: what the current training costs (the progress tracker, price_per_hour)."""

    KEY = "cost"
    price_per_hour: float | None = None
    currency: str | None = None
    spent: float | None = None
    eta_cost: float | None = None
    total: float | None = None
    budget: float | None = None
    fits_budget: bool | None = None

    def metrics(self, view: View) -> list[Metric]:
        cur = {"currency": self.currency or ""}
        return [gauge("cost_price_per_hour", "What this machine costs per hour.", self.price_per_hour, cur),
                gauge("cost_spent", "Money spent on the current training so far.", self.spent, cur),
                gauge("cost_to_finish", "Money the training will cost until it finishes (estimate).",
                      self.eta_cost, cur)]


@dataclass
class TrainingBlock(Block):
    """`training`: the job in tmux and, under `progress`, how far it got."""

    KEY = "training"
    PRIVATE = ("command",)  # a command line may carry a token (--hf_token ...)
    state: str | None = None
    pid: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    restarts: int | None = None
    command: str | None = None
    log: str | None = None
    session: str | None = None
    tmux_socket: str | None = None
    run_id: int | None = None
    stop_requested: bool | None = None
    note: str | None = None
    env_withheld: list[str] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)

    def head(self, now: float) -> str:
        """supervisord's shape: name padded, state padded to 10, then details."""
        name = (self.session or "train").ljust(32)
        state = self.state if self.state is not None else "UNKNOWN"
        if state in ("RUNNING", "STARTING", "STOPPING") and self.pid:
            detail = f"pid {self.pid}, uptime {format_hms(now - (self.started_at or now))}"
        elif state in ("FINISHED", "FAILED", "STOPPED") and self.ended_at:
            detail = f"{describe_exit(self.exit_code, self.signal)}, ended {clock(self.ended_at, now)}"
        else:
            detail = self.note or ("no training started" if state == "STOPPED" else "")
        return f"{name} {state.ljust(10)} {detail}".rstrip()

    def lines(self, view: View) -> list[str]:
        out = [self.head(view.now)]
        if self.command:
            out.append(f"  command   {self.command}")
        if self.log:
            out.append(f"  log       {self.log}")
        if self.note and self.state not in ("STOPPED",):
            out.append(f"  note      {self.note}")
        pl = self.progress_line(view)
        if pl:
            out.append(f"  {pl}")
        return out

    def progress_line(self, view: View) -> str:
        """`progress  [######--------------]  1200/3750  32.0%  loss 1.214  2,410 tok/s  ETA 1h12m
        spent €4.21, to finish ~€4.68`, with the `cost` block; "" before any run."""
        if self.progress.started_at is None:
            return ""
        try:
            return _progress_line(self.progress, view.block(CostBlock), view.now)
        except (TypeError, ValueError, OverflowError):
            return "progress  unknown"

    def metrics(self, view: View) -> list[Metric]:
        pr = self.progress
        out = [*enum("training_state", "Training state: 1 for the current one.", self.state, TRAINING_STATES),
               gauge("training_start_timestamp_seconds", "When the current or last training started.", self.started_at),
               gauge("training_end_timestamp_seconds", "When the last training ended.", self.ended_at),
               gauge("training_exit_code", "Exit code of the last training (-N: killed by signal N).", self.exit_code),
               gauge("training_restarts", "Automatic restarts of the current training.", self.restarts),
               gauge("training_step", "Current optimizer step.", pr.step),
               gauge("training_max_steps", "Steps the training will run in all.", pr.max_steps),
               gauge("training_epoch", "Current epoch (fractional).", pr.epoch),
               gauge("training_loss", "Last training loss reported.", pr.loss),
               gauge("training_learning_rate", "Last learning rate reported.", pr.learning_rate),
               gauge("training_tokens_per_second", "Training throughput in tokens per second.", pr.tokens_per_s),
               gauge("training_steps_per_second", "Training steps per second.", pr.steps_per_s),
               gauge("training_progress_ratio", "Fraction of the training done (0-1).",
                     pr.percent / 100.0 if pr.percent is not None else None),
               gauge("training_elapsed_seconds", "Time the training has run.", pr.elapsed_s),
               gauge("training_eta_seconds", "Estimated time left to finish.", pr.eta_s)]
        if self.state == TrainingState.RUNNING.value or pr.stalled_since is not None:
            out.append(gauge("training_stalled", "1 while a running training shows no progress.",
                             pr.stalled_since is not None))
        out += [gauge("training_stalled_since_timestamp_seconds", "Since when the training shows no progress.",
                      pr.stalled_since),
                gauge("seconds_since_step", "Seconds since the running training's step last advanced.", pr.since_step_s),
                gauge("training_stall_after_seconds",
                      "Seconds without a new step after which the running training counts as hung.", pr.stall_after_s)]
        if pr.since_step_s is not None:
            out.append(gauge("training_hung", "1 while the running training's step has not advanced for "
                             "training_stall_after_seconds (the training-stalled alert).", bool(pr.stalled)))
        return out


def _progress_line(p: Progress, cost: CostBlock, now: float) -> str:
    parts = ["progress"]
    pct = p.percent
    if pct is not None:
        filled = int(round(pct / 100 * 20))
        parts.append("[" + "#" * filled + "-" * (20 - filled) + "]")
    if p.step is not None:
        parts.append(f"{p.step:,}/{p.max_steps:,}" if p.max_steps else f"step {p.step:,}")
    elif p.epoch is not None:
        parts.append(f"epoch {p.epoch:.2f}" + (f"/{p.num_epochs:g}" if p.num_epochs else ""))
    else:
        parts.append("unknown (no progress in the log or a checkpoint yet)")
    if pct is not None:
        parts.append(f"{pct:.1f}%")
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4g}")
    running = p.ended_at is None and not p.finished
    if p.tokens_per_s is not None:
        parts.append(f"{p.tokens_per_s:,.0f} tok/s")
    elif p.steps_per_s is not None and running:
        parts.append(steps_rate(p.steps_per_s))
    if p.finished:
        took = p.finished_at - p.started_at if p.finished_at is not None else p.elapsed_s  # type: ignore[operator]
        parts.append(f"done in {format_duration(took)}")
    elif p.ended_at is not None:
        parts.append(f"ended after {format_duration(p.elapsed_s)}")
    elif p.stalled_since is not None:
        parts.append(f"ETA unknown (no progress for {format_duration(now - p.stalled_since)})")
    else:
        parts.append(f"ETA {format_duration(p.eta_s)}")
    cur = cost.currency or ""
    money_bits = []
    if cost.spent is not None:
        money_bits.append(f"spent {money(cost.spent, cur)}")
    if cost.eta_cost is not None and running:
        money_bits.append(f"to finish ~{money(cost.eta_cost, cur)}")
    if money_bits:
        parts.append(", ".join(money_bits))
    elif p.elapsed_s is not None:
        parts.append(f"elapsed {format_duration(p.elapsed_s)}")
    if p.stalled and p.since_step_s is not None:
        parts.append(f"STALLED: no step for {format_duration(p.since_step_s)} (since {hm(now - p.since_step_s)})")
    return "  ".join(parts)


@dataclass
class DaemonInfo(Record):
    pid: int | None = None
    started_at: float | None = None
    uptime_s: float | None = None
    config: str | None = None
    state_dir: str | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class DaemonBlock(Block):
    """`version`, `now` and `daemon`: the daemon's own (written by daemon/main.py)."""

    version: str | None = None
    now: float | None = None
    daemon: DaemonInfo = field(default_factory=DaemonInfo)

    def lines(self, view: View) -> list[str]:
        return [f"problem   {p}" for p in self.daemon.problems[-3:]]

    def metrics(self, view: View) -> list[Metric]:
        return [gauge("build_info", "Always 1; the daemon's version as a label.", 1,
                      {"version": self.version or "unknown"}),
                gauge("status_timestamp_seconds",
                      "When the daemon built these figures (a stale value means the daemon stopped writing).", self.now),
                gauge("daemon_start_timestamp_seconds", "When the daemon started.", self.daemon.started_at),
                gauge("daemon_problems", "Problems the daemon reports in status (e.g. a state file set aside).",
                      len(self.daemon.problems))]
