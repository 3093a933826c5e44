"""The live progress of the current run: the shell around supervisor.progress.record.

`ProgressTracker` is a LineListener on the training log and reads the newest checkpoint's
trainer_state.json when it changes; what they say is merged into the run record by the pure
functions of supervisor.progress.record, which also derive the rates, ETA and cost. This shell does
the I/O: lines in, trainer_state.json reads, persistence, the structured log and the estimate mail.

The state of the run is persisted (`progress.json` in state_dir) so a daemon restart keeps the
step, the series behind the rates and the run's start time; `start_run` with the same run_id
picks it up again, a new run_id starts from nothing.
"""

from __future__ import annotations

import math
import os
import pwd
import threading
from collections.abc import Sequence

import structlog

from supervisor.config import ProgressConfig
from supervisor.context import Context
from supervisor.interfaces import Duty, GpuView
from supervisor.notify.mails import progress as words
from supervisor.progress import record as pr
from supervisor.progress import stall
from supervisor.progress.parse import parse_trainer_state
from supervisor.progress.trackers import TrackerFiles
from supervisor.statefile import set_aside
from supervisor.status import Block
from supervisor.status.training import CostBlock
from supervisor.training.finder import find_checkpoints
from supervisor.untrusted.fileopen import open_regular

log = structlog.get_logger("progress")

MAX_STATE_BYTES = 16 * 1024 * 1024   # a trainer_state.json beyond this is not read: parsing 64 MiB of
# hostile JSON (`[[],[],...]`) took about 1.3 GB, past the unit's MemoryMax; the log lines still give progress
SAVE_EVERY_S = 15.0


class ProgressTracker:
    """Thread-safe; every public method swallows and logs its own errors (a progress figure is
    never worth a daemon crash). The price and currency come from the caller: the tracker reads
    only its own `[progress]` section."""

    def __init__(self, ctx: Context, conf: ProgressConfig, *, price_per_hour: float | None, currency: str = "USD",
                 gpu: GpuView | None = None, job_env: dict[str, str] | None = None, job_user: str = "",
                 save_dirs: Sequence[str] = ()):
        self.ctx = ctx
        self.cfg = conf
        self.save_dirs = list(save_dirs)    # sync.watch and training.workdir: where checkpoints land
        # the training's env and user: where Trackio keeps its databases for the job
        self.job_env, self.job_user = job_env or {}, job_user
        self.gpu = gpu
        self.price_per_hour = price_per_hour
        self.currency = currency
        self._lock = threading.RLock()
        self._last_save = -math.inf
        self._dirty = False
        self._errors = 0
        self.run = self._load()
        src = set(self.cfg.sources)
        self._log_on = "auto" in src or "log" in src
        self._state_on = "auto" in src or "trainer_state" in src
        self.trackers = TrackerFiles(list(src))
        self._trackio_at = self._trackio_dirs() if self.trackers.trackio else []
        self.tracker_end: dict[str, str] = {}

    def _load(self) -> pr.Run:
        try:
            saved = self.ctx.store.load("progress", None)
            if saved is None:
                return pr.Run()
            return pr.Run.from_json(saved)
        except ValueError as e:
            aside = set_aside(self.ctx.store.path("progress"))
            self.ctx.store.problems.append(f"{e}; set aside as {aside.name}, progress starts afresh")
            log.warning("progress_state_unusable", error=str(e), set_aside=str(aside))
        except Exception:  # noqa: BLE001
            log.exception("progress_state_unusable")
        return pr.Run()

    # --- lifecycle, called by the daemon -----------------------------------------------------------
    def start_run(self, run_id: int, started_at: float, from_step: int | None = None) -> None:
        """A run is (or is again, after a daemon restart) in progress. The same run_id keeps what
        was known; a new one starts from nothing. from_step: the step of the newest complete
        checkpoint here as it starts (what a resume continues from; its rate counts only later steps)."""
        with self._lock:
            if self.run.run_id == run_id and self.run.started_at is not None:
                return
            self.run = pr.Run(run_id=run_id, started_at=started_at, from_step=from_step or None)
            self.tracker_end = {}
            log.info("progress_run_started", run_id=run_id, started_at=started_at, from_step=from_step or None)
            self._save(force=True)
        reset_peak = getattr(self.gpu, "reset_peak", None)
        if callable(reset_peak):
            try:
                reset_peak()  # "peak GPU memory" in the estimate means this run's
            except Exception:  # noqa: BLE001
                log.warning("gpu_reset_peak_failed", exc_info=True)

    def end_run(self, run_id: int, ended_at: float, dirs: list[str] | None = None) -> None:
        """The run ended (any way): figures freeze at ended_at; the cost stops growing. `dirs`: a
        last look at its trainer_state.json files and trackers first (what it wrote on its way out:
        the final step of a run the log did not follow)."""
        if dirs:
            self.scan_checkpoints(dirs)
            self.poll_trackers(dirs, rediscover=True)
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
                if not self.run.live or not self._log_on:
                    return
                m = pr.merge_line(self.run, line, now)
                self._dirty = self._dirty or m.changed
                if m.finished:
                    self._log_progress(now, "progress_finished")
                if self._dirty:
                    self._save()
        except Exception:  # noqa: BLE001
            self._error("progress_feed_failed")

    def reset(self, now: float) -> None:
        """The log was truncated or replaced. What is known about the run stays (a new run comes
        with start_run)."""
        with self._lock:
            pr.forget_bar(self.run)

    # --- checkpoints --------------------------------------------------------------------------------
    def scan_checkpoints(self, dirs: list[str]) -> None:
        """Read trainer_state.json of the newest checkpoint-N/ in (or one level below) `dirs`,
        only when it changed since the last read and was written during this run."""
        if not self._state_on:
            return
        try:
            with self._lock:
                r = self.run
                if not r.live:
                    return
                started = r.started_at
                last_key = r.state_key
            assert started is not None
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
                    with os.fdopen(open_regular(path), "rb") as f:  # no FIFO, no link: the user's folder
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
                    m = pr.merge(self.run, obs, min(now, max(started, mtime_ns / 1e9)))
                    if m.finished:
                        self._log_progress(now, "progress_finished")
                self._save(force=True)
        except Exception:  # noqa: BLE001
            self._error("progress_scan_failed")

    def poll_trackers(self, dirs: list[str], rediscover: bool = False) -> None:
        """What the trackers wrote since the last look (progress.sources), merged like a log line,
        at the writer's own time."""
        try:
            with self._lock:
                if not self.run.live or not self.trackers.wanted:
                    return
                started = self.run.started_at
            found = self.trackers.poll(dirs, started, rediscover, self._trackio_at)
            now = self.ctx.clock.time()
            with self._lock:
                if self.run.started_at != started or started is None:
                    return
                for obs, t in found.obs:
                    if t >= started - 60:
                        m = pr.merge(self.run, obs, min(now, max(started, t)))
                        self._dirty = self._dirty or m.changed
                self.tracker_end.update(found.ended)
                if self._dirty:
                    self._save()
        except Exception:  # noqa: BLE001
            self._error("progress_trackers_failed")

    def _trackio_dirs(self) -> list[str]:
        """Where Trackio keeps its databases for the job: TRACKIO_DIR, else HF_HOME/trackio, else the
        training user's ~/.cache/huggingface/trackio."""
        env = self.job_env
        out = [env["TRACKIO_DIR"]] if env.get("TRACKIO_DIR") else []
        if env.get("HF_HOME"):
            out.append(os.path.join(env["HF_HOME"], "trackio"))
        user = self.job_user
        try:
            home = pwd.getpwnam(user).pw_dir if user and not user.isdigit() else \
                pwd.getpwuid(int(user) if user else os.geteuid()).pw_dir
        except (KeyError, ValueError):
            home = ""
        if home:
            out.append(os.path.join(home, ".cache", "huggingface", "trackio"))
        return out

    # --- figures ------------------------------------------------------------------------------------
    def _figures(self, now: float) -> pr.Figures:
        return pr.figures(self.run, now, self.cfg.window)

    def snapshot(self, now: float) -> dict:
        """`training.progress` of status --json: the contract's keys plus a few more; None = unknown."""
        try:
            with self._lock:
                out = pr.snapshot(self.run, self._figures(now))
                v = self._stall_view(now)
            out.update(since_step_s=None if v.since_step_s is None else round(v.since_step_s, 1),
                       stall_after_s=v.threshold_s, stalled=v.stall is not None,
                       tracker_end=[t for _, t in sorted(self.tracker_end.items())][:4])
            return out
        except Exception:  # noqa: BLE001
            self._error("progress_snapshot_failed")
            return dict.fromkeys(("step", "max_steps", "epoch", "loss", "tokens_per_s", "eta_s"))

    def stall(self, now: float) -> stall.View:
        """Seconds since the step last moved, the stall threshold, and the stall if there is one
        (supervisor.progress.stall). The caller also checks that the training is RUNNING."""
        try:
            with self._lock:
                return self._stall_view(now)
        except Exception:  # noqa: BLE001
            self._error("progress_stall_failed")
            return stall.View(None, None, None)

    def _stall_view(self, now: float) -> stall.View:
        r = self.run
        times = [s.t for s in r.steps.samples]
        if len(times) < 3 and r.started_at is not None and (not times or r.started_at < times[0]):
            # too few steps for a typical gap: the wait for the first one counts as one, so a step seen
            # only in hourly checkpoints (or a log line every 40 minutes) is not called hung after 30m
            times.insert(0, r.started_at)
        return stall.view(r.step, r.step_at, times, now, self.cfg.stall_after, r.live and not r.finished)

    def step_at(self, t: float) -> int | None:
        """This run's step at wall time `t`: the newest step seen at or before it (None when none
        was yet, or the samples that far back were let go). The sync writes it into the manifest of
        a save whose name states no step (nanoGPT's ckpt.pt), so a restore ranks saves by step."""
        with self._lock:
            best = None
            for s in self.run.steps.samples:
                if s.t > t:
                    break
                best = s
            return int(best.v) if best is not None else None

    def cost(self, now: float) -> dict:
        """The `cost` block of status --json (see progress_run.cost)."""
        f = None
        try:
            with self._lock:
                f = self._figures(now)
        except Exception:  # noqa: BLE001
            self._error("progress_cost_failed")
        return pr.cost(f, self.price_per_hour, self.currency, self.cfg.budget)

    def _facts(self, now: float) -> tuple[words.RunFacts, words.CostFacts]:
        r = self.run
        f = self._figures(now)
        run = words.RunFacts(started_at=r.started_at, step=r.step, max_steps=r.max_steps, fraction=f.fraction,
                             epoch=r.epoch, num_epochs=r.num_epochs, loss=r.loss, steps_per_s=f.steps_per_s,
                             tokens_per_s=f.tokens_per_s, elapsed_s=f.elapsed_s, running=f.running,
                             eta_s=f.eta_s, finish_at=f.finish_at)
        return run, words.CostFacts(**pr.cost(f, self.price_per_hour, self.currency, self.cfg.budget))

    def email_summary(self, now: float) -> str:
        """A few lines for the finished / failed / idle mails."""
        try:
            with self._lock:
                if self.run.started_at is None:
                    return words.summary(words.RunFacts(None), words.CostFacts(None, self.currency))
                return words.summary(*self._facts(now))
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
                if pr.log_due(r, now, self.cfg.log_interval):
                    r.last_logged = now
                    self._log_progress(now, "progress")
                    self._dirty = True
                f = self._figures(now)
                if not pr.estimate_due(r, now, self.cfg.estimate_after, f.eta_s is not None):
                    if self._dirty:
                        self._save(force=True)
                    return
                r.estimate_sent = True
                self._save(force=True)
                run_id = r.run_id
                run, cost = self._facts(now)
            peak, total = self._gpu_peak()
            mail = words.estimate(run, cost, peak, total)
            log.info("progress_estimate", run_id=run_id, eta_s=run.eta_s, spent=cost.spent,
                     eta_cost=cost.eta_cost, fits_budget=cost.fits_budget, peak_gpu_mem_bytes=peak)
            if self.cfg.estimate_email:
                self.ctx.alerts.event(f"progress:estimate:{run_id}", "early_estimate",
                                      "warning" if cost.fits_budget is False else "info", mail.subject, mail.body)
        except Exception:  # noqa: BLE001
            self._error("progress_estimate_failed")

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
                 steps_per_s=f.steps_per_s, tokens_per_s=f.tokens_per_s, eta_s=f.eta_s,
                 elapsed_s=f.elapsed_s, source=r.step_source)

    def _save(self, force: bool = False) -> None:
        now = self.ctx.clock.monotonic()
        if not force and now - self._last_save < SAVE_EVERY_S:
            return
        self.run.prune(self.ctx.clock.time() - 12 * self.cfg.window)
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

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        now = self.ctx.clock.time
        return (Duty("progress", 30.0, lambda: self.scan_checkpoints(self.save_dirs)),
                Duty("trackers", 10.0, lambda: self.poll_trackers(self.save_dirs)),  # TensorBoard, MLflow, ...
                Duty("estimate", 60.0, lambda: self.maybe_early_estimate(now())))

    def status_blocks(self) -> tuple[Block, ...]:
        return (CostBlock.of(self.cost(self.ctx.clock.time())),)


def _newest_state(dirs: list[str], since: float) -> tuple[str, int, int] | None:
    """(path, mtime_ns, size) of the most recently written checkpoint-N/trainer_state.json, or
    the one trainer.save_state() leaves at the top of output_dir when the run ends (the final step:
    a run that saved every 40 steps and finished at 200 says 200/200, not 160/200), whether
    output_dir is the watched folder or a folder in it."""
    best: tuple[int, int, str, int] | None = None
    seen: set[str] = set()
    for d in dirs:
        for ck, n in _state_dirs(d):
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
            cand = (st.st_mtime_ns, n, p, st.st_size)
            if best is None or cand[:2] > best[:2]:
                best = cand
    return (best[2], best[0], best[3]) if best else None


def _state_dirs(d: str) -> list[tuple[str, int]]:
    """(path, step) of each folder whose trainer_state.json may be the newest: each checkpoint-N/
    in `d` or one level below, with its step; `d` itself and each other folder in it that is no
    checkpoint of any kind (an output_dir, where save_state() writes at the end) with -1."""
    out: list[tuple[str, int]] = [(d, -1)]
    try:
        with os.scandir(d) as it:  # an output_dir; never a checkpoint being written (tmp-checkpoint-300)
            out += [(e.path, -1) for e in it if "checkpoint" not in e.name and e.is_dir(follow_symlinks=False)]
    except OSError:
        return out
    return out + [(f.path, f.step) for f in find_checkpoints([d], depth=1)]
