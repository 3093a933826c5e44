"""The Hugging Face Trainer's checkpoint folder names (`checkpoint-1200`), read in one place."""

from __future__ import annotations

import re

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(name: str) -> int | None:
    """1200 for `checkpoint-1200`; None for anything else (`tmp-checkpoint-5` is never final)."""
    m = CHECKPOINT_NAME.match(name)
    return int(m.group(1)) if m else None
