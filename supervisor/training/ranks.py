"""How many ranks the training runs: WORLD_SIZE as torchrun, accelerate and the deepspeed launcher
put it in each worker's environment, read from /proc of the job's own processes (the daemon
started them; the config's sync.world_size stands in when it did not)."""

from __future__ import annotations

from collections.abc import Iterable

ENVIRON_MAX = 1 << 20   # a process environment larger than this is not read


def world_size(pids: Iterable[int], proc: str = "/proc", single_if_unset: bool = False) -> int | None:
    """The largest WORLD_SIZE any of `pids` was started with; None when none says. With
    `single_if_unset`: 1 when the training runs (some of `pids` was read) and none of its processes
    was given a WORLD_SIZE: a plain `python train.py` is one process (no launcher told it of others);
    None still when no process could be read, or one could not be read for a reason other than
    having exited (then a worker that says otherwise may be among them)."""
    best: int | None = None
    read = blind = 0
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/environ", "rb") as f:
                env = f.read(ENVIRON_MAX)
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone
        except OSError:
            blind += 1  # not ours to read
            continue
        read += 1
        for item in env.split(b"\0"):
            if item.startswith(b"WORLD_SIZE="):
                try:
                    n = int(item[len(b"WORLD_SIZE="):])
                except ValueError:
                    break
                if 0 < n <= 1_000_000:
                    best = n if best is None else max(best, n)
                break
    if best is None and single_if_unset and read and not blind:
        return 1
    return best
