"""One unit for the whole run of several nodes, the same on every node (sync/parts.run_choice):
the newest with a run-wide record whose parts are all on the target as recorded, or whose every
part is complete there now. Each node restores its own part of that unit and nothing else: a node
whose part is damaged, or "none" (it never held any of it), never falls back to an older unit,
which would resume the run from two steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from supervisor.config.cluster import PART_PREFIX
from supervisor.resume.choose import PARTIAL, UnitInfo
from supervisor.saves import parts
from supervisor.store.base import TargetError, reader
from supervisor.training.checkpoints import unit_order

WHOLE_RUN_CHECKED = 16  # units checked on every node's part, newest first (a resume needs one)


@dataclass(frozen=True)
class RunParts:
    """A run of several nodes, as a restore reads it: its own prefix (every node's part and the
    run-wide records), its node count, this node's rank, the run's key (cluster.key_file), and a
    target rooted at `_cluster/` (its listing names the records without every part's files)."""

    target: object
    nodes: int
    rank: int = 0
    key: bytes | None = None
    records: object | None = None

    def close(self) -> None:
        for t in (self.target, self.records):
            close = getattr(t, "close", None)
            if callable(close):
                close()


def run_parts(run_target: str, nodes: int, rank: int, key_file: str, make: Callable[[str], object]) -> RunParts | None:
    """The run a node restores within (None on one machine): `make(url)` builds a target."""
    if nodes <= 1 or not run_target:
        return None
    from supervisor.store.credentials import run_key

    key, problem = run_key(key_file)
    if problem:
        raise TargetError(f"cluster.key_file cannot be read ({problem}): the run-wide records cannot be checked")
    return RunParts(make(run_target), nodes, rank, key, make(f"{run_target.rstrip('/')}/{parts.RECORDS}"))


def whole_run(run: RunParts, order: list[UnitInfo], skipped: list[UnitInfo],
              name: str | None = None) -> tuple[list[UnitInfo], list[UnitInfo]]:
    """One unit for the whole run (sync.parts.run_choice), the same on every node: the newest
    with a run-wide record whose parts are all on the target as recorded, or whose every part
    is complete there now. Only this node's part of it is tried: never an older unit (the
    nodes would resume from two steps). A node whose part of it is "none" restores nothing."""
    rd = reader(run.target)
    mine = {u.key: u for u in order}
    cands = set(list(mine)[:WHOLE_RUN_CHECKED])
    for k in _records_listed(run):
        if not name or name in (k, k.rsplit("/", 1)[-1]):
            cands.add(k)
    ordered = sorted(cands, key=unit_order, reverse=True)[:WHOLE_RUN_CHECKED]

    def record(u: str) -> tuple[dict[int, str] | None, str]:
        return parts.read_record(rd.read_file(parts.record_key(u)), u, run.nodes, run.key)

    def now(u: str) -> dict[int, str]:
        got = {k: parts.part_digest(rd.read_file(parts.part_manifest(k, u))) for k in range(run.nodes)}
        return {k: d for k, d in got.items() if d}

    ch = parts.run_choice(ordered, record, now, run.nodes, run.rank)
    newer = [replace(mine[u], state=PARTIAL, why=f"not complete on every node of the run: {why}") if u in mine
             else UnitInfo(u, PARTIAL, why=f"not complete on every node of the run: {why}")
             for u, why in ch.skipped]
    if not ch.unit:
        return [], newer + skipped
    if ch.mine == parts.NONE:
        note = UnitInfo(ch.unit, PARTIAL,
                        why=f"the run resumes from {ch.unit}, of which this node (rank {run.rank}) holds no part "
                            "(its run-wide record says none): nothing to restore here, and no older unit")
        return [], [note, *newer]
    u = mine.get(ch.unit)
    if u is None or (u.digest and u.digest != ch.mine):
        why = (f"the run resumes from {ch.unit}, and this node's part of it is not among its complete units "
               "on the target as the run recorded it: no older unit is taken")
        return [], [UnitInfo(ch.unit, PARTIAL, why=why), *newer]
    return [u], newer + [x for x in skipped if x.key != u.key]


def _records_listed(run: RunParts) -> list[str]:
    """The units the run's records name (their keys under _cluster/, heartbeats left out)."""
    if run.records is None:
        return []
    try:
        keys = reader(run.records).list_keys()
    except Exception:  # noqa: BLE001 - no record folder yet (a folder target), or unreadable: parts decide
        return []
    return [k[: -len(".json")] for k in keys
            if k.endswith(".json") and "/" not in k and not k.startswith(PART_PREFIX)][:4096]
