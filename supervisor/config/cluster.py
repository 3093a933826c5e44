"""Which node of a run this machine is: [cluster] completed from the engines' environment. Pure.

torchrun, SkyPilot, dstack and RunPod's instant clusters each put the node count and this node's
rank in the environment, so a recipe needs no per-node config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.config.schema import Config

PART_PREFIX = "node-"   # node k's part of each unit lives under node-<k>/ below the run's prefix
# Where the engines put the node count, the node's rank and the run's name (first found wins).
NODES_VARS = ("NNODES", "PET_NNODES", "SKYPILOT_NUM_NODES", "DSTACK_NODES_NUM", "NUM_NODES")
RANK_VARS = ("NODE_RANK", "PET_NODE_RANK", "GROUP_RANK", "SKYPILOT_NODE_RANK", "DSTACK_NODE_RANK")
RUN_VARS = ("SKYPILOT_TASK_ID", "DSTACK_RUN_NAME")


@dataclass(frozen=True)
class Identity:
    nodes: int
    rank: int
    run_id: str

    @property
    def clustered(self) -> bool:
        return self.nodes > 1


def _int_var(envs: list[Mapping[str, str]], names: tuple[str, ...]) -> int | None:
    for env in envs:
        for n in names:
            v = (env.get(n) or "").strip()
            if not v:
                continue
            if not v.isdigit():
                raise ValueError(f"cluster: {n}={v[:40]!r} in the environment is not a whole number")
            return int(v)
    return None


def identity(nodes: int, rank: int | None, run_id: str, envs: list[Mapping[str, str]], default_run_id: str) -> Identity:
    """The config's [cluster] values, each missing one taken from the environments in order.
    ValueError naming the key or variable when they do not fit together."""
    if not nodes:
        nodes = _int_var(envs, NODES_VARS) or 1
    if rank is None:
        rank = _int_var(envs, RANK_VARS) or 0
    if not 0 <= rank < nodes:
        raise ValueError(f"cluster.rank: {rank} is not a node of a run of {nodes} (0 to {nodes - 1}); "
                         f"set cluster.rank and cluster.nodes, or {RANK_VARS[0]} and {NODES_VARS[0]}")
    if not run_id:
        run_id = next((e[n].strip() for e in envs for n in RUN_VARS if (e.get(n) or "").strip()), "") or default_run_id
    return Identity(nodes, rank, run_id)


def part_target(target: str, rank: int) -> str:
    """Where node `rank` syncs its part: `node-<k>` below the run's prefix (s3://, a folder, or
    user@host:path alike: each is a path that ends in the prefix)."""
    return f"{target.rstrip('/')}/{PART_PREFIX}{rank}"


def for_node(cfg: Config, env: Mapping[str, str]) -> tuple[Config, str]:
    """[cluster] resolved (nodes, rank and run_id filled in from the engines' environment), and
    the config this node runs with: on a run of several nodes its sync target is its part,
    `node-<k>/` below the run's prefix (sync, resume, prune and the probe all work on the part).
    Returns the run's own target too (the heartbeats and records live there). ValueError naming
    the key when the node does not fit the run."""
    c = cfg.cluster
    run_target = cfg.sync.target.strip()
    ident = identity(c.nodes, c.rank, c.run_id, [env, dict(cfg.training.env or {})], run_target)
    cluster = dataclasses.replace(c, nodes=ident.nodes, rank=ident.rank, run_id=ident.run_id)
    sync = cfg.sync
    if ident.clustered and run_target:
        sync = dataclasses.replace(cfg.sync, target=part_target(run_target, ident.rank))
    return dataclasses.replace(cfg, cluster=cluster, sync=sync), run_target
