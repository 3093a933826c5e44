"""Typed status (issue 54): every key a wing writes into `status --json` is a declared field of its block
and reads back as the same value; a reader never crashes on what it reads; the two assemblers (the
status text and the Prometheus exposition) do not look status keys up by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from supervisor.cli.render import SCREEN, render_status
from supervisor.daemon.control import request
from supervisor.fleet.metrics import EXPOSED, exposition
from supervisor.status import Block, Record, View
from supervisor.status.alerts import AlertsBlock, NotifyBlock
from supervisor.status.cluster import ClusterBlock
from supervisor.status.gpu import GpusBlock, WasteBlock
from supervisor.status.misc import HooksBlock, MetricsBlock, OrchestratorBlock
from supervisor.status.sync import SyncBlock
from supervisor.status.training import CostBlock, DaemonBlock, TrainingBlock

REPO = Path(__file__).resolve().parents[2]
ALL_BLOCKS: set[type[Block]] = {*SCREEN, *EXPOSED, CostBlock, HooksBlock, MetricsBlock}


def _keys(cls: type[Block]) -> set[str]:
    if cls.KEY:
        return {cls.KEY}
    return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}


def test_every_top_level_key_has_one_block():
    owners: dict[str, type[Block]] = {}
    for cls in ALL_BLOCKS:
        for k in _keys(cls):
            assert k not in owners, f"{k} claimed by {owners[k].__name__} and {cls.__name__}"
            owners[k] = cls


@pytest.fixture
def real_status(make_daemon, tmp_path):
    """A representative status: the real daemon with a sync target, a price, a stop action and a job."""
    w = tmp_path / "w"
    w.mkdir()
    (w / "checkpoint-10").mkdir()
    (w / "checkpoint-10" / "model.safetensors").write_bytes(b"x" * 100)
    d = make_daemon({"price_per_hour": 2.0, "currency": "EUR",
                     "training": {"command": "sleep 30", "workdir": str(w), "log": str(w / "train.log")},
                     "sync": {"target": str(tmp_path / "tgt"), "watch": [str(w)], "quiet_period": "1s"},
                     "stop": {"action": "dry-run"}, "budget": {"max_cost": 50.0},
                     "notify": {"urls": ["json://127.0.0.1:9/x"]}})
    request(d.socket, "start", timeout=10)
    return request(d.socket, "status", timeout=10)


def test_every_key_a_block_writes_reads_back(real_status):
    st = real_status
    claimed = set().union(*(_keys(c) for c in ALL_BLOCKS))
    assert set(st) <= claimed, f"top-level keys no block declares: {set(st) - claimed}"
    rebuilt: dict = {}
    for cls in ALL_BLOCKS:
        b = cls.from_json(st)
        assert not b.unread(), f"{cls.__name__}: {b.unread()}"
        if any(k in st for k in _keys(cls)):
            rebuilt.update(b.to_json())
    assert rebuilt == st  # what the blocks write is today's JSON, key for key


def test_a_block_built_in_code_writes_its_fields_and_reads_them_back():
    b = SyncBlock(target="s3://b/run", state="idle", pending_files=2, partial=["checkpoint-8"])
    back = SyncBlock.from_json(b.to_json())
    assert (back.target, back.state, back.pending_files, back.partial) == ("s3://b/run", "idle", 2, ["checkpoint-8"])
    assert not back.unread()


HOSTILE = [None, 0, "x", [], {}, {"training": "RUNNING"}, {"training": {"progress": [1]}, "now": "soon"},
           {"gpus": {"0": 1}, "gpu_error": 5}, {"gpus": [None, {"index": "0", "processes": "many"}]},
           {"sync": {"state": 3, "waiting": [{"unit": None}], "target_behind": "x", "pending_files": "2"}},
           {"idle": {"state": "IDLE", "reasons": "ssh"}, "stop": {"provider": [], "confirmed": {}, "final_sync": 1}},
           {"budget": {"cap": {"kind": 5}, "projection": "soon"}}, {"disk": {"filesystems": [1, {"line": 2}]}},
           {"alerts": [1, {"severity": []}], "notify": None}, {"health": {"verdict": "BAD", "gpus": [{}]}},
           {"resume": {"enabled": True, "state": "restoring", "progress": None}},
           {"cluster": {"nodes": [{"rank": "a"}], "trust": "yes"}}, {"preemption": {"notice": {}, "previous": 3}},
           {"orchestrator": {"name": 1}}, {"training": {"progress": {"started_at": 1.0, "step": 10**400}}},
           {"training": {"progress": {"started_at": 1.0, "step": 5, "max_steps": "ten"}}}]


@pytest.mark.parametrize("st", HOSTILE, ids=range(len(HOSTILE)))
def test_readers_never_raise_on_odd_status(st):
    """Unknown, missing or wrongly typed keys are "not reported": the screen and the metrics still come."""
    render_status(st)
    exposition(st)
    for cls in ALL_BLOCKS:
        cls.from_json(st).to_json()


def test_a_missing_block_is_not_reported_and_says_nothing():
    v = View({"now": 1.0})
    for cls in (SyncBlock, ClusterBlock, OrchestratorBlock, NotifyBlock):
        assert not v.block(cls).reported and v.block(cls).lines(v) == []
    assert v.block(GpusBlock).lines(v) == [] and v.block(WasteBlock).lines(v) == []
    assert [m for m in v.block(SyncBlock).metrics(v) if m.value is not None] == []
    assert AlertsBlock.from_json({}).lines(v) == ["alerts    none active"]
    assert isinstance(TrainingBlock.from_json({}).progress, Record) and DaemonBlock.from_json(None).version is None


# --- the assemblers read blocks, not keys -----------------------------------------------------------------
# render.py's other screens read other answers: `supervisorctl alerts` (the alert log) and `supervisorctl
# health` (the health verb's own dict); they are not the status blocks and are left out of the check.
NOT_STATUS = {"_delivery_note", "render_alerts", "render_health", "_cell"}


def _key_lookups(path: Path, skip: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in skip for n in ast.walk(f)}
    out = []
    for n in ast.walk(tree):
        if id(n) in skipped:
            continue
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args \
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


# fleet/hosts.py reads a status from each machine (idle-check, status --host) through View; what is left
# of it (parse the hosts file, run ssh, read its exit code and stdout) reads no dict at all, and
# verdict_text reads idle-check's own answer back through its Verdict dataclass. notify/webhook.py's
# only status reader is facts_for, which picks blocks by class; nothing else in it reads a dict by key.
READERS = [("supervisor/cli/render.py", NOT_STATUS), ("supervisor/fleet/metrics.py", set()),
           ("supervisor/fleet/hosts.py", set()), ("supervisor/notify/webhook.py", set())]


@pytest.mark.parametrize("path,skip", READERS)
def test_the_assemblers_look_up_no_status_key_by_name(path, skip):
    assert not _key_lookups(REPO / path, skip)


def test_what_a_block_keeps_private_is_a_field_it_declares():
    for cls in ALL_BLOCKS:
        assert set(cls.PRIVATE) <= {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_the_fleet_and_the_webhook_read_the_blocks_a_real_daemon_writes(real_status):
    """A renamed key would show here: the one-line view and the webhook's facts say what the daemon wrote."""
    from supervisor.fleet.hosts import HostResult, host_line, idle_verdict
    from supervisor.notify.webhook import facts_for

    st = real_status
    line = host_line(HostResult("m", True, st))
    assert f" {st['training']['state']:<10} " in line and f"idle {st['idle']['state']}" in line
    assert idle_verdict(st)["state"] == st["idle"]["state"]
    facts = facts_for("stopping", st)
    assert [k for k in facts] == ["idle", "stop", "sync", "cost", "at"] and facts["sync"] == st["sync"]
    shared = facts_for("training_failed", st)["training"]
    assert "command" in st["training"] and "command" not in shared
    assert shared == {k: v for k, v in st["training"].items() if k != "command"}


def test_the_health_block_reads_every_field_a_gpu_health_reading_has():
    # status/health.py HealthGpu is the read side of gpu/health.py GpuHealth (frozen, `index` required,
    # built from NVML): it reads another daemon's JSON, where any field may be missing, so it is its
    # own type; the two must not drift apart
    from supervisor.gpu.health import GpuHealth
    from supervisor.status.health import HealthGpu

    assert [f.name for f in dataclasses.fields(HealthGpu) if not f.name.startswith('_')] == [f.name for f in dataclasses.fields(GpuHealth)]
    g = GpuHealth(index=3, name="H100", ecc_uncorrected_volatile=2, temp_c=71, power_w=650.5)
    assert HealthGpu.read(dataclasses.asdict(g)) == HealthGpu(**dataclasses.asdict(g))
