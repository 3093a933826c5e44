"""The layout stays the architecture (README "How it is built"): wings by concern, arrows one way.

Read from the source with ast, so a new module that breaks a rule fails here and says which."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "supervisor"
WINGS: list[str] = []  # filled below from MAY_IMPORT: a folder not named there is part of the core
# folders of the core's lower half, open to every wing: the config, the readers of bytes the
# daemon does not own (every wing reads some), and the typed status blocks (each wing returns its own)
CORE_PACKAGES = {"config", "untrusted", "status"}
# The one-way flow between wings; the core's lower half is open to every wing.
MAY_IMPORT = {
    "notify": set(),
    "training": {"notify"},
    "progress": {"notify", "training"},
    "idle": {"notify", "training", "progress", "hooks", "stop"},
    "gpu": {"notify", "training"},
    "spot": {"notify", "training"},
    "store": set(),  # bytes on the target: sync and resume use it, it knows neither
    "sync": {"notify", "training", "store"},
    "resume": {"notify", "training", "sync", "store"},
    "fleet": set(),
    "hooks": {"notify"},
    "money": {"notify", "training", "progress", "sync", "store"},
    "disk": {"notify", "training", "sync", "store"},
    "stop": {"notify"},
    "cluster": {"notify", "training", "sync", "store"},
}
# The stop wing's rule table: pure data that imports nothing of the product, re-exported by the core's
# states.py so that every wing reads the one table (no wing but stop may import the stop wing).
TABLES = {"supervisor.stop.rules"}
# The top of the core: what wires the wings together or shows them. No wing imports these.
WINGS[:] = sorted(MAY_IMPORT)
TOP_PACKAGES = {"daemon", "cli"}


def is_top(mod: str) -> bool:
    parts = mod.split(".")
    return mod == "supervisor.__main__" or (len(parts) >= 2 and parts[1] in TOP_PACKAGES)
# What a pure module may import from the standard library: data, text and arithmetic, no I/O.
PURE_STDLIB = {"__future__", "dataclasses", "typing", "collections", "collections.abc", "enum", "math",
               "re", "json", "ast", "decimal", "functools", "struct", "itertools", "fnmatch"}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every supervisor module `path` imports, at the top or inside a function (an import in a
    function is still an arrow); names under `if TYPE_CHECKING:` are types only and skipped."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("supervisor"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("supervisor"))
    return {m for m in found if m in known}


def wing_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in WINGS else "core"


KNOWN = modules()
GRAPH = {m: imports(p, KNOWN) - {m} for m, p in KNOWN.items()}


def test_every_wing_says_what_it_owns_and_its_arrows():
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()} - CORE_PACKAGES - TOP_PACKAGES
    assert folders == set(MAY_IMPORT), "a new wing needs its line in MAY_IMPORT and README"
    for w in WINGS:
        doc = importlib.import_module(f"supervisor.{w}").__doc__ or ""
        assert "May import:" in doc and "Imported by:" in doc and "Pure:" in doc, w


@pytest.mark.parametrize("mod", sorted(KNOWN))
def test_arrows_go_one_way(mod):
    w = wing_of(mod)
    for dep in GRAPH[mod]:
        dw = wing_of(dep)
        if dw == "core":
            assert w == "core" or not is_top(dep), f"{mod} imports {dep}: no wing imports the daemon's side"
            if w == "core" and not is_top(mod):
                assert not is_top(dep), f"{mod} (core) imports {dep} (top)"
        elif w == "core":
            assert is_top(mod) or dep in TABLES, f"{mod} is core but imports the {dw} wing ({dep})"
        elif dw != w:
            assert dw in MAY_IMPORT[w], f"{mod} imports {dep}: {w} may import only {sorted(MAY_IMPORT[w])}"


def test_the_tables_the_core_reads_import_nothing():
    for t in TABLES:
        assert not GRAPH[t], f"{t} is read by the core and may import nothing of the product"


def test_no_import_circle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


# The core's pure modules: values, words and rules that a wing's pure module may build on.
CORE_PURE = {"supervisor.states", "supervisor.requests", "supervisor.errors", "supervisor.durations", "supervisor.interfaces", "supervisor.records",
             "supervisor.timefmt", "supervisor.config.schema", "supervisor.config.cluster",
             "supervisor.untrusted", *(f"supervisor.untrusted.{p.stem}" for p in (PKG / "untrusted").glob("[!_]*.py")
                                    if p.stem != "fileopen"),  # fileopen opens files: the readers' one shell
             "supervisor.status", *(f"supervisor.status.{p.stem}" for p in (PKG / "status").glob("[!_]*.py"))}
# A pure module's standard-library imports beyond PURE_STDLIB, each with why no I/O comes of it.
ALLOWED = {
    "supervisor.timefmt": {"datetime"},                    # formats a time it is handed; never reads the clock
    "supervisor.sync.manifest_doc": {"datetime", "hashlib"},  # created_at formatted; the file list's sha256
    "supervisor.sync.policy": {"os"},                      # os.path's string functions (and ~ for the HF cache)
    "supervisor.requests": {"os"},                         # os.path.isabs on the folder a request names
    "supervisor.records": {"types"},                       # the annotations' union types
    "supervisor.status": {"types"},                        # the annotations' union types
    "supervisor.untrusted.signed": {"hashlib", "hmac"},    # a run's documents signed with its shared key
}


def pure_modules() -> set[str]:
    out = set(CORE_PURE)
    for w in WINGS:
        wing = importlib.import_module(f"supervisor.{w}")
        for name in wing.PURE:
            base = f"supervisor.{w}.{name}"
            out.update(m for m in KNOWN if m == base or m.startswith(base + "."))
    return out


def test_pure_modules_do_no_io():
    for mod in sorted(pure_modules()):
        for node in ast.walk(ast.parse(KNOWN[mod].read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for n in names:
                if not n.startswith("supervisor"):
                    assert n in PURE_STDLIB | ALLOWED.get(mod, set()), f"{mod} is listed pure but imports {n}"


def test_a_pure_module_imports_only_pure_modules():
    """Purity follows the imports: a decision that calls into a shell module is not pure (types
    under TYPE_CHECKING are not imports)."""
    pure = pure_modules()
    for mod in sorted(pure):
        for dep in sorted(GRAPH[mod]):
            parent = dep.rsplit(".", 1)[0]
            assert dep in pure or (dep not in KNOWN and parent in pure), f"{mod} is pure but imports {dep}, a shell"


@pytest.mark.parametrize("mod", sorted(KNOWN))
def test_no_module_over_600_lines_no_class_over_400(mod):
    text = KNOWN[mod].read_text()
    assert text.count("\n") <= 600, f"{mod}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            n = node.end_lineno - node.lineno + 1
            assert n <= 400, f"{mod}.{node.name}: {n} lines"


def test_each_wing_receives_its_own_config_section_not_the_whole_config():
    """Context carries the clock, the store and the alerts only; a wing's constructor names the section
    it reads (or a small view of the config built by the daemon), never the whole Config."""
    import dataclasses
    import inspect

    from supervisor.cluster.watch import ClusterWatch
    from supervisor.context import Context
    from supervisor.disk.floor import DiskFloor
    from supervisor.disk.watch import DiskWatch
    from supervisor.gpu.healthwatch import HealthWatch
    from supervisor.gpu.hostcheck import HostCheck
    from supervisor.gpu.monitor import GpuMonitor
    from supervisor.gpu.oom import OomDetector
    from supervisor.gpu.wastewatch import WasteWatch
    from supervisor.idle.guard import IdleGuard
    from supervisor.money.guard import MoneyGuard
    from supervisor.money.runledger import RunLedger
    from supervisor.progress.stallwatch import StallWatch
    from supervisor.progress.tracker import ProgressTracker
    from supervisor.resume.gate import ResumeGate
    from supervisor.spot.guard import SpotGuard
    from supervisor.sync.engine import SyncEngine
    from supervisor.training.job import Training

    assert {f.name for f in dataclasses.fields(Context)} == {"clock", "store", "alerts"}
    for cls in (Training, GpuMonitor, OomDetector, HostCheck, StallWatch, SpotGuard, DiskWatch, DiskFloor, HealthWatch,
                ProgressTracker, MoneyGuard, IdleGuard, WasteWatch, ResumeGate, RunLedger, SyncEngine, ClusterWatch):
        for p in inspect.signature(cls.__init__).parameters.values():
            assert p.annotation not in ("Config", "Config | None"), f"{cls.__name__}({p.name}: Config)"
