"""The README's configuration reference is generated from the shipped default config; keep them equal.
Regenerate with: python -m supervisor.configdoc (and paste between the markers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from supervisor import config
from supervisor.configdoc import default_text, markdown, rows

README = Path(__file__).resolve().parents[1] / "README.md"


def _block() -> str:
    text = README.read_text()
    start = text.index("<!-- config-reference:start -->") + len("<!-- config-reference:start -->")
    return text[start:text.index("<!-- config-reference:end -->")].strip()


def test_readme_config_reference_matches_default_config():
    assert _block() == markdown(default_text()).strip(), \
        "README config reference is stale: run `python -m supervisor.configdoc` and paste it between the markers"


def test_every_schema_key_has_a_row():
    keys = {k for k, _, _ in rows(default_text())}
    want = set()
    for f in dataclasses.fields(config.Config):
        if f.metadata.get("internal"):
            continue
        if f.name in config.SECTIONS:
            for sf in dataclasses.fields(config.SECTIONS[f.name]):
                want.add(f"{f.name}.{sf.name.rstrip('_')}")
        else:
            want.add(f.name)
    assert want <= keys, sorted(want - keys)
