"""JSON, numbers and text from bytes the daemon does not own. Pure; nothing but Unreadable escapes."""

from __future__ import annotations

import json
import math
from typing import Any

DEPTH_MAX = 64            # no file the daemon reads nests deeper (trainer_state.json: 4)
INT_MAX = 10 ** 15        # a step, a size in MiB, a rank: anything larger is not one
JSON_MAX = 64 << 20       # the largest JSON document any reader here takes whole


class Unreadable(ValueError):
    """Bytes that cannot be read as what was expected; the message says why, for people.

    A ValueError, so the callers that already turned a ValueError into "unreadable" keep doing so."""


def _depth_ok(doc: Any, limit: int) -> bool:
    """Iterative (a recursive walk is what the cap protects against)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        items = v.values() if isinstance(v, dict) else v
        for x in items:
            if isinstance(x, dict | list):
                stack.append((x, d + 1))
    return True


def json_doc(data: bytes | bytearray | memoryview | str, *, limit: int = JSON_MAX, depth: int = DEPTH_MAX,
             what: str = "the file") -> Any:
    """The JSON value in `data`, or Unreadable: larger than `limit` bytes, not UTF-8, not JSON, or
    nested deeper than `depth`. NaN, Infinity and 1e999 read as the floats nan and inf, as Python
    writes them (a Trainer's NaN loss is in many a trainer_state.json): a number is checked where
    it is used (finite_int), never trusted to be finite."""
    try:
        if len(data) > limit:
            raise Unreadable(f"{what} is {len(data)} bytes, more than {limit} read")
        text_ = data if isinstance(data, str) else bytes(data).decode("utf-8")
        doc = json.loads(text_)
        if isinstance(doc, dict | list) and not _depth_ok(doc, depth):
            raise Unreadable(f"{what} nests deeper than {depth} levels")
        return doc
    except Unreadable:
        raise
    except UnicodeDecodeError:
        raise Unreadable(f"{what} is not UTF-8 text") from None
    except RecursionError:
        raise Unreadable(f"{what} nests deeper than {depth} levels") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:
        raise Unreadable(f"{what} is not JSON ({str(e)[:80]})") from None


def json_object(data: bytes | bytearray | memoryview | str, *, limit: int = JSON_MAX, depth: int = DEPTH_MAX,
                what: str = "the file") -> dict[str, Any]:
    """json_doc, and it must be an object."""
    doc = json_doc(data, limit=limit, depth=depth, what=what)
    if not isinstance(doc, dict):
        raise Unreadable(f"{what} is JSON but not an object")
    return doc


def finite_int(v: object, *, lo: int = 0, hi: int = INT_MAX, what: str = "the value") -> int:
    """`v` as an int in [lo, hi]: an int (never a bool), or a float with no fraction; else Unreadable.
    A step of 1e999, -1, true, "12" or 1e300 is not a step."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Unreadable(f"{what} is not a number")
    if isinstance(v, float):
        if not math.isfinite(v) or not v.is_integer():
            raise Unreadable(f"{what} is not a whole number")
        if not (lo <= v <= hi):
            raise Unreadable(f"{what} is out of range")
        v = int(v)
    if not (lo <= v <= hi):
        raise Unreadable(f"{what} is out of range")
    return v


def finite_float(v: object, *, lo: float = float("-inf"), hi: float = float("inf"),
                 what: str = "the value") -> float:
    """`v` as a finite float in [lo, hi] (an int or a float, never a bool, nan or inf); else Unreadable."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Unreadable(f"{what} is not a number")
    try:
        f = float(v)
    except OverflowError:
        raise Unreadable(f"{what} is out of range") from None
    if not math.isfinite(f) or not (lo <= f <= hi):
        raise Unreadable(f"{what} is out of range")
    return f


def float_or_none(v: object, *, lo: float = float("-inf"), hi: float = float("inf")) -> float | None:
    """finite_float, or None where it is not one."""
    try:
        return finite_float(v, lo=lo, hi=hi)
    except Unreadable:
        return None


def int_or_none(v: object, *, lo: int = 0, hi: int = INT_MAX) -> int | None:
    """finite_int, or None where it is not one."""
    try:
        return finite_int(v, lo=lo, hi=hi)
    except Unreadable:
        return None


def text(data: bytes | bytearray | memoryview, *, limit: int = 4096, what: str = "the file") -> str:
    """A small text file (a tracker like DeepSpeed's `latest`): at most `limit` bytes, UTF-8 with
    anything undecodable replaced, no NUL."""
    try:
        if len(data) > limit:
            raise Unreadable(f"{what} is {len(data)} bytes, more than {limit} read")
        s = bytes(data).decode("utf-8", "replace")
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001 - nothing but Unreadable leaves a reader
        raise Unreadable(f"{what} cannot be read ({type(e).__name__})") from None
    if "\0" in s:
        raise Unreadable(f"{what} holds a NUL byte")
    return s
