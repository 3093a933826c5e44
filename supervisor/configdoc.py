"""The README's configuration reference, generated from the shipped default config so the two can
never disagree: `python -m supervisor.configdoc` prints the Markdown tables."""

from __future__ import annotations

import re
import sys
from importlib import resources

_KEY = re.compile(r"^#?\s*([a-z0-9_]+)\s*=\s*(.+)$")
_SECTION = re.compile(r"^#?\s*\[([a-z_]+)\]\s*$")


def rows(text: str) -> list[tuple[str, str, str]]:
    """(dotted key, default as written, description) for every key in the commented config."""
    out: list[tuple[str, str, str]] = []
    section = ""
    desc: list[str] = []
    header_done = False
    for raw in text.splitlines():
        line = raw.strip()
        m = _SECTION.match(line)
        if m:
            section, desc, header_done = m.group(1), [], True
            continue
        m = _KEY.match(line)
        if m and (header_done or not line.startswith("# ")):
            key = f"{section}.{m.group(1)}" if section else m.group(1)
            out.append((key, m.group(2).strip(), " ".join(desc).strip()))
            desc = []
            header_done = True
            continue
        if line.startswith("#"):
            desc.append(line.lstrip("#").strip())
        elif not line:
            desc = [] if not header_done else desc
    return out


def markdown(text: str) -> str:
    parts: list[str] = []
    current = None
    for key, default, desc in rows(text):
        sec = key.split(".")[0] if "." in key else ""
        if sec != current:
            current = sec
            parts.append(f"\n**{'[' + sec + ']' if sec else 'top level'}**\n\n| key | default | what it does |\n| --- | --- | --- |")
        d = desc.replace("|", "\\|")
        parts.append(f"| `{key}` | `{default.replace('|', '/')}` | {d} |")
    return "\n".join(parts).strip() + "\n"


def default_text() -> str:
    return resources.files("supervisor").joinpath("default-config.toml").read_text(encoding="utf-8")


if __name__ == "__main__":
    sys.stdout.write(markdown(default_text()))
