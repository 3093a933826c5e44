"""The heartbeat duty of a run on several machines: write this node's heartbeat to the sync target,
read the others', and when one is lost, alert and (on_node_lost = "save_and_stop") ask the one
stop door for a `node_lost` stop while this node's training runs: the stop interrupts the hung
training (SIGINT, SIGTERM, SIGKILL, HUNG_GRACE_S apart), makes the final verified sync, and stops
the machine. A node that comes back before the stop acts withdraws the reason.

No server of our own: S3, rsync over SSH and a shared folder all carry the heartbeats. Every read
and write is bounded by the target's own timeouts; a target that fails here is told in status and
judges nobody lost (nodes.judge)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from supervisor.cluster import nodes as cn
from supervisor.cluster.nodes import read_every
from supervisor.config.cluster import Identity
from supervisor.interfaces import Duty
from supervisor.states import TRAINING_ALIVE
from supervisor.timefmt import utc_stamp

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import ClusterConfig, Config
    from supervisor.interfaces import TrainingView
    from supervisor.notify.alerts import Alerts
    from supervisor.stop.runner import StopRunner

log = structlog.get_logger("cluster")

READ_THREADS = 8     # heartbeats read at once: 64 nodes in 8 round trips
RECORDS_PENDING = 4  # unrecorded units of this part looked at per round, newest first
RECORDS_KEPT = 256   # recorded units remembered (older ones are never looked at again)


class ClusterWatch:
    def __init__(self, cfg: ClusterConfig, ident: Identity, target: object, training: TrainingView,
                 alerts: Alerts, clock: Clock, hostname: str, *, stop: Callable[[str, str], bool],
                 withdraw: Callable[[str], None], display: str = "", holds: Callable[[], list[str]] | None = None,
                 part0: object | None = None, since_step: Callable[[], float | None] | None = None):
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
        self._reads_ok_since: float | None = None
        self._views: list[cn.NodeView] = []
        self._lost: set[int] = set()
        self._held: set[int] = set()   # lost by their heartbeats, yet this run still steps
        self._asked = False
        self.error = ""
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="cluster-read")
        self._holds = holds or (lambda: [])
        # seconds since this node's training last stepped (None: not known): a run that still steps
        # has lost no peer (its collectives would block), whatever a silent supervisor says
        self._since_step = since_step or (lambda: None)
        # rank 0 writes the run-wide records: its own part's units, each once every node's part is whole
        self._part0 = part0
        self._last_records: float | None = None
        self._recorded: list[str] = []
        self._complete_here: dict[str, float] = {}   # unit -> when its part here was first read complete
        self._records_waiting: dict[str, str] = {}

    @classmethod
    def of(cls, cfg: Config, run_target: str, training: TrainingView, alerts: Alerts, clock: Clock, hostname: str,
           stops: StopRunner, holds: Callable[[], list[str]], target_at: Callable[[str], object],
           since_step: Callable[[], float | None] | None = None) -> ClusterWatch:
        """The watch for the run's own prefix (the heartbeats sit beside the nodes' parts);
        `target_at` builds a target for a place on the store (the sync engine's sibling_target)."""
        from supervisor.syncurl import parse_target

        c = cfg.cluster
        ident = Identity(c.nodes, c.rank or 0, c.run_id)
        part0 = target_at(cfg.sync.target) if ident.rank == 0 else None
        return cls(c, ident, target_at(run_target), training, alerts, clock, hostname, stop=stops.request,
                   withdraw=stops.withdraw, display=parse_target(run_target).display(), holds=holds, part0=part0,
                   since_step=since_step)

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
                                   self._reads_ok_since, self.cfg.heartbeat, self.cfg.silent_after)
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
        if self._part0 is not None and (self._last_records is None or
                                        now - self._last_records >= max(2 * self.cfg.heartbeat, 2.0)):
            self._last_records = now
            try:
                self._write_records(now)
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
        try:
            holds = tuple(self._holds()[: cn.HOLDS_MAX])
        except Exception:  # noqa: BLE001 - the engine's view is a courtesy: a heartbeat goes out anyway
            log.exception("cluster_holds_failed")
            holds = ()
        doc = cn.beat_doc(cn.Beat(self.ident.rank, self.hostname, self._seq, self._boot, self.clock.time(), training,
                                  run, self.ident.run_id, holds))
        try:
            self.target.write_object(cn.beat_key(self.ident.rank), doc)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - a failing target must never take the duty down
            self._problem(f"cannot write this node's heartbeat: {e}")

    def _read_all(self) -> tuple[dict[int, cn.Beat | None], bool]:
        from supervisor.sync.targets.base import reader

        others = [r for r in range(self.ident.nodes) if r != self.ident.rank]
        read = reader(self.target)

        def one(rank: int) -> cn.Beat | None:
            data = read.read_file(cn.beat_key(rank))
            if data is None:
                return None
            beat = cn.parse_beat(data, rank)
            return beat if beat.run_id == self.ident.run_id else None  # another run's, left on this prefix

        out: dict[int, cn.Beat | None] = {}
        ok = True
        for rank, fut in [(r, self._pool.submit(one, r)) for r in others]:
            try:
                out[rank] = fut.result()
            except ValueError as e:
                out[rank] = None
                log.warning("cluster_heartbeat_unreadable", rank=rank, error=str(e))
            except Exception as e:  # noqa: BLE001 - a target error: nobody is judged lost meanwhile
                ok = False
                self._problem(f"cannot read node {rank}'s heartbeat: {e}")
        if ok:
            self.error = ""
        return out, ok

    def _problem(self, text: str) -> None:
        if text != self.error:
            log.warning("cluster_target_failed", error=text)
        self.error = text

    # --- the run-wide records (rank 0) -----------------------------------------------------------
    def _write_records(self, now: float) -> None:
        """`_cluster/<unit>.json` for each unit of this part that every node's part makes whole
        (sync.parts); the newest RECORDS_PENDING unrecorded units are looked at each round."""
        from supervisor.sync import parts
        from supervisor.sync.policy import MANIFEST_NAME, PROBE_FOLDER
        from supervisor.sync.targets.base import reader
        from supervisor.training.checkpoints import unit_order

        tail = "/" + MANIFEST_NAME
        base = getattr(self._part0, "base", None)
        if isinstance(base, Path) and not base.exists():
            return  # a folder target: nothing of this part uploaded yet
        own = [k[: -len(tail)] for k in reader(self._part0).list_keys()
               if k.endswith(tail) and not k.startswith(PROBE_FOLDER)]
        own.sort(key=unit_order, reverse=True)
        read = reader(self.target).read_file
        todo = [u for u in own if u not in self._recorded][:RECORDS_PENDING]
        self._records_waiting = {u: w for u, w in self._records_waiting.items() if u in todo}
        for unit in todo:
            if parts.record_names_all(read(parts.record_key(unit)), unit, self.ident.nodes):
                self._recorded.append(unit)  # written before this daemon started
                continue
            digests = {k: parts.part_digest(read(parts.part_manifest(k, unit))) for k in range(self.ident.nodes)}
            if not digests[0]:
                continue
            since = self._complete_here.setdefault(unit, now)
            with self._lock:
                holds = {k: frozenset(s.beat.holds) if s.beat is not None and s.changed is not None
                         and s.changed > since + self.cfg.heartbeat else None for k, s in self._seen.items()}
            why = cn.unit_whole(unit, self.ident.nodes, {k: bool(d) for k, d in digests.items()}, holds)
            if why:
                self._records_waiting[unit] = why
                continue
            doc = parts.record_doc(unit, self.ident.run_id, {k: d or "none" for k, d in digests.items()},
                                   utc_stamp(self.clock.time()))
            self.target.write_object(parts.record_key(unit), doc)  # type: ignore[attr-defined]
            log.info("cluster_unit_recorded", unit=unit, nodes=self.ident.nodes,
                     without_part=[k for k, d in digests.items() if not d])
            self._recorded.append(unit)
            self._records_waiting.pop(unit, None)
            self._complete_here.pop(unit, None)
        del self._recorded[:-RECORDS_KEPT]

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
    def status(self) -> dict:
        now_wall = self.clock.time()
        with self._lock:
            views = list(self._views)
        return {"run_id": self.ident.run_id, "rank": self.ident.rank, "target": self.display,
                "heartbeat_s": self.cfg.heartbeat, "silent_after_s": self.cfg.silent_after,
                "on_node_lost": self.cfg.on_node_lost, "error": self.error,
                "records": {"recorded": list(reversed(self._recorded[-5:])),
                            "waiting": [{"unit": u, "why": w} for u, w in list(self._records_waiting.items())[:5]]}
                if self._part0 is not None else None,
                "nodes": [v.to_json(now_wall) for v in views] or
                         [{"rank": r, "host": self.hostname if r == self.ident.rank else "",
                           "state": cn.OK if r == self.ident.rank else cn.SILENT, "last_seen": None,
                           "quiet_s": None, "why": ""} for r in range(self.ident.nodes)]}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in (self.target, self._part0):
            close = getattr(t, "close", None)
            if callable(close):
                close()

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("cluster", read_every(self.cfg.heartbeat), self.poll),)  # a lost node stops us

    def status_blocks(self) -> dict[str, object]:
        return {"cluster": self.status()}

