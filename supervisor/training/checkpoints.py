"""The Hugging Face Trainer's checkpoint folder names (`checkpoint-1200`), read in one place."""

from __future__ import annotations

import re

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(name: str) -> int | None:
    """1200 for `checkpoint-1200`; None for anything else (`tmp-checkpoint-5` is never final)."""
    m = CHECKPOINT_NAME.match(name)
    return int(m.group(1)) if m else None


_STEP_IN_NAME = re.compile(r"(?:^|[^A-Za-z])step[=_-]?(\d{1,15})(?!\d)")   # Lightning's epoch=2-step=300.ckpt
_LAST_NUMBER = re.compile(r"(\d{1,15})(?!.*\d)")                           # checkpoint_7, epoch_3, 300/


def name_order(name: str) -> int:
    """A unit's place among its siblings by its name alone: the step it names (Lightning's
    `epoch=2-step=300.ckpt`: 300), else its last number (Accelerate's `checkpoint_7`, torchtune's
    `epoch_3`, Orbax's `300`); -1 for a name with none (nanoGPT's `ckpt.pt`). Saves are numbered in
    order, so this ranks them where an upload time (one second's resolution) cannot."""
    m = _STEP_IN_NAME.search(name) or _LAST_NUMBER.search(name)
    return int(m.group(1)) if m else -1


_NAMED_STEP = (
    re.compile(r"^checkpoint-(\d{1,15})$"),                          # HF Trainer
    re.compile(r"(?:^|[^A-Za-z])step[=_-]?(\d{1,15})(?!\d)"),        # Lightning epoch=2-step=300.ckpt
    re.compile(r"^global_step(\d{1,15})$"),                          # DeepSpeed
    re.compile(r"^iter_(\d{7})$"),                                   # Megatron's iteration
    re.compile(r"(?:^|-)ba(\d{1,15})(?:-|\.|$)"),                     # Composer ep1-ba300-rank0.pt: batches
    re.compile(r"^(\d{1,15})$"),                                     # Orbax's <step>/
)


def named_step(name: str) -> int | None:
    """The training step a unit's name states, where its writer puts one there (`checkpoint-300`,
    `epoch=2-step=300.ckpt`, `global_step300`, `iter_0000300`, `ep1-ba300-rank0.pt`, Orbax's
    `300`); None for a name that numbers saves, not steps (Accelerate's `checkpoint_7`, torchtune's
    `epoch_3`) or has no number (`ckpt.pt`, `last.ckpt`)."""
    for rx in _NAMED_STEP:
        m = rx.search(name)
        if m:
            return int(m.group(1))
    return None


def unit_order(key: str) -> tuple[int, str]:
    """Sort key of a unit key ("out/checkpoint-40") by its folder's step, then its name: newest
    last (sort with reverse=True for newest first); a unit that is no checkpoint-N counts as -1."""
    return checkpoint_step(key.rsplit("/", 1)[-1]) or -1, key
