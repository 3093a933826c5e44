"""What looks like training output in the watched folders while no `sync.include` glob selects it
(issue 50): it never leaves the machine, so status, `sync --wait` and the finish and stop mails
name it, and a stop waits while such a checkpoint is newer than anything selected.

Training output, by what it is rather than by one trainer's naming:
- a checkpoint-shaped folder: `checkpoint-N`, `checkpoint_N`, `global_stepN`, `iter_NNNNNNN`,
  `epoch_N`, `step_N`, a folder named `*.ckpt`, a folder holding Orbax's `_CHECKPOINT_METADATA`
  (`<step>/`), a NeMo 2 folder (`weights/` and `context/` inside), a folder of `.distcp` shards;
  its unselected files are counted under its name (the outermost such folder);
- elsewhere, a checkpoint-format file of any size (`.pt`, `.pth`, `.ckpt`, `.safetensors`,
  `.distcp`, `.gguf`, `.onnx`, `.keras`, `.pth.tar`, a `.bin` named like weights or optimizer state),
  and any other file of LARGE_FILE or more that is not a log, a tracker's record, a dataset (an archive,
  a shard format, a `.bin` not named like weights: nanoGPT's `train.bin`) or a library.

Never warned: what the user excluded on purpose (an explicit `sync.exclude` glob), what is never
training output (the Hugging Face cache and tool state, temporary names: `allowed` says so), and
what lives in a virtualenv, site-packages or node_modules (a workdir watched whole holds one), and a
model downloaded into a watched folder (`hf download --local-dir` leaves `.cache/huggingface/` there).

Pure: the walks (walk.py, unreached.py) hand in what they saw; paths are "/"-joined strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

LARGE_FILE = 64 * 1024 * 1024   # a file this large is named whatever its name (a 2 GB model.bin)
NAMES_MAX = 20                  # names listed; every file is counted

# each trainer's name for its checkpoint folders (HF, Accelerate, DeepSpeed, Megatron, torchtune, custom loops)
_SHAPED_NAME = re.compile(r"^(?:checkpoint[-_]\d+|global_step\d+|iter_\d+|epoch_\d+|step[-_]?\d+)$")
ORBAX_METADATA = "_CHECKPOINT_METADATA"
CKPT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".distcp", ".gguf", ".onnx", ".keras", ".pth.tar")
# a .bin is weights (pytorch_model.bin, optimizer.bin, model.bin) or data (nanoGPT's train.bin, Megatron's
# *_text_document.bin): only a name that says weights or state makes it a checkpoint file
_BIN_STATE = re.compile(r"model|optim|weight|ckpt|checkpoint|state|adapter|scheduler|scaler|rng", re.I)
# large files that are never training output: logs, trackers' records, datasets and their archives, libraries
_NOT_OUTPUT = re.compile(
    r"""(?ix) \.(log|txt|out|err|csv|tsv|json|jsonl|yaml|yml|md|wandb|db|sqlite|sqlite3|arrow|parquet|idx
    |tfrecord|npy|mds|lmdb|mdb|beton|ffcv|tar|zip|gz|tgz|zst|xz|bz2|so|a|o|whl|egg|deb|rpm|py|pyc|ipynb
    |mp4|png|jpg|jpeg|gif|wav|mp3)$
    | (^|[/.])events\.out\.tfevents\. | \.so\.\d""")
NOT_OUTPUT_DIRS = frozenset({"site-packages", "dist-packages", "node_modules", ".venv", "venv", ".tox", ".nox",
                             ".conda", "miniconda3", "anaconda3"})
VENV_MARKER = "pyvenv.cfg"


class Seen(NamedTuple):
    """One file a walk saw under a watched folder (a tuple: 2,600 of them made at every scan)."""

    root: str       # the watched folder (absolute)
    rel: str        # relative to it
    size: int
    mtime: float    # seconds


@dataclass(frozen=True)
class Item:
    """One thing named: a checkpoint-shaped folder (its unselected files) or a single file."""

    path: str
    files: int
    bytes: int
    mtime: float          # its newest file
    checkpoint: bool      # checkpoint-shaped or a checkpoint format (not only large)
    partly: bool = False  # a folder some of whose files are selected (a narrow include)


@dataclass(frozen=True)
class Report:
    files: int = 0
    bytes: int = 0
    names: tuple[str, ...] = ()   # up to NAMES_MAX, newest first
    items: int = 0                # how many things are named in all
    hold: bool = False            # a checkpoint nothing of which is selected, newer than every selected file
    complete: bool = True         # False: a listing stopped at its cap, the counts are a lower bound

    def __bool__(self) -> bool:
        return self.items > 0


NONE = Report()


def shaped(d: str, rels: frozenset[str], dirs: frozenset[str], dcp: frozenset[str] = frozenset()) -> bool:
    """Is folder `d` (relative to its root) checkpoint-shaped? `rels`: every file under the root;
    `dirs`: every folder holding one; `dcp`: the folders holding a `.distcp` shard (all relative)."""
    name = d.rsplit("/", 1)[-1]
    if _SHAPED_NAME.match(name) or name.endswith(".ckpt") or d in dcp:
        return True
    if f"{d}/{ORBAX_METADATA}" in rels:
        return True
    return f"{d}/weights" in dirs and f"{d}/context" in dirs   # NeMo 2: <name>/weights/, <name>/context/


def checkpoint_file(name: str) -> bool:
    low = name.lower()
    if low.endswith(CKPT_SUFFIXES):
        return True
    return low.endswith(".bin") and bool(_BIN_STATE.search(low))


def not_output(rel: str, dirs_with_venv: frozenset[str]) -> bool:
    """Inside a virtualenv, site-packages or node_modules: never training output."""
    parts = rel.split("/")[:-1]
    if any(p in NOT_OUTPUT_DIRS for p in parts):
        return True
    return any("/".join(parts[:i]) in dirs_with_venv for i in range(1, len(parts) + 1))


def _dirs(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def find(seen: Iterable[Seen], selected: Iterable[str], units: Iterable[str], allowed: Callable[[str], bool],
         newest_selected: float | None = None, complete: bool = True,
         downloaded: Callable[[str], bool] = lambda d: False) -> Report:
    """The report for what the walks saw. `selected`: the absolute paths of the selected files;
    `units`: the absolute folders of the selected folder units (all they hold is covered);
    `allowed(rel)`: not ruled out by name, cache or an explicit exclude (Policy.allowed);
    `newest_selected`: the newest selected file's mtime (None: nothing is selected);
    `downloaded(folder)`: a model downloaded there (`hf download --local-dir`), not trained: asked
    only of the folders above a candidate; `complete`: False when a listing stopped at its cap."""
    seen = list(seen)
    chosen = set(selected)
    held = set(units)
    by_root: dict[str, list[Seen]] = {}
    for s in seen:
        path = _join(s.root, s.rel)
        if path in chosen or any(a in held for a in _ancestors(path)) or not allowed(s.rel):
            continue
        by_root.setdefault(s.root, []).append(s)
    above: set[str] = set()  # the folders with something selected inside, made when first asked

    def partly(folder: str) -> bool:
        if not above:
            above.update(d for p in [*chosen, *held] for d in _ancestors(p))
            above.add("")
        return folder in above or folder in held

    items: list[Item] = []
    for root, files in by_root.items():
        items += _items(root, files, [s for s in seen if s.root == root], partly, downloaded)
    items.sort(key=lambda i: (-i.mtime, i.path))
    hold = any(i.checkpoint and not i.partly and (newest_selected is None or i.mtime > newest_selected)
               for i in items)
    return Report(sum(i.files for i in items), sum(i.bytes for i in items),
                  tuple(i.path for i in items[:NAMES_MAX]), len(items), hold, complete)


def _join(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}" if rel else root


def _ancestors(path: str) -> list[str]:
    """`/a/b/c` -> [`/a/b`, `/a`, `/`]: the folders above an absolute path."""
    out = []
    while "/" in path.rstrip("/"):
        path = path.rstrip("/").rsplit("/", 1)[0] or "/"
        out.append(path)
    return out


def _all_dirs(rels: Iterable[str]) -> frozenset[str]:
    """Every folder holding a file, each walked up once (2,600 files of 200 checkpoints: 1 ms)."""
    out: set[str] = set()
    for r in rels:
        p = r.rpartition("/")[0]
        while p and p not in out:
            out.add(p)
            p = p.rpartition("/")[0]
    return frozenset(out)


def _items(root: str, candidates: list[Seen], every: list[Seen], partly: Callable[[str], bool],
           downloaded: Callable[[str], bool]) -> list[Item]:
    """`candidates`: the files under `root` neither selected nor ruled out; `every`: all it saw there."""
    rels = frozenset(s.rel for s in every)
    dirs = _all_dirs(rels)
    venvs = frozenset(r.rsplit("/", 1)[0] for r in rels if r.rsplit("/", 1)[-1] == VENV_MARKER and "/" in r)
    dcp = frozenset(r.rsplit("/", 1)[0] for r in rels if r.endswith(".distcp") and "/" in r)
    asked: dict[str, bool] = {}

    def download(rel: str) -> bool:
        for d in _dirs(rel):
            if d not in asked:
                asked[d] = downloaded(_join(root, d))
            if asked[d]:
                return True
        return False

    folders: dict[str, list[Seen]] = {}
    out: list[Item] = []
    for s in candidates:
        if not_output(s.rel, venvs):
            continue
        outer = next((d for d in _dirs(s.rel) if shaped(d, rels, dirs, dcp)), None)
        if outer is not None:
            if not download(s.rel):
                folders.setdefault(outer, []).append(s)
            continue
        name = s.rel.rsplit("/", 1)[-1]
        ckpt = checkpoint_file(name)
        # a large .bin not named like weights is a dataset (nanoGPT's train.bin, Megatron's *_document.bin)
        if (ckpt or (s.size >= LARGE_FILE and not _NOT_OUTPUT.search(name) and not name.lower().endswith(".bin"))) \
                and not download(s.rel):
            out.append(Item(_join(root, s.rel), 1, s.size, s.mtime, ckpt))
    for d, fs in folders.items():
        path = _join(root, d)
        out.append(Item(path, len(fs), sum(f.size for f in fs), max(f.mtime for f in fs), True, partly(path)))
    return out
