"""The sync engine: finds complete checkpoints and adapters under the watched folders and gets
them onto the target, verified, with a manifest written last.

Threads (managed here; the daemon needs no heartbeat from outside):
- `sync-worker`: the only thread that scans, decides and talks to the target. It wakes on
  inotify hints, on requests, and sleeps exactly until the next thing that is due (a waiting
  unit goes quiet, the periodic rescan, a retry, the end of a hint's debounce), at most 0.5 s
  at a time when the clock is injected, so a FakeClock is noticed (5 s with the system clock).
- the watchdog observer thread (hints only) and the target's own request pool.
Public methods only set flags, queue a request or copy a snapshot under a short lock: nothing a
control-socket handler calls ever waits on the network, except wait_idle/final_sync, which exist
to wait (the daemon calls them from a worker thread).

This module is the shell. Decisions are pure (scan.py, complete.py, policy.py, retention.py,
backoff.py, final.py); the scan's I/O is walk.py, sending is upload.py, waiting callers are
waiter.py and answered by answers.py, the status board is status.py, failing/recovering and its alert are health.py,
persisted truth is the ledger, words are mails/sync.py and render.sync_lines.

Time: every decision reads the injected clock. The worker's own pacing (how long it sleeps, how
long an inotify hint is debounced) and a caller's wait for its answer are in real seconds, so a
FakeClock that stands still never stalls the worker: `realtime` is that one seam.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from supervisor.clock import SystemClock
from supervisor.config import SyncConfig
from supervisor.config.target import parse_target
from supervisor.interfaces import FinalSyncResult, Holding, Verb
from supervisor.states import SyncState
from supervisor.status import Block
from supervisor.status.sync import SyncBlock
from supervisor.store import make_target, target_identity
from supervisor.store._log import Once, get_logger
from supervisor.store.base import Target, TargetError, describe
from supervisor.store.credentials import CredentialWatch
from supervisor.sync import scan as sc
from supervisor.sync.answers import Answers
from supervisor.sync.ledger import Ledger, open_ledger
from supervisor.sync.lost import LostWatch
from supervisor.sync.policy import Policy, excluded_roots, hf_cache_roots
from supervisor.sync.probe import Access
from supervisor.sync.proof import Prover
from supervisor.sync.status import Board
from supervisor.sync.targethealth import AlertSink, Health
from supervisor.sync.upload import Uploader
from supervisor.sync.walk import Walker

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import Config

log = get_logger("sync")

LOOP_MAX_WAIT = 0.5      # real seconds: the longest the worker sleeps without looking at an injected clock
# with the system clock every due time is slept to exactly; this cap only bounds a due time missed
# (it costs 0.2 wakeups a second at rest, not 2)
REAL_MAX_WAIT = 5.0
DEBOUNCE_S = 1.0         # real seconds between an inotify hint and the rescan it causes (at most;
                         # never more than half the quiet period: see _debounce)
DEBOUNCE_MIN_S = 0.1     # ... and at least this (quiet_period = 0: not a rescan per write)
READY_MARGIN_S = 0.002   # look again this long after a unit's computed ready time (float rounding;
                          # a file's mtime is the kernel's coarse clock, never later than the write)
EMERGENCY_QUIET_S = 2.0  # quiet period while the machine is about to be taken (a marker still required)


class SyncEngine:
    """Implements interfaces.SyncView; `start()` once. cfg: the [sync] section; state_dir: where the ledger
    (and snapshots) live; alerts: where "sync failing" goes (None: nowhere, for a one-shot run whose failure is
    its exit status); hostname: written into manifests; excluded_roots: folders never entered (default: the HF
    caches this process's environment names); target: an already built target (tests)."""
    step_at: Callable[[float], int | None] | None = None  # the training's step at a wall time (engine_for)

    def __init__(self, cfg: SyncConfig, *, state_dir: str, clock: Clock, alerts: AlertSink | None = None,
                 hostname: str = "", excluded_roots: list[str] | None = None, target: Target | None = None,
                 realtime: Callable[[], float] = time.monotonic, training_command: str = "",
                 world_size: Callable[[], int | None] | None = None):
        self.cfg = cfg
        self.state_dir = state_dir
        self.clock = clock
        self.alerts = alerts
        self._realtime = realtime
        self.lock = threading.RLock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.thread: threading.Thread | None = None
        self.enabled = bool(cfg.target.strip())
        self.url = parse_target(cfg.target) if self.enabled else None
        self.display = self.url.display() if self.url else ""
        self.roots = sc.watch_roots(cfg.watch)
        self.extra_roots: list[sc.Root] = []
        if excluded_roots is None:
            excluded_roots = hf_cache_roots([dict(os.environ)], [r.path for r in self.roots])
        self.policy = Policy(list(cfg.include), list(cfg.exclude), list(excluded_roots))
        self.target: Target | None = target
        self.ledger: Ledger | None = None
        self.hostname = hostname or socket.gethostname()
        self._once = Once(log)
        self.walker = Walker(self.policy, cfg, self._once, alerts, world_size)
        self.board = Board(self.lock, self.enabled)
        self.stats = self.board.stats
        self.up: Uploader | None = None
        self.units: dict[sc.UnitKey, sc.Unit] = {}
        # scheduling (clock.monotonic unless noted)
        self._dirty = True
        self._dirty_at = 0.0          # realtime()
        self._requested = True
        self._next_rescan = 0.0
        self._next_ready: float | None = None
        self.health = Health(self.board, clock, alerts, self.display, cfg.retry_max_backoff, cfg.fail_alert_after)
        self.lost = LostWatch(alerts, self.display, training_command, cfg.quiet_period)
        self.passes = 0
        self._emergency = False       # a spot notice: no backoff waits, short quiet, newest re-judged per unit
        self._cut_short = False       # this pass stopped early to look for a newer checkpoint first
        self.answers = Answers(self)  # the callers who wait, and what the engine holds
        self._watcher = None
        self.prover = Prover(self.answers.proof_view, self.request_sync, clock)  # for the disk wing's prune
        # keys written down after the daemon started, and the probe that tells a missing one early
        self.access = Access(CredentialWatch(cfg.credentials_file, cfg.hf_token_file, getattr(self.url, "kind", "")),
                             self.target, self.hostname, self.health, clock)
        if self.enabled:
            assert self.url is not None
            if self.target is None:
                self.target = self.access.target = make_target(self.url, cfg, state_dir, self.access.creds)
            self._open_ledger()

    # --- setup ------------------------------------------------------------------------------------
    def _open_ledger(self) -> bool:
        assert self.url is not None and self.target is not None
        self.ledger, event, error = open_ledger(self.state_dir, target_identity(self.url, self.cfg))
        if self.ledger is None:
            self._once.warning(event, event, error=error)
            self._note_error(error)
            return False
        self.up = Uploader(self.target, self.ledger, self.board, self.clock, self.hostname, self.cfg,
                            self._closing, self.alerts, self.state_dir, lambda t: self.step_at and self.step_at(t))
        return True

    def all_roots(self) -> list[sc.Root]:
        with self.lock:
            return list(self.roots) + list(self.extra_roots)

    def start(self, watch: bool = True) -> None:
        """Start the worker; `watch=False` (a one-shot run) skips inotify and the start log."""
        if not self.enabled or self.thread is not None:
            return
        if watch:
            from supervisor.sync.watch import FolderWatcher

            self._watcher = FolderWatcher(self._on_fs_event)
            self.access.soon()  # the daemon probes at start; a one-shot pass is its own probe
        self.thread = threading.Thread(target=self._run, name="sync-worker", daemon=True)
        self.thread.start()
        if watch:
            log.info("sync_started", target=self.display, watch=[r.path for r in self.roots])
            # the first checkpoint must not wait for the keys and the connection (bench_daemon_sync.py); one-shot: only if needed
            getattr(self.target, "prepare", lambda: None)()

    def close(self, timeout: float = 10.0) -> None:
        self._closing.set()
        self._wake.set()
        t = self.thread
        if t is not None:
            t.join(timeout)
        if self._watcher is not None:
            self._watcher.close()
        if self.target is not None:
            with contextlib.suppress(Exception):  # closing must not raise
                self.target.close()
        if self.ledger is not None and (t is None or not t.is_alive()):
            self.ledger.close()
        self.answers.answer_all("sync engine stopped")  # the worker does this as it ends; not if it hangs

    # --- the SyncView API -------------------------------------------------------------------------
    def request_sync(self) -> None:
        with self.lock:
            self._requested = True
            self.health.backoff.retry_now()  # the user asked: retry now, whatever the backoff said
        self._wake.set()

    def scan_again(self) -> None:
        """The worker scans on its next turn (under the lock; it is the worker that asks: no wake)."""
        self._requested = True

    def reload_credentials(self) -> None:
        """`supervisorctl sync`: the target builds its client again before the next request."""
        self.access.reload("sync requested")

    def probe_soon(self) -> None:
        """`run`: a missing or refused key is told before the run's first checkpoint (probe.py)."""
        self.access.soon()
        self._wake.set()

    def emergency(self) -> None:
        """The machine is about to be taken (a spot notice): sync now and keep at it. Until the
        engine closes: no backoff wait between tries; the quiet period shrinks to EMERGENCY_QUIET_S
        (a checkpoint-N still needs its trainer_state.json, and every file its format check), so the
        checkpoint a training saves on the notice goes up seconds after it is whole; and the worker
        looks again after each unit, so a checkpoint finished meanwhile goes before the older ones."""
        with self.lock:
            self._emergency = True
            self.walker.quiet = min(self.cfg.quiet_period, EMERGENCY_QUIET_S)
        log.warning("sync_emergency", target=self.display)
        self.request_sync()

    def wait_idle(self, timeout_s: float) -> FinalSyncResult:
        return self.answers.wait_idle(timeout_s)

    def once(self, timeout_s: float) -> FinalSyncResult:
        return self.answers.once(timeout_s)

    def holdings(self) -> list[Holding]:
        return self.answers.holdings()

    def sibling_target(self, where: str) -> Target:
        """Another place on the same store (the run's prefix, its ledger) for a wing that keeps a
        client open: built from this engine's credential sources, so keys written down after the
        daemon started (the environment file the engine watches) reach it too."""
        return make_target(parse_target(where), self.cfg, self.state_dir, self.access.creds)

    def fs_events(self, fn: Callable[[str], None]) -> bool:
        """Tell `fn` of every change under the watched folders, from this engine's own watcher
        (the disk wing needs no second one); False when the engine watches nothing."""
        if self._watcher is None:
            return False
        self._watcher.also(fn)
        return True

    def final_sync(self, paths: list[str], timeout_s: float) -> FinalSyncResult:
        """Upload everything the policy selects under `paths`, regardless of the quiet period,
        then check on the target itself that it holds all of it (Answers.final_sync)."""
        return self.answers.final_sync(paths, timeout_s)

    def status(self) -> dict:
        with self.lock:
            totals = self.ledger.totals() if self.ledger else (0, 0)
            snap = self.board.snapshot(self.clock.monotonic(), self.health.backoff, self.display, totals,
                                       [r.path for r in self.roots])
        snap["target_info"] = describe(self.target) if self.target is not None else {}  # e.g. Xet or LFS
        snap.update(self.access.status(), lost=list(self.lost.lost), units=self.answers.unit_formats())
        return snap

    # --- worker loop ------------------------------------------------------------------------------
    def _on_fs_event(self, path: str) -> None:
        if self.policy.ignores_event(path):
            return
        if self.up is not None:  # a save seen while the worker sends (saves.counts.Saves)
            self.up.snaps.hint(path)
        self._mark_dirty()
        self._wake.set()

    def _mark_dirty(self) -> None:
        with self.lock:
            if not self._dirty:
                self._dirty_at = self._realtime()
            self._dirty = True

    def _run(self) -> None:
        failed_with = ""  # the error whose traceback was logged: each new one once, never every second
        try:
            while not self._closing.is_set():
                try:
                    self._iteration()
                except Exception as e:  # noqa: BLE001 - the worker must outlive any bug or odd file
                    self._note_error(said := f"internal error: {type(e).__name__}: {e}")
                    with contextlib.suppress(Exception):  # not even a broken logger may end the worker
                        if said != failed_with:  # the traceback once, not every second
                            log.exception("sync_iteration_failed")
                    failed_with = said
                    self._closing.wait(1.0)
                self._wake.wait(self._sleep_for())
                self._wake.clear()
        finally:
            self.answers.answer_all("sync engine stopped")
            if self.ledger is not None:
                self.ledger.close()

    @property
    def _debounce(self) -> float:
        """A burst of hints (a file being written) causes one rescan per this many seconds. The
        quiet clock starts at a file's mtime, not at the rescan (scan.observe), so the debounce
        delays nothing as long as the rescan comes before the quiet period is over."""
        return min(DEBOUNCE_S, max(DEBOUNCE_MIN_S, self.cfg.quiet_period / 2))

    def _sleep_for(self) -> float:
        """Real seconds the worker may sleep: until the soonest of a unit's ready time, the
        periodic rescan, the next retry, the end of the debounce, a final sync's deadline and the
        sync-failing alert; at most LOOP_MAX_WAIT with an injected clock, so a FakeClock that jumps
        is noticed, REAL_MAX_WAIT with the system clock. Distances on the injected clock are slept in real
        seconds: with the system clock that is exact, and a FakeClock is re-read every pass."""
        now = self.clock.monotonic()
        with self.lock:
            if self._requested:
                return 0.0
            cap = REAL_MAX_WAIT if isinstance(self.clock, SystemClock) else LOOP_MAX_WAIT
            t = min(cap, self._next_rescan - now)
            if self._next_ready is not None:
                t = min(t, self._next_ready - now)
            retry = self.health.backoff.retry_in(now)
            if retry is not None:
                t = min(t, retry)
            for ticket in self.answers.finals.tickets():
                t = min(t, ticket.spec.deadline - now)
            failing_for = self.health.backoff.failing_for(now)
            if failing_for is not None and not self.health.fired:
                t = min(t, self.health.alert_after - failing_for)
            if self._dirty:
                t = min(t, self._dirty_at + self._debounce - self._realtime())
        return max(0.0, t)

    def _iteration(self) -> None:
        if self.ledger is None:
            if not self._open_ledger():
                self._closing.wait(2.0)
                return
            self._note_error("")
        assert self.ledger is not None
        if self.access.changed():
            with self.lock:
                self._requested = True  # and the backoff is over: try the new keys at once
        now = self.clock.monotonic()
        with self.lock:
            due = (self._requested or bool(self.answers.finals.tickets()) or now >= self._next_rescan
                   or (self._dirty and self._realtime() - self._dirty_at >= self._debounce)
                   or (self._next_ready is not None and now >= self._next_ready)
                   or self.health.backoff.due(now))
            due = due or (self._emergency and self.health.failing)
            in_backoff = self.health.backoff.waiting(now) and not self._emergency
        self.answers.expire_finals()
        self.health.evaluate_alert()
        if not due:
            self.ledger.sync()
            return
        if in_backoff:
            # a rescan during backoff still refreshes pending counts, but sends nothing
            self._do_scan()
            return
        self.health.begin_try()
        if self.access.due:
            self.access.run()
        pass_id = self._do_scan()
        self._cut_short = False
        error = self._process_work()
        self.ledger.sync()
        if self._cut_short:
            return  # the next iteration scans again at once and goes on; nobody is answered yet
        if error is None:
            self.answers.verify_finals()
        self.answers.answer_idle_waits(error, pass_id)
        self.health.evaluate_alert()

    def _move(self, state: SyncState) -> None:
        self.board.move(state, failing=self.health.failing)

    def _do_scan(self) -> int:
        assert self.ledger is not None
        with self.lock:
            self._requested = False
            self._dirty = False
            self.passes += 1
            pass_id = self.passes
            forced = [p for t in self.answers.finals.tickets() for p in t.spec.paths]
            self._move(SyncState.SCANNING)
        roots = self.all_roots()
        if self._watcher is not None:
            self._watcher.forget_missing()
            self._watcher.ensure([r.path for r in roots])
        began = self.clock.monotonic()   # the verdicts' ready_in count from here, not from the scan's end
        units = self.walker.scan(roots, forced, self.clock.time(), began,
                                  self.ledger.manifests_under, self._held)
        self.board.look_unselected(self.walker, units.values(), began, bool(forced))
        if self.up is not None:  # a checkpoint deleted before it left the machine: told at once
            self.lost.look(self.units, units, self.up.synced, self.clock.time(), self.board.last_error)
            self.up.snaps.look(units.values(), self.up.synced)  # saves the target lacks; old snapshots go
        now = self.clock.monotonic()
        with self.lock:
            self.units = units
            self._next_rescan = now + self.cfg.rescan_interval
            ready = sc.next_ready(units.values())
            self._next_ready = began + ready + READY_MARGIN_S if ready is not None else None
            self._refresh_pending()
            self._move(SyncState.IDLE)
            self.stats["scans"] += 1
            self.stats["header_reads"] = self.walker.header_reads
        return pass_id

    def _held(self, u: sc.Unit) -> bool:
        """Uploader.held; a unit that is not makes the target get ready while the scan goes on."""
        if self.up is not None and self.up.held(u):
            return True
        prepare = getattr(self.target, "prepare", None)
        if callable(prepare):
            prepare()
        return False

    def _refresh_pending(self) -> None:
        assert self.ledger is not None
        p = sc.pending(self.units.values(), self.ledger.current, self.clock.time(), self.cfg.quiet_period,
                       self.cfg.complete_marker)
        for label, quiet_for in p.without_marker:
            self._once.warning(f"marker:{label}", "sync_checkpoint_without_marker", unit=label,
                               marker=self.cfg.complete_marker, quiet_for_s=round(quiet_for))
        self.lost.stuck(p.stuck, {w[0]: w[2] for w in p.waiting})
        self.board.pending = p

    # --- uploading --------------------------------------------------------------------------------
    def _process_work(self) -> str | None:
        """Upload every unit that is ready. Returns the error that stopped the pass, or None."""
        up = self.up
        assert up is not None
        with self.lock:
            units = list(self.units.values())
        work = sc.work(units, up.synced)
        if self._emergency:
            work = sc.hold_for_newer(units, work, up.synced, self.cfg.complete_marker, EMERGENCY_QUIET_S)
        if not work:
            with self.lock:
                # nothing left that could fail, unless a final sync still has to ask the target
                # whether it holds everything (that check fails while the target is down: issue
                # 29), nor while the probe fails (it tells that the target refuses us)
                if (self.health.failing or self.health.alerted) and not self.answers.finals.tickets() \
                        and not self.access.failed:
                    self.health.recovered(contacted=False)
            return None
        # newest first; folders one after another in one step (a commit, or one stream of files),
        # except under a spot notice: one folder at a time, looking again after each
        for i, batch in enumerate(up.batches(work, together=not self._emergency)):
            if self._closing.is_set():
                return "closing"
            if i and self._emergency:
                with self.lock:
                    self._requested = self._cut_short = True
                self._wake.set()
                break
            self._move(SyncState.UPLOADING)
            try:
                whole = up.send(batch)
            except TargetError as e:
                self.failed(str(e), e)
                return str(e)
            if not whole:
                self._mark_dirty()  # a file vanished or changed under us: look again soon
            with self.lock:
                self.health.recovered()
            self.access.sent()
        with self.lock:
            self.board.current = ""
            self._move(SyncState.IDLE)
            self._refresh_pending()
        return None

    # --- failure and recovery ---------------------------------------------------------------------
    def failed(self, error: str, cause: BaseException | None = None) -> None:
        self.health.failed(error, cause)
        with self.lock:
            self._refresh_pending()

    def _note_error(self, error: str) -> None:
        self.board.error(error, self.clock.time())

    # --- what the daemon lists -------------------------------------------------------------------
    def status_blocks(self) -> tuple[Block, ...]:
        return (SyncBlock.of(self.status()),)

    def verbs(self) -> dict[str, Verb]:
        return {"sync": self.answers.on_request}


def engine_for(config: Config, clock: Clock, alerts: AlertSink | None = None,
               world_size: Callable[[], int | None] | None = None, excluded: list[str] | None = None,
               step_at: Callable[[float], int | None] | None = None) -> SyncEngine:
    """The engine as the daemon (and `python -m supervisor.sync`) build it from the whole
    config: the HF caches named in the training's environment are never entered (`excluded`, when
    the caller worked them out already). `world_size`: the training's ranks now (the daemon reads
    its workers' WORLD_SIZE). `step_at`: the training's step at a wall time (the progress wing's), for
    the manifest of a save whose name and files state no step (ckpt.pt, checkpoint_7/)."""
    if excluded is None:
        excluded = excluded_roots(config, os.environ)
    e = SyncEngine(config.sync, state_dir=config.state_dir, clock=clock, alerts=alerts,
                   hostname=config.hostname, excluded_roots=excluded, training_command=config.training.command,
                   world_size=world_size)
    e.step_at = step_at
    return e
