"""How many ranks the training runs: WORLD_SIZE as torchrun, accelerate and the deepspeed launcher
put it in each worker's environment, read from /proc of the job's own processes (the daemon
started them; the config's sync.world_size stands in when it did not)."""

from __future__ import annotations

from collections.abc import Iterable

ENVIRON_MAX = 1 << 20   # a process environment larger than this is not read


def world_size(pids: Iterable[int], proc: str = "/proc") -> int | None:
    """The largest WORLD_SIZE any of `pids` was started with; None when none says."""
    best: int | None = None
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/environ", "rb") as f:
                env = f.read(ENVIRON_MAX)
        except OSError:
            continue  # gone, or not ours to read
        for item in env.split(b"\0"):
            if item.startswith(b"WORLD_SIZE="):
                try:
                    n = int(item[len(b"WORLD_SIZE="):])
                except ValueError:
                    break
                if 0 < n <= 1_000_000:
                    best = n if best is None else max(best, n)
                break
    return best
