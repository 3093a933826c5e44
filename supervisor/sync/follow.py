"""`sync.follow_deletions = true`: the target follows the trainer's own rotation. Lightning's top-k,
Accelerate's `total_limit`, the Trainer's `save_total_limit` delete old saves here; without this
they pile up on the target (six `.ckpt` and `last.ckpt` there against two and `last.ckpt` kept).

A unit is deleted on the target only when all of these hold, so that no finished work is lost:
- this machine sent it (or restored it) and the ledger holds its files with the paths they had here,
  and every one of those paths is gone now while the folder that held the unit is still there (an
  unmounted disk or a watched folder moved away deletes nothing);
- a newer unit beside it, of the same kind (a folder among folders, a `.ckpt` among `.ckpt`), was
  just verified complete on the target with its manifest (the caller asks right then);
- it ranks below that unit by the step its name states, else the number in its name.

Pure: the caller passes the facts (`gone` looks at the disk) and deletes what this returns."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from supervisor.training.checkpoints import name_order, named_step

FOLLOW_MAX = 16   # units deleted after one completion at most: a rotation deletes one or two


@dataclass(frozen=True)
class Done:
    key: str      # the unit just verified complete on the target
    kind: str     # "dir" | "file"


def rank(key: str) -> tuple[int, int]:
    name = posixpath.basename(key)
    step = named_step(name)
    return (step if step is not None else -1, name_order(name))


def family(key: str, kind: str) -> tuple[str, str, str]:
    """Units that rotate together: the same folder, the same kind, and for files the same suffix."""
    parent, name = posixpath.split(key)
    return parent, kind, posixpath.splitext(name)[1].lower() if kind == "file" else ""


def to_follow(done: Done, others: Iterable[tuple[str, str]], gone: Callable[[str, str], bool]) -> list[str]:
    """The unit keys (oldest first) to delete on the target now that `done` is complete there:
    `others` are (key, kind) of the units the ledger holds complete on the target; `gone(key, kind)`
    says whether the trainer deleted that unit here (see the module's rules)."""
    fam, top = family(done.key, done.kind), rank(done.key)
    if top == (-1, -1):
        return []  # a unit whose name ranks nothing (ckpt.pt, last.ckpt) is newer than nothing by name
    cands = sorted((rank(k), k, kind) for k, kind in others
                   if k != done.key and family(k, kind) == fam and (-1, -1) < rank(k) < top)
    return [k for _, k, kind in cands if gone(k, kind)][:FOLLOW_MAX]
