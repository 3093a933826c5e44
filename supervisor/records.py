"""Loading a dataclass back from the JSON this code wrote, with every field's type checked.

State files outlive daemons and can be damaged, hand-edited or written by another version; a wrong
type must become a clear ValueError naming the file and the field (the caller sets the file aside
and starts over), never a TypeError deep inside a poll or a live job judged by a string `run_id`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _fits(v: Any, tp: Any) -> tuple[bool, Any]:
    """(accepted, value converted to the field's type) for one value against one annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            ok, out = _fits(v, alt)
            if ok:
                return True, out
        return False, None
    if tp is type(None):
        return v is None, None
    if tp is Any:
        return True, v
    if tp is bool:
        return isinstance(v, bool), v
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), v
    if tp is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok, float(v) if ok else None
    if tp is str:
        return isinstance(v, str), v
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return True, tp(v)
        except ValueError:
            return False, None
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(v, list):
            return False, None
        args = typing.get_args(tp)
        if origin is list and args:
            out = []
            for x in v:
                ok, y = _fits(x, args[0])
                if not ok:
                    return False, None
                out.append(y)
            return True, out if origin is list else tuple(out)
        return True, list(v) if (origin or tp) is list else tuple(v)
    if origin is dict or tp is dict:
        return isinstance(v, dict), v
    return False, None


def _describe(tp: Any) -> str:
    names = {bool: "true/false", int: "a whole number", float: "a number", str: "a string",
             type(None): "null", list: "a list", dict: "an object"}
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}" if typing.get_args(tp) else "a list"
    return names.get(origin or tp, getattr(tp, "__name__", str(tp)))


def load(cls: type[T], d: Any, what: str, *, skip: tuple[str, ...] = ()) -> T:
    """An instance of dataclass `cls` from JSON object `d`: missing fields keep their defaults, unknown
    keys are ignored (a newer version's extras), a field of the wrong type raises ValueError naming
    `what` and the field. Fields in `skip` are left at their defaults for the caller to fill."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} is not a JSON object")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip or f.name not in d or not f.init:
            continue
        ok, value = _fits(d[f.name], hints[f.name])
        if not ok:
            raise ValueError(f"{what}: {f.name} should be {_describe(hints[f.name])}, got {d[f.name]!r:.60}")
        kwargs[f.name] = value
    return cls(**kwargs)
