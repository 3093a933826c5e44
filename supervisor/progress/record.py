"""One training run's progress as data: the record, how an observation changes it, and the figures
(rates, ETA, cost) derived from it. Pure: no I/O and no clock; every function is handed `now`.

Merging: our TSUP line over the tqdm bar over the Trainer's dicts over trainer_state.json (see
supervisor.progress.parse for the parsers). The record keeps timestamped series of steps, tokens and
epochs; supervisor.progress.rate turns them into rates and an ETA.

Telling the training bar from other tqdm bars: a bar must match max_steps when a trusted source
(TSUP, trainer_state.json, the Trainer's or Unsloth's banner) has said it; otherwise the first bar
seen in the run is taken provisionally, becomes certain once a training loss is logged while it
runs, and is let go if it completes before that (a preprocessing or evaluation-on-start bar).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from supervisor import records
from supervisor.progress.parse import Observation, parse_line
from supervisor.progress.rate import (
    Series,
    eta_seconds,
    fits_budget,
    fraction,
    money,
    stalled_since,
    window_rate,
)

# how much a source's max_steps is believed: a bar's total only until someone better speaks
RANK = {"tsup": 3, "trainer_state": 3, "banner": 2, "log": 2, "tqdm": 1}
LINE_TIME_SLACK_S = 600.0   # a TSUP `time` further in the past than this is ignored (a replayed log)
# A run whose first step above 0 is past this did not start from nothing (a resume whose bar leapt to
# its checkpoint's step): the bar's own it/s counts that leap, so only our window gives a rate.
# tqdm repaints at most every 0.1 s: a run afresh at 100 steps/s shows about 10 at its first.
LEAP_STEPS = 16
_SERIES = ("steps", "tokens_s", "epochs")


# Sources read from files the training writes, each at its own pace: a step older than the one
# known is theirs lagging, never a restart of the run.
FILE_SOURCES = ("trainer_state", "tensorboard", "mlflow", "trackio", "wandb", "lightning")


@dataclass
class Run:
    run_id: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    step: int | None = None
    step_at: float | None = None
    step_source: str | None = None
    max_steps: int | None = None
    max_steps_rank: int = 0
    epoch: float | None = None
    epoch_at: float | None = None
    num_epochs: float | None = None
    loss: float | None = None
    loss_from_log: bool = False
    learning_rate: float | None = None
    tokens: int | None = None
    tokens_step: int | None = None         # the step `tokens` was counted at, when the same line said both
    tokens_direct: float | None = None     # tokens/s a line printed, used without a token count
    tokens_direct_at: float | None = None
    bar_rate: float | None = None          # tqdm's own it/s, used before our window is long enough
    bar_rate_at: float | None = None
    bar_total: int | None = None           # the tqdm bar taken as the training bar
    bar_committed: bool = False
    finished: bool = False
    finished_at: float | None = None
    estimate_sent: bool = False
    last_logged: float | None = None
    state_key: list | None = None          # [path, mtime_ns, size] of the last trainer_state read
    from_step: int | None = None           # the newest complete checkpoint here when the run started
    leap_at: float | None = None           # when the steps leapt to from_step (a resume, not work)
    first_step: int | None = None          # the first step above 0 this run showed: the rates start there
    # a bar that counts one epoch (Lightning's): how its epochs are numbered (0 or 1) once known, the
    # epoch it is in (from 0), the steps done before that epoch, its total (None: "n/?"), its last n
    epoch_base: int | None = None
    bar_epoch: int | None = None
    bar_epoch_start: int | None = None
    bar_epoch_total: int | None = None
    bar_epoch_n: int | None = None
    steps: Series = field(default_factory=Series)
    tokens_s: Series = field(default_factory=Series)
    epochs: Series = field(default_factory=Series)

    def to_json(self) -> dict:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SERIES}
        d["series"] = {"steps": self.steps.to_json(), "tokens": self.tokens_s.to_json(),
                       "epochs": self.epochs.to_json()}
        return d

    @classmethod
    def from_json(cls, d: object) -> Run:
        """The saved run; ValueError naming the field when the document is not one we wrote."""
        r = records.load(cls, d, "progress.json", skip=_SERIES)
        if r.run_id is None:
            raise ValueError("progress.json: run_id missing")
        s = d.get("series") if isinstance(d, dict) and isinstance(d.get("series"), dict) else {}
        r.steps = Series.from_json(s.get("steps"))
        r.tokens_s = Series.from_json(s.get("tokens"))
        r.epochs = Series.from_json(s.get("epochs"))
        return r

    @property
    def live(self) -> bool:
        """Started and not ended: lines and checkpoints still count."""
        return self.started_at is not None and self.ended_at is None

    def prune(self, before: float) -> None:
        for s in (self.steps, self.tokens_s, self.epochs):
            s.prune(before)


# --- merging observations --------------------------------------------------------------------------

@dataclass(frozen=True)
class Merged:
    changed: bool = False     # something was taken from the observation (the record needs saving)
    finished: bool = False    # the observation said the run completed, for the first time


def merge_line(run: Run, line: str, now: float) -> Merged:
    """What one log line says, taken into the run. Carriage-return repaints count one by one."""
    changed = finished = False
    for seg in line.split("\r"):
        obs = parse_line(seg)
        if obs is None:
            continue
        t = obs.at if obs.at is not None and now - LINE_TIME_SLACK_S <= obs.at <= now + 5 else now
        m = merge(run, obs, min(t, now))
        changed, finished = changed or m.changed, finished or m.finished
    return Merged(changed, finished)


def merge(run: Run, obs: Observation, t: float) -> Merged:
    """Take what `obs` (seen at `t`) says into the run."""
    r = run
    src = obs.source
    if obs.epoch_bar is not None:
        m = _merge_epoch_bar(r, obs, t)
        if obs.finished and not r.finished:  # "`Trainer.fit` stopped" glued to the bar's last repaint
            r.finished, r.finished_at = True, t
            return Merged(True, True)
        return m
    if obs.bar and r.step_source == "tsup" and not r.finished:
        # the user's own line owns the step; the bar still knows its speed before our window does
        if obs.max_steps == r.max_steps and obs.steps_per_s is not None:
            r.bar_rate, r.bar_rate_at = obs.steps_per_s, t
        return Merged()
    if obs.bar and not _bar_ok(r, obs):
        return Merged()
    if obs.max_steps is not None and (rank := RANK.get(src, 0)) >= r.max_steps_rank:
        if rank >= 2 and r.bar_total is not None and r.bar_total != obs.max_steps:
            # the bar we followed was not the training bar: forget what it said
            if r.step_source == "tqdm":
                _forget_bar_step(r)
            r.bar_total, r.bar_committed = None, False
        r.max_steps, r.max_steps_rank = obs.max_steps, rank
    if obs.num_epochs is not None:
        r.num_epochs = obs.num_epochs
    if obs.step is not None:
        _merge_step(r, obs.step, src, t)
    if obs.epoch is not None and not (src in FILE_SOURCES and r.epoch is not None and obs.epoch <= r.epoch):
        if not r.epochs.add(t, obs.epoch) and r.epochs.last and obs.epoch < r.epochs.last.v:
            r.epochs.clear()
            r.epochs.add(t, obs.epoch)
        r.epoch, r.epoch_at = obs.epoch, t
    from_log = src != "trainer_state"
    if obs.loss is not None and (from_log or not r.loss_from_log):
        r.loss, r.loss_from_log = obs.loss, from_log
        if src == "log" and r.bar_total is not None:
            r.bar_committed = True  # a training loss while this bar runs: it is the training bar
    if obs.learning_rate is not None and (from_log or not r.loss_from_log):
        r.learning_rate = obs.learning_rate
    if obs.tokens is not None and not (src == "trainer_state" and r.tokens is not None and obs.tokens <= r.tokens):
        if not r.tokens_s.add(t, obs.tokens, obs.tokens_err) and r.tokens_s.last and obs.tokens < r.tokens_s.last.v:
            r.tokens_s.clear()
            r.tokens_s.add(t, obs.tokens, obs.tokens_err)
        r.tokens = obs.tokens
        r.tokens_step = obs.step if obs.step else None
    if obs.tokens_per_s is not None:
        r.tokens_direct, r.tokens_direct_at = obs.tokens_per_s, t
    if obs.steps_per_s is not None:
        r.bar_rate, r.bar_rate_at = obs.steps_per_s, t
    finished = obs.finished and not r.finished
    if finished:
        r.finished, r.finished_at = True, t
    return Merged(True, finished)


def _merge_epoch_bar(r: Run, obs: Observation, t: float) -> Merged:
    """A bar that counts one epoch, taken as the run's step: the steps of the epochs before it (each
    one seen to end counts its own total: Lightning's last epoch is shorter when max_steps ends the
    run) plus its n, and max_steps only when the line names the run's epochs. Fail closed: nothing
    while the numbering of its epochs is not known, nor from a repaint at 0 (Lightning resets the bar
    at an epoch's end before naming the next: "Epoch 0: 0/20" comes after "Epoch 0: 20/20"). Also
    after the run said it finished, where it only fills in: Lightning's Rich bar prints its one frame
    after "`Trainer.fit` stopped"."""
    assert obs.epoch_bar is not None
    shown, epochs, base = obs.epoch_bar
    n, total = obs.step, obs.max_steps
    if n is None or n == 0 or r.step_source == "tsup":
        return Merged()
    base = base if base is not None else _epoch_base(r, shown, epochs)
    if base is None or shown < base:
        return Merged()
    r.epoch_base = base
    e = shown - base
    start = _epoch_start(r, e, total)
    if start is None:
        return Merged()
    if r.finished and (r.step or 0) > start + n:
        return Merged()  # after the end, only what goes no further back (not a second fit's bar)
    r.bar_epoch, r.bar_epoch_start, r.bar_epoch_total, r.bar_epoch_n = e, start, total, n
    mx = start + (epochs - e) * total if epochs is not None and total and epochs > e else None
    return merge(r, replace(obs, step=start + n, max_steps=mx, epoch=e + n / total if total else None,
                            num_epochs=float(epochs) if epochs else None, epoch_bar=None, bar=False,
                            finished=False), t)


def _epoch_base(r: Run, shown: int, epochs: int | None) -> int | None:
    """How a loop's own `Epoch 2/3` bar numbers its epochs: from 0 once it shows 0, from 1 once it
    shows the last (3/3), or when its first epoch in a run started afresh is 1; else not known."""
    if r.epoch_base is not None:
        return r.epoch_base
    if shown == 0:
        return 0
    if epochs is not None and shown == epochs:
        return 1
    if shown == 1 and r.step is None and not r.from_step:
        return 1
    return None


def _epoch_start(r: Run, e: int, total: int | None) -> int | None:
    """The steps done before epoch `e` (from 0) began."""
    if r.bar_epoch is None or r.bar_epoch_start is None or e < r.bar_epoch:
        # the first epoch bar seen (a resume, a daemon that came late) or a new fit: the epochs
        # before it were as long as this one
        return 0 if e == 0 else (e * total if total else None)
    if e == r.bar_epoch:
        return r.bar_epoch_start
    ended = r.bar_epoch_total or r.bar_epoch_n  # the epoch seen last, as long as it was
    if ended is None:
        return None
    missed = e - r.bar_epoch - 1               # epochs whose lines never came
    if missed and not total:
        return None
    return r.bar_epoch_start + ended + missed * (total or 0)


def forget_bar(run: Run) -> None:
    """The log was truncated or replaced: bars in the new text may be other bars."""
    run.bar_total = None
    run.bar_committed = False


def _forget_bar_step(r: Run) -> None:
    r.step = r.step_at = r.step_source = None
    r.steps.clear()


def _bar_ok(r: Run, obs: Observation) -> bool:
    total, n = obs.max_steps, obs.step
    if r.finished:
        return False  # bars after the end are evaluation or prediction
    if r.max_steps_rank >= 2:
        return total == r.max_steps
    if r.bar_total is None:
        if n == total:
            return False  # first seen complete: some other job's bar
        r.bar_total, r.bar_committed = total, False
        return True
    if total != r.bar_total:
        return False
    if n == total and not r.bar_committed:
        # a provisional bar that completed before any training loss was logged: not training
        r.bar_total = None
        if r.step_source == "tqdm":
            _forget_bar_step(r)
        if r.max_steps_rank <= 1:
            r.max_steps, r.max_steps_rank = None, 0
        r.bar_rate = r.bar_rate_at = None
        return False
    return True


def _merge_step(r: Run, step: int, src: str, t: float) -> None:
    last = r.steps.last
    if r.from_step and r.leap_at is None and last is not None and last.v < r.from_step <= step:
        # a resumed run's counter leaps from where its bar began (0) to the saved step in one
        # update (the HF Trainer's ProgressCallback does this): steps this process did not do
        r.steps.clear()
        r.leap_at = t
    if src in FILE_SOURCES:
        if r.step is not None and step <= r.step:
            return  # older than what another source already said (a checkpoint, a flush that lags)
        _sample(r, t, step)
        r.step, r.step_at = step, t
        if r.step_source is None or src != "trainer_state":
            r.step_source = src  # a tracker that moves the step is the freshest witness
        return
    if src == "tqdm" and r.step_source == "tsup":
        return  # the user's own line is the better witness
    if r.steps.last is not None and step < r.steps.last.v:
        r.steps.clear()  # resumed from a checkpoint inside the same run: rates start over
    _sample(r, t, step)
    if r.step != step or r.step_at is None:
        r.step_at = t
    r.step = step
    if r.step_source != "tsup" or src == "tsup":
        r.step_source = src


def _sample(r: Run, t: float, step: int) -> None:
    """A step into the rate's series. Step 0 never is: a resumed run's bar starts at 0 and leaps to
    its checkpoint's step at its first update, and a rate from that 0 counts steps this run never
    made (ETA 12 s where 78 s remained). The first step above 0 is where this run's rate starts."""
    if step <= 0:
        return
    r.steps.add(t, step)
    if r.first_step is None:
        r.first_step = step


# --- figures ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Figures:
    te: float                      # the moment rates are judged at (now, or the run's end)
    running: bool
    steps_per_s: float | None
    tokens_per_s: float | None
    eta_s: float | None
    fraction: float | None
    elapsed_s: float | None
    stalled_since: float | None

    @property
    def finish_at(self) -> float | None:
        return self.te + self.eta_s if self.eta_s is not None else None


def figures(r: Run, now: float, window: float) -> Figures:
    W = window
    t_end = min(now, r.ended_at) if r.ended_at is not None else now
    te = t_end  # rates are judged at the end of training, the cost runs to the end of the job
    if r.finished and r.finished_at is not None:
        te = min(te, r.finished_at)
    running = r.ended_at is None and not r.finished
    sps = window_rate(r.steps.samples, te, W)
    # a resumed run's bar counts the leap to the saved step as done in its first second, so the
    # rate it prints is the leap's, not the training's: only this process's own samples count
    if sps is None and r.bar_rate is not None and r.bar_rate_at is not None and te - r.bar_rate_at <= W \
            and not r.from_step and (r.first_step or 0) <= LEAP_STEPS:
        sps = r.bar_rate
    stalled = stalled_since(r.steps.samples, te, W) if running else None
    if stalled is not None:
        sps = 0.0
    tps = window_rate(r.tokens_s.samples, te, W)
    if tps is not None and running and stalled_since(r.tokens_s.samples, te, W) is not None:
        tps = 0.0
    if tps is None and r.tokens_direct is not None and r.tokens_direct_at is not None \
            and te - r.tokens_direct_at <= W:
        tps = r.tokens_direct
    if tps is None and sps is not None and r.tokens is not None and r.tokens_step:
        tps = sps * r.tokens / r.tokens_step  # early on: the step rate times tokens per step so far
    pct_f = fraction(r.step, r.max_steps)
    eta = None
    if r.finished:
        eta = 0.0
    elif running and pct_f is not None:
        eta = eta_seconds(r.step, r.max_steps, sps, te - (r.step_at or te))
    elif running and r.step is None:
        ep_f = fraction(r.epoch, r.num_epochs)
        if ep_f is not None:
            pct_f = ep_f
            eps = window_rate(r.epochs.samples, te, W)
            if stalled_since(r.epochs.samples, te, W) is not None:
                eps = 0.0
            eta = eta_seconds(r.epoch, r.num_epochs, eps, te - (r.epoch_at or te))
    if pct_f is None and r.finished and r.step is not None and r.step == r.max_steps:
        pct_f = 1.0
    elapsed = t_end - r.started_at if r.started_at is not None else None
    if elapsed is not None and elapsed < 0:
        elapsed = None
    return Figures(te, running, sps, tps, eta, pct_f, elapsed, stalled)


def snapshot(r: Run, f: Figures) -> dict:
    """`training.progress` of status --json: the contract's keys plus a few more; None = unknown."""
    total_s = f.elapsed_s + f.eta_s if f.elapsed_s is not None and f.eta_s is not None else None
    return {
        "step": r.step, "max_steps": r.max_steps, "epoch": _sig(r.epoch, 6), "loss": _sig(r.loss, 6),
        "tokens_per_s": _round(f.tokens_per_s, 2), "eta_s": _round(f.eta_s, 1),
        "steps_per_s": _sig(f.steps_per_s, 6),
        "percent": _round(f.fraction * 100.0, 2) if f.fraction is not None else None,
        "elapsed_s": _round(f.elapsed_s, 1), "total_s": _round(total_s, 1),
        "learning_rate": _sig(r.learning_rate, 6), "tokens": r.tokens, "num_epochs": r.num_epochs,
        "finished": r.finished, "stalled_since": f.stalled_since,
        "source": r.step_source, "run_id": r.run_id,
        "started_at": r.started_at, "ended_at": r.ended_at, "finished_at": r.finished_at,
    }


def cost(f: Figures | None, price_per_hour: float | None, currency: str, budget: float | None) -> dict:
    """The `cost` block: price_per_hour, currency, spent (this run's machine time so far),
    eta_cost (to finish), plus total, budget and fits_budget. None = unknown."""
    out: dict[str, Any] = {"price_per_hour": price_per_hour, "currency": currency, "spent": None,
                           "eta_cost": None, "total": None, "budget": budget, "fits_budget": None}
    if f is None:
        return out
    spent = money(price_per_hour, f.elapsed_s)
    to_finish = money(price_per_hour, f.eta_s)
    out.update(spent=_round(spent, 4), eta_cost=_round(to_finish, 4),
               total=_round(spent + to_finish, 4) if spent is not None and to_finish is not None else None,
               fits_budget=fits_budget(spent, to_finish, budget))
    return out


# --- the duties' decisions ---------------------------------------------------------------------------

def log_due(r: Run, now: float, interval: float) -> bool:
    """Time for the periodic structured `progress` line."""
    return (r.started_at is not None and r.ended_at is None and not r.finished
            and (r.last_logged is None or now - r.last_logged >= interval))


def estimate_due(r: Run, now: float, after: float, eta_known: bool) -> bool:
    """Once per run, `after` into it; while the ETA is still unknown, up to twice as long."""
    if r.started_at is None or r.estimate_sent or r.ended_at is not None or r.finished:
        return False
    ran = now - r.started_at
    return ran >= after and (eta_known or ran >= 2 * after)


def _sig(x: float | None, digits: int) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def _round(x: float | None, nd: int) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, nd)
