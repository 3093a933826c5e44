"""Which files under a watched folder are uploaded, and how they group into units.

Pure: every function works on relative POSIX paths (relative to the watched folder) and names.

- include/exclude are globs relative to the watched folder: `*` and `?` never cross `/`, `**`
  is any number of whole folders (`checkpoint-*/**` is everything inside a checkpoint folder,
  `**/adapter_config.json` is that name at any depth, top level included).
- Never uploaded whatever the globs say: temporary names (`tmp-checkpoint-*`, `*.tmp`, `*.part`,
  `*.incomplete`, rsync's `.name.XXXXXX`, editor locks) and the Hugging Face model cache
  (`models--*`, `datasets--*`, `.cache`, and the folders HF_HOME & co. point at).
- A folder pattern with no `/` before its `/**` (`checkpoint-*/**`) matches that folder at any
  depth, as in .gitignore: one run folder per training inside the watched folder
  (`out/tiny/checkpoint-5/`) is the usual layout and must not be skipped silently. Write
  `./checkpoint-*/**` to mean the top level only.
- A *unit* is what completes as a whole and gets a manifest: the shortest folder matching an
  include pattern of the form `PATTERN/**` (checkpoint-1200/, run/checkpoint-1200/), else the
  folder holding an `adapter_config.json` (a PEFT adapter saved anywhere), else the single file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from supervisor.saves.complete import is_temp_name as is_temp_name  # the trainers' in-flight names (saves)
from supervisor.store.keys import FILE_MANIFEST_SUFFIX as FILE_MANIFEST_SUFFIX
from supervisor.store.keys import MANIFEST_NAME as MANIFEST_NAME
from supervisor.store.keys import manifest_key as manifest_key

if TYPE_CHECKING:
    from supervisor.config import Config


def is_manifest_name(name: str) -> bool:
    """Our own manifest (a folder's or a single file's), never training output."""
    return name == MANIFEST_NAME or (name.endswith(FILE_MANIFEST_SUFFIX) and len(name) > len(FILE_MANIFEST_SUFFIX))
PROBE_FOLDER = ".train-supervisor-probe"  # the probe's tiny object (sync/probe.py): no unit, never restored


# Folder names that are caches or tool state, never training output.
# (.train-supervisor-snapshots: the daemon's own snapshots of files sent, saves/snapshot.py)
_CACHE_DIR_RE = re.compile(r"^(models--|datasets--|spaces--).+$|^(\.cache|\.locks|\.git|__pycache__|"
                           r"\.ipynb_checkpoints|\.rsync-partial|\.Trash.*|\.huggingface|huggingface|"
                           r"\.train-supervisor-snapshots|"
                           # installed software, never output: the default `**/*.pth` would pick
                           # site-packages' distutils-precedence.pth out of a venv in the workdir
                           r"site-packages|dist-packages|node_modules|\.venv|\.tox|\.nox|\.conda|"
                           r"\.mypy_cache|\.ruff_cache|\.pytest_cache)$")

# Environment variables that point at Hugging Face caches.
HF_CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE",
                 "HF_DATASETS_CACHE", "HF_XET_CACHE")

ADAPTER_MARKER = "adapter_config.json"
DCP_SHARD_SUFFIX = ".distcp"   # torch.distributed.checkpoint's shards: their folder is one unit


def is_cache_dir(name: str) -> bool:
    return bool(_CACHE_DIR_RE.match(name))


def has_temp_component(rel: str) -> bool:
    return any(is_temp_name(p) for p in rel.split("/"))


def has_cache_component(rel: str) -> bool:
    return any(is_cache_dir(p) for p in rel.split("/")[:-1])


# --- globs -------------------------------------------------------------------------------------

def _component_regex(part: str) -> str:
    out = []
    i = 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = part.find("]", i + 2 if i + 1 < len(part) and part[i + 1] in "!^" else i + 1)
            if j == -1:
                out.append(re.escape(c))
            else:
                body = part[i + 1:j]
                neg = body[:1] in ("!", "^")
                if neg:
                    body = body[1:]
                body = body.replace("\\", "\\\\").replace("/", "")
                out.append(f"[{'^' if neg else ''}{body}]" if body else "(?!)")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def any_depth(pattern: str) -> str:
    """`checkpoint-*/**` -> `**/checkpoint-*/**` (a folder pattern without `/` matches at any
    depth); `./checkpoint-*/**` stays anchored at the watched folder; anything else unchanged."""
    raw = pattern.strip().replace("\\", "/")
    if raw.startswith("./") or raw.startswith("/"):
        return normalize_glob(raw)
    p = normalize_glob(raw)
    if p.endswith("/**") and len(p) > 3 and "/" not in p[:-3] and p[:-3] != "**":
        return "**/" + p
    return p


def normalize_glob(pattern: str) -> str:
    p = pattern.strip().replace("\\", "/")
    while p.startswith("./"):
        p = p[2:]
    p = p.lstrip("/")
    p = re.sub(r"/+", "/", p)
    if p.endswith("/"):
        p += "**"  # "checkpoint-*/" means the folder's contents
    return p


@lru_cache(maxsize=512)
def glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob over relative POSIX paths (see module doc for the syntax)."""
    parts = normalize_glob(pattern).split("/")
    out = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:[^/]+/)*"
        else:
            out += _component_regex(part) + ("" if last else "/")
    return re.compile(out, re.DOTALL)


def glob_match(pattern: str, rel: str) -> bool:
    return glob_regex(pattern).fullmatch(rel) is not None


def _component_match(part: str, name: str) -> bool:
    return re.fullmatch(_component_regex(part), name, re.DOTALL) is not None


def could_match_below(pattern: str, reldir: str) -> bool:
    """Could a path inside folder `reldir` match `pattern`? (prunes the walk)."""
    pparts = normalize_glob(pattern).split("/")
    dparts = [d for d in reldir.split("/") if d]

    def rec(pi: int, di: int) -> bool:
        if di == len(dparts):
            return pi < len(pparts)  # something after the folder may still match
        if pi == len(pparts):
            return False
        if pparts[pi] == "**":
            return True
        return _component_match(pparts[pi], dparts[di]) and rec(pi + 1, di + 1)

    return rec(0, 0)


def folder_prefix(pattern: str) -> str | None:
    """`checkpoint-*/**` -> `checkpoint-*`: the folders that pattern makes units."""
    p = normalize_glob(pattern)
    if p.endswith("/**") and len(p) > 3:
        prefix = p[:-3]
        # a leading `**/` (any depth) is allowed: the shortest matching ancestor is the unit
        if "**" not in prefix.split("/")[1 if prefix.startswith("**/") else 0:]:
            return prefix
    return None


# --- the policy --------------------------------------------------------------------------------

SELECTS_MEMO_MAX = 200_000


@dataclass
class Policy:
    include: list[str]
    exclude: list[str] = field(default_factory=list)
    excluded_roots: list[str] = field(default_factory=list)  # absolute folders never entered

    def __post_init__(self) -> None:
        self.include = [any_depth(p) for p in self.include]
        self._inc = [glob_regex(p) for p in self.include]
        self._exc = [glob_regex(p) for p in self.exclude]
        self._folders = [re.compile(glob_regex(fp).pattern) for fp in
                         (folder_prefix(p) for p in self.include) if fp]
        self._roots = [os.path.normpath(r) for r in self.excluded_roots if r]
        self._selects: dict[str, bool] = {}

    def selects(self, rel: str) -> bool:
        """Would the file at `rel` be uploaded (name rules, cache rules, globs)? Remembered per
        path: every scan asks again for every file kept (2,600 of them with 200 checkpoints)."""
        hit = self._selects.get(rel)
        if hit is None:
            if len(self._selects) >= SELECTS_MEMO_MAX:
                self._selects.clear()
            hit = self._selects[rel] = self.allowed(rel) and any(r.fullmatch(rel) for r in self._inc)
        return hit

    def allowed(self, rel: str) -> bool:
        """Not ruled out by name (temp, cache, our manifest) or by an exclude glob. Every file
        directly in an adapter folder that is allowed is uploaded with it."""
        if not rel or rel.startswith("/") or ".." in rel.split("/"):
            return False
        name = rel.rsplit("/", 1)[-1]
        if is_manifest_name(name) or has_temp_component(rel) or has_cache_component(rel):
            return False
        return not any(r.fullmatch(rel) for r in self._exc)

    def excluded_by_glob(self, rel: str) -> bool:
        return any(r.fullmatch(rel) for r in self._exc)

    def enter_dir(self, reldir: str, abspath: str | None = None) -> bool:
        """Walk into this folder? False for caches, excluded roots, folders no glob can reach
        and folders an exclude pattern covers entirely."""
        name = reldir.rsplit("/", 1)[-1]
        if is_cache_dir(name):
            return False
        if abspath is not None:
            a = os.path.normpath(abspath)
            if any(a == r or a.startswith(r.rstrip("/") + "/") for r in self._roots):
                return False
        if not any(could_match_below(p, reldir) for p in self.include):
            return False
        probe1, probe2 = f"{reldir}/\x00", f"{reldir}/\x00/\x00"
        return not any(r.fullmatch(probe1) and r.fullmatch(probe2) for r in self._exc)

    def in_cache(self, reldir: str, abspath: str) -> bool:
        """Is this folder a cache (or inside an excluded root)? Such a folder is never training output."""
        a = os.path.normpath(abspath)
        return (any(is_cache_dir(p) for p in reldir.split("/"))
                or any(a == r or a.startswith(r.rstrip("/") + "/") for r in self._roots))

    def ignores_event(self, path: str) -> bool:
        """A file event no rescan should follow: a model download in the HF cache or an excluded
        root writes thousands of times."""
        folder = os.path.dirname(path)
        return self.in_cache(folder.lstrip("/"), folder)

    def folder_unit(self, rel: str) -> str | None:
        """The shortest ancestor folder of file `rel` that an include pattern makes a unit."""
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if any(r.fullmatch(d) for r in self._folders):
                return d
        return None

    def unit_of(self, rel: str, adapter_dirs: set[str]) -> tuple[str, str]:
        """(kind, unit path): ("dir", "checkpoint-5"), ("dir", "adapter") or ("file", rel).
        `adapter_dirs` are the folders (relative, "" for the top) holding adapter_config.json."""
        d = self.folder_unit(rel)
        if d is not None:
            return "dir", d
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if parent in adapter_dirs:
            return "dir", parent
        return "file", rel


# What lives in HF_HOME besides the caches: the login token must never leave the machine.
HF_HOME_PARTS = ("hub", "datasets", "xet", "assets", "modules", "accelerate", "token", "stored_tokens")


def hf_cache_roots(env_sources: list[dict[str, str]], watch_roots: list[str] = ()) -> list[str]:
    """Absolute folders never entered: the caches the HF variables name in any of the
    environments given, plus ~/.cache/huggingface (the default). An HF_HOME that holds a
    watched folder (HF_HOME=/workspace, watch /workspace/out) is not excluded whole: only its
    caches and token are."""
    out: list[str] = []
    watched = [os.path.normpath(w) for w in watch_roots]
    for env in env_sources:
        for k in HF_CACHE_VARS:
            v = env.get(k)
            if not v or not os.path.isabs(v):
                continue
            v = os.path.normpath(v)
            if k == "HF_HOME" and any(w == v or w.startswith(v.rstrip("/") + "/") for w in watched):
                out += [os.path.join(v, p) for p in HF_HOME_PARTS]
            else:
                out.append(v)
    home = os.path.expanduser("~")
    if home and home != "~":
        out.append(os.path.join(home, ".cache", "huggingface"))
    return sorted(set(out))


def excluded_roots(config: Config, env: Mapping[str, str]) -> list[str]:
    """The folders a sync never enters for this config: the HF caches named in `env` (the process's
    own) or in the training's environment (hf_cache_roots)."""
    return hf_cache_roots([dict(env), dict(config.training.env or {})], [w for w in config.sync.watch if w])
