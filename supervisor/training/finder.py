"""The one checkpoint finder: every Trainer `checkpoint-N/` folder in the folders it is given or a few
levels below (a watched folder above several runs' output_dirs). The disk wing, the resume wing's
local look, the money wing's save figures and the progress tracker all find checkpoints here.

It reads directory entries only (no file is opened), never follows a link, never enters a checkpoint,
a hidden folder or one the caller skips (the disk wing: caches), nor a folder wider than WIDE_DIR below
the top (a dataset, not an output folder)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from supervisor.training.checkpoints import checkpoint_step

WIDE_DIR = 10000


@dataclass(frozen=True)
class Found:
    path: str
    step: int

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def find_checkpoints(roots: Iterable[str], depth: int = 1,
                     skip: Callable[[str], bool] = lambda name: False) -> list[Found]:
    """Every checkpoint-N folder in `roots` or up to `depth` folders below, by step (then path)."""
    out: list[Found] = []
    for root in dict.fromkeys(os.path.normpath(r) for r in roots if r):
        _walk(root, 0, depth, skip, out)
    return sorted(out, key=lambda f: (f.step, f.path))


def _walk(d: str, level: int, depth: int, skip: Callable[[str], bool], out: list[Found]) -> None:
    try:
        with os.scandir(d) as it:
            entries = []
            for e in it:
                entries.append(e)
                if level and len(entries) > WIDE_DIR:
                    return
    except OSError:
        return
    for e in entries:
        try:
            if not e.is_dir(follow_symlinks=False) or skip(e.name):
                continue
        except OSError:
            continue
        step = checkpoint_step(e.name)
        if step is not None:
            out.append(Found(e.path, step))
        elif level < depth and not e.name.startswith("."):
            _walk(e.path, level + 1, depth, skip, out)
