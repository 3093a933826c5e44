"""Every local delete, in `state_dir/disk/journal.jsonl`: an intent line before the folder is
removed (what the target was just seen to hold, when), an outcome line after. Appended and
fsynced, so a crash between the two still shows what was about to go."""

from __future__ import annotations

import json
import os
import threading
from collections import deque

import structlog

log = structlog.get_logger("disk")

KEEP = 50   # entries shown in status


class Journal:
    def __init__(self, state_dir: str):
        self.dir = os.path.join(state_dir, "disk")
        self.path = os.path.join(self.dir, "journal.jsonl")
        self._lock = threading.Lock()
        self._recent: deque[dict] = deque(maxlen=KEEP)
        self.deleted = 0
        self.freed = 0
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue  # a line torn by a crash: the rest still counts
                    if isinstance(e, dict):
                        self._note(e)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk_journal_unreadable", path=self.path, error=str(e))

    def _note(self, e: dict) -> None:
        self._recent.append(e)
        if e.get("event") == "deleted":
            self.deleted += 1
            self.freed += int(e.get("bytes") or 0)

    def append(self, entry: dict) -> None:
        line = (json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._note(entry)

    def recent(self, n: int = 10) -> list[dict]:
        with self._lock:
            return list(self._recent)[-n:]
