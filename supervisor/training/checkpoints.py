"""The Hugging Face Trainer's checkpoint folder names (`checkpoint-1200`), read in one place."""

from __future__ import annotations

import re

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(name: str) -> int | None:
    """1200 for `checkpoint-1200`; None for anything else (`tmp-checkpoint-5` is never final)."""
    m = CHECKPOINT_NAME.match(name)
    return int(m.group(1)) if m else None


def unit_order(key: str) -> tuple[int, str]:
    """Sort key of a unit key ("out/checkpoint-40") by its folder's step, then its name: newest
    last (sort with reverse=True for newest first); a unit that is no checkpoint-N counts as -1."""
    return checkpoint_step(key.rsplit("/", 1)[-1]) or -1, key
