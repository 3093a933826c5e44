"""The configuration reference (docs/configuration.md), generated from the shipped default config and the schema
in config.py, so the two can never disagree: `python -m supervisor.cli.configdoc` prints the Markdown.

The "default" column is the built-in default. Where the file shows an example instead (a key that
has none, like price_per_hour), the column says "none" or "required" and the example goes to the
description; a value written over several lines (sync.include) is read whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from importlib import resources
from typing import Any

from supervisor import config as C

KEY_LINE = re.compile(r"^#?([a-z0-9_]+) = (.+)$")
SECTION_LINE = re.compile(r"^#?\[([a-z_]+)\]$")


@dataclass(frozen=True)
class Row:
    key: str       # dotted: "sync.include"
    shown: str     # the value as the file writes it, joined onto one line
    desc: str      # the "# " prose right above it
    example: bool  # the value shown is an example, not the default


def _depth(value: str) -> int:
    """Open brackets/braces minus closed ones, outside strings: > 0 means the value goes on."""
    depth, quote, escaped = 0, "", False
    for ch in value:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
    return depth


def _entries(text: str) -> list[tuple[str, str, str]]:
    """(dotted key, value joined onto one line, description) for every key line, active or not."""
    out: list[tuple[str, str, str]] = []
    section = ""
    desc: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if m := SECTION_LINE.match(line):
            section, desc = m.group(1) + ".", []
        elif m := KEY_LINE.match(line):
            parts = [m.group(2).strip()]
            while _depth(" ".join(parts)) > 0 and i < len(lines):
                parts.append(lines[i].lstrip("#").strip())
                i += 1
            out.append((section + m.group(1), " ".join(parts), " ".join(desc)))
            desc = []
        elif line.startswith("# "):
            desc.append(line[2:].strip())
        else:
            desc = []
    return out


def uncomment(text: str) -> str:
    """The file with every "#key = value" (with the continuation lines of a long array) and
    "#[section]" line switched on: what the file would mean if every line shown were set."""
    out, depth = [], 0
    for line in text.splitlines():
        if line.startswith("#") and (depth > 0 or KEY_LINE.match(line) or SECTION_LINE.match(line)):
            line = line[1:]
            if not SECTION_LINE.match(line):
                depth += _depth(line)
        out.append(line)
    return "\n".join(out)


def _field_value(cfg: C.Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        if obj is None:  # an optional section ([email]) that is absent
            obj = C.SECTIONS[key.split(".")[0]]()
        obj = getattr(obj, "from_" if part == "from" else part)
    return obj


def default_of(key: str) -> Any:
    """The built-in default of a dotted key (for [email], that of an [email] section present)."""
    return _field_value(C.Config(), key)


def rows(text: str) -> list[Row]:
    as_set = C.parse(uncomment(text), "default-config.toml with every key set")
    return [Row(key, shown, desc, _field_value(as_set, key) != default_of(key))
            for key, shown, desc in _entries(text)]


def default_cell(row: Row) -> str:
    """What the "default" column says: the value, or "none"/"required" where the file shows an example."""
    if not row.example:
        return f"`{row.shown}`"
    value = default_of(row.key)
    if value is None:
        return "none"
    if re.search(r"\bRequired\b", row.desc):
        return "required"
    return f"`{'true' if value is True else 'false' if value is False else json.dumps(value)}`"


def _cell(s: str) -> str:
    """A table cell: "|" escaped everywhere; "<" and ">" outside code spans, where Markdown would
    take "<hostname>" for an HTML tag and show nothing."""
    parts = s.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def markdown(text: str) -> str:
    parts: list[str] = []
    current = None
    for row in rows(text):
        sec = row.key.split(".")[0] if "." in row.key else ""
        if sec != current:
            current = sec
            title = f"[{sec}]" if sec else "top level"
            parts.append(f"\n**{title}**\n\n| key | default | what it does |\n| --- | --- | --- |")
        desc = row.desc + (f" Example: `{row.shown}`." if row.example else "")
        parts.append(f"| `{row.key}` | {_cell(default_cell(row))} | {_cell(desc)} |")
    return "\n".join(parts).strip() + "\n"


def schema_keys() -> set[str]:
    """Every key a config file may hold, dotted, from the dataclasses (so a new key is seen)."""
    out: set[str] = set()
    for f in dataclasses.fields(C.Config):
        if f.metadata.get("internal"):
            continue
        if f.name in C.SECTIONS:
            out |= {f"{f.name}.{sf.name.rstrip('_')}" for sf in dataclasses.fields(C.SECTIONS[f.name])
                    if not sf.metadata.get("internal")}
        else:
            out.add(f.name.rstrip("_"))
    return out


def default_text() -> str:
    return resources.files("supervisor").joinpath("default-config.toml").read_text(encoding="utf-8")


if __name__ == "__main__":
    sys.stdout.write(markdown(default_text()))
