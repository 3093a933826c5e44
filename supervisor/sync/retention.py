"""`sync.keep_last = N`: keep the N newest `checkpoint-*` folders on the target, as the Trainer's
`save_total_limit` does locally. Pure: the engine passes what it found here and what the ledger
says it has on the target; nothing is deleted unless keep_last > 0."""

from __future__ import annotations

from collections.abc import Iterable

from supervisor.training.checkpoints import checkpoint_step


def step_under(unit_key: str, prefix: str) -> int | None:
    """The step of a unit key (`run/checkpoint-5` under prefix `run`), None when it is not a
    checkpoint folder directly under the prefix."""
    if prefix:
        if not unit_key.startswith(prefix + "/"):
            return None
        unit_key = unit_key[len(prefix) + 1:]
    return checkpoint_step(unit_key)


def kept_steps(local: Iterable[int], remote: Iterable[int], keep_last: int) -> set[int]:
    """The steps keep_last keeps, counting checkpoints here and those already on the target."""
    if keep_last <= 0:
        return set(local) | set(remote)
    return set(sorted(set(local) | set(remote))[-keep_last:])


def retired(local: Iterable[int], remote_units: Iterable[str], prefix: str, keep_last: int) -> set[int]:
    """Local checkpoint steps older than the newest `keep_last` (here or on the target): they are
    not sent, or keep_last would delete them again after every upload."""
    local = set(local)
    if keep_last <= 0:
        return set()
    remote = {s for s in (step_under(k, prefix) for k in remote_units) if s is not None}
    return local - kept_steps(local, remote, keep_last)


def to_delete(remote_units: Iterable[str], prefix: str, keep_last: int, just_done: str) -> list[str]:
    """The unit keys (oldest first) to delete from the target after `just_done` was completed
    there: all checkpoint folders under `prefix` but the newest `keep_last`, never `just_done`."""
    if keep_last <= 0:
        return []
    mine = sorted((s, k) for k in remote_units if (s := step_under(k, prefix)) is not None)
    return [k for _, k in mine[:-keep_last] if k != just_done]
