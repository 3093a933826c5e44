"""The configuration reference (docs/configuration.md) is generated from the shipped default config; keep them equal,
and hold the table itself to the truth: every "default" cell is the built-in default of config.py.
Regenerate with: python -m supervisor.cli.configdoc (and paste between the markers)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from supervisor import config as C
from supervisor.cli.configdoc import default_of, default_text, markdown, rows, schema_keys

README = Path(__file__).resolve().parents[2] / "README.md"
CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| (.+?) \| (.*) \|$")


def _block() -> str:
    text = CONFIG_DOC.read_text()
    start = text.index("<!-- config-reference:start -->") + len("<!-- config-reference:start -->")
    return text[start:text.index("<!-- config-reference:end -->")].strip()


def readme_rows() -> dict[str, tuple[str, str]]:
    """key -> (default cell, description cell), read from docs/configuration.md's table as a person reads it."""
    out = {}
    for line in _block().splitlines():
        if m := ROW.match(line):
            assert m.group(1) not in out, f"{m.group(1)}: two rows in docs/configuration.md"
            out[m.group(1)] = (m.group(2).replace("\\|", "|"), m.group(3))
    return out


def _with(key: str, value) -> dict:
    """A minimal config document that sets `key` to `value` (and what [email] needs besides)."""
    if "." not in key:
        return {key: value}
    section, name = key.split(".", 1)
    table = {"to": ["o@example.com"], "smtp_host": "smtp.example.com"} if section == "email" else {}
    return {section: {**table, name: value}}


def test_readme_config_reference_matches_default_config():
    assert _block() == markdown(default_text()).strip(), \
        "docs/configuration.md is stale: run `python -m supervisor.cli.configdoc` and paste it between the markers"


def test_every_schema_key_has_a_row():
    assert schema_keys() <= {r.key for r in rows(default_text())}
    assert schema_keys() == set(readme_rows())


@pytest.mark.parametrize("key", sorted(schema_keys()))
def test_each_default_in_the_readme_is_the_real_default(key):
    cell, desc = readme_rows()[key]
    real = default_of(key)
    if cell == "none":
        assert real is None, f"{key}: docs/configuration.md says no default, the default is {real!r}"
        return
    if cell == "required":
        assert real in ("", []), f"{key}: docs/configuration.md says required, yet it defaults to {real!r}"
        doc = _with(key, "x")
        del doc[key.split(".")[0]][key.split(".", 1)[1]]
        with pytest.raises(C.ConfigError, match=re.escape(key)):
            C.from_dict(doc)
        return
    assert cell.startswith("`") and cell.endswith("`"), f"{key}: default cell {cell!r} is not a value"
    try:
        value = tomllib.loads(f"v = {cell[1:-1]}")["v"]
    except tomllib.TOMLDecodeError as e:
        pytest.fail(f"{key}: docs/configuration.md's default {cell} is not one whole TOML value ({e})")
    cfg = C.from_dict(_with(key, value))
    section = key.split(".")[0] if "." in key else None
    obj = getattr(cfg, section) if section else cfg
    got = getattr(obj, "from_" if key.endswith(".from") else key.rsplit(".", 1)[-1])
    assert got == real, f"{key}: docs/configuration.md shows {cell}, meaning {got!r}; the default is {real!r}"


def test_an_example_value_is_marked_as_one():
    """The shipped file shows examples for keys without a default; the table must not pass them off
    as defaults (it once showed price_per_hour 3.90 and max_idle_cost 20.0 as defaults)."""
    examples = {r.key: r.shown for r in rows(default_text()) if r.example}
    assert {"price_per_hour", "max_idle_cost", "progress.budget", "email.to", "email.smtp_host"} <= set(examples)
    table = readme_rows()
    for key, shown in examples.items():
        cell, desc = table[key]
        assert shown not in cell and f"Example: `{shown}`" in desc.replace("\\|", "|"), (key, cell, desc)


def test_a_value_written_over_several_lines_stays_in_its_row():
    cell, _ = readme_rows()["sync.include"]
    assert '"*results.json", ' in cell and cell.endswith('"**/*.pth"]`')
    cell, desc = readme_rows()["sync.exclude"]
    assert cell == "`[]`" and "safetensors" not in desc


def test_the_container_quickstart_follows_the_two_commands_and_its_config_is_good():
    """The first screen gets a new user from nothing to a synced, alerted, stoppable run: the
    quickstart comes right after "Try it", and the config it writes passes check-config."""
    from supervisor.config import nothing_watched, parse

    text = README.read_text()
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads[heads.index("Try it: two commands") + 1].startswith("Quickstart: a RunPod or vast.ai container")
    section = text.split("## Quickstart: a RunPod or vast.ai container", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"^cat > /etc/train-supervisor/config\.toml <<'EOF'\n(.*?)^EOF$", section, re.M | re.S)
    assert m, "the quickstart writes the config with a here-document"
    cfg = parse(m.group(1), "README quickstart")
    assert not nothing_watched(cfg) and cfg.sync.watch and cfg.email is not None
    assert cfg.stop.action == "command" and "runpodctl stop pod" in cfg.stop.command
    assert "sudo" not in section.split("```sh", 1)[1].split("```", 1)[0]
    assert "train-supervisor-start" in section and "supervisorctl run -- " in section
