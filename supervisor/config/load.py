"""Reading a config: TOML to the dataclasses of schema.py, each value converted and checked against
its declaration, every problem collected (one line each, naming the key) and raised at once."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from supervisor.config.checks import cross_checks
from supervisor.config.schema import (
    DEFAULT_PATH,
    ENV_VAR,
    SECTIONS,
    Config,
    ConfigError,
    HookConfig,
    keyname,
    show_value,
)
from supervisor.durations import format_bytes, format_duration, parse_duration, parse_size


def _toml_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")  # `from` is a keyword


def _limit(meta: dict, which: str) -> str:
    v = meta[which]
    if meta["kind"] == "size":
        return format_bytes(v)
    if meta["kind"] not in ("duration", "optduration"):
        return f"{v:g}"
    return f"{v * 1000:g}ms" if v < 1 else format_duration(v)


def _convert(key: str, meta: dict, value: Any, problems: list[str]) -> Any:
    kind = meta["kind"]
    bad = _BAD
    out: Any = bad
    if kind in ("str", "path", "choice", "url"):
        if not isinstance(value, str):
            problems.append(f"{key}: expected a string, got {show_value(value)}")
            return bad
        if kind == "choice" and value not in meta["choices"]:
            problems.append(f"{key}: expected one of {', '.join(meta['choices'])}, got {show_value(value)}")
            return bad
        if kind == "url" and value and not re.match(r"^https?://[^\s/]+", value):
            problems.append(f"{key}: expected an http:// or https:// URL, got {show_value(value)}")
            return bad
        if "\x00" in value:
            problems.append(f"{key}: contains a NUL byte")
            return bad
        # Relative paths would resolve against the daemon's cwd, which under systemd is "/".
        if kind == "path" and value and not os.path.isabs(value):
            problems.append(f"{key}: expected an absolute path, got {show_value(value)}")
            return bad
        out = value
    elif kind == "bool":
        if not isinstance(value, bool):
            problems.append(f"{key}: expected true or false, got {show_value(value)}")
            return bad
        out = value
    elif kind in ("int", "optint"):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}: expected a whole number, got {show_value(value)}")
            return bad
        out = value
    elif kind in ("float", "optfloat"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{key}: expected a number, got {show_value(value)}")
            return bad
        out = float(value)
        if not math.isfinite(out):
            problems.append(f"{key}: expected a finite number, got {value!r}")
            return bad
    elif kind == "optduration" and value == "":
        return None  # written out as unset: the built-in rule applies
    elif kind in ("duration", "optduration"):
        if not isinstance(value, str):
            problems.append(f'{key}: expected a duration like "2h", got {show_value(value)}')
            return bad
        try:
            out = parse_duration(value)
        except ValueError:
            problems.append(f'{key}: expected a duration like "2h", got {show_value(value)}')
            return bad
    elif kind == "size":
        try:
            if not isinstance(value, (str, int)):
                raise TypeError
            out = parse_size(value)
        except (ValueError, TypeError):
            problems.append(f'{key}: expected a size like "64M", got {show_value(value)}')
            return bad
    elif kind == "strlist":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            problems.append(f"{key}: expected a list of strings, got {show_value(value)}")
            return bad
        out = list(value)
    elif kind == "strdict":
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a table of strings, got {show_value(value)}")
            return bad
        wrong = [k for k, v in value.items() if not isinstance(v, str)]
        for k in wrong:
            problems.append(f"{key}.{keyname(k)}: expected a string, got {show_value(value[k])}")
        if wrong:
            return bad
        out = dict(value)
    if meta.get("min") is not None and isinstance(out, (int, float)) and out < meta["min"]:
        problems.append(f"{key}: must be at least {_limit(meta, 'min')}, got {show_value(value)}")
        return bad
    if meta.get("max") is not None and isinstance(out, (int, float)) and out > meta["max"]:
        problems.append(f"{key}: must be at most {_limit(meta, 'max')}, got {show_value(value)}")
        return bad
    return out


def _fill(obj: Any, prefix: str, table: dict, problems: list[str]) -> None:
    fields = {_toml_name(f): f for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
    for name, value in table.items():
        key = f"{prefix}{keyname(name)}"
        if name == "hooks" and not prefix:
            obj.hooks = _hooks(value, problems)
            continue
        f = fields.get(name)
        if f is None:
            hint = _close_match(name, fields)
            problems.append(f"{key}: unknown key" + (f" (did you mean {prefix}{hint}?)" if hint else ""))
            continue
        if name in SECTIONS and not prefix:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a [{name}] table, got {show_value(value)}")
                continue
            sub = SECTIONS[name]()
            _fill(sub, f"{name}.", value, problems)
            setattr(obj, f.name, sub)
            continue
        converted = _convert(key, f.metadata, value, problems)
        if converted is not _BAD:
            setattr(obj, f.name, converted)


_BAD = object()  # what _convert returns for a value it already reported


def _hooks(value: Any, problems: list[str]) -> list[HookConfig]:
    """[[hooks]]: an array of tables, each read like a section (`hooks[0].run: ...` names a problem)."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        problems.append(f"hooks: expected [[hooks]] tables, got {show_value(value)}")
        return []
    out = []
    for i, table in enumerate(value):
        h = HookConfig()
        _fill(h, f"hooks[{i}].", table, problems)
        out.append(h)
    return out


def _close_match(name: str, fields: dict) -> str | None:
    import difflib

    m = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.75)
    return m[0] if m else None


def parse(text: str, source: str = "<string>") -> Config:
    """Config from TOML text; ConfigError listing every problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{source}: not valid TOML: {e}"]) from None
    return from_dict(data, source)


def from_dict(data: dict, source: str = "<dict>") -> Config:
    problems: list[str] = []
    cfg = Config()
    _fill(cfg, "", data, problems)
    cfg.source = source
    cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def resolve_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get(ENV_VAR) or DEFAULT_PATH


def load(path: str | None = None) -> Config:
    """Load the config file. A missing default file means the embedded defaults (a fresh install
    without a config still reports status); a missing explicit file is an error."""
    p = resolve_path(path)
    explicit = bool(path or os.environ.get(ENV_VAR))
    try:
        text = Path(p).read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise ConfigError([f"{p}: config file not found"]) from None
        return Config()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{p}: cannot read config file: {e}"]) from None
    return parse(text, p)


def redacted(cfg: Config) -> dict:
    """The config as plain data for status. Passwords and secrets live in files, so only their paths
    appear; URLs that may carry a token (Apprise URLs, the webhook URL) are shown redacted."""
    d = dataclasses.asdict(cfg)
    n = d.get("notify") or {}
    n["urls"] = [redact_url(u) for u in n.get("urls", [])]
    if n.get("webhook_url"):
        n["webhook_url"] = redact_url(n["webhook_url"])
    return d


def redact_url(url: str) -> str:
    """A URL safe to show: for Slack, Discord or Telegram even the "host" part is a token, so only
    the scheme is kept; for schemes whose host is a real server, the host too. User, password, path
    and query are always hidden (the daemon shows Apprise's own redaction where it can)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://(?:[^@/?#]*@)?([^/?#]*)(.*)$", url)
    if not m:
        return "***"
    scheme, host, rest = m.groups()
    if scheme.lower() not in _HOST_SCHEMES:
        return f"{scheme}://***"
    return f"{scheme}://{host}" + ("/***" if rest.strip("/") else "")


# Schemes whose host part names a server rather than holding a credential.
_HOST_SCHEMES = frozenset({"http", "https", "json", "jsons", "xml", "xmls", "form", "forms",
                           "gotify", "gotifys", "mailto", "mailtos", "matrix", "matrixs", "mqtt", "mqtts"})
