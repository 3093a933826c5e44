"""Each trainer's own rule for "this checkpoint is complete", from the files alone. Pure.

Quiet is not complete on a multi-GPU run: every rank writes its own shard, and the files that
say "done" are written by one rank, sometimes before the others have finished. The whole-file
checks (complete.py: safetensors header, torch zip end record, JSON) apply inside every format;
these rules add what the format itself promises:

- hf: the Trainer's `trainer_state.json`, written last (complete.py's marker rule).
- deepspeed: `global_stepN/` holds one optimizer shard per data-parallel rank and model-parallel
  rank (`[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`). `latest` (the tag) is
  written by rank 0 *before* the last barrier (DeepSpeed #7546), so it proves nothing about the
  other ranks: every shard of *this node's* ranks must be there (the ranks and the world size
  coming from the workers, training/ranks.py), and `mp_rank_00_model_states.pt` on the node that
  runs data-parallel rank 0 (the only one that writes it, unless use_node_local_storage).
- dcp (torch.distributed.checkpoint, FSDP, Megatron's torch_dist): `.metadata` is written last,
  by the coordinator (rank 0), after every rank's `.distcp` files; on its node a folder of
  `.distcp` without it is nothing; on a node without rank 0 (node-local disks) each of its ranks'
  `__{rank}_0.distcp` is. `.metadata` is a pickle: it is never opened.
- the files only global rank 0 writes (model states, `.metadata`, Megatron's tracker, NeMo's
  marker, trainer_state.json) are not awaited on a node that does not run it: the run-wide check
  (saves/parts.py) asks the union of the nodes' parts for them. Ranks not known: not complete.
- megatron: `iter_NNNNNNN/` is complete once `latest_checkpointed_iteration.txt` beside it names
  that iteration or a later one.
- nemo: a `<name>-unfinished` marker beside `<name>.ckpt` while the save runs.
- nemo2: a folder `<name>/` (`weights/`: DCP files and `.metadata`; `context/`) with the same
  marker, `<name>-unfinished`, beside it from before the first file until after the last (NeMo's
  ModelCheckpoint sets it before a save and before a deletion, and removes it after either).
- accelerate (`save_state`, `checkpoint_N/`): every process writes its own
  `random_states_{process}.pkl` after its part (rank 0's model, optimizer, scheduler and sampler
  come first), so the save is complete once random_states_0 .. W-1 are all there, W the world size.
  Without W it waits (a final sync takes the files as they are), unless the names show a gap.
- orbax: `<step>.orbax-checkpoint-tmp[-<n>]/` is a save in progress, renamed to `<step>/` when done:
  never complete under its temporary name. Where the rename is not atomic (object stores) Orbax
  writes `commit_success.txt` last; `_CHECKPOINT_METADATA` (JSON) gets `commit_timestamp_nsecs`
  at the commit in both ways.
- torchtune: `epoch_N/` holds `model-{i}-of-{n}` shards (all n of them), then the recipe state is
  written beside it (`../recipe_state/recipe_state.pt`, not for the last epoch): a recipe state
  newer than every file of the epoch says the epoch's save is over.
- composer: `ep{e}-ba{b}-rank{r}.pt` per rank (rank 0 alone unless the ranks save shards): once
  a rank other than 0 shows in the names, every rank's file of that batch must be there.
- lightning and single files: a `.ckpt`/`.pt` torch zip is whole by its end record (complete.py).

`judge` returns a Rule: what the unit still waits for ("" when nothing), whether the format's own
rule says complete (`positive`: complete.py then waits a short settle instead of the quiet period),
and whether the only thing missing is a fact the daemon lacks (`soft`: the world size), which a
final sync does without. `waiting_for` is its `waiting` alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from supervisor.untrusted import Unreadable, json_object

DS_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
DS_MODEL = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")
DS_RANK_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")  # ZeRO-3: one per rank
DS_LATEST = "latest"
DCP_METADATA = ".metadata"
DCP_SHARD = re.compile(r"\.distcp$")
DCP_RANK = re.compile(r"^__(\d+)_\d+\.distcp$")     # FileSystemWriter: __{rank}_{file}.distcp
HF_RNG = re.compile(r"^rng_state_(\d+)\.pth$")      # the Trainer: one per process when it runs several
HF_NAME = re.compile(r"^checkpoint-\d+$")
MEGATRON_ITER = re.compile(r"^iter_(\d{7})$")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
NEMO_UNFINISHED = "-unfinished"
NEMO2_PARTS = ("weights", "context")      # NeMo 2's WEIGHTS_PATH and CONTEXT_PATH (nemo/lightning/ckpt_utils.py)
ACCEL_NAME = re.compile(r"^checkpoint_\d+$")   # ProjectConfiguration(automatic_checkpoint_naming=True)
ACCEL_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
ORBAX_TMP = re.compile(r"\.orbax-checkpoint-tmp(?:-\d+)?$")  # older releases add -<timestamp>
ORBAX_METADATA = "_CHECKPOINT_METADATA"
ORBAX_COMMIT = "commit_success.txt"
ORBAX_METADATA_MAX = 256 * 1024           # the step metadata is a few KiB (handlers, metrics)
TORCHTUNE_EPOCH = re.compile(r"^epoch_\d+$")
TORCHTUNE_SHARD = re.compile(r"^model-(\d{1,7})-of-(\d{1,7})\.(?:safetensors|bin|pt|pth)$")
TORCHTUNE_RECIPE = "../recipe_state/recipe_state.pt"
COMPOSER_FILE = re.compile(r"^ep(\d{1,12})-ba(\d{1,15})-rank(\d{1,7})\.pt$")
CHECKPOINT_FILE_EXT = (".safetensors", ".pt", ".pth", ".ckpt", ".bin")
TEXT_MAX = 4096   # a tracker file longer than this is not a tracker
RANKS_MAX = 1 << 17  # more ranks than any run has: a name claiming more is not a shard to wait for
HF_STATE = "trainer_state.json"

FORMATS = ("hf", "adapter", "deepspeed", "dcp", "megatron", "nemo", "nemo2", "accelerate", "orbax",
           "torchtune", "composer", "lightning", "files")


@dataclass(frozen=True)
class Facts:
    """What the shell read for the rules beyond the unit's file names."""

    world_size: int | None = None                      # the training's WORLD_SIZE (None: not known)
    texts: Mapping[str, str] = field(default_factory=dict)  # small tracker files: rel in the unit, or
                                                       # "../NAME" beside it -> their text
    siblings: frozenset[str] = frozenset()             # names beside the unit (markers written there)
    text_mtimes: Mapping[str, float] = field(default_factory=dict)  # those tracker files' mtimes
    newest: float | None = None                        # the newest mtime among the unit's own files
    above: frozenset[str] = frozenset()                # names beside the unit's parent folder (NeMo 2's
                                                       # marker, when the unit is its weights/ folder)
    mtimes: Mapping[str, float] = field(default_factory=dict)  # files a rule only stats (never reads):
                                                       # rel ("../x" beside the unit) -> mtime
    ranks: frozenset[int] | None = None                # the global ranks this node runs (None: every rank of
                                                       # world_size, one node, unless ranks_waiting says)
    ranks_waiting: str = ""                            # a node of several whose ranks are not known: what
                                                       # is awaited (training/ranks.py)


@dataclass(frozen=True)
class Rule:
    waiting: str = ""        # what the unit still waits for, in words ("" = nothing the rule knows of)
    positive: bool = False   # the format's own rule says complete (not merely "nothing seen missing")
    soft: bool = False       # only a fact the daemon lacks (the world size) is missing: a final sync,
                             # whose writers are gone, takes the files as they are
    elsewhere: bool = False  # global rank 0 runs on another node: the Trainer's trainer_state.json (the
                             # default sync.complete_marker) is its file, never this node's to wait for


def _mine(facts: Facts) -> frozenset[int] | None:
    """The ranks whose files this node's folder holds; None while they are not known."""
    if facts.ranks is not None:
        return facts.ranks
    if facts.world_size is None or facts.ranks_waiting or facts.world_size > RANKS_MAX:
        return None
    return frozenset(range(facts.world_size))


def _elsewhere(facts: Facts) -> bool:
    """Global rank 0 runs on another node: the files only it writes (DeepSpeed's model states,
    DCP's .metadata, Megatron's tracker, NeMo's marker, the Trainer's trainer_state.json) are not
    this node's to wait for (a node-local disk never gets them; the run-wide check asks the
    union of the nodes' parts for them, saves/parts.py)."""
    mine = _mine(facts)
    return mine is not None and 0 not in mine


def _unknown(facts: Facts) -> Rule:
    """The rule needs this node's ranks and they are not known: not complete (a final sync, whose
    writers are gone, takes the files as they are)."""
    if facts.world_size is None:
        why = facts.ranks_waiting or "the training's WORLD_SIZE is not known yet"
        return Rule(f"the world size (set sync.world_size): {why}", soft=True)
    return Rule(facts.ranks_waiting or "this node's ranks (set sync.world_size and cluster.nodes)", soft=True)


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _top(names: list[str]) -> set[str]:
    """The unit's top-level entries: its files, and the first folder of each deeper path."""
    return {r.split("/", 1)[0] for r in names}


def detect(unit_name: str, rels: Iterable[str], siblings: Iterable[str] = (), above: Iterable[str] = ()) -> str:
    """The format a unit is in, from its name, its files' paths (relative to the unit) and the
    names beside it (`siblings`) and beside its folder (`above`)."""
    names = list(rels)
    base = _base(unit_name)
    near = set(siblings)
    top = _top(names)
    if ORBAX_TMP.search(base):
        return "orbax"
    if nemo2_checkpoint(unit_name, top, near, set(above)) is not None:
        return "nemo2"
    if not base.endswith(".ckpt") and f"{_nemo_stem(base)}{NEMO_UNFINISHED}" in near:
        return "nemo"  # NeMo 1's distributed checkpoint folder (model_weights/), same marker
    if ACCEL_NAME.match(base) or any(ACCEL_RNG.match(n) for n in top):
        return "accelerate"
    if any(DS_SHARD.match(_base(r)) or DS_MODEL.match(_base(r)) for r in names):
        return "deepspeed"
    if MEGATRON_ITER.match(base):
        return "megatron"
    if any(_base(r) == DCP_METADATA or DCP_SHARD.search(r) for r in names):
        return "dcp"
    if base.endswith(".ckpt"):
        stem = base[: -len(".ckpt")]
        return "nemo" if f"{stem}{NEMO_UNFINISHED}" in near or "/" in "".join(names) else "lightning"
    if ORBAX_METADATA in top or ORBAX_COMMIT in top:
        return "orbax"
    if TORCHTUNE_EPOCH.match(base):
        return "torchtune"
    if COMPOSER_FILE.match(base):
        return "composer"
    if any(_base(r) == "adapter_config.json" for r in names):
        return "adapter"
    if re.match(r"^checkpoint-\d+$", base):
        return "hf"
    return "files"


def nemo2_checkpoint(unit_name: str, top: set[str], siblings: set[str], above: set[str]) -> str | None:
    """The NeMo 2 checkpoint folder's name when the unit is one (weights/ and context/ in it, or
    its -unfinished marker beside it) or is its weights/ or context/ folder; else None."""
    base = _base(unit_name)
    if base.endswith(".ckpt"):
        return None  # NeMo 1's folder keeps the .ckpt; NeMo 2's drops it (ckpt_to_dir)
    if set(NEMO2_PARTS) <= top or (bool(top & set(NEMO2_PARTS)) and f"{_nemo_stem(base)}{NEMO_UNFINISHED}" in siblings):
        return base
    if base in NEMO2_PARTS and "/" in unit_name:
        parent = _base(unit_name.rsplit("/", 1)[0])
        other = NEMO2_PARTS[1 - NEMO2_PARTS.index(base)]
        if other in siblings or f"{_nemo_stem(parent)}{NEMO_UNFINISHED}" in above:
            return parent
    return None


def _nemo_stem(name: str) -> str:
    """What NeMo's format_checkpoint_unfinished_marker_path keeps of a checkpoint's name."""
    return name.removesuffix(".ckpt").removesuffix("-EMA")


def waiting_for(fmt: str, unit_name: str, rels: Iterable[str], facts: Facts) -> str:
    """"" when the unit is complete by its format's rule, else what it still waits for."""
    return judge(fmt, unit_name, rels, facts).waiting


def judge(fmt: str, unit_name: str, rels: Iterable[str], facts: Facts) -> Rule:
    """The unit's format's rule, applied to its files' names and the facts the shell read."""
    r = _rule(fmt, unit_name, list(rels), facts)
    return replace(r, elsewhere=True) if _elsewhere(facts) else r


def _rule(fmt: str, unit_name: str, names: list[str], facts: Facts) -> Rule:
    base = _base(unit_name)
    if fmt == "megatron":
        tracker = f"../{MEGATRON_TRACKER}" in facts.texts
        if _elsewhere(facts) and not tracker:
            return Rule()  # the tracker is rank 0's, on its node: this node's files wait out the quiet period
        why = _megatron(base, facts)
        if why and facts.ranks_waiting and not tracker:
            return _unknown(facts)  # rank 0's tracker to come, or a node-local disk that never gets it
        return Rule(why, positive=not why)
    if fmt == "orbax":
        return _orbax(base, names, facts)
    if fmt == "torchtune":
        return _torchtune(names, facts)
    if fmt == "composer":
        return _composer(base, facts)
    if fmt == "nemo2":
        return _nemo2(unit_name, names, facts)
    if fmt == "nemo" or (fmt == "lightning" and base.endswith(".ckpt")):
        stem = _nemo_stem(base)
        if f"{stem}{NEMO_UNFINISHED}" in facts.siblings:
            return Rule(f"the save to end ({stem}{NEMO_UNFINISHED} is still beside it)")
        if fmt == "lightning" or names == [base]:
            return Rule(positive=True)  # a single .ckpt: whole by its zip end record (complete.py)
    # DeepSpeed and DCP layouts also sit inside an HF checkpoint-N/ (the Trainer with DeepSpeed or
    # FSDP) and an Accelerate checkpoint_N/ (save_state with either)
    ds = _deepspeed(names, facts)
    if ds is not None and ds.waiting:
        return ds
    dcp = _dcp(names, facts)
    if dcp.waiting:
        return dcp
    if fmt in ("hf", "deepspeed") and _elsewhere(facts) and HF_STATE not in names:
        rng = _hf_rng(names, facts)
        if rng is not None and rng.waiting:
            return rng  # the Trainer's processes write their rng_state last, after their shards
        if rng is None and HF_NAME.match(base):
            return Rule()  # the Trainer's folder before any rng_state: the quiet period decides
    if fmt == "accelerate":
        return _accelerate(names, facts)
    if fmt == "hf":
        return _hf(names, facts, ds)
    if fmt == "deepspeed":
        return ds or Rule()
    if fmt == "dcp":
        return dcp  # every folder of .distcp shards has its .metadata, written last (or this node's ranks' files)
    if fmt == "nemo":
        # NeMo removes its marker only after the last file; the marker is global rank 0's: a node
        # without rank 0 never sees one, and waits out the quiet period
        return Rule(positive=not _elsewhere(facts) and not facts.ranks_waiting)
    if fmt == "files" and names == [base] and base.lower().endswith(CHECKPOINT_FILE_EXT):
        return Rule(positive=True)  # one checkpoint file: whole by its own header (complete.py)
    return Rule()


def _hf(names: list[str], facts: Facts, ds: Rule | None) -> Rule:
    """The Trainer's trainer_state.json, written last by the main process (global rank 0). A node
    without rank 0 holds the folder with its own processes' rng_state_{rank}.pth (each written by
    its process after its model and optimizer parts) and their DeepSpeed shards."""
    if HF_STATE in names:
        return Rule(positive=True)
    if not _elsewhere(facts):
        return Rule()
    return _hf_rng(names, facts) or Rule(positive=ds is not None and ds.positive)


def _hf_rng(names: list[str], facts: Facts) -> Rule | None:
    """None: no rng_state_N.pth among the names. Else each of this node's ranks' (its process
    writes it after its model and optimizer parts), or complete."""
    rng = {int(m.group(1)) for n in _top(names) if (m := HF_RNG.match(n)) and len(m.group(1)) <= 7}
    if not rng:
        return None
    for r in sorted(_mine(facts) or ()):
        if r not in rng:
            return Rule(f"rng_state_{r}.pth (rank {r} of this node writes it after its part of the save)")
    return Rule(positive=True)


def _folders(names: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in names:
        d, _, n = r.rpartition("/")
        out.setdefault(d, []).append(n)
    return out


def _dcp(names: list[str], facts: Facts | None = None) -> Rule:
    """Every folder of .distcp files has its .metadata, written last by the coordinator (global
    rank 0). A node without rank 0 (a node-local disk) never gets it: there each of this node's
    ranks' `__{rank}_0.distcp` must be there, and the quiet period covers a rank's later files;
    the run-wide check asks the union of the parts for the .metadata (saves/parts.py)."""
    facts = facts or Facts()
    positive = True
    for d, files in sorted(_folders(names).items()):
        if not any(DCP_SHARD.search(n) for n in files) or DCP_METADATA in files:
            continue
        where = f"{d}/" if d else ""
        if facts.ranks_waiting and _mine(facts) is None:
            return _unknown(facts)
        if not _elsewhere(facts):
            return Rule(f"{where}{DCP_METADATA} (torch.distributed.checkpoint writes it last, on the coordinator rank)")
        have = {int(m.group(1)) for n in files if (m := DCP_RANK.match(n)) and len(m.group(1)) <= 7}
        for r in sorted(_mine(facts) or ()):
            if r not in have:
                return Rule(f"{where}__{r}_0.distcp (rank {r} of this node; the .metadata is the coordinator's, "
                            "rank 0's, on its node)")
        positive = False
    return Rule(positive=positive)


def _deepspeed(names: list[str], facts: Facts) -> Rule | None:
    """None: no DeepSpeed files. Else what this node's ranks' files still lack, or complete."""
    folders = _folders(names)
    tags = {d: files for d, files in folders.items() if any(DS_SHARD.match(n) or DS_MODEL.match(n) for n in files)}
    if not tags:
        return None
    latest = facts.texts.get(DS_LATEST, "").strip() if DS_LATEST in folders.get("", []) else ""
    if latest and latest not in tags:
        return Rule(f"{latest}/ (named by `latest`) to hold the ranks' shards")
    positive = True
    for d, files in sorted(tags.items()):
        if latest and d != latest:
            continue
        r = _ranks(d, files, facts)
        if r.waiting:
            return r
        positive = positive and r.positive
    return Rule(positive=positive)


def _ranks(folder: str, files: list[str], facts: Facts) -> Rule:
    """One tag folder: every shard of this node's ranks. Rank r is data-parallel rank r // M and
    model-parallel rank r % M (M: the model-parallel ranks the names show; Megatron's order). Each
    rank writes `[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt` (and under ZeRO-3 its
    own `zero_pp_rank_..._model_states.pt`); `mp_rank_{mp:02d}_model_states.pt` comes from data-
    parallel rank 0 alone (DeepSpeed's save_non_zero_checkpoint), so only the node that runs it
    waits for it (with use_node_local_storage each node's local rank 0 writes one: taken if there)."""
    where = f"{folder}/" if folder else ""
    shards: dict[tuple[int, int], str] = {}
    owned: set[tuple[int, int]] = set()  # ZeRO-3: each rank's own model states
    models: set[int] = set()
    for n in files:
        m = DS_SHARD.match(n) or DS_RANK_MODEL.match(n) or DS_MODEL.match(n)
        if m is None:
            continue
        if any(len(g) > 7 for g in m.groups()):  # int() of a 5,000-digit name raises
            return Rule(f"{where}{n[:80]} to name a rank any run has (its number is {len(m.group(1))} digits long)")
        if n.endswith("_optim_states.pt"):
            shards[(int(m.group(1)), int(m.group(2)))] = n
        elif n.startswith("zero_pp_rank_"):
            owned.add((int(m.group(1)), int(m.group(2))))
        else:
            models.add(int(m.group(1)))
    mps = max((mp for _, mp in (*shards, *owned)), default=max(models, default=0)) + 1
    world = facts.world_size
    prefix = "bf16_" if any(n.startswith("bf16_") for n in shards.values()) else ""
    if world is not None and world > RANKS_MAX:
        return Rule(f"{where}shards of {world} ranks, more than any run has ({RANKS_MAX}): not judged complete")
    mine = _mine(facts)
    if mine is None:
        dps = max((dp for dp, _ in shards), default=0) + 1
        if shards and dps * mps <= RANKS_MAX:
            for mp in range(mps):  # a gap the names show waits in any case
                for dp in range(min(dps, len(shards) + 1)):
                    if (dp, mp) not in shards:
                        return Rule(f"rank {mp * dps + dp} of {dps * mps}: {where}{prefix}zero_pp_rank_{dp}_mp_rank_"
                                    f"{mp:02d}_optim_states.pt missing (world size not known: ranks counted from the "
                                    "files)")
        return _unknown(facts)
    if any(dp * mps >= RANKS_MAX for dp, _ in (*shards, *owned)):
        return Rule(f"{where}shards of more ranks than any run has ({RANKS_MAX}): not judged complete")
    zero = bool(shards) or bool(owned)
    for mp in sorted({r % mps for r in mine if r // mps == 0}):
        if mp not in models and not owned:
            return Rule(f"{where}mp_rank_{mp:02d}_model_states.pt (the model's states, written by data-parallel rank 0)")
    for r in sorted(mine) if zero else ():
        dp, mp = r // mps, r % mps
        if shards and (dp, mp) not in shards:
            return Rule(f"rank {r} of {world}: {where}{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt missing")
        if owned and (dp, mp) not in owned:
            return Rule(f"rank {r} of {world}: {where}zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt missing")
    # only the model states on a run of several ranks: ZeRO off, or the shards not begun: the quiet period
    return Rule(positive=zero or world == 1)


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


def _accelerate(names: list[str], facts: Facts) -> Rule:
    """Every process's random_states_{process}.pkl: the last file each one writes."""
    ranks = set()
    for n in _top(names):
        if (m := ACCEL_RNG.match(n)) and len(m.group(1)) <= 7:
            ranks.add(int(m.group(1)))
    if facts.ranks is not None:
        # a node of several on its own disk: its processes' random states (process index = global
        # rank); the main process's model and optimizer are on rank 0's node
        for r in sorted(facts.ranks):
            if r not in ranks:
                return Rule(f"random_states_{r}.pkl (process {r} of this node writes it last)")
        return Rule(positive=True)
    if not ranks:
        return Rule("random_states_0.pkl (Accelerate's save_state writes each process's random_states_N.pkl last)")
    seen = max(ranks) + 1
    world = facts.world_size
    if seen > RANKS_MAX:
        return Rule(f"random states of {seen} processes, more than any run has ({RANKS_MAX}): not judged complete")
    for r in range(seen):  # at most len(ranks) + 1 turns: a gap is found by then
        if r not in ranks:
            return Rule(f"random_states_{r}.pkl (process {r} writes it last; random_states_{seen - 1}.pkl is there)")
    if world is None or seen > world:
        known = ("the training's WORLD_SIZE is not known" if world is None else
                 f"the training runs {world} process(es) by its WORLD_SIZE but {seen} wrote random states")
        return Rule(f"the world size (set sync.world_size): random_states_0..{seen - 1}.pkl are there, and {known}",
                    soft=True)
    for r in range(world):  # stops at the first missing: at most len(ranks) + 1 turns
        if r not in ranks:
            return Rule(f"random_states_{r}.pkl (process {r} of {world} writes it last)")
    return Rule(positive=True)


def _nemo2(unit_name: str, names: list[str], facts: Facts) -> Rule:
    base = _base(unit_name)
    inner = base in NEMO2_PARTS and "/" in unit_name and not set(NEMO2_PARTS) <= _top(names)
    ckpt = _base(unit_name.rsplit("/", 1)[0]) if inner else base
    beside = facts.above if inner else facts.siblings
    marker = f"{_nemo_stem(ckpt)}{NEMO_UNFINISHED}"
    if marker in beside:
        return Rule(f"the save to end ({marker} is still beside {ckpt}/)")
    dcp = _dcp(names, facts)
    if dcp.waiting:
        return dcp
    weights = "" if inner else "weights/"
    has_metadata = f"{weights}{DCP_METADATA}" in names or (inner and base == "context")
    return Rule(positive=has_metadata)


def _orbax(base: str, names: list[str], facts: Facts) -> Rule:
    if m := ORBAX_TMP.search(base):
        return Rule(f"Orbax to rename it to {base[:m.start()]}/ (it saves into {base} and renames it when done)")
    inner = next((r for r in names if any(ORBAX_TMP.search(p) for p in r.split("/")[:-1])), None)
    if inner is not None:
        return Rule(f"Orbax to finish {inner.rsplit('/', 1)[0]} (still under its temporary name)")
    if ORBAX_COMMIT in names:
        return Rule(positive=True)
    meta = facts.texts.get(ORBAX_METADATA)
    if meta is None:
        return Rule()  # an older Orbax, renamed when done: the quiet period decides
    try:
        committed = json_object(meta, limit=ORBAX_METADATA_MAX).get("commit_timestamp_nsecs")
    except Unreadable:
        return Rule()
    if isinstance(committed, int) and not isinstance(committed, bool) and committed > 0:
        return Rule(positive=True)
    return Rule(f"{ORBAX_COMMIT} or a commit time in {ORBAX_METADATA} (Orbax writes them when the save is committed)")


def _torchtune(names: list[str], facts: Facts) -> Rule:
    shards: dict[int, set[int]] = {}
    for n in _top(names):
        if m := TORCHTUNE_SHARD.match(n):
            shards.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    for total, have in sorted(shards.items()):
        if total > RANKS_MAX:
            return Rule(f"{total} model shards, more than any save has: not judged complete")
        for i in range(1, total + 1):  # stops at the first missing: at most len(have) + 1 turns
            if i not in have:
                return Rule(f"model shard {i} of {total} (model-{i:05d}-of-{total:05d}.*)")
    recipe = facts.mtimes.get(TORCHTUNE_RECIPE)
    # the recipe state is saved after the epoch's files: newer than all of them, the save is over
    done = recipe is not None and facts.newest is not None and recipe >= facts.newest
    return Rule(positive=done and bool(shards or any(n.startswith("adapter_model") for n in names)))


def _composer(base: str, facts: Facts) -> Rule:
    m = COMPOSER_FILE.match(base)
    if m is None:
        return Rule()
    ep, ba = m.group(1), m.group(2)
    mine: set[int] = set()
    top = 0
    for n in facts.siblings | {base}:
        if s := COMPOSER_FILE.match(n):
            r = int(s.group(3))
            top = max(top, r)
            if (s.group(1), s.group(2)) == (ep, ba):
                mine.add(r)
    world = facts.world_size or 1
    if facts.ranks is not None and top > 0:
        for r in sorted(facts.ranks):  # a node of several: its own ranks' files
            if r not in mine:
                return Rule(f"ep{ep}-ba{ba}-rank{r}.pt (Composer writes one file per rank; rank {r} of this node)")
        return Rule(positive=True)
    if top == 0:
        # rank 0's file alone: rank 0 saves for all (the usual), or the others have not begun;
        # with more ranks running the quiet period decides
        return Rule(positive=world == 1)
    expected = max(top + 1, world)
    if expected > RANKS_MAX:
        return Rule(f"files of {expected} ranks, more than any run has ({RANKS_MAX}): not judged complete")
    for r in range(expected):  # stops at the first missing
        if r not in mine:
            return Rule(f"ep{ep}-ba{ba}-rank{r}.pt (Composer writes one file per rank; rank {r} of {expected})")
    return Rule(positive=True)


def texts_wanted(fmt: str, unit_name: str, rels: Iterable[str]) -> list[str]:
    """The small files the rules read (relative to the unit; "../NAME" beside it)."""
    if fmt == "megatron":
        return [f"../{MEGATRON_TRACKER}"]
    names = list(rels)
    if fmt in ("deepspeed", "hf", "accelerate") and DS_LATEST in names:
        return [DS_LATEST]
    if fmt == "orbax" and ORBAX_METADATA in names and ORBAX_COMMIT not in names:
        return [ORBAX_METADATA]
    return []


def text_limit(rel: str) -> int:
    """How many bytes of a file the rules read at most."""
    return ORBAX_METADATA_MAX if rel == ORBAX_METADATA else TEXT_MAX


def stats_wanted(fmt: str, unit_name: str, rels: Iterable[str]) -> list[str]:
    """Files beside the unit whose mtime a rule compares (stat only: never opened)."""
    return [TORCHTUNE_RECIPE] if fmt == "torchtune" else []


def lists_wanted(unit_name: str, kind: str) -> tuple[bool, bool]:
    """(the names beside the unit, the names beside its folder) the rules may need, from what its
    name says before any file is read: folders all (markers sit beside them), single files only
    where a rule reads their neighbours (.ckpt, Composer's per-rank files)."""
    base = _base(unit_name)
    beside = kind == "dir" or base.endswith(".ckpt") or bool(COMPOSER_FILE.match(base))
    return beside, kind == "dir" and base in NEMO2_PARTS and "/" in unit_name
