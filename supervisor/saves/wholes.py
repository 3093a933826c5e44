"""Folders that go up whole, whatever the include globs select inside them: a NeMo 2 checkpoint
(`<name>/` with `weights/` and `context/`) and a model saved below the top of a watched folder
(`trainer.save_model("out/final")`, save_pretrained), but not a model downloaded there. Read from
the walk's file list; `downloaded` alone looks at the disk."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Protocol


class Units(Protocol):
    """What a folder is a unit of, by the include globs (sync.policy.Policy)."""

    def folder_unit(self, rel: str) -> object: ...


NEMO2_WEIGHTS, NEMO2_CONTEXT = "weights", "context"   # NeMo 2's checkpoint folder: <name>/weights/ (DCP), <name>/context/


def nemo2_dirs(dcp_dirs: set[str], raw: Iterable[str]) -> set[str]:
    """The NeMo 2 checkpoint folders among the parents of DCP folders: `<name>/` whose DCP folder is
    `weights/` and that holds a `context/` too. Each is one unit: a restore needs its context (the
    model's config and tokenizer) as much as its weights."""
    cands = {d.rsplit("/", 1)[0] for d in dcp_dirs if "/" in d and d.rsplit("/", 1)[1] == NEMO2_WEIGHTS}
    if not cands:
        return set()
    ctx = {rel.rsplit(f"/{NEMO2_CONTEXT}/", 1)[0] for rel in raw if f"/{NEMO2_CONTEXT}/" in rel}
    return cands & ctx


MODEL_WEIGHTS = re.compile(r"^(?:model|pytorch_model)(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)$")
MODEL_CONFIG = "config.json"


def saved_models(raw: Iterable[str], policy: Units) -> set[str]:
    """Folders below the top holding what save_pretrained / `Trainer.save_model` writes: `config.json`
    and the model's weights (`model.safetensors`, `model-00001-of-00004.safetensors`,
    `pytorch_model.bin`). The top level is covered by the include's own globs; a folder a glob makes a
    unit of its own (`checkpoint-N/`) stays that unit."""
    configs, weights = set(), set()
    for rel in raw:
        if "/" not in rel:
            continue
        d, name = rel.rsplit("/", 1)
        if name == MODEL_CONFIG:
            configs.add(d)
        elif MODEL_WEIGHTS.match(name):
            weights.add(d)
    return {d for d in configs & weights if policy.folder_unit(f"{d}/{MODEL_CONFIG}") is None}


DOWNLOAD_MARKS = (".cache/huggingface/download", ".huggingface")  # what `hf download --local-dir` leaves


def downloaded(folder: str) -> bool:
    """A model downloaded into this folder (`hf download --local-dir`), not trained here: never sent."""
    return any(os.path.isdir(os.path.join(folder, m)) for m in DOWNLOAD_MARKS)


def inside(rel: str, folders: set[str]) -> str | None:
    """The folder of `folders` that holds `rel` (at any depth); None when none does."""
    if not folders:
        return None
    parts = rel.split("/")
    for i in range(len(parts) - 1, 0, -1):
        d = "/".join(parts[:i])
        if d in folders:
            return d
    return None
