"""The layout stays the architecture (README "How it is built"): wings by concern, arrows one way.

Read from the source with ast, so a new module that breaks a rule fails here and says which."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "supervisor"
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
    "saves": {"store"},  # what a trainer's save is and when it is whole: read by sync, resume, cluster; knows no sync
    "sync": {"notify", "training", "store", "saves"},
    "resume": {"notify", "training", "sync", "store", "saves"},
    "fleet": set(),
    "hooks": {"notify"},
    "money": {"notify", "training", "progress", "sync", "store"},
    "disk": {"notify", "training", "sync", "store"},
    "stop": {"notify"},
    "cluster": {"notify", "training", "sync", "store", "saves"},
}
# The stop wing's rule table: pure data that imports nothing of the product, re-exported by the core's
# states.py so that every wing reads the one table (no wing but stop may import the stop wing).
TABLES = {"supervisor.stop.rules"}
# The top of the core: what wires the wings together or shows them. No wing imports these.
WINGS[:] = sorted(MAY_IMPORT)
TOP_PACKAGES = {"daemon", "cli"}


def is_top(mod: str) -> bool:
    """The daemon's and the CLI's side; a wing's `__main__` (`python -m supervisor.sync`) is an entry point too."""
    parts = mod.split(".")
    return parts[-1] == "__main__" or (len(parts) >= 2 and parts[1] in TOP_PACKAGES)
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


def imports(path: Path, known: dict[str, Path], types: bool = False) -> set[str]:
    """Every supervisor module `path` imports, at the top or inside a function (an import in a
    function is still an arrow); names under `if TYPE_CHECKING:` are types only and skipped, unless
    `types` (a type-only import still ties the two modules: a circle through one is a class carved in two)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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
    return parts[1] if len(parts) >= 2 and parts[1] in WINGS and not is_top(mod) else "core"


KNOWN = modules()
GRAPH = {m: imports(p, KNOWN) - {m} for m, p in KNOWN.items()}
TYPED_GRAPH = {m: imports(p, KNOWN, types=True) - {m} for m, p in KNOWN.items()}  # with the type-only imports


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


def test_at_most_14_modules_sit_directly_in_supervisor():
    """The rest lives in a wing, the core's packages or the entry points (cli/, daemon/): a newcomer
    reads the top level as a table of contents."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 14, f"{len(top)} modules directly in supervisor/: {top}"


def test_the_tables_the_core_reads_import_nothing():
    for t in TABLES:
        assert not GRAPH[t], f"{t} is read by the core and may import nothing of the product"


@pytest.mark.parametrize("graph", [GRAPH, TYPED_GRAPH], ids=["imports", "with_type_only_imports"])
def test_no_import_circle(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
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
    "supervisor.saves.manifest_doc": {"datetime", "hashlib"},  # created_at formatted; the file list's sha256
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


# The standard library's (and one library's) underscore names that are documented API, each with why.
PRIVATE_OK = {
    "_exit": "os._exit: the documented exit without cleanup (a forked child, the daemon's last word)",
    "_getframe": "sys._getframe: documented, CPython's frame for a log line's caller",
    "_replace": "namedtuple's documented API (the underscore only keeps it out of the field names)",
    "_asdict": "namedtuple's documented API",
    "_fields": "namedtuple's documented API",
    "_make": "namedtuple's documented API",
    "_field_defaults": "namedtuple's documented API",
    "_nvmlGetFunctionPointer_cache": "pynvml caches function pointers per process with no public reset; "
                                     "gpu.nvml_library puts another library in its public nvmlLib slot, and "
                                     "pointers into the old one must go with it (gpu/nvml.py _install_lib)",
}
# Underscore names imported from a module that is not ours, each with why.
PRIVATE_IMPORT_OK = {
    ("socketserver", "_SocketWriter"): "the stdlib's sendall-as-a-file, what StreamRequestHandler itself uses "
                                       "unbuffered; a hand copy would drift from it",
}


def own_names(tree: ast.AST) -> set[str]:
    """What a module defines itself: its functions, classes, names, arguments, imports' aliases and
    the attributes it sets on self or cls."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls") \
                and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name.split(".")[0])
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reach_ins(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = own_names(tree)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and private(n.attr):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr not in own and n.attr not in PRIVATE_OK:
                out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:
                sub = f"{n.module}.{a.name}"
                if private(a.name) and sub not in KNOWN and (n.module, a.name) not in PRIVATE_IMPORT_OK:
                    out.append(f"{n.lineno}: from {n.module} import {a.name}")  # an _module: a file, not a name kept inside one
    return out


@pytest.mark.parametrize("mod", sorted(KNOWN))
def test_no_reach_into_another_modules_private_names(mod):
    """`x._name` reads what another module keeps to itself: a class carved in two, or a library's
    inside that changes without notice. A module may use what it defines (self._x, cls._x, its own
    _helpers on any object it made); anything else is asked for through a public name."""
    assert not reach_ins(KNOWN[mod]), f"{mod} reaches into private names: {reach_ins(KNOWN[mod])}"


SYNC_BUDGET = 5000  # lines: sync keeps policy, completeness's use, scan, ledger, manifest and one worker (issue 54)


def test_the_sync_wing_stays_within_its_line_budget():
    n = sum(p.read_text().count("\n") for p in (PKG / "sync").rglob("*.py"))
    assert n < SYNC_BUDGET, f"supervisor/sync/ is {n} lines (budget {SYNC_BUDGET}): what is not sync's own goes to its wing"


def _imports_hub(tree: ast.AST) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "huggingface_hub" for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "huggingface_hub":
            return True
    return False


def hub_private_uses(tree: ast.AST) -> list[str]:
    """huggingface_hub's insides as a module may reach them: a private submodule or name imported,
    `x._name` on anything but self/cls (the library's objects pass through these modules: an op's
    `_upload_mode`, `_remote_oid`), getattr/setattr/hasattr with an underscore name, or a private
    module named in a string. Stricter than reach_ins: a name the module defines itself is no excuse."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [f"{n.lineno}: import {a.name}" for a in n.names
                    if a.name.split(".")[0] == "huggingface_hub" and any(map(private, a.name.split(".")))]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "huggingface_hub":
            if any(map(private, n.module.split("."))) or any(private(a.name) for a in n.names):
                out.append(f"{n.lineno}: from {n.module} import {', '.join(a.name for a in n.names)}")
        elif isinstance(n, ast.Attribute) and private(n.attr) \
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                and n.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(n.args) >= 2 \
                and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) and private(n.args[1].value):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("huggingface_hub.") \
                and any(map(private, n.value.split("."))):
            out.append(f"{n.lineno}: {n.value!r}")
    return out


HUB_MODULES = sorted(m for m, p in KNOWN.items()
                     if m.startswith("supervisor.store.hf") or _imports_hub(ast.parse(p.read_text())))


def test_the_hub_target_uses_only_huggingface_hubs_public_api():
    """The Hub through huggingface_hub's public API only (issue 54): its private parts change
    without notice between releases, and the target's guarantees (what `done` means) must not rest
    on them. Every module that imports the library, and every hf*.py module of the store (they pass
    its objects between them), is checked."""
    assert {"supervisor.store.hf", "supervisor.store.hf_repo", "supervisor.store.hf_stage",
            "supervisor.store.hf_commit"} <= set(HUB_MODULES), HUB_MODULES
    bad = {m: hub_private_uses(ast.parse(KNOWN[m].read_text())) for m in HUB_MODULES}
    assert not {m: v for m, v in bad.items() if v}, bad
    # the check itself sees what the store used to do
    old = ast.parse("def f(op, src, hh):\n"
                    "    op._upload_mode, op._should_ignore = src._upload_mode, src._should_ignore\n"
                    "    ok = getattr(src, '_is_uploaded', False)\n"
                    "    from huggingface_hub._commit_api import _fetch_upload_modes\n"
                    "    import huggingface_hub.utils._http\n"
                    "    return hh.utils._http.default_client_factory\n")
    assert len(hub_private_uses(old)) == 8, hub_private_uses(old)


# EC2's API for the `ec2` stop action (stop/providers/aws.py): boto3 there is an EC2 client, not S3's
BOTO_EC2 = "supervisor.stop.providers.aws"


def _boto_imports(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module or ""] if isinstance(n, ast.ImportFrom) else []
        out |= {m.split(".")[0] for m in names if m.split(".")[0] in ("boto3", "botocore")}
    return out


def test_exactly_one_s3_client():
    """Issue 54: one S3 client, s3_light.py (chosen by tests/bench/bench_engines.py: it wins by a
    margin a user feels). boto3 is no S3 client here (only the EC2 stop action's); botocore is the
    credential chain's library, imported by the credentials module alone, and no client is ever made
    from it; SigV4 for S3 is computed in one module."""
    boto3_users, botocore_users, clients, signers = set(), set(), [], set()
    for mod, path in KNOWN.items():
        text = path.read_text()
        tree = ast.parse(text)
        used = _boto_imports(tree)
        if "boto3" in used:
            boto3_users.add(mod)
        if "botocore" in used:
            botocore_users.add(mod)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in ("client", "create_client", "resource") and n.args \
                    and isinstance(n.args[0], ast.Constant) and n.args[0].value != "ec2":
                clients.append(f"{mod}:{n.lineno}: {ast.unparse(n)}")
            if used and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in ("client", "create_client", "resource") and mod != BOTO_EC2:
                clients.append(f"{mod}:{n.lineno}: {ast.unparse(n)}")
        if "aws4_request" in text or "AWS4-HMAC-SHA256" in text:
            signers.add(mod)
    assert boto3_users <= {BOTO_EC2}, f"boto3 imported by {sorted(boto3_users - {BOTO_EC2})}: S3 goes through s3_light"
    assert botocore_users <= {"supervisor.store.credentials", BOTO_EC2}, sorted(botocore_users)
    assert not clients, f"a boto3/botocore client made outside the EC2 stop action: {clients}"
    assert signers == {"supervisor.store.s3_light"}, f"SigV4 for S3 computed in {sorted(signers)}"


def test_tests_live_by_wing():
    """tests/<wing>/ for each wing, plus core, daemon, cli and e2e: no test file left flat in tests/."""
    tests = PKG.parent / "tests"
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert not flat, f"test files directly in tests/ (put each in tests/<wing>/): {flat}"
    allowed = set(WINGS) | {"core", "daemon", "cli", "e2e"}
    for p in tests.rglob("test_*.py"):
        folder = p.relative_to(tests).parts[0]
        if folder in ("bench", "fixtures", "writers"):
            continue
        assert folder in allowed, f"{p.relative_to(tests)}: tests/{folder}/ is not a wing's folder"
