"""The run-wide records (rank 0's duty): `_cluster/<unit>.json` for each unit of rank 0's part that
every node's part makes whole, signed with the run's key when it has one.

A record is written only when every node's part is verified on the target as that node holds it
now, or the node provably never held any of it (cluster/nodes.unit_whole), and the union of the
parts holds every rank's files and the files only one rank writes (sync/parts.covers). Anything
else waits, and `waiting` says why per unit (status). Everything read from the target goes through
the untrusted readers: a record or manifest that is not one is no record, never an error of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from supervisor.cluster import nodes as cn
from supervisor.saves import parts
from supervisor.timefmt import utc_stamp

if TYPE_CHECKING:
    from supervisor.config.cluster import Identity

log = structlog.get_logger("cluster")

RECORDS_PENDING = 4  # unrecorded units of this part looked at per round: the 2 newest and 2 older in turn
RECORDS_DEPTH = 32   # unrecorded units (newest first) the older turns go through
RECORDS_KEPT = 256   # recorded units remembered (older ones are never looked at again)
APPEARED_KEPT = 512  # units whose first sighting here is remembered


class RunRecords:
    """part0: rank 0's own part (its target); run: the run's prefix (the heartbeats and records)."""

    def __init__(self, ident: Identity, part0: object, run: object, key: bytes | None, heartbeat: float):
        self.ident = ident
        self.part0 = part0
        self.run = run
        self.key = key
        self.heartbeat = heartbeat
        self.recorded: list[str] = []
        self.waiting: dict[str, str] = {}
        self._complete_here: dict[str, float] = {}  # unit -> when its part here was first read complete
        self._appeared: dict[str, float] = {}        # unit -> when it was first seen here (held or complete)
        self._turn = 0

    def saw(self, units: list[str], now: float) -> None:
        """The units rank 0 holds now (its heartbeat's list): when each first appeared here."""
        for u in units:
            self._appeared.setdefault(u, now)
        while len(self._appeared) > APPEARED_KEPT:
            self._appeared.pop(next(iter(self._appeared)))

    def write(self, now: float, wall: float, seen: Mapping[int, cn.Seen], world: int | None,
              lost: frozenset[int] = frozenset()) -> None:
        """The newest RECORDS_PENDING unrecorded units of this part, each recorded once whole.
        now: this node's monotonic time; wall: its wall time (the record's created_at)."""
        from supervisor.store.base import reader
        from supervisor.sync.policy import MANIFEST_NAME, PROBE_FOLDER
        from supervisor.training.checkpoints import unit_order

        tail = "/" + MANIFEST_NAME
        base = getattr(self.part0, "base", None)
        if isinstance(base, Path) and not base.exists():
            return  # a folder target: nothing of this part uploaded yet
        own = [k[: -len(tail)] for k in reader(self.part0).list_keys()
               if k.endswith(tail) and not k.startswith(PROBE_FOLDER)]
        own.sort(key=unit_order, reverse=True)
        read = reader(self.run).read_file
        unrecorded = [u for u in own if u not in self.recorded][:RECORDS_DEPTH]
        # the newest, and older ones in turn: newer units a lost node never finished must not keep an
        # older one it did finish from its record
        rest = unrecorded[2:]
        self._turn = (self._turn + 2) % len(rest) if rest else 0
        todo = unrecorded[:2] + (rest[self._turn:] + rest[:self._turn])[: RECORDS_PENDING - 2]
        self.waiting = {u: w for u, w in self.waiting.items() if u in unrecorded}
        for unit in todo:
            rec, bad = parts.read_record(read(parts.record_key(unit)), unit, self.ident.nodes, self.key)
            if rec is not None:
                self.recorded.append(unit)  # written before this daemon started
                continue
            if bad:
                log.warning("cluster_record_not_ours", unit=unit, why=bad)  # written again below, when whole
            found = {k: parts.part_files(read(parts.part_manifest(k, unit))) for k in range(self.ident.nodes)}
            if not found[0][0]:
                continue
            since = self._complete_here.setdefault(unit, now)
            appeared = min(self._appeared.get(unit, since), since)
            views = {k: self._part(k, found[k][0], seen.get(k), since, appeared, unit, k in lost)
                     for k in range(self.ident.nodes)}
            why, digests = cn.unit_whole(unit, self.ident.nodes, views)
            if not why:
                why = parts.covers({k: f for k, (d, f) in found.items() if d}, self._world(world, seen))
                if why:
                    why = f"the nodes' parts together lack {why}"
            if not why:
                why = self._rank0_part(seen, digests)
            if why:
                self.waiting[unit] = why
                continue
            doc = parts.record_doc(unit, self.ident.run_id, digests, utc_stamp(wall), self.key)
            self.run.write_object(parts.record_key(unit), doc)  # type: ignore[attr-defined]
            log.info("cluster_unit_recorded", unit=unit, nodes=self.ident.nodes,
                     without_part=[k for k, d in digests.items() if d == parts.NONE])
            self.recorded.append(unit)
            self.waiting.pop(unit, None)
            self._complete_here.pop(unit, None)
        del self.recorded[:-RECORDS_KEPT]

    def _part(self, k: int, digest: str, s: cn.Seen | None, since: float, appeared: float, unit: str,
              lost: bool) -> cn.Part:
        if k == self.ident.rank:
            return cn.Part(digest)  # this node's own part: its manifest says complete
        s = s or cn.Seen()
        return cn.Part(digest, s.beat, fresh=s.changed is not None and s.changed > since + self.heartbeat,
                       watched_before=s.known_since is not None and s.known_since < appeared,
                       listed=unit in s.listed, lost=lost)

    @staticmethod
    def _world(world: int | None, seen: Mapping[int, cn.Seen]) -> int | None:
        """The training's world size as the nodes know it (the largest any says)."""
        worlds = [w for w in [world, *(s.beat.world for s in seen.values() if s.beat is not None)] if w]
        return max(worlds) if worlds else None

    def _rank0_part(self, seen: Mapping[int, cn.Seen], digests: dict[int, str]) -> str:
        """Global rank 0 writes a file of every format's save (model states, .metadata, a tracker,
        trainer_state.json): the node that runs it must have a part."""
        for k, s in seen.items():
            if s.beat is not None and s.beat.has_rank(0) and digests.get(k) == parts.NONE:
                return f"node {k} runs global rank 0 and has no part"
        return ""

    def status(self) -> dict:
        return {"recorded": list(reversed(self.recorded[-5:])),
                "waiting": [{"unit": u, "why": w} for u, w in list(self.waiting.items())[:5]]}

