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

A heartbeat read again, or an older one of the same daemon (a lower seq, a boot already replaced),
is no change: replaying an old heartbeat keeps no dead node alive.

What a heartbeat says of the units (`holds`): None until the node's first scan ended (a restarted
daemon knows nothing yet, and "nothing" would read as "no part"); else the units in its watched
folders, each with the digest of its part when that part is verified on the target as it is
here; and `lost`: the units it held and lost before they were sent, kept for as long as the node
runs this run (sync/lost.py finds them; the watch keeps them across restarts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.config.cluster import PART_PREFIX, Identity
from supervisor.untrusted import Unreadable, int_or_none, json_object, signed

CLUSTER_FOLDER = "_cluster"
BEAT_MAX = 128 << 10  # bytes: a heartbeat larger than this is not one of ours
HOLDS_MAX = 64        # unit names a heartbeat lists (the newest)
LOST_MAX = 32         # lost units a heartbeat lists (the newest)
NAME_MAX = 512        # a unit name longer than this is cut (and then matches no unit)
SPANS_MAX = 64        # runs of consecutive ranks a heartbeat lists
LISTED_MAX = 1024     # units remembered as listed by a node (the names it ever held)
BOOTS_MAX = 16        # replaced daemon boots remembered per node (their heartbeats are old)
KIND = "train-supervisor-heartbeat/2"

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
    holds: tuple[str, ...] | None = ()  # the units in its watched folders (complete or not); None: not known yet
    verified: Mapping[str, str] = field(default_factory=dict)  # held unit -> its part's digest, verified on the target
    lost: tuple[str, ...] = ()          # units it held and lost before they were sent
    world: int | None = None            # the training's WORLD_SIZE as the node knows it
    ranks: tuple[tuple[int, int], ...] | None = None  # the node's global ranks, as spans (None: not known)

    def has_rank(self, r: int) -> bool | None:
        return None if self.ranks is None else any(a <= r <= b for a, b in self.ranks)


def beat_doc(b: Beat, key: bytes | None = None) -> bytes:
    holds = None if b.holds is None else [h[:NAME_MAX] for h in b.holds[:HOLDS_MAX]]
    doc = {"kind": KIND, "rank": b.rank, "host": b.host, "seq": b.seq, "boot": b.boot, "at": round(b.at, 3),
           "training": b.training, "run": b.run, "run_id": b.run_id, "holds": holds,
           "verified": {k[:NAME_MAX]: v for k, v in b.verified.items() if holds is not None and k[:NAME_MAX] in holds},
           "lost": [x[:NAME_MAX] for x in b.lost[:LOST_MAX]], "world": b.world,
           "ranks": None if b.ranks is None else [list(s) for s in b.ranks[:SPANS_MAX]]}
    return json.dumps(signed.seal(key, KIND, doc), separators=(",", ":")).encode()


class Forged(Unreadable):
    """A heartbeat or record that is not signed with this run's key (cluster.key_file)."""


def parse_beat(data: bytes, rank: int, key: bytes | None = None) -> Beat:
    """Unreadable (a ValueError) naming what is wrong with what was read as node `rank`'s
    heartbeat; Forged when a key is set and it is not signed with it."""
    if len(data) > BEAT_MAX:
        raise Unreadable(f"node {rank}'s heartbeat is {len(data)} bytes, more than any heartbeat")
    d = json_object(data, limit=BEAT_MAX, depth=4, what=f"node {rank}'s heartbeat")
    why = signed.check(key, KIND, d)
    if why:
        raise Forged(f"node {rank}'s heartbeat is {why}")
    seq, at, r = d.get("seq"), d.get("at"), d.get("rank")
    if r != rank or int_or_none(seq) is None or not isinstance(at, int | float) or isinstance(at, bool) \
            or not math.isfinite(at):
        raise Unreadable(f"node {rank}'s heartbeat lacks its rank, seq or time")
    run = d.get("run")
    holds = None if "holds" in d and d["holds"] is None else _names(d.get("holds"), HOLDS_MAX)
    ver = d.get("verified")
    verified = {k: v[:64] for k, v in list(ver.items())[:HOLDS_MAX] if isinstance(v, str) and v} \
        if isinstance(ver, dict) and holds is not None else {}
    return Beat(rank, str(d.get("host") or "")[:253], int(seq), str(d.get("boot") or "")[:80], float(at),
                str(d.get("training") or "")[:16], run if isinstance(run, int) and not isinstance(run, bool) else 0,
                str(d.get("run_id") or "")[:128], holds, verified, _names(d.get("lost"), LOST_MAX),
                int_or_none(d.get("world"), lo=1, hi=1_000_000), _spans(d.get("ranks")))


def _names(v: object, most: int) -> tuple[str, ...]:
    return tuple(x[:NAME_MAX] for x in v[:most] if isinstance(x, str)) if isinstance(v, list) else ()


def _spans(v: object) -> tuple[tuple[int, int], ...] | None:
    if not isinstance(v, list):
        return None
    out = []
    for s in v[:SPANS_MAX]:
        if not (isinstance(s, list) and len(s) == 2):
            return None
        a, b = int_or_none(s[0], hi=1_000_000), int_or_none(s[1], hi=1_000_000)
        if a is None or b is None or b < a:
            return None
        out.append((a, b))
    return tuple(out)


@dataclass(frozen=True)
class Seen:
    """What this node knows of another: the last heartbeat read and when, here, it changed."""

    beat: Beat | None = None
    changed: float | None = None       # this node's monotonic time when the heartbeat last changed
    alive: bool = False                # a change was seen: the node wrote while we watched
    failed_since: float | None = None  # monotonic time its training was first read as FAILED
    known_since: float | None = None   # monotonic time of the first heartbeat of its current daemon
                                       # that said what it holds (its first scan over)
    listed: frozenset[str] = frozenset()  # every unit a heartbeat of it listed, as read here
    old_boots: tuple[str, ...] = ()    # its daemon boots since replaced: their heartbeats are stale


def observe(prev: Seen | None, beat: Beat | None, now: float) -> Seen:
    """Fold one read of a node's heartbeat into what was known (None: nothing there)."""
    s = prev or Seen()
    if beat is None or beat.boot in s.old_boots:
        return s
    old = s.beat
    if old is not None and beat.boot == old.boot and beat.seq <= old.seq:
        return s  # the same heartbeat, or an older one of the same daemon (a replay)
    boots = s.old_boots
    new_boot = old is not None and beat.boot != old.boot
    if new_boot:
        boots = (*s.old_boots, old.boot)[-BOOTS_MAX:]
    known = s.known_since if not new_boot and s.known_since is not None else None
    if beat.holds is not None and known is None:
        known = now
    listed = s.listed | frozenset(beat.holds or ()) | frozenset(beat.lost)
    if len(listed) > LISTED_MAX:
        listed = frozenset(sorted(listed)[-LISTED_MAX:])
    failed = beat.training == "FAILED"
    return Seen(beat, now, alive=old is not None or s.alive,
                failed_since=(s.failed_since if failed and s.failed_since is not None else now) if failed else None,
                known_since=known, listed=listed, old_boots=boots)


@dataclass(frozen=True)
class NodeView:
    rank: int
    host: str
    state: str                    # ok | silent | lost | finished
    quiet_s: float | None         # since its heartbeat last changed, as seen here (None: never)
    why: str = ""
    problem: str = ""             # its heartbeat file is unreadable or forged: that node's problem

    def to_json(self, now_wall: float) -> dict:
        return {"rank": self.rank, "host": self.host, "state": self.state,
                "last_seen": None if self.quiet_s is None else round(now_wall - self.quiet_s, 3),
                "quiet_s": None if self.quiet_s is None else round(self.quiet_s, 1), "why": self.why,
                "problem": self.problem}


def judge(seen: Mapping[int, Seen], me: Identity, my_host: str, my_training: str, now: float,
          reads_ok_since: float | None, heartbeat: float, silent_after: float,
          problems: Mapping[int, str] | None = None) -> list[NodeView]:
    """Every node's state, this one's included. `reads_ok_since`: the monotonic time since which
    this node's reads of the target have all worked (None: the last one failed). `problems`: a
    node's heartbeat that could not be taken (unreadable, forged): named on that node alone."""
    problems = problems or {}
    out = [NodeView(me.rank, my_host, FINISHED if my_training == "FINISHED" else OK, 0.0)]
    for rank in range(me.nodes):
        if rank == me.rank:
            continue
        p = problems.get(rank, "")
        s = seen.get(rank) or Seen()
        if s.beat is None or s.changed is None:
            out.append(NodeView(rank, "", SILENT, None, "not heard from yet", p))
            continue
        b = s.beat
        quiet = now - s.changed
        # judged only over time this node could see: from the later of the change and the reads' recovery
        window = quiet if reads_ok_since is None else now - max(s.changed, reads_ok_since)
        if b.training == "FINISHED":
            out.append(NodeView(rank, b.host, FINISHED, quiet, "its training finished", p))
        elif not s.alive:
            out.append(NodeView(rank, b.host, SILENT, quiet, "its heartbeat has not changed since this node first read it", p))
        elif reads_ok_since is not None and window >= silent_after:
            out.append(NodeView(rank, b.host, LOST, quiet, f"not heard from for {quiet:.0f} s", p))
        elif (reads_ok_since is not None and s.failed_since is not None and my_training in ("STARTING", "RUNNING")
              and now - max(s.failed_since, reads_ok_since) >= silent_after):
            out.append(NodeView(rank, b.host, LOST, quiet, "its training failed", p))
        elif quiet >= quiet_limit(heartbeat):
            out.append(NodeView(rank, b.host, SILENT, quiet, f"not heard from for {quiet:.0f} s", p))
        else:
            out.append(NodeView(rank, b.host, OK, quiet, "", p))
    return sorted(out, key=lambda v: v.rank)


def read_every(heartbeat: float) -> float:
    """How often the others' heartbeats are read: three times a heartbeat, at most every 5 s, so a
    lost node is seen within a few seconds of silent_after."""
    return max(0.2, min(5.0, heartbeat / 3))


@dataclass(frozen=True)
class Part:
    """What rank 0 knows of node k's part of one unit when it decides on the run-wide record."""

    digest: str = ""              # its part manifest on the target says complete: the files' digest; "" not
    beat: Beat | None = None      # its newest heartbeat (None: never heard from)
    fresh: bool = False           # that heartbeat came after rank 0's own part was complete (and a heartbeat more)
    watched_before: bool = False  # its current daemon said what it holds before the unit appeared on rank 0
    listed: bool = False          # a heartbeat of it ever listed the unit
    lost: bool = False            # the node is lost: its files can change no more, its manifest is its last word


def unit_whole(unit: str, nodes: int, parts: Mapping[int, Part]) -> tuple[str, dict[int, str]]:
    """("", every node's part digest or "none") when `unit` is whole on the run, else (why not, {}).

    A node's part counts when its manifest on the target says complete and the node does not say
    it holds other files of it now (its heartbeat names the unit with no verified digest, or
    another one: still writing or sending), unless the node is lost (its files change no more). A node with no part counts as "none" only when it
    never held the unit: it does not hold it now, never listed it, did not lose it, said so in a
    heartbeat after rank 0's part was complete, and its daemon was watching since before the unit
    appeared (a daemon that started later, or a first heartbeat before its first scan, knows
    nothing of what was there before)."""
    out: dict[int, str] = {}
    for k in range(nodes):
        p = parts.get(k) or Part()
        b = p.beat
        if b is not None and unit in b.lost:
            return f"node {k} lost its part before it was sent (deleted locally, e.g. by the trainer's rotation)", {}
        if p.digest:
            if (b is not None and b.holds is not None and unit in b.holds and b.verified.get(unit) != p.digest
                    and not p.lost):
                return f"node {k} still writes or sends its part (its files differ from its manifest on the target)", {}
            out[k] = p.digest
            continue
        if b is None:
            return f"node {k}'s part is not complete on the target (node {k} not heard from)", {}
        if b.holds is None:
            return f"node {k}'s part is not complete on the target, and node {k} has not finished its first scan (holds: unknown)", {}
        if unit in b.holds:
            return f"node {k} still writes or sends its part", {}
        if p.listed:
            return f"node {k} held a part and it is not complete on the target (lost before it was sent?)", {}
        if not p.fresh:
            return f"node {k}'s part is not complete on the target", {}
        if not p.watched_before:
            return (f"node {k} holds no part, but its daemon started after the unit was saved: whether it ever "
                    "held one is not known"), {}
        out[k] = "none"
    if all(d == "none" for d in out.values()):
        return "no node's part is complete", {}
    return "", out
