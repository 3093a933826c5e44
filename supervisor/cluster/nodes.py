"""Which node of a run this is, what each node's heartbeat says, and which nodes are lost. Pure.

The nodes meet through the sync target: each writes `_cluster/node-<k>.json` every `heartbeat`
and reads the others'. A node is judged by what this node *saw change*, on this node's own
monotonic clock, never by the wall time the other node wrote: machines' clocks disagree, and a
skew would otherwise read as silence (or hide it).

- never heard from, or heard from but never seen to change (a heartbeat left by an earlier run on
  the same prefix): `silent`, and never lost. Only a node seen alive here can be lost.
- its heartbeat says its training finished: `finished` (a run ending normally is no lost node).
- seen alive, then unchanged for `silent_after` while this node's own reads worked: `lost`. After
  this node could not read the target, every node gets a fresh `silent_after` from the first read
  that worked again (a store outage that both sides saw is not a lost node).
- its training FAILED and stayed failed for `silent_after` while ours runs: `lost` too (its ranks are
  gone; ours wait in a collective for them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.config.cluster import PART_PREFIX, Identity
from supervisor.untrusted import Unreadable, int_or_none, json_object

CLUSTER_FOLDER = "_cluster"
BEAT_MAX = 64 << 10  # bytes: a heartbeat larger than this is not one of ours
HOLDS_MAX = 64        # unit names a heartbeat lists (the newest)

OK, SILENT, LOST, FINISHED = "ok", "silent", "lost", "finished"


def quiet_limit(heartbeat: float) -> float:
    """Quiet longer than this (two heartbeats missed) and a node is `silent`."""
    return 2 * heartbeat + 1


def beat_key(rank: int) -> str:
    return f"{CLUSTER_FOLDER}/{PART_PREFIX}{rank}.json"


@dataclass(frozen=True)
class Beat:
    rank: int
    host: str
    seq: int          # +1 per heartbeat written by this daemon
    boot: str         # the daemon's start (boot id and pid): a restarted daemon's seq starts again
    at: float         # the writer's wall time (shown, never judged)
    training: str     # the writer's training state (RUNNING, FINISHED, FAILED, ...)
    run: int = 0      # the writer's training run id
    run_id: str = ""  # the cluster run's name: another run's heartbeat on the same prefix is ignored
    holds: tuple[str, ...] = ()  # the units this node has in its watched folders (complete or not)


def beat_doc(b: Beat) -> bytes:
    return json.dumps({"rank": b.rank, "host": b.host, "seq": b.seq, "boot": b.boot, "at": round(b.at, 3),
                       "training": b.training, "run": b.run, "run_id": b.run_id,
                       "holds": list(b.holds[:HOLDS_MAX])}, separators=(",", ":")).encode()


def parse_beat(data: bytes, rank: int) -> Beat:
    """ValueError naming what is wrong with what was read as node `rank`'s heartbeat."""
    if len(data) > BEAT_MAX:
        raise Unreadable(f"node {rank}'s heartbeat is {len(data)} bytes, more than any heartbeat")
    d = json_object(data, limit=BEAT_MAX, depth=4, what=f"node {rank}'s heartbeat")
    seq, at, r = d.get("seq"), d.get("at"), d.get("rank")
    if r != rank or int_or_none(seq) is None or not isinstance(at, int | float) or isinstance(at, bool) \
            or not math.isfinite(at):
        raise Unreadable(f"node {rank}'s heartbeat lacks its rank, seq or time")
    run = d.get("run")
    return Beat(rank, str(d.get("host") or "")[:253], seq, str(d.get("boot") or "")[:80], float(at),
                str(d.get("training") or "")[:16], run if isinstance(run, int) and not isinstance(run, bool) else 0,
                str(d.get("run_id") or "")[:128], _holds(d.get("holds")))


def _holds(v: object) -> tuple[str, ...]:
    return tuple(x[:1024] for x in v[:HOLDS_MAX] if isinstance(x, str)) if isinstance(v, list) else ()


@dataclass(frozen=True)
class Seen:
    """What this node knows of another: the last heartbeat read and when, here, it changed."""

    beat: Beat | None = None
    changed: float | None = None       # this node's monotonic time when the heartbeat last changed
    alive: bool = False                # a change was seen: the node wrote while we watched
    failed_since: float | None = None  # monotonic time its training was first read as FAILED


def observe(prev: Seen | None, beat: Beat | None, now: float) -> Seen:
    """Fold one read of a node's heartbeat into what was known (None: nothing there)."""
    s = prev or Seen()
    if beat is None:
        return s
    if s.beat is not None and (beat.seq, beat.boot) == (s.beat.seq, s.beat.boot):
        return s
    failed = beat.training == "FAILED"
    return Seen(beat, now, alive=s.beat is not None or s.alive,
                failed_since=(s.failed_since if failed and s.failed_since is not None else now) if failed else None)


@dataclass(frozen=True)
class NodeView:
    rank: int
    host: str
    state: str                    # ok | silent | lost | finished
    quiet_s: float | None         # since its heartbeat last changed, as seen here (None: never)
    why: str = ""

    def to_json(self, now_wall: float) -> dict:
        return {"rank": self.rank, "host": self.host, "state": self.state,
                "last_seen": None if self.quiet_s is None else round(now_wall - self.quiet_s, 3),
                "quiet_s": None if self.quiet_s is None else round(self.quiet_s, 1), "why": self.why}


def judge(seen: Mapping[int, Seen], me: Identity, my_host: str, my_training: str, now: float,
          reads_ok_since: float | None, heartbeat: float, silent_after: float) -> list[NodeView]:
    """Every node's state, this one's included. `reads_ok_since`: the monotonic time since which
    this node's reads of the target have all worked (None: the last one failed)."""
    out = [NodeView(me.rank, my_host, FINISHED if my_training == "FINISHED" else OK, 0.0)]
    for rank in range(me.nodes):
        if rank == me.rank:
            continue
        s = seen.get(rank) or Seen()
        if s.beat is None or s.changed is None:
            out.append(NodeView(rank, "", SILENT, None, "not heard from yet"))
            continue
        b = s.beat
        quiet = now - s.changed
        # judged only over time this node could see: from the later of the change and the reads' recovery
        window = quiet if reads_ok_since is None else now - max(s.changed, reads_ok_since)
        if b.training == "FINISHED":
            out.append(NodeView(rank, b.host, FINISHED, quiet, "its training finished"))
        elif not s.alive:
            out.append(NodeView(rank, b.host, SILENT, quiet, "its heartbeat has not changed since this node first read it"))
        elif reads_ok_since is not None and window >= silent_after:
            out.append(NodeView(rank, b.host, LOST, quiet, f"not heard from for {quiet:.0f} s"))
        elif (reads_ok_since is not None and s.failed_since is not None and my_training in ("STARTING", "RUNNING")
              and now - max(s.failed_since, reads_ok_since) >= silent_after):
            out.append(NodeView(rank, b.host, LOST, quiet, "its training failed"))
        elif quiet >= quiet_limit(heartbeat):
            out.append(NodeView(rank, b.host, SILENT, quiet, f"not heard from for {quiet:.0f} s"))
        else:
            out.append(NodeView(rank, b.host, OK, quiet))
    return sorted(out, key=lambda v: v.rank)


def read_every(heartbeat: float) -> float:
    """How often the others' heartbeats are read: three times a heartbeat, at most every 5 s, so a
    lost node is seen within a few seconds of silent_after."""
    return max(0.2, min(5.0, heartbeat / 3))


def unit_whole(unit: str, nodes: int, part_done: Mapping[int, bool],
               holds: Mapping[int, frozenset[str] | None]) -> str:
    """"" when `unit` is complete on the whole run, else why not. part_done[k]: node k's part
    manifest on the target says complete. holds[k]: the units node k's heartbeat lists, from a
    heartbeat written after this unit's part here was complete (None: none such yet). A node
    that holds nothing of the unit then has no part of it (the HF Trainer saves a DDP checkpoint
    on the main process only); one that still holds it is still writing or sending it."""
    for k in range(nodes):
        if part_done.get(k):
            continue
        h = holds.get(k)
        if h is None:
            return f"node {k}'s part is not complete on the target"
        if unit in h:
            return f"node {k} still writes or sends its part"
    return "" if any(part_done.get(k) for k in range(nodes)) else "no node's part is complete"
