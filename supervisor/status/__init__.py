"""Typed status: each block of `status --json` as a dataclass that says how it reads and what it measures.

A wing hands the daemon its blocks (HasStatus.status_blocks); the daemon writes each block's `to_json()`
into `status --json` (the SPEC's contract: the same keys and values as the wing's dict). The readers
(`supervisorctl status`, the Prometheus metrics, `supervisorctl hosts`, the webhook) get that JSON over
a socket or from a file and read it back with `from_json`: each declared field from its key, by its
annotation; a missing key, a wrong type or an unknown key is "not reported" (the field's default),
never an exception. Then they assemble: `lines(view)` for the status text, `metrics(view)` for
Prometheus. No reader looks a key up by name: a renamed key fails tests/core/test_status_blocks.py (every key
a block writes must be a declared field) instead of silently dropping a line or a metric.
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

P = "train_supervisor_"  # every metric's prefix
MAX_ITEMS = 4096         # a list read back longer than this is cut: the reader's memory is bounded
_BAD = object()          # a value of the wrong type: the field keeps its default

R = TypeVar("R", bound="Record")
B = TypeVar("B", bound="Block")


@dataclass(frozen=True)
class Metric:
    """One sample: None values are left out by the exposition (unknown is never written as 0)."""

    name: str
    kind: str  # gauge | counter
    help: str
    value: Any
    labels: dict[str, Any] | None = None


def gauge(name: str, help_: str, value: Any, labels: dict[str, Any] | None = None) -> Metric:
    return Metric(P + name, "gauge", help_, value, labels)


def counter(name: str, help_: str, value: Any, labels: dict[str, Any] | None = None) -> Metric:
    return Metric(P + name, "counter", help_, value, labels)


def enum(name: str, help_: str, current: Any, values: list[str]) -> list[Metric]:
    """A state as one series per possible value, 1 for the current one (nothing when unknown)."""
    if not isinstance(current, str) or not current:
        return []
    return [gauge(name, help_, 1 if s == current else 0, {"state": s})
            for s in [*values, *([current] if current not in values else [])]]


@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, annotation, default) of each public field, resolved once per class."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if f.name.startswith("_"):
            continue
        out.append((f.name, hints[f.name], f))
    return tuple(out)


def _coerce(tp: Any, v: Any) -> Any:
    """`v` (plain JSON) as `tp`, or _BAD. Bounded: lists are cut at MAX_ITEMS, records read only their
    declared fields, and `object` keeps the value as the JSON parser made it."""
    if tp is object or tp is Any:
        return v
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if v is None:
            return None if type(None) in args else _BAD
        for a in args:
            if a is not type(None) and (got := _coerce(a, v)) is not _BAD:
                return got
        return _BAD
    if tp is bool:
        return v if isinstance(v, bool) else _BAD
    if tp is int:
        return v if isinstance(v, int) and not isinstance(v, bool) else _BAD
    if tp is float:
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else _BAD
    if tp is str:
        return v if isinstance(v, str) else _BAD
    if origin is list:
        if not isinstance(v, list):
            return _BAD
        (arg,) = typing.get_args(tp) or (object,)
        return [x for x in (_coerce(arg, y) for y in v[:MAX_ITEMS]) if x is not _BAD]
    if origin is dict:
        if not isinstance(v, dict):
            return _BAD
        _k, arg = typing.get_args(tp) or (str, object)
        return {k: x for k, x in ((k, _coerce(arg, y)) for k, y in list(v.items())[:MAX_ITEMS])
                if isinstance(k, str) and x is not _BAD}
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.read(v) if isinstance(v, dict) else _BAD
    return _BAD


def _plain(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@dataclass
class Record:
    """A JSON object with declared fields. Read from the daemon's JSON it keeps that dict (`_src`), so
    what it writes back is exactly what it read; built in code it writes its fields."""

    _src: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def read(cls: type[R], raw: Any) -> R:
        """Never raises: a non-dict is an empty record, a field of the wrong type keeps its default."""
        raw = raw if isinstance(raw, dict) else {}
        kw = {}
        for name, tp, _f in _hints(cls):
            if name in raw and (v := _coerce(tp, raw[name])) is not _BAD:
                kw[name] = v
        return cls(_src=raw, **kw)

    def to_dict(self) -> dict:
        if self._src is not None:
            return self._src
        return {name: _plain(getattr(self, name)) for name, _tp, _f in _hints(type(self))}

    @property
    def filled(self) -> bool:
        """The JSON gave this object with something in it (a record built in code: always)."""
        return bool(self._src) if self._src is not None else True

    def unread(self, path: str = "") -> list[str]:
        """Where the dict this record was read from holds what its fields do not: a key not declared,
        or a value of another type than declared (recursively). Empty when the round trip is whole."""
        src = self._src or {}
        declared = {n: (tp, f) for n, tp, f in _hints(type(self))}
        out = []
        for k, v in src.items():
            if k not in declared:
                out.append(f"{path}{k}: not a field of {type(self).__name__}")
                continue
            out += _unread_value(getattr(self, k), v, f"{path}{k}")
        return out


def _unread_value(got: Any, raw: Any, path: str) -> list[str]:
    if isinstance(got, Record):
        return got.unread(path + ".")
    if isinstance(got, list) and isinstance(raw, list):
        if len(got) != len(raw):
            return [f"{path}: {len(raw) - len(got)} item(s) of another type"]
        return [p for i, (g, r) in enumerate(zip(got, raw, strict=True)) for p in _unread_value(g, r, f"{path}[{i}]")]
    if _plain(got) != raw:
        return [f"{path}: {raw!r} read back as {got!r}"]
    return []


@dataclass
class Block(Record):
    """One or more top-level keys of `status --json`. With KEY set the block is that key's object
    (`{"sync": {...}}`) and may be null or absent; with KEY None its fields are top-level keys
    themselves (`gpus` and `gpu_error`)."""

    KEY: ClassVar[str | None] = None
    # Declared fields that may not leave the machine in shared_json() (a webhook): a command line may
    # carry a token. tests/core/test_status_blocks.py checks each is a declared field.
    PRIVATE: ClassVar[tuple[str, ...]] = ()
    _present: bool = field(default=False, repr=False, compare=False)
    _null: bool = field(default=False, repr=False, compare=False)  # KEY's value was null (or absent)
    _given: bool = field(default=False, repr=False, compare=False)  # KEY was in the status at all

    @classmethod
    def of(cls: type[B], value: Any) -> B:
        """The wing's side: its block from the dict it built (KEY set: the key's value; else the
        top-level fragment)."""
        return cls.from_json({cls.KEY: value} if cls.KEY else value)

    @classmethod
    def from_json(cls: type[B], st: Any) -> B:
        """The readers' side: this block out of a whole `status --json` dict; never raises."""
        st = st if isinstance(st, dict) else {}
        if cls.KEY is None:
            names = [n for n, _tp, _f in _hints(cls)]
            b = cls.read({k: st[k] for k in names if k in st})
            b._present = b._given = any(k in st for k in names)
            return b
        raw = st.get(cls.KEY)
        b = cls.read(raw)
        b._present, b._null, b._given = isinstance(raw, dict), raw is None, cls.KEY in st
        return b

    @property
    def reported(self) -> bool:
        """False where the status had no such block (an older daemon, a wing not built, null)."""
        return self._present

    @property
    def given(self) -> bool:
        """The status named this block's key, whatever its value."""
        return self._given

    def to_json(self) -> dict:
        if self.KEY is None:
            return self.to_dict()
        return {self.KEY: None if self._null else self.to_dict()}

    def shared_json(self) -> dict:
        """to_json() less the PRIVATE fields: what this block may say outside the machine."""
        if not self.PRIVATE:
            return self.to_json()
        kept = {k: v for k, v in self.to_dict().items() if k not in self.PRIVATE}
        if self.KEY is None:
            return kept
        return {self.KEY: None if self._null else kept}

    def lines(self, view: View) -> list[str]:
        """This block's lines of `supervisorctl status` (none by default)."""
        return []

    def metrics(self, view: View) -> list[Metric]:
        """This block's Prometheus samples (none by default)."""
        return []


class View:
    """A whole status read back: its time, and each block parsed once, on first ask."""

    def __init__(self, st: Any):
        self.st = st if isinstance(st, dict) else {}
        now = self.st.get("now")
        self.now_known = isinstance(now, (int, float)) and not isinstance(now, bool)
        self.now: float = now if self.now_known else 0
        self._blocks: dict[type, Block] = {}

    def block(self, cls: type[B]) -> B:
        if cls not in self._blocks:
            self._blocks[cls] = cls.from_json(self.st)
        return self._blocks[cls]  # type: ignore[return-value]
