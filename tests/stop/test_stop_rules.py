"""The rule table (issue 51): one row per reason written with keywords, every column read, and where
each stop setting lives (check-config prints it from the table)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import from_dict
from supervisor.stop import rules
from supervisor.stop.rules import SEQUENCE_SETTINGS, SETTINGS, STOP_RULES, StopReason, StopRule, notice

REPO = Path(__file__).resolve().parents[2]


def test_every_row_is_written_with_keywords_and_every_column_is_read():
    with pytest.raises(TypeError):
        StopRule("none", False, False, 4, True, "the spend cap")  # positional rows are refused
    columns = {f.name for f in dataclasses.fields(StopRule)}
    source = "\n".join(p.read_text() for p in (REPO / "supervisor").rglob("*.py") if p.name != "rules.py")
    for c in columns:
        assert f".{c}" in source, f"the column {c} is never read outside the table"
    assert "CAP_REASONS" not in source  # what a cap may cut is the table's cuts_sync_short alone


def test_the_notice_comes_from_the_table():
    assert notice("idle", 3600, 600) == 3600 and notice("idle", 60, 600, announced=300) == 300  # never sooner
    assert notice("stalled", 3600, 600) == 3600 and notice("waste", 90, 600) == 90
    assert notice("finished", 3600, 600) == 600 and notice("failed", 3600, 600, announced=120) == 120
    for word in ("max_cost", "deadline", "gpu_bad", "node_lost", "preemption", "manual"):
        assert notice(word, 3600, 600) == 0
    assert STOP_RULES[StopReason.PREEMPTION].interrupt == "none" and STOP_RULES[StopReason.NODE_LOST].hung
    assert rules.is_cap("max_cost") and rules.is_cap("preemption") and not rules.is_cap("gpu_bad")


def test_every_reason_has_its_settings_and_each_key_is_in_the_config():
    named = {w for words in SETTINGS for w in words.split()}
    assert named == {r.value for r in StopReason}
    cfg = from_dict({})
    for key in {k for ks in SETTINGS.values() for k in ks} | set(SEQUENCE_SETTINGS):
        x: object = cfg
        for part in key.split("."):
            assert dataclasses.is_dataclass(x) and part in {f.name for f in dataclasses.fields(x)}, key
            x = getattr(x, part)


def test_check_config_says_where_each_stop_setting_lives(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('state_dir = "/var/lib/train-supervisor"\nprice_per_hour = 2.5\n[budget]\nmax_cost = 50\n'
                 '[gpu]\non_waste = "stop"\n')
    r = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "check-config", str(p)], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "stop settings (supervisor/stop/rules.py" in out, out
    assert "budget.max_cost = 50.0" in out and "gpu.on_waste = stop" in out and "training.finish_grace = 10m00s" in out
    assert "supervisorctl stop-machine (root)" in out and "stop.final_sync_timeout = 30m00s" in out
