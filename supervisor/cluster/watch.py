"""The heartbeat duty of a run on several machines: write this node's heartbeat to the sync target,
read the others', and when one is lost, alert and (on_node_lost = "save_and_stop") ask the one
stop door for a `node_lost` stop while this node's training runs: the stop interrupts the hung
training (SIGINT, SIGTERM, SIGKILL, HUNG_GRACE_S apart), makes the final verified sync, and stops
the machine. A node that comes back before the stop acts withdraws the reason.

No server of our own: S3, rsync over SSH and a shared folder all carry the heartbeats. Every read
and write is bounded by the target's own timeouts; a target that fails here is told in status and
judges nobody lost (nodes.judge). A heartbeat file that is not one (unreadable, another run's,
unsigned or wrongly signed where the run has a key) is that node's problem, named on its line in
status (and, when forged, alerted once): it never counts as the target failing."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog

from supervisor.cluster import nodes as cn
from supervisor.cluster.nodes import read_every
from supervisor.cluster.records import RunRecords
from supervisor.config.cluster import Identity
from supervisor.interfaces import Duty
from supervisor.saves.parts import Held
from supervisor.states import TRAINING_ALIVE
from supervisor.status import Block
from supervisor.status.cluster import ClusterBlock
from supervisor.store.credentials import run_key
from supervisor.training.checkpoints import unit_order
from supervisor.training.ranks import Ranks, spans

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import ClusterConfig, Config
    from supervisor.interfaces import TrainingView
    from supervisor.notify.alerts import Alerts
    from supervisor.stop.runner import StopRunner

log = structlog.get_logger("cluster")

READ_THREADS = 8     # heartbeats read at once: 64 nodes in 8 round trips
LOST_STATE = "cluster-lost"  # state file: the units this node lost before they were sent, for this run
UNTRUSTED = ("no cluster.key_file: whoever can write the sync target's _cluster/ folder is trusted by the cluster "
             "(can keep a dead node \"finished\", get a live node stopped, or plant run-wide records)")


class ClusterWatch:
    def __init__(self, cfg: ClusterConfig, ident: Identity, target: object, training: TrainingView,
                 alerts: Alerts, clock: Clock, hostname: str, *, stop: Callable[[str, str], bool],
                 withdraw: Callable[[str], None], display: str = "",
                 holds: Callable[[], Held | list[str]] | None = None, part0: object | None = None,
                 since_step: Callable[[], float | None] | None = None, key: bytes | None = None,
                 key_problem: str = "", ranks: Callable[[], Ranks | None] | None = None,
                 state_dir: str | None = None):
        self.cfg = cfg
        self.ident = ident
        self.target = target
        self.training = training
        self.alerts = alerts
        self.clock = clock
        self.hostname = hostname
        self.display = display
        self._stop = stop
        self._withdraw = withdraw
        self._lock = threading.Lock()
        self._seq = 0
        self._boot = f"{clock.boot()[0]}:{os.getpid()}:{int(clock.time())}"
        self._last_write: float | None = None
        self._seen: dict[int, cn.Seen] = {}
        self._problems: dict[int, str] = {}   # node -> why its heartbeat file was not taken
        self._forged_told: set[int] = set()
        self._reads_ok_since: float | None = None
        self._views: list[cn.NodeView] = []
        self._lost: set[int] = set()
        self._held: set[int] = set()   # lost by their heartbeats, yet this run still steps
        self._asked = False
        self.error = ""
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="cluster-read")
        self._holds = holds or (lambda: [])
        self._ranks = ranks or (lambda: None)
        # the run's shared secret (cluster.key_file): heartbeats and records are signed with it and
        # only signed ones count; None: the bucket is trusted (status says so)
        self.key = key
        self.key_problem = key_problem
        # seconds since this node's training last stepped (None: not known): a run that still steps
        # has lost no peer (its collectives would block), whatever a silent supervisor says
        self._since_step = since_step or (lambda: None)
        # rank 0 writes the run-wide records: its own part's units, each once every node's part is whole
        self._records = RunRecords(ident, part0, target, key, cfg.heartbeat) if part0 is not None else None
        self._last_records: float | None = None
        # the units this node lost before they were sent: said in every heartbeat of this run, across restarts
        self._state = None
        self._lost_units: list[str] = []
        if state_dir:
            from supervisor.statefile import StateStore

            self._state = StateStore(state_dir)
            got = self._state.load(LOST_STATE, {})
            if isinstance(got, dict) and got.get("run_id") == ident.run_id and isinstance(got.get("lost"), list):
                self._lost_units = [u for u in got["lost"] if isinstance(u, str)][: cn.LOST_MAX]

    @classmethod
    def of(cls, cfg: Config, run_target: str, training: TrainingView, alerts: Alerts, clock: Clock, hostname: str,
           stops: StopRunner, holds: Callable[[], Held | list[str]], target_at: Callable[[str], object],
           since_step: Callable[[], float | None] | None = None,
           ranks: Callable[[], Ranks | None] | None = None) -> ClusterWatch:
        """The watch for the run's own prefix (the heartbeats sit beside the nodes' parts);
        `target_at` builds a target for a place on the store (the sync engine's sibling_target)."""
        from supervisor.config.target import parse_target

        c = cfg.cluster
        ident = Identity(c.nodes, c.rank or 0, c.run_id)
        part0 = target_at(cfg.sync.target) if ident.rank == 0 else None
        key, problem = run_key(c.key_file)
        if problem:
            log.error("cluster_key_unreadable", key_file=c.key_file, error=problem)
            alerts.fire("cluster:key", "cluster_key", "critical", "cluster.key_file cannot be read",
                        f"cluster.key_file = {c.key_file}: {problem}.\nThis node neither signs nor checks the run's "
                        "heartbeats and records: whoever can write the sync target is trusted by the cluster.\n")
        return cls(c, ident, target_at(run_target), training, alerts, clock, hostname, stop=stops.request,
                   withdraw=stops.withdraw, display=parse_target(run_target).display(), holds=holds, part0=part0,
                   since_step=since_step, key=key, key_problem=problem, ranks=ranks, state_dir=cfg.state_dir)

    # --- the duty -------------------------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock.monotonic()
        info = self.training.info()
        if self._last_write is None or now - self._last_write >= self.cfg.heartbeat - 0.05:
            self._beat(info.state.value, info.run_id)
            self._last_write = now
        got, ok = self._read_all()
        now = self.clock.monotonic()
        with self._lock:
            if not ok:
                self._reads_ok_since = None
            elif self._reads_ok_since is None:
                self._reads_ok_since = now
            for rank, beat in got.items():
                self._seen[rank] = cn.observe(self._seen.get(rank), beat, now)
            self._views = cn.judge(self._seen, self.ident, self.hostname, info.state.value, now,
                                   self._reads_ok_since, self.cfg.heartbeat, self.cfg.silent_after, self._problems)
            lost = {v.rank: v for v in self._views if v.state == cn.LOST}
            held: list[cn.NodeView] = []
            if lost and info.state in TRAINING_ALIVE and self._still_stepping():
                held = [v for r, v in lost.items() if r not in self._lost]
                lost = {r: v for r, v in lost.items() if r in self._lost}
            was_held, self._held = self._held, {v.rank for v in held}
            quiet_again = [r for r in was_held if r not in self._held]
            back = {v.rank: v for v in self._views if v.rank in self._lost and v.state in (cn.OK, cn.FINISHED)}
            new = [v for r, v in lost.items() if r not in self._lost]
            self._lost = (self._lost | set(lost)) - set(back)
        for v in held:
            if v.rank not in was_held:
                self._on_held(v)
        for r in quiet_again:
            self.alerts.resolve(f"cluster:silent:{r}")
        for v in new:
            self._on_lost(v, info.state in TRAINING_ALIVE)
        for v in back.values():
            self._on_back(v)
        if self._records is not None and (self._last_records is None or
                                          now - self._last_records >= max(2 * self.cfg.heartbeat, 2.0)):
            self._last_records = now
            with self._lock:
                seen = dict(self._seen)
                gone = frozenset(v.rank for v in self._views if v.state == cn.LOST)
            r = self._ranks_now()
            try:
                self._records.write(now, self.clock.time(), seen, r.world if r is not None else None, gone)
            except Exception as e:  # noqa: BLE001 - a failing target must never take the duty down
                self._problem(f"cannot write the run-wide records: {e}")

    def _still_stepping(self) -> bool:
        """Our training stepped within half of silent_after: its collectives answer, so every peer's
        training is alive, and a silent node is its supervisor (down, restarting), not its run."""
        try:
            since = self._since_step()
        except Exception:  # noqa: BLE001 - no figure: the heartbeats alone decide
            log.exception("cluster_since_step_failed")
            return False
        return since is not None and since < self.cfg.silent_after / 2

    def beat_soon(self) -> None:
        """The training ended: the next poll (within seconds) tells the other nodes, so a node whose
        run finished is never taken for a lost one before its machine stops."""
        self._last_write = None

    def _beat(self, training: str, run: int) -> None:
        self._seq += 1
        held = self._held_now()
        r = self._ranks_now()
        if self._records is not None and held.scanned:
            self._records.saw([u for u, _ in held.units], self.clock.monotonic())
        doc = cn.beat_doc(cn.Beat(self.ident.rank, self.hostname, self._seq, self._boot, self.clock.time(), training,
                                  run, self.ident.run_id, tuple(u for u, _ in held.units) if held.scanned else None,
                                  {u: d for u, d in held.units if d}, tuple(self._lost_units),
                                  r.world if r is not None else None,
                                  tuple((a, b) for a, b in spans(r.mine)) if r is not None and r.mine is not None
                                  else None), self.key)
        try:
            self.target.write_object(cn.beat_key(self.ident.rank), doc)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - a failing target must never take the duty down
            self._problem(f"cannot write this node's heartbeat: {e}")

    def _held_now(self) -> Held:
        """The engine's answer (a plain list of names from an older caller: their parts unverified),
        with this node's lost units kept: a unit lost before it was sent stays lost for the run,
        across restarts, until the node holds it again verified."""
        try:
            got = self._holds()
        except Exception:  # noqa: BLE001 - the engine's view is a courtesy: a heartbeat goes out anyway
            log.exception("cluster_holds_failed")
            return Held(False)
        held = got if isinstance(got, Held) else Held(True, tuple((u, "") for u in got[: cn.HOLDS_MAX]))
        verified = {u for u, d in held.units if d}
        lost = [u for u in dict.fromkeys([*held.lost, *self._lost_units]) if u not in verified]
        lost = sorted(lost, key=unit_order, reverse=True)[: cn.LOST_MAX]
        if lost != self._lost_units:
            self._lost_units = lost
            if self._state is not None:
                try:
                    self._state.save(LOST_STATE, {"run_id": self.ident.run_id, "lost": lost})
                except OSError:
                    pass  # kept in memory; the state store says it is unsaved
        return held

    def _ranks_now(self) -> Ranks | None:
        try:
            return self._ranks()
        except Exception:  # noqa: BLE001 - not known: the heartbeat says so
            log.exception("cluster_ranks_failed")
            return None

    def _read_all(self) -> tuple[dict[int, cn.Beat | None], bool]:
        from supervisor.store.base import reader

        others = [r for r in range(self.ident.nodes) if r != self.ident.rank]
        read = reader(self.target)

        def one(rank: int) -> cn.Beat | None:
            data = read.read_file(cn.beat_key(rank))
            if data is None:
                return None
            beat = cn.parse_beat(data, rank, self.key)
            if beat.run_id != self.ident.run_id:  # another run's, left on this prefix
                raise cn.Unreadable(f"node {rank}'s heartbeat is another run's ({beat.run_id[:80]!r})")
            return beat

        out: dict[int, cn.Beat | None] = {}
        ok = True
        for rank, fut in [(r, self._pool.submit(one, r)) for r in others]:
            try:
                out[rank] = fut.result()
                self._problems.pop(rank, None)
            except ValueError as e:  # Unreadable, Forged: that node's file, never the target failing
                out[rank] = None
                self._bad_beat(rank, e)
            except Exception as e:  # noqa: BLE001 - a target error: nobody is judged lost meanwhile
                ok = False
                self._problem(f"cannot read node {rank}'s heartbeat: {e}")
        if ok:
            self.error = ""
        return out, ok

    def _bad_beat(self, rank: int, e: ValueError) -> None:
        text = str(e)[:300]
        if self._problems.get(rank) != text:
            log.warning("cluster_heartbeat_not_taken", rank=rank, error=text)
        self._problems[rank] = text
        if isinstance(e, cn.Forged) and rank not in self._forged_told:
            self._forged_told.add(rank)
            self.alerts.fire(f"cluster:forged:{rank}", "cluster_forged", "critical",
                             f"a heartbeat of node {rank} is not signed with the run's key",
                             f"Run {self.ident.run_id or '(unnamed)'}: {text}.\nIt is ignored: node {rank} counts as "
                             "not heard from. Someone other than the run's nodes can write the sync target, or node "
                             f"{rank} runs with another cluster.key_file.\n")

    def _problem(self, text: str) -> None:
        if text != self.error:
            log.warning("cluster_target_failed", error=text)
        self.error = text

    # --- a node lost, a node back ---------------------------------------------------------------
    def _on_lost(self, v: cn.NodeView, training_alive: bool) -> None:
        who = f"node {v.rank}" + (f" ({v.host})" if v.host else "")
        acting = self.cfg.on_node_lost == "save_and_stop" and training_alive
        if acting:
            then = ("This node saves what is complete, ends its training (it waits in a collective for the lost "
                    "ranks), makes the final verified sync and stops the machine.")
        elif self.cfg.on_node_lost == "alert":
            then = 'cluster.on_node_lost = "alert": nothing is stopped.'
        else:
            then = "This node's training is not running: nothing is stopped."
        body = (f"Run {self.ident.run_id or '(unnamed)'}: {who} is lost: {v.why}.\n"
                f"This is node {self.ident.rank} ({self.hostname}) of {self.ident.nodes}.\n{then}\n")
        log.error("cluster_node_lost", rank=v.rank, host=v.host, why=v.why, acting=acting)
        self.alerts.fire(f"cluster:lost:{v.rank}", "node_lost", "critical", f"{who} of the run lost", body)
        if acting:
            self._asked = True
            self._stop("node_lost", f"{who} was lost ({v.why})")

    def _on_held(self, v: cn.NodeView) -> None:
        who = f"node {v.rank}" + (f" ({v.host})" if v.host else "")
        log.warning("cluster_node_silent_run_steps", rank=v.rank, host=v.host, why=v.why)
        self.alerts.fire(f"cluster:silent:{v.rank}", "node_silent", "warning", f"{who}'s supervisor is silent",
                         f"Run {self.ident.run_id or '(unnamed)'}: {who} is not heard from ({v.why}), yet this run "
                         "still steps, so its training is alive: its train-supervisor is down or cannot reach the "
                         "target, and that node's checkpoints may not be leaving it. Nothing is stopped while the "
                         "run steps; if it stops stepping, the node counts as lost.\n")

    def _on_back(self, v: cn.NodeView) -> None:
        log.warning("cluster_node_back", rank=v.rank, host=v.host, state=v.state)
        self.alerts.resolve(f"cluster:lost:{v.rank}")
        if self._asked and not self._lost:
            self._asked = False
            self._withdraw("node_lost")

    # --- status ---------------------------------------------------------------------------------
    def trust(self) -> dict:
        """Whom the cluster trusts, in words for status."""
        if self.key:
            return {"signed": True, "words": "heartbeats and run-wide records are signed with cluster.key_file; "
                                             "unsigned or wrongly signed ones are ignored"}
        why = f"cluster.key_file cannot be read ({self.key_problem}): " if self.key_problem else ""
        return {"signed": False, "words": why + UNTRUSTED}

    def status(self) -> dict:
        now_wall = self.clock.time()
        r = self._ranks_now()
        with self._lock:
            views = list(self._views)
        return {"run_id": self.ident.run_id, "rank": self.ident.rank, "target": self.display,
                "heartbeat_s": self.cfg.heartbeat, "silent_after_s": self.cfg.silent_after,
                "on_node_lost": self.cfg.on_node_lost, "error": self.error,
                "trust": self.trust(), "ranks": r.to_json() if r is not None else None,
                "records": self._records.status() if self._records is not None else None,
                "nodes": [v.to_json(now_wall) for v in views] or
                         [{"rank": r, "host": self.hostname if r == self.ident.rank else "",
                           "state": cn.OK if r == self.ident.rank else cn.SILENT, "last_seen": None,
                           "quiet_s": None, "why": ""} for r in range(self.ident.nodes)]}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in (self.target, self._records.part0 if self._records is not None else None):
            close = getattr(t, "close", None)
            if callable(close):
                close()

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("cluster", read_every(self.cfg.heartbeat), self.poll),)  # a lost node stops us

    def status_blocks(self) -> tuple[Block, ...]:
        return (ClusterBlock.of(self.status()),)


