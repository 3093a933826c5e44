"""What a hook sees: a clean environment made of the event's facts, nothing of the daemon's own."""

from __future__ import annotations

import re

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PREFIX = "TRAIN_SUPERVISOR_"


def hook_env(event: str, facts: dict[str, object], home: str = "/root") -> dict[str, str]:
    """PATH, HOME, LANG and TRAIN_SUPERVISOR_EVENT plus one TRAIN_SUPERVISOR_<FACT> per fact
    (reason, checkpoint, target, host, ...). None becomes empty; names are upper-cased, anything but
    letters, digits and '_' dropped."""
    env = {"PATH": SAFE_PATH, "HOME": home, "LANG": "C.UTF-8", f"{PREFIX}EVENT": event}
    for k, v in facts.items():
        name = re.sub(r"[^A-Z0-9_]", "", k.upper())
        if name and name != "EVENT":
            env[PREFIX + name] = "" if v is None else str(v).replace("\x00", "")
    return env
