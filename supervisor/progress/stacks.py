"""Where a training hangs: the Python stacks of its processes, read from outside with `py-spy dump`
(which attaches with ptrace, reads the interpreter's memory and detaches; the process is not stopped
for more than a moment and never killed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable

import psutil

MAX_PROCESSES = 4
MAX_CHARS = 12_000


def py_spy() -> str | None:
    """The py-spy beside this interpreter (our venv ships it), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def python_pids(pids: Iterable[int]) -> list[int]:
    """The Python processes among `pids`, oldest first (the launcher before its workers)."""
    found = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            name = os.path.basename((p.cmdline() or [p.name()])[0])
            if name.startswith("python") or p.name().startswith("python"):
                found.append((p.create_time(), pid))
        except (psutil.Error, IndexError):
            continue
    return [pid for _, pid in sorted(found)]


def dump(pids: Iterable[int], timeout: float = 15.0) -> str:
    """The stacks of up to MAX_PROCESSES Python processes among `pids`, as text for a mail; when they
    cannot be read, a line saying why (never raises)."""
    tool = py_spy()
    if tool is None:
        return "(stacks not available: py-spy is not installed)"
    targets = python_pids(pids)[:MAX_PROCESSES]
    if not targets:
        return "(stacks not available: no Python process in the training)"
    out = []
    for pid in targets:
        try:
            cp = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            out.append(f"pid {pid}: py-spy did not answer within {timeout:.0f}s")
            continue
        except OSError as e:
            out.append(f"pid {pid}: cannot run py-spy: {e}")
            continue
        if cp.returncode != 0:
            why = (cp.stderr or cp.stdout).strip().splitlines()[-1:] or ["unknown error"]
            out.append(f"pid {pid}: py-spy failed: {why[0][:300]}")
        else:
            out.append(cp.stdout.rstrip())
    text = "\n\n".join(out)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + "\n... (cut)"
