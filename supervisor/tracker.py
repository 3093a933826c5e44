"""The live progress of the current run: fed log lines and checkpoints, asked for figures.

`ProgressTracker` is a LineListener on the training log and reads the newest checkpoint's
trainer_state.json when it changes. It merges what the sources say (our TSUP line over the tqdm
bar over the Trainer's dicts over trainer_state.json; see supervisor.progress), keeps timestamped
series of steps, tokens and epochs, and derives rates, ETA and cost with supervisor.rate.

Telling the training bar from other tqdm bars: a bar must match max_steps when a trusted source
(TSUP, trainer_state.json, the Trainer's or Unsloth's banner) has said it; otherwise the first bar
seen in the run is taken provisionally, becomes certain once a training loss is logged while it
runs, and is let go if it completes before that (a preprocessing or evaluation-on-start bar).

The state of the run is persisted (`progress.json` in state_dir) so a daemon restart keeps the
step, the series behind the rates and the run's start time; `start_run` with the same run_id
picks it up again, a new run_id starts from nothing.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import threading
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import structlog

from .context import Context
from .durations import format_bytes, format_duration
from .progress import Observation, parse_line, parse_trainer_state
from .rate import Series, eta_seconds, fits_budget, fraction, money, stalled_since, window_rate

log = structlog.get_logger("progress")

# how much a source's max_steps is believed: a bar's total only until someone better speaks
_RANK = {"tsup": 3, "trainer_state": 3, "banner": 2, "log": 2, "tqdm": 1}
_CKPT = re.compile(r"checkpoint-(\d+)")
MAX_STATE_BYTES = 64 * 1024 * 1024   # a trainer_state.json beyond this is not read (log_history of millions)
SAVE_EVERY_S = 15.0
_CURRENCY = {"EUR": "€", "USD": "$", "GBP": "£", "JPY": "¥", "INR": "₹"}


@dataclass
class _Run:
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
    steps: Series = field(default_factory=Series)
    tokens_s: Series = field(default_factory=Series)
    epochs: Series = field(default_factory=Series)

    _INT = ("run_id", "step", "max_steps", "max_steps_rank", "tokens", "tokens_step", "bar_total")
    _NUM = ("started_at", "ended_at", "step_at", "epoch", "epoch_at", "num_epochs", "loss", "learning_rate",
            "tokens_direct", "tokens_direct_at", "bar_rate", "bar_rate_at", "finished_at", "last_logged")
    _BOOL = ("loss_from_log", "bar_committed", "finished", "estimate_sent")
    _STR = ("step_source",)
    _PLAIN = _INT + _NUM + _BOOL + _STR + ("state_key",)

    def to_json(self) -> dict:
        d: dict[str, Any] = {k: getattr(self, k) for k in self._PLAIN}
        d["series"] = {"steps": self.steps.to_json(), "tokens": self.tokens_s.to_json(),
                       "epochs": self.epochs.to_json()}
        return d

    @classmethod
    def from_json(cls, d: object) -> _Run | None:
        """The saved run, or None when the document is not one we wrote (then start afresh)."""
        if not isinstance(d, dict):
            return None
        r = cls()
        for k in cls._PLAIN:
            v = d.get(k)
            if v is None:
                continue
            ok = (isinstance(v, bool) if k in cls._BOOL
                  else isinstance(v, str) if k in cls._STR
                  else isinstance(v, list) if k == "state_key"
                  else not isinstance(v, bool) and (isinstance(v, int) if k in cls._INT
                                                    else isinstance(v, (int, float)) and math.isfinite(v)))
            if ok:
                setattr(r, k, v)
        if not isinstance(r.run_id, int) or isinstance(r.run_id, bool):
            return None
        s = d.get("series") if isinstance(d.get("series"), dict) else {}
        r.steps = Series.from_json(s.get("steps"))
        r.tokens_s = Series.from_json(s.get("tokens"))
        r.epochs = Series.from_json(s.get("epochs"))
        return r


class ProgressTracker:
    """Thread-safe; every public method swallows and logs its own errors (a progress figure is
    never worth a daemon crash)."""

    def __init__(self, ctx: Context, gpu: Any = None):
        self.ctx = ctx
        self.gpu = gpu
        self._lock = threading.RLock()
        self._last_save = -math.inf
        self._dirty = False
        self._errors = 0
        saved = None
        try:
            saved = _Run.from_json(ctx.store.load("progress", None))
        except Exception:  # noqa: BLE001
            log.exception("progress_state_unusable")
        self.run = saved or _Run()

    @property
    def cfg(self):
        return self.ctx.config.progress

    # --- lifecycle, called by the daemon -----------------------------------------------------------
    def start_run(self, run_id: int, started_at: float) -> None:
        """A run is (or is again, after a daemon restart) in progress. The same run_id keeps what
        was known; a new one starts from nothing."""
        with self._lock:
            if self.run.run_id == run_id and self.run.started_at is not None:
                return
            self.run = _Run(run_id=run_id, started_at=started_at)
            log.info("progress_run_started", run_id=run_id, started_at=started_at)
            self._save(force=True)
        reset_peak = getattr(self.gpu, "reset_peak", None)
        if callable(reset_peak):
            try:
                reset_peak()  # "peak GPU memory" in the estimate means this run's
            except Exception:  # noqa: BLE001
                log.warning("gpu_reset_peak_failed", exc_info=True)

    def end_run(self, run_id: int, ended_at: float) -> None:
        """The run ended (any way): figures freeze at ended_at; the cost stops growing."""
        with self._lock:
            if self.run.run_id != run_id or self.run.ended_at is not None:
                return
            self.run.ended_at = ended_at
            self._log_progress(ended_at, "progress_run_ended")
            self._save(force=True)

    # --- LineListener -----------------------------------------------------------------------------
    def feed_line(self, line: str, now: float) -> None:
        try:
            with self._lock:
                if self.run.started_at is None or self.run.ended_at is not None:
                    return
                for seg in line.split("\r"):
                    obs = parse_line(seg)
                    if obs is not None:
                        t = obs.at if obs.at is not None and now - 600 <= obs.at <= now + 5 else now
                        self._apply(obs, min(t, now), now)
                if self._dirty:
                    self._save()
        except Exception:  # noqa: BLE001
            self._error("progress_feed_failed")

    def reset(self, now: float) -> None:
        """The log was truncated or replaced: bars in the new text may be other bars. What is known
        about the run stays (a new run comes with start_run)."""
        with self._lock:
            self.run.bar_total = None
            self.run.bar_committed = False

    # --- checkpoints --------------------------------------------------------------------------------
    def scan_checkpoints(self, dirs: list[str]) -> None:
        """Read trainer_state.json of the newest checkpoint-N/ in (or one level below) `dirs`,
        only when it changed since the last read and was written during this run."""
        try:
            with self._lock:
                r = self.run
                if r.started_at is None or r.ended_at is not None:
                    return
                started = r.started_at
                last_key = r.state_key
            newest = _newest_state(dirs, since=started - 60.0)
            if newest is None:
                return
            path, mtime_ns, size = newest
            key = [path, mtime_ns, size]
            if key == last_key:
                return
            obs = None
            if size <= MAX_STATE_BYTES:
                try:
                    with open(path, "rb") as f:
                        obs = parse_trainer_state(f.read(MAX_STATE_BYTES + 1))
                except OSError as e:
                    log.warning("trainer_state_unreadable", path=path, error=str(e))
                    return  # vanished (rotation) or racing the writer: look again next time
            now = self.ctx.clock.time()
            with self._lock:
                if self.run.started_at != started:
                    return
                self.run.state_key = key
                if obs is None:
                    log.warning("trainer_state_unusable", path=path, size=size)
                else:
                    t = min(now, max(started, mtime_ns / 1e9))
                    self._apply(obs, t, now)
                self._save(force=True)
        except Exception:  # noqa: BLE001
            self._error("progress_scan_failed")

    # --- merging observations ---------------------------------------------------------------------------
    def _apply(self, obs: Observation, t: float, now: float) -> None:
        r = self.run
        src = obs.source
        if obs.bar and r.step_source == "tsup" and not r.finished:
            # the user's own line owns the step; the bar still knows its speed before our window does
            if obs.max_steps == r.max_steps and obs.steps_per_s is not None:
                r.bar_rate, r.bar_rate_at = obs.steps_per_s, t
            return
        if obs.bar and not self._bar_ok(obs):
            return
        self._dirty = True
        if obs.max_steps is not None and (rank := _RANK.get(src, 0)) >= r.max_steps_rank:
            if rank >= 2 and r.bar_total is not None and r.bar_total != obs.max_steps:
                # the bar we followed was not the training bar: forget what it said
                if r.step_source == "tqdm":
                    r.step = r.step_at = r.step_source = None
                    r.steps.clear()
                r.bar_total, r.bar_committed = None, False
            r.max_steps, r.max_steps_rank = obs.max_steps, rank
        if obs.num_epochs is not None:
            r.num_epochs = obs.num_epochs
        if obs.step is not None:
            self._apply_step(obs.step, src, t)
        if obs.epoch is not None and not (src == "trainer_state" and r.epoch is not None and obs.epoch <= r.epoch):
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
        if obs.finished and not r.finished:
            r.finished, r.finished_at = True, t
            self._log_progress(now, "progress_finished")

    def _bar_ok(self, obs: Observation) -> bool:
        r = self.run
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
                r.step = r.step_at = r.step_source = None
                r.steps.clear()
            if r.max_steps_rank <= 1:
                r.max_steps, r.max_steps_rank = None, 0
            r.bar_rate = r.bar_rate_at = None
            return False
        return True

    def _apply_step(self, step: int, src: str, t: float) -> None:
        r = self.run
        if src == "trainer_state":
            if r.step is not None and step <= r.step:
                return  # an older checkpoint than what the log already said
            r.steps.add(t, step)
            r.step, r.step_at = step, t
            if r.step_source is None:
                r.step_source = src
            return
        if src == "tqdm" and r.step_source == "tsup":
            return  # the user's own line is the better witness
        if r.steps.last is not None and step < r.steps.last.v:
            r.steps.clear()  # resumed from a checkpoint inside the same run: rates start over
        r.steps.add(t, step)
        if r.step != step or r.step_at is None:
            r.step_at = t
        r.step = step
        if r.step_source != "tsup" or src == "tsup":
            r.step_source = src

    # --- figures --------------------------------------------------------------------------------------
    def _figures(self, now: float) -> dict:
        r = self.run
        W = self.cfg.window
        t_end = min(now, r.ended_at) if r.ended_at is not None else now
        te = t_end  # rates are judged at the end of training, the cost runs to the end of the job
        if r.finished and r.finished_at is not None:
            te = min(te, r.finished_at)
        running = r.ended_at is None and not r.finished
        sps = window_rate(r.steps.samples, te, W)
        if sps is None and r.bar_rate is not None and r.bar_rate_at is not None and te - r.bar_rate_at <= W:
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
        return {"te": te, "running": running, "steps_per_s": sps, "tokens_per_s": tps, "eta_s": eta,
                "fraction": pct_f, "elapsed_s": elapsed, "stalled_since": stalled}

    def snapshot(self, now: float) -> dict:
        """`training.progress` of status --json: the contract's keys plus a few more; None = unknown."""
        try:
            with self._lock:
                r = self.run
                f = self._figures(now)
                total_s = f["elapsed_s"] + f["eta_s"] if f["elapsed_s"] is not None and f["eta_s"] is not None else None
                return {
                    "step": r.step, "max_steps": r.max_steps, "epoch": _sig(r.epoch, 6), "loss": _sig(r.loss, 6),
                    "tokens_per_s": _round(f["tokens_per_s"], 2), "eta_s": _round(f["eta_s"], 1),
                    "steps_per_s": _sig(f["steps_per_s"], 6),
                    "percent": _round(f["fraction"] * 100.0, 2) if f["fraction"] is not None else None,
                    "elapsed_s": _round(f["elapsed_s"], 1), "total_s": _round(total_s, 1),
                    "learning_rate": _sig(r.learning_rate, 6), "tokens": r.tokens, "num_epochs": r.num_epochs,
                    "finished": r.finished, "stalled_since": f["stalled_since"],
                    "source": r.step_source, "run_id": r.run_id,
                }
        except Exception:  # noqa: BLE001
            self._error("progress_snapshot_failed")
            return dict.fromkeys(("step", "max_steps", "epoch", "loss", "tokens_per_s", "eta_s"))

    def cost(self, now: float) -> dict:
        """The `cost` block: price_per_hour, currency, spent (this run's machine time so far),
        eta_cost (to finish), plus total, budget and fits_budget. None = unknown."""
        c = self.ctx.config
        out: dict[str, Any] = {"price_per_hour": c.price_per_hour, "currency": c.currency, "spent": None,
                               "eta_cost": None, "total": None, "budget": self.cfg.budget, "fits_budget": None}
        try:
            with self._lock:
                f = self._figures(now)
            spent = money(c.price_per_hour, f["elapsed_s"])
            to_finish = money(c.price_per_hour, f["eta_s"])
            out.update(spent=_round(spent, 4), eta_cost=_round(to_finish, 4),
                       total=_round(spent + to_finish, 4) if spent is not None and to_finish is not None else None,
                       fits_budget=fits_budget(spent, to_finish, self.cfg.budget))
        except Exception:  # noqa: BLE001
            self._error("progress_cost_failed")
        return out

    # --- words for people -------------------------------------------------------------------------------
    def render_line(self, now: float) -> str:
        """One status line, e.g. `progress  [######--------------]  1200/3750  32.0%  loss 1.214
        2,410 tok/s  ETA 1h12m  spent €4.21, to finish ~€4.68`; "" before any run."""
        try:
            with self._lock:
                r = self.run
                if r.started_at is None:
                    return ""
                f = self._figures(now)
                cost = self.cost(now)
            parts = ["progress"]
            frac = f["fraction"]
            if frac is not None:
                filled = int(round(frac * 20))
                parts.append("[" + "#" * filled + "-" * (20 - filled) + "]")
            if r.step is not None:
                parts.append(f"{r.step:,}/{r.max_steps:,}" if r.max_steps else f"step {r.step:,}")
            elif r.epoch is not None:
                parts.append(f"epoch {r.epoch:.2f}" + (f"/{r.num_epochs:g}" if r.num_epochs else ""))
            else:
                parts.append("unknown (no progress in the log or a checkpoint yet)")
            if frac is not None:
                parts.append(f"{frac * 100:.1f}%")
            if r.loss is not None:
                parts.append(f"loss {r.loss:.4g}")
            if f["tokens_per_s"] is not None:
                parts.append(f"{f['tokens_per_s']:,.0f} tok/s")
            elif f["steps_per_s"] is not None and f["running"]:
                parts.append(_steps_rate(f["steps_per_s"]))
            if r.finished:
                took = r.finished_at - r.started_at if r.finished_at is not None else f["elapsed_s"]
                parts.append(f"done in {format_duration(took)}")
            elif r.ended_at is not None:
                parts.append(f"ended after {format_duration(f['elapsed_s'])}")
            elif f["stalled_since"] is not None:
                parts.append(f"ETA unknown (no progress for {format_duration(now - f['stalled_since'])})")
            else:
                parts.append(f"ETA {format_duration(f['eta_s'])}")
            money_bits = []
            if cost["spent"] is not None:
                money_bits.append(f"spent {_money(cost['spent'], cost['currency'])}")
            if cost["eta_cost"] is not None and f["running"]:
                money_bits.append(f"to finish ~{_money(cost['eta_cost'], cost['currency'])}")
            if money_bits:
                parts.append(", ".join(money_bits))
            elif f["elapsed_s"] is not None:
                parts.append(f"elapsed {format_duration(f['elapsed_s'])}")
            return "  ".join(parts)
        except Exception:  # noqa: BLE001
            self._error("progress_render_failed")
            return "progress  unknown"

    def email_summary(self, now: float) -> str:
        """A few lines for the finished / failed / idle mails."""
        try:
            with self._lock:
                r = self.run
                if r.started_at is None:
                    return "Progress: no training run seen."
                f = self._figures(now)
                cost = self.cost(now)
            cur = cost["currency"]
            lines = []
            if r.step is not None:
                of = f" of {r.max_steps:,}" if r.max_steps else ""
                pct = f" ({f['fraction'] * 100:.1f}%)" if f["fraction"] is not None else ""
                lines.append(f"Progress: step {r.step:,}{of}{pct}"
                             + (f", epoch {r.epoch:.2f}" if r.epoch is not None else "")
                             + (f", loss {r.loss:.4g}" if r.loss is not None else ""))
            elif r.epoch is not None:
                lines.append(f"Progress: epoch {r.epoch:.2f}" + (f" of {r.num_epochs:g}" if r.num_epochs else "")
                             + (f", loss {r.loss:.4g}" if r.loss is not None else ""))
            else:
                lines.append("Progress: unknown (the log shows no progress lines; see README, Progress)")
            speed = []
            if f["steps_per_s"] is not None:
                speed.append(_steps_rate(f["steps_per_s"]))
            if f["tokens_per_s"] is not None:
                speed.append(f"{f['tokens_per_s']:,.0f} tokens/s")
            if speed:
                lines.append("Speed: " + ", ".join(speed))
            lines.append(f"Run time: {format_duration(f['elapsed_s'])} (started {_utc(r.started_at)})")
            if f["running"]:
                if f["eta_s"] is not None:
                    lines.append(f"Estimated finish: {_utc(f['te'] + f['eta_s'])} (in {format_duration(f['eta_s'])})")
                else:
                    lines.append("Estimated finish: unknown")
            if cost["spent"] is not None:
                line = f"Cost: {_money(cost['spent'], cur)} so far at {_money(cost['price_per_hour'], cur)}/h"
                if f["running"] and cost["eta_cost"] is not None:
                    line += f", about {_money(cost['eta_cost'], cur)} more to finish"
                lines.append(line)
            return "\n".join(lines)
        except Exception:  # noqa: BLE001
            self._error("progress_summary_failed")
            return "Progress: unknown"

    # --- the early estimate and the periodic log line -----------------------------------------------
    def maybe_early_estimate(self, now: float) -> None:
        """Call every minute. Once per run, after progress.estimate_after: the projected finish
        and cost, peak GPU memory, and whether the run fits progress.budget — to the structured log
        always, by mail (an alert event) when progress.estimate_email is set. Also writes the
        `progress` log line every progress.log_interval and saves unsaved state."""
        try:
            with self._lock:
                r = self.run
                if r.started_at is None:
                    return
                if r.ended_at is None and not r.finished and (
                        r.last_logged is None or now - r.last_logged >= self.cfg.log_interval):
                    r.last_logged = now
                    self._log_progress(now, "progress")
                    self._dirty = True
                due = (not r.estimate_sent and r.ended_at is None and not r.finished
                       and now - r.started_at >= self.cfg.estimate_after)
                if not due:
                    if self._dirty:
                        self._save(force=True)
                    return
                f = self._figures(now)
                if f["eta_s"] is None and now - r.started_at < 2 * self.cfg.estimate_after:
                    if self._dirty:
                        self._save(force=True)
                    return  # give the figures a little longer before mailing unknowns
                r.estimate_sent = True
                self._save(force=True)
                run_id = r.run_id
                cost = self.cost(now)
            peak, total = self._gpu_peak()
            subject, body, fits = self._estimate_text(now, f, cost, peak, total)
            log.info("progress_estimate", run_id=run_id, eta_s=f["eta_s"], spent=cost["spent"],
                     eta_cost=cost["eta_cost"], fits_budget=fits, peak_gpu_mem_bytes=peak)
            if self.cfg.estimate_email:
                self.ctx.alerts.event(f"progress:estimate:{run_id}", "early_estimate",
                                      "warning" if fits is False else "info", subject, body)
        except Exception:  # noqa: BLE001
            self._error("progress_estimate_failed")

    def _estimate_text(self, now: float, f: dict, cost: dict, peak: int | None,
                       total: int | None) -> tuple[str, str, bool | None]:
        cur = cost["currency"]
        eta = f["eta_s"]
        fits = cost["fits_budget"]
        if eta is not None:
            subject = f"Training estimate: done in {format_duration(eta)}"
            if cost["total"] is not None:
                subject += f", about {_money(cost['total'], cur)} in all"
        else:
            subject = "Training estimate: finish time unknown"
        if fits is False:
            subject += " (over budget)"
        lines = [self.email_summary(now), ""]
        if eta is not None:
            lines.append(f"Projected finish: {_utc(f['te'] + eta)}")
        if cost["total"] is not None:
            lines.append(f"Projected cost of the run: {_money(cost['total'], cur)} "
                         f"({_money(cost['spent'], cur)} so far + {_money(cost['eta_cost'], cur)} to finish)")
        elif cost["price_per_hour"] is None:
            lines.append("Cost: unknown (set price_per_hour in the config)")
        if peak is not None:
            of = f" of {format_bytes(total)} ({100.0 * peak / total:.0f}%)" if total else ""
            lines.append(f"Peak GPU memory so far: {format_bytes(peak)}{of}")
        else:
            lines.append("Peak GPU memory so far: unknown")
        budget = cost["budget"]
        if budget is not None:
            left = budget - cost["spent"] if cost["spent"] is not None else None
            verdict = {True: "fits", False: "does NOT fit", None: "cannot be judged yet against"}[fits]
            lines.append(f"Budget: the run {verdict} the budget of {_money(budget, cur)}"
                         + (f" ({_money(left, cur)} left)" if left is not None else ""))
        if eta is None:
            lines.append("")
            lines.append("The supervisor cannot see the run's progress well enough to estimate. Print a "
                         'line like: TSUP {"step": 120, "max_steps": 3750, "tokens": 1966080}')
        return subject, "\n".join(lines), fits

    def _gpu_peak(self) -> tuple[int | None, int | None]:
        if self.gpu is None:
            return None, None
        peak = total = None
        try:
            fn = getattr(self.gpu, "peak_mem_bytes", None)
            v = fn() if callable(fn) else None
            if isinstance(v, dict):
                v = max((x for x in v.values() if isinstance(x, (int, float))), default=None)
            elif isinstance(v, (list, tuple)):
                v = max((x for x in v if isinstance(x, (int, float))), default=None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                peak = int(v)
            st = self.gpu.status() if callable(getattr(self.gpu, "status", None)) else {}
            totals = [g.get("mem_total_bytes") for g in (st or {}).get("gpus", []) if isinstance(g, dict)]
            totals = [t for t in totals if isinstance(t, int) and t > 0]
            total = max(totals) if totals else None
        except Exception:  # noqa: BLE001
            log.warning("gpu_peak_unavailable", exc_info=True)
        return peak, total

    # --- internals ---------------------------------------------------------------------------------------
    def _log_progress(self, now: float, event: str) -> None:
        f = self._figures(now)
        r = self.run
        log.info(event, run_id=r.run_id, step=r.step, max_steps=r.max_steps, epoch=r.epoch, loss=r.loss,
                 steps_per_s=f["steps_per_s"], tokens_per_s=f["tokens_per_s"], eta_s=f["eta_s"],
                 elapsed_s=f["elapsed_s"], source=r.step_source)

    def _save(self, force: bool = False) -> None:
        now = self.ctx.clock.monotonic()
        if not force and now - self._last_save < SAVE_EVERY_S:
            return
        W = self.cfg.window
        t_now = self.ctx.clock.time()
        for s in (self.run.steps, self.run.tokens_s, self.run.epochs):
            s.prune(t_now - 12 * W)
        try:
            self.ctx.store.save("progress", self.run.to_json())
            self._dirty = False
        except (OSError, TypeError, ValueError) as e:
            log.error("progress_save_failed", error=str(e))
        self._last_save = now

    def _error(self, event: str) -> None:
        self._errors += 1
        if self._errors <= 20 or self._errors % 1000 == 0:
            log.exception(event, count=self._errors)


def _newest_state(dirs: list[str], since: float) -> tuple[str, int, int] | None:
    """(path, mtime_ns, size) of the most recently written checkpoint-N/trainer_state.json."""
    best: tuple[int, int, str, int] | None = None
    seen: set[str] = set()
    for d in dirs:
        for ck in _checkpoint_dirs(d):
            p = os.path.join(ck, "trainer_state.json")
            if p in seen:
                continue
            seen.add(p)
            try:
                st = os.stat(p)
            except OSError:
                continue
            if st.st_mtime < since:
                continue
            n = int(_CKPT.fullmatch(os.path.basename(ck)).group(1))  # type: ignore[union-attr]
            cand = (st.st_mtime_ns, n, p, st.st_size)
            if best is None or cand[:2] > best[:2]:
                best = cand
    return (best[2], best[0], best[3]) if best else None


def _checkpoint_dirs(d: str) -> list[str]:
    out = []
    try:
        with os.scandir(d) as it:
            entries = [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return out
    for e in entries:
        if _CKPT.fullmatch(e.name):
            out.append(e.path)
            continue
        try:
            with os.scandir(e.path) as it2:
                out.extend(s.path for s in it2 if _CKPT.fullmatch(s.name) and s.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return out


def _sig(x: float | None, digits: int) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def _round(x: float | None, nd: int) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, nd)


def _money(x: float | None, currency: str) -> str:
    """Cents rounded half up, as on an invoice (8.125 -> 8.13; binary floats would say 8.12)."""
    if x is None or not math.isfinite(x):
        return "unknown"
    cents = Decimal(repr(round(x, 6))).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    sym = _CURRENCY.get(currency)
    return f"{sym}{cents:,}" if sym else f"{currency} {cents:,}"


def _steps_rate(sps: float) -> str:
    if sps >= 1 or sps == 0:
        return f"{sps:.2f} steps/s"
    return f"{1 / sps:.1f} s/step"


def _utc(t: float | None) -> str:
    if t is None:
        return "unknown"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
