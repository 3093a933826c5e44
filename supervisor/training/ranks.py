"""Which ranks the training runs, and which of them run on this node: what torchrun, accelerate and
the deepspeed launcher put in each worker's environment (WORLD_SIZE, RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK), read from /proc of the job's own processes (the daemon started
them); the config's sync.world_size and [cluster] stand in where the workers do not say.

A node of a multi-node run writes only its own ranks' shards to a node-local disk: its part of a
checkpoint is complete when *its* ranks' files are there, never all WORLD_SIZE of them. `settle`
(pure) joins what was read with the config; `read` is the /proc shell."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ENVIRON_MAX = 1 << 20   # a process environment larger than this is not read
CMDLINE_MAX = 4096
RANK_MAX = 1_000_000
# A launcher starts the workers a moment after itself: while only it runs, nothing is known yet
# (its own environment has no WORLD_SIZE, and a plain run's "one process" would be wrong).
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate", "deepspeed",
             "mpirun", "mpiexec", "srun", "composer", "tune", "nemo", "lightning")
_VARS = (b"WORLD_SIZE", b"RANK", b"LOCAL_RANK", b"LOCAL_WORLD_SIZE", b"LOCAL_SIZE", b"GROUP_RANK",
         b"NODE_RANK")


@dataclass(frozen=True)
class Ranks:
    """The training's ranks as far as they are known."""

    world: int | None = None               # the whole run's WORLD_SIZE (None: not known)
    mine: frozenset[int] | None = None     # the global ranks of this node's workers (None: not known)
    source: str = ""                       # where they came from, for people
    waiting: str = ""                      # what is awaited while `mine` or `world` is not known
    nodes: int = 1                         # the run's nodes: with one, global rank 0 is here whatever the world

    def to_json(self) -> dict:
        return {"world_size": self.world, "ranks": spans(self.mine) if self.mine is not None else None,
                "source": self.source, "waiting_for": self.waiting}


@dataclass(frozen=True)
class Worker:
    """One process's launch variables (None where it was not given)."""

    world: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    local_world: int | None = None
    node: int | None = None
    launcher: bool = False
    launched: bool = False   # it was given a launch variable at all (a value that was not a number included)


def spans(ranks: Iterable[int]) -> list[list[int]]:
    """[[first, last], ...] of consecutive ranks: a node's 8 ranks are one pair, not eight numbers."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def parse_environ(env: bytes, cmdline: bytes = b"") -> Worker:
    """A worker's launch variables from its /proc environ (NUL-separated) and whether its command
    line is a launcher's. Bounded: a value that is not a small whole number is not one."""
    got: dict[bytes, int] = {}
    launched = False
    for item in env.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if not eq or name not in _VARS or name in got:
            continue
        launched = True
        if value.isdigit() and len(value) <= 7 and int(value) <= RANK_MAX:
            got[name] = int(value)
    argv = [a.rsplit(b"/", 1)[-1].decode("utf-8", "replace") for a in cmdline.split(b"\0")[:8] if a]
    launcher = any(a in LAUNCHERS or a.startswith(("torch.distributed.run", "torch.distributed.launch",
                                                    "deepspeed.launcher", "accelerate.commands"))
                   for a in argv[:3]) and "WORLD_SIZE" not in {k.decode() for k in got}
    world = got.get(b"WORLD_SIZE")
    return Worker(world if world else None, got.get(b"RANK"), got.get(b"LOCAL_RANK"),
                  got.get(b"LOCAL_WORLD_SIZE") or got.get(b"LOCAL_SIZE") or None,
                  got.get(b"GROUP_RANK", got.get(b"NODE_RANK")), launcher, launched)


def from_workers(workers: list[Worker], read: int, blind: int, single_if_unset: bool) -> Ranks:
    """What the processes' variables say. Pure."""
    world = max((w.world for w in workers if w.world), default=None)
    mine: set[int] = set()
    whole = False   # a worker named its node's ranks in full (RANK - LOCAL_RANK .. + LOCAL_WORLD_SIZE)
    for w in workers:
        if w.rank is None or (world is not None and w.rank >= world):
            continue
        mine.add(w.rank)
        if w.local_rank is not None and w.local_world and w.local_rank <= w.rank and w.local_rank < w.local_world:
            base = w.rank - w.local_rank
            top = base + w.local_world
            if world is None or top <= world:
                mine.update(range(base, top))
                whole = True
    if world is None:
        # one process only when nothing was launched: no launcher, and no process given a launch
        # variable (a RANK, or a WORLD_SIZE that is no number, is a worker of several)
        if single_if_unset and read and not blind and not any(w.launcher or w.launched for w in workers):
            return Ranks(1, frozenset({0}), "one process (no WORLD_SIZE in the training's environment)")
        if any(w.launcher for w in workers):
            return Ranks(waiting="the training's workers (its launcher runs; they have not started yet)")
        return Ranks(waiting="the training's WORLD_SIZE (no worker read yet)")
    if whole:
        return Ranks(world, frozenset(mine), "the workers' RANK, LOCAL_RANK and LOCAL_WORLD_SIZE")
    return Ranks(world, None, "the workers' WORLD_SIZE",
                 "" if not mine else f"this node's ranks (its workers name ranks {spans(mine)} without LOCAL_WORLD_SIZE)")


def settle(read: Ranks, world_size: int = 0, nodes: int = 1, node: int = 0) -> Ranks:
    """What was read, joined with the config: sync.world_size (`world_size`) stands in for the
    workers' WORLD_SIZE; on a run of `nodes` nodes with no worker naming its node's ranks, node
    `node` runs the `world / nodes` ranks from `node * world / nodes` (torchrun's order). Pure."""
    world = world_size or read.world
    source = "sync.world_size" if world_size else read.source
    nodes = max(1, nodes)
    if world is None:
        return Ranks(None, None, read.source, read.waiting or "the training's WORLD_SIZE (set sync.world_size)", nodes)
    mine = read.mine if read.mine is not None and all(r < world for r in read.mine) else None
    if mine is not None:
        return Ranks(world, mine, read.source if not world_size else f"{read.source}; sync.world_size", nodes=nodes)
    if nodes == 1:
        return Ranks(world, frozenset(range(world)), source)
    if world % nodes == 0 and 0 <= node < nodes:
        per = world // nodes
        return Ranks(world, frozenset(range(node * per, (node + 1) * per)),
                     f"{source}, split evenly over cluster.nodes = {nodes}", nodes=nodes)
    return Ranks(world, None, source, read.waiting or
                 f"this node's ranks (WORLD_SIZE {world} does not split evenly over {nodes} nodes, and no worker "
                 "gave its LOCAL_WORLD_SIZE)", nodes)


def read(pids: Iterable[int], proc: str = "/proc", single_if_unset: bool = False) -> Ranks:
    """What the processes `pids` were started with. A process that exited is passed over; one that
    cannot be read (not ours) makes "one process" unsure."""
    workers: list[Worker] = []
    n = blind = 0
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/environ", "rb") as f:
                env = f.read(ENVIRON_MAX)
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone
        except OSError:
            blind += 1  # not ours to read
            continue
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                cmd = f.read(CMDLINE_MAX)
        except OSError:
            cmd = b""
        n += 1
        workers.append(parse_environ(env, cmd))
    return from_workers(workers, n, blind, single_if_unset)


def world_size(pids: Iterable[int], proc: str = "/proc", single_if_unset: bool = False) -> int | None:
    """The largest WORLD_SIZE any of `pids` was started with; None when none says. With
    `single_if_unset`: 1 when the training runs (some of `pids` was read), none of its processes
    was given a WORLD_SIZE and none is a launcher whose workers are still to come: a plain
    `python train.py` is one process (no launcher told it of others)."""
    return read(pids, proc, single_if_unset).world
