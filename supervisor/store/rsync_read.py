"""The rsync target's read side (resume): the listing rsync gives, one small file by `ssh cat`,
and a unit's files in one rsync run (`--files-from`, over the target's shared SSH connection),
with progress read from the growing files here while it runs. The content is verified by the
caller against the manifest's sha256."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.store.base import TargetError, join_key

if TYPE_CHECKING:
    from supervisor.store.base import Into

PARTIAL_DIR = ".rsync-partial"
RSYNC_PARTIAL = 23  # rsync's exit for a partial transfer (rsync.PARTIAL; a missing folder lists so)
SMALL_MAX = 64 << 20


class Link(Protocol):
    """What the reader uses of its target (RsyncTarget): its names, its shared SSH connection and
    rsync command line, and its listing. Named here, so the two modules do not import each other."""

    display: str
    remote_host: str

    def ssh_argv(self) -> list[str]: ...

    def rsync_base(self) -> list[str]: ...

    def remote_path(self, sub: str = "") -> str: ...

    def run_cmd(self, argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess: ...

    def listing(self, sub: str) -> dict[str, int]: ...


class RsyncReader:
    """The read side of RsyncTarget (a restore): keys, small files, a unit's files by rsync."""

    # A download's progress is counted by a watcher thread while one rsync run fetches the whole
    # unit, so a restore that stops it (progress raising) would wait for the run to end: no unit
    # is downloaded here on a guess (resume/ahead.py).
    stops_midway = False

    def __init__(self, c: Link):
        self.c = c  # the target: its ssh command, remote names and listings

    def list_keys(self) -> dict[str, int]:
        return {k: v for k, v in self.c.listing("").items() if PARTIAL_DIR not in k.split("/")}

    def list_versions(self) -> dict[str, tuple[int, str]]:
        """key -> (size, modification time to the second, as rsync lists it)."""
        r = self.c.run_cmd([*self.c.rsync_base(), "-r", "--list-only", f"{self.c.remote_host}:{self.c.remote_path('')}/"],
                        timeout=300)
        if r.returncode == RSYNC_PARTIAL and b"No such file" in r.stderr:
            return {}
        if r.returncode != 0:
            raise TargetError(f"{self.c.display}: listing failed ({r.returncode})")
        out: dict[str, tuple[int, str]] = {}
        for ln in r.stdout.decode(errors="replace").splitlines():
            f = ln.split(None, 4)
            if len(f) < 5 or not f[0].startswith("-") or PARTIAL_DIR in f[4].split("/"):
                continue
            try:
                out[f[4]] = (int(f[1].replace(",", "")), f"{f[2]} {f[3]}")
            except ValueError:
                continue
        return out

    def read_file(self, key: str) -> bytes | None:
        path = self.c.remote_path(key)
        r = self.c.run_cmd([*self.c.ssh_argv(), self.c.remote_host,
                       f"test -e {shlex.quote(path)} || exit 3; exec head -c {SMALL_MAX} -- {shlex.quote(path)}"],
                      timeout=120)
        if r.returncode == 3:
            return None
        if r.returncode != 0:
            raise TargetError(f"{self.c.display}: cannot read {key} ({r.returncode}): "
                              f"{r.stderr.decode(errors='replace')[-300:]}")
        return r.stdout

    def download(self, unit_key: str, files: list[tuple[str, int]], into: Into,
                 progress: Callable[[int], None]) -> None:
        """rsync writes into the staging folder by its /proc name, only the files named in the
        (checked) list, without links or devices (-t only: no -l, -D); whatever else it might
        leave there is found by the caller (Staging.extras) and refuses the unit."""
        dest_dir = into.path
        done = threading.Event()
        seen = [0]

        def watch() -> None:  # rsync writes each file under a temp name in its folder: count them all
            while not done.wait(0.5):
                now = _tree_bytes(dest_dir)
                if now > seen[0]:
                    progress(now - seen[0])
                    seen[0] = now

        t = threading.Thread(target=watch, name="rsync-progress", daemon=True)
        t.start()
        with tempfile.NamedTemporaryFile("wb", prefix="restore-", suffix=".list") as lst:
            lst.write(b"".join(os.fsencode(rel) + b"\0" for rel, _ in files))
            lst.flush()
            timeout = 600 + sum(max(0, s) for _, s in files) / (5 * 1024 * 1024)
            argv: list[Any] = [*self.c.rsync_base(), "--from0", f"--files-from={lst.name}",
                               f"{self.c.remote_host}:{self.c.remote_path(join_key(unit_key))}/", dest_dir.rstrip("/") + "/"]
            try:
                r = self.c.run_cmd(argv, timeout=timeout)
            finally:
                done.set()
                t.join()
        if r.returncode != 0:
            raise TargetError(f"{self.c.display}: download of {unit_key} failed ({r.returncode}): "
                              f"{r.stderr.decode(errors='replace')[-300:]}")
        total = _tree_bytes(dest_dir)
        if total > seen[0]:
            progress(total - seen[0])


def _tree_bytes(path: str) -> int:
    n = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                n += os.stat(os.path.join(dirpath, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return n
