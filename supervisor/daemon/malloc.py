"""The daemon's own memory at rest: glibc's malloc tuned for a process of many mostly idle threads,
and the heap the start-up left free handed back once started (RSS measured in bench_daemon_idle)."""

from __future__ import annotations

from typing import Any


def _libc() -> Any:
    """The C library this process runs on (its own symbols: no find_library, which runs ldconfig)."""
    import ctypes

    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def few_arenas() -> None:
    """glibc gives each thread that allocates its own malloc arena; a dozen mostly idle threads
    hold a MiB or more that way. Two are plenty for a daemon that waits (M_ARENA_MAX is -8)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-8, 2)


def settle_memory() -> None:
    """Once started: hand the heap the imports and the first scan left free back to the system
    (glibc keeps it otherwise), so the daemon at rest holds only what it uses, and spare the
    collector what stays."""
    import gc

    gc.collect()
    # what is alive now (modules, config, the daemon's objects) lives as long as the process: the
    # collector need not walk it again on every full collection
    gc.freeze()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
