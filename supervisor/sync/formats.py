"""Each trainer's own rule for "this checkpoint is complete", from the files alone. Pure.

Quiet is not complete on a multi-GPU run: every rank writes its own shard, and the files that
say "done" are written by one rank, sometimes before the others have finished. The whole-file
checks (complete.py: safetensors header, torch zip end record, JSON) apply inside every format;
these rules add what the format itself promises:

- hf: the Trainer's `trainer_state.json`, written last (complete.py's marker rule).
- deepspeed: `global_stepN/` holds one optimizer shard per data-parallel rank and model-parallel
  rank (`[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`). `latest` (the tag) is
  written by rank 0 *before* the last barrier (DeepSpeed #7546), so it proves nothing about the
  other ranks: every rank's shard must be there, the world size coming from the workers.
- dcp (torch.distributed.checkpoint, FSDP, Megatron's torch_dist): `.metadata` is written last,
  by the coordinator, after every rank's `.distcp` files; a folder of `.distcp` without it is
  nothing. `.metadata` is a pickle: it is never opened.
- megatron: `iter_NNNNNNN/` is complete once `latest_checkpointed_iteration.txt` beside it names
  that iteration or a later one.
- nemo: a `<name>-unfinished` marker beside `<name>.ckpt` while the save runs.
- lightning and single files: a `.ckpt`/`.pt` torch zip is whole by its end record (complete.py).

`waiting_for` returns "" when the rule holds, else what the unit still waits for, in words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DS_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
DS_MODEL = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")
DS_LATEST = "latest"
DCP_METADATA = ".metadata"
DCP_SHARD = re.compile(r"\.distcp$")
MEGATRON_ITER = re.compile(r"^iter_(\d{7})$")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
NEMO_UNFINISHED = "-unfinished"
TEXT_MAX = 4096   # a tracker file longer than this is not a tracker
RANKS_MAX = 1 << 17  # more ranks than any run has: a name claiming more is not a shard to wait for

FORMATS = ("hf", "adapter", "deepspeed", "dcp", "megatron", "nemo", "lightning", "files")


@dataclass(frozen=True)
class Facts:
    """What the shell read for the rules beyond the unit's file names."""

    world_size: int | None = None                      # the training's WORLD_SIZE (None: not known)
    texts: Mapping[str, str] = field(default_factory=dict)  # small tracker files: rel in the unit, or
                                                       # "../NAME" beside it -> their text
    siblings: frozenset[str] = frozenset()             # names beside the unit (markers written there)
    text_mtimes: Mapping[str, float] = field(default_factory=dict)  # those tracker files' mtimes
    newest: float | None = None                        # the newest mtime among the unit's own files


def detect(unit_name: str, rels: Iterable[str], siblings: Iterable[str] = ()) -> str:
    """The format a unit is in, from its name and its files' paths (relative to the unit)."""
    names = list(rels)
    base = unit_name.rsplit("/", 1)[-1]
    if any(DS_SHARD.match(r.rsplit("/", 1)[-1]) or DS_MODEL.match(r.rsplit("/", 1)[-1]) for r in names):
        return "deepspeed"
    if MEGATRON_ITER.match(base):
        return "megatron"
    if any(r.rsplit("/", 1)[-1] == DCP_METADATA or DCP_SHARD.search(r) for r in names):
        return "dcp"
    if base.endswith(".ckpt"):
        stem = base[: -len(".ckpt")]
        return "nemo" if f"{stem}{NEMO_UNFINISHED}" in set(siblings) or "/" in "".join(names) else "lightning"
    if any(r.rsplit("/", 1)[-1] == "adapter_config.json" for r in names):
        return "adapter"
    if re.match(r"^checkpoint-\d+$", base):
        return "hf"
    return "files"


def waiting_for(fmt: str, unit_name: str, rels: Iterable[str], facts: Facts) -> str:
    """"" when the unit is complete by its format's rule, else what it still waits for."""
    names = list(rels)
    base = unit_name.rsplit("/", 1)[-1]
    if fmt == "megatron":
        return _megatron(base, facts)
    if fmt == "nemo" or (fmt == "lightning" and base.endswith(".ckpt")):
        stem = base[: -len(".ckpt")] if base.endswith(".ckpt") else base
        if f"{stem}{NEMO_UNFINISHED}" in facts.siblings:
            return f"the save to end ({stem}{NEMO_UNFINISHED} is still beside it)"
    # DeepSpeed and DCP layouts also sit inside an HF checkpoint-N/ (the Trainer with DeepSpeed or FSDP)
    why = _deepspeed(names, facts)
    return why or _dcp(names)


def _folders(names: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in names:
        d, _, n = r.rpartition("/")
        out.setdefault(d, []).append(n)
    return out


def _dcp(names: list[str]) -> str:
    for d, files in sorted(_folders(names).items()):
        if any(DCP_SHARD.search(n) for n in files) and DCP_METADATA not in files:
            where = f"{d}/{DCP_METADATA}" if d else DCP_METADATA
            return f"{where} (torch.distributed.checkpoint writes it last, on the coordinator rank)"
    return ""


def _deepspeed(names: list[str], facts: Facts) -> str:
    folders = _folders(names)
    tags = {d: files for d, files in folders.items() if any(DS_SHARD.match(n) or DS_MODEL.match(n) for n in files)}
    if not tags:
        return ""
    latest = facts.texts.get(DS_LATEST, "").strip() if DS_LATEST in folders.get("", []) else ""
    if latest and latest not in tags:
        return f"{latest}/ (named by `latest`) to hold the ranks' shards"
    for d, files in sorted(tags.items()):
        if latest and d != latest:
            continue
        why = _ranks(d, files, facts.world_size)
        if why:
            return why
    return ""


def _ranks(folder: str, files: list[str], world: int | None) -> str:
    where = f"{folder}/" if folder else ""
    shards = {}
    for n in files:
        if m := DS_SHARD.match(n):
            if len(m.group(1)) > 7 or len(m.group(2)) > 7:  # int() of a 5,000-digit name raises
                return f"{where}{n[:80]} to name a rank any run has (its number is {len(m.group(1))} digits long)"
            shards[(int(m.group(1)), int(m.group(2)))] = n
    models = [n for n in files if DS_MODEL.match(n)]
    if not models:
        return f"{where}mp_rank_00_model_states.pt (the model's states)"
    if not shards:
        return ""  # ZeRO off: the model states alone
    prefix = "bf16_" if any(n.startswith("bf16_") for n in shards.values()) else ""
    mps = max(mp for _, mp in shards) + 1
    dps = max(dp for dp, _ in shards) + 1
    if world is not None and world % mps == 0:
        dps = max(dps, world // mps)
    total = dps * mps
    if total > RANKS_MAX:
        # a name like zero_pp_rank_9999999_... would have the loop below count ranks for hours
        return f"{where}shards of {total} ranks, more than any run has ({RANKS_MAX}): not judged complete"
    for mp in range(mps):
        for dp in range(dps):
            if (dp, mp) not in shards:
                rank = mp * dps + dp
                return (f"rank {rank} of {total}: {where}{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt "
                        "missing" + ("" if world is not None else " (world size not known: ranks counted from the files)"))
    return ""


def _megatron(base: str, facts: Facts) -> str:
    m = MEGATRON_ITER.match(base)
    if m is None:
        return ""
    n = int(m.group(1))
    text = facts.texts.get(f"../{MEGATRON_TRACKER}")
    if text is None:
        return f"{MEGATRON_TRACKER} beside it to name iteration {n}"
    said = text.strip()
    if said == "release":
        return ""
    latest = int(said) if said.isascii() and said.isdigit() and len(said) <= 15 else None
    if latest is None:
        return f"{MEGATRON_TRACKER} to name iteration {n} (it holds {said[:40]!r})"
    if latest < n:
        return f"{MEGATRON_TRACKER} to name iteration {n} (it names {latest})"
    # Megatron rewrites the tracker after each save: one older than this iteration's files is left
    # from an earlier run (a rollback), and says nothing of the save now being written
    written = facts.text_mtimes.get(f"../{MEGATRON_TRACKER}")
    if written is not None and facts.newest is not None and written < facts.newest:
        return (f"{MEGATRON_TRACKER} to be written after iteration {n} (it names {latest} but is older "
                "than this iteration's files: left from an earlier run)")
    return ""


def texts_wanted(fmt: str, unit_name: str, rels: Iterable[str]) -> list[str]:
    """The small files the rules read (relative to the unit; "../NAME" beside it)."""
    if fmt == "megatron":
        return [f"../{MEGATRON_TRACKER}"]
    if fmt in ("deepspeed", "hf") and DS_LATEST in list(rels):
        return [DS_LATEST]
    return []
