"""Names that come from a target: unit keys and the paths a manifest lists.

Whoever can write the bucket (a leaked key, another tenant, a job that read the keys) decides these
strings, and the daemon that restores them runs as root. S3 keys may hold `..`, a leading `/`, `//`
and control characters verbatim; a restore that joined them to a folder here would write anywhere.
So every such name is checked once, where it enters (the manifest's parser, the listing's unit
keys), into a RemotePath: a string that is a relative POSIX path of plain components and nothing
else. A unit with a name that fails is refused and named, never partly written.

Pure: no I/O.
"""

from __future__ import annotations

MAX_KEY_BYTES = 1024        # S3's own limit on a key; no unit or file of ours comes near it
MAX_COMPONENT_BYTES = 255   # NAME_MAX on Linux file systems


class BadName(ValueError):
    """A name from the target that cannot name a file inside a folder here."""


class RemotePath(str):
    """A relative path checked by `remote_path`: components joined by `/`, none of them empty,
    `.` or `..`, no NUL, backslash or control character, within the length limits. Only
    `remote_path` makes one."""

    __slots__ = ()

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.split("/"))


def problem(name: object) -> str:
    """What is wrong with `name` as a relative path from a target, in words ('' when nothing)."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if len(raw) > MAX_KEY_BYTES:
        return f"longer than {MAX_KEY_BYTES} bytes"
    if name.startswith("/"):
        return "absolute (starts with /)"
    for ch in name:
        o = ord(ch)
        if o == 0:
            return "holds a NUL byte"
        if ch == "\\":
            return "holds a backslash"
        if o < 0x20 or o == 0x7F or 0x80 <= o < 0xA0:
            return f"holds the control character {o:#04x}"
    for part in name.split("/"):
        if part == "":
            return "has an empty component (// or a trailing /)"
        if part in (".", ".."):
            return f"has a {part!r} component"
        if len(part.encode("utf-8")) > MAX_COMPONENT_BYTES:
            return f"has a component longer than {MAX_COMPONENT_BYTES} bytes"
    return ""


def remote_path(name: object, what: str = "path") -> RemotePath:
    """`name` as a RemotePath; BadName naming `what` and the problem when it is not one."""
    why = problem(name)
    if why:
        raise BadName(f"{what} {shown(name)} is refused: {why}")
    return RemotePath(name)  # type: ignore[arg-type]


def check_tree(paths: list[RemotePath]) -> str:
    """What makes a unit's file list impossible as one folder ('' when nothing): the same path
    twice, or a path that is both a file and a folder (`a` and `a/b`)."""
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            return f"lists {shown(p)} twice"
        seen.add(p)
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            head = "/".join(parts[:i])
            if head in seen:
                return f"lists {shown(head)} as a file and as a folder"
    return ""


def shown(name: object, limit: int = 120) -> str:
    """A name as a message may show it: repr (control characters escaped), cut when long."""
    r = repr(name)
    return r if len(r) <= limit else r[:limit] + "..."
