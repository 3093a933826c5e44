"""The `cluster` block (cluster/watch.py): one run on several machines, null on one machine."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.status import Block, Record, View


@dataclass
class Node(Record):
    rank: int | None = None
    host: str | None = None
    state: str | None = None
    last_seen: float | None = None
    quiet_s: float | None = None
    why: str | None = None
    problem: str | None = None


@dataclass
class Trust(Record):
    signed: bool | None = None
    words: str | None = None


@dataclass
class RecordWait(Record):
    unit: str | None = None
    why: str | None = None


@dataclass
class Records(Record):
    recorded: list[object] = field(default_factory=list)
    waiting: list[RecordWait] = field(default_factory=list)


@dataclass
class ClusterBlock(Block):
    KEY = "cluster"
    run_id: str | None = None
    rank: int | None = None
    target: str | None = None
    heartbeat_s: float | None = None
    silent_after_s: float | None = None
    on_node_lost: str | None = None
    error: str | None = None
    trust: Trust | None = None
    ranks: object = None
    records: Records | None = None
    nodes: list[Node] = field(default_factory=list)

    def lines(self, view: View) -> list[str]:
        """A line for the run, then one per node (a run of several machines only)."""
        if not self.filled:
            return []
        lost = self.on_node_lost == "save_and_stop"
        out = [f"cluster   run {self.run_id or '?'}: node {self.rank} of {len(self.nodes)}, heartbeats every "
               f"{self.heartbeat_s or 0:g}s on {self.target}; a node silent {self.silent_after_s or 0:g}s is lost"
               f" ({'save and stop' if lost else 'alert only'})"]
        if self.error:
            out.append(f"  target    {self.error}")
        if self.trust is not None and self.trust.filled and not self.trust.signed:
            out.append(f"  trust     {self.trust.words}")
        for n in self.nodes:
            quiet = n.quiet_s
            me = n.rank == self.rank
            seen = "" if me else " never heard from" if quiet is None else f" heard {quiet:g}s ago"
            why = f": {n.why}" if n.why and n.state != "ok" else ""
            bad = f"; its heartbeat file: {n.problem}" if n.problem else ""
            out.append(f"  node {n.rank!s:<3} {n.state or '?':<8} {n.host or '?'}{' (this node)' if me else ''}"
                       f"{seen}{why}{bad}")
        for w in (self.records.waiting if self.records is not None else [])[:3]:
            out.append(f"  waiting   {w.unit}: {w.why}")
        return out
