"""The commented default config that install.sh writes: it parses, it documents every key of the
schema in config.py, and the defaults it shows are the real ones."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

import pytest

from supervisor import config as C
from supervisor.cli.configdoc import uncomment

# Keys whose commented line shows an example rather than the default (the default is "unset").
EXAMPLES = {"price_per_hour", "max_idle_cost", "progress.budget", "email.to", "email.from", "email.smtp_host",
            "budget.max_cost", "budget.deadline", "budget.max_runtime", "cluster.rank"}

KEY_LINE = re.compile(r"^#?([a-z0-9_]+) = (.+)$")
SECTION_LINE = re.compile(r"^#?\[([a-z_]+)\]$")


def text() -> str:
    return (resources.files("supervisor") / "default-config.toml").read_text(encoding="utf-8")


def schema_keys() -> dict[str, dataclasses.Field]:
    """Every key a config file may hold, dotted, from the dataclasses (so a new key is seen)."""
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(C.Config):
        name = f.name.rstrip("_")
        if f.metadata.get("internal") or name in C.SECTIONS:
            continue
        out[name] = f
    for section, cls in C.SECTIONS.items():
        for f in dataclasses.fields(cls):
            if not f.metadata.get("internal"):
                out[f"{section}.{f.name.rstrip('_')}"] = f
    return out


def documented() -> dict[str, tuple[int, str]]:
    """Dotted key -> (line number, line) for each key line, active or commented out."""
    section = ""
    seen: dict[str, tuple[int, str]] = {}
    for i, line in enumerate(text().splitlines()):
        if m := SECTION_LINE.match(line):
            section = m.group(1) + "."
        elif m := KEY_LINE.match(line):
            key = section + m.group(1)
            assert key not in seen, f"{key} documented twice (lines {seen[key][0] + 1} and {i + 1})"
            seen[key] = (i, line)
    return seen


def test_default_config_parses_to_the_built_in_defaults():
    cfg = C.parse(text(), "default-config.toml")
    assert dataclasses.replace(cfg, source="x") == dataclasses.replace(C.Config(), source="x")


def test_every_schema_key_is_documented_in_its_section():
    doc = documented()
    missing = sorted(set(schema_keys()) - set(doc))
    assert not missing, f"add these keys, each with a comment line above, to supervisor/default-config.toml: {missing}"
    assert not sorted(set(doc) - set(schema_keys())), "keys in the default config that config.py lacks"


def comment_above(i: int) -> str:
    """The block of '# ' prose lines directly above line i."""
    lines = text().splitlines()
    block = []
    while i > 0 and lines[i - 1].startswith("# "):
        i -= 1
        block.insert(0, lines[i][2:])
    return " ".join(block)


def test_every_key_has_a_comment_right_above():
    bare = [f"{key} (line {i + 1})" for key, (i, _) in documented().items() if not comment_above(i)]
    assert not bare, f"each key needs a '# what it does' line right above it: {bare}"


def test_shown_defaults_are_the_real_defaults():
    cfg = C.parse(uncomment(text()), "uncommented default-config.toml")
    default = C.Config()
    default.email = C.EmailConfig()
    wrong = []
    for key in schema_keys():
        if key in EXAMPLES:
            continue
        a, b = cfg, default
        for part in key.split("."):
            part = "from_" if part == "from" else part
            a, b = getattr(a, part), getattr(b, part)
        if a != b:
            wrong.append(f"{key}: the file shows {a!r}, the default is {b!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_example_values_say_so(key):
    i, _ = documented()[key]
    assert re.search(r"No default|Required|\(default:", comment_above(i)), \
        f"{key}: its comment must say the value shown is an example (no default / required)"


def test_safe_defaults():
    cfg = C.parse(text())
    assert cfg.training.command == "" and not cfg.training.autostart
    assert cfg.sync.target == "" and cfg.email is None
    assert cfg.idle.warn_after == 7200 and cfg.idle.stop_after_warning == 3600
    # issue 52: the provider's own stop where one is found, poweroff only where that ends billing
    assert cfg.stop.action == "auto" and cfg.stop.mode == "stop" and not cfg.stop.stop_even_if_sync_fails
