"""Persisted state: small JSON documents in state_dir, written atomically (temp, fsync, rename).

A corrupt or truncated file is never fatal: it is renamed aside (`NAME.corrupt-TIMESTAMP`), the
problem is logged with the file's name, and the caller starts from its default.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def set_aside(path: Path, now: float | None = None) -> Path:
    """Rename a damaged state file to `NAME.corrupt-TIMESTAMP` so it can be looked at later and the
    caller can start afresh; returns the new path (the old one when the rename failed)."""
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time() if now is None else now)}")
    try:
        os.replace(path, aside)
    except OSError:
        return path
    return aside


class StateStore:
    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self._lock = threading.Lock()
        self.problems: list[str] = []  # shown in status so a set-aside file is not silent

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def load(self, name: str, default: Any = None) -> Any:
        p = self.path(name)
        with self._lock:
            try:
                raw = p.read_bytes()
            except FileNotFoundError:
                return default
            except OSError as e:
                self._note(f"{p}: unreadable ({e}); starting from defaults")
                return default
            try:
                return json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                aside = set_aside(p)
                self._note(f"{p}: corrupt state file ({e}); set aside as {aside.name}, starting from defaults")
                return default

    def save(self, name: str, data: Any) -> None:
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        with self._lock:
            atomic_write(self.path(name), blob)

    def _note(self, msg: str) -> None:
        self.problems.append(msg)
        import structlog  # here, not at import: the sync one-shot pass uses atomic_write and stays light

        structlog.get_logger("statefile").error("state_file_problem", problem=msg)
