"""The Hugging Face Hub's rules the hf:// target follows, apart from its network code: which
upload path the client takes (Xet or LFS) and why, where the token comes from (and how to name
that without showing it; find_token reads the file, the rest are pure), how a commit is named
after a checkpoint, and the ids the Hub's tree lists: the git blob id of a regular file, the
sha256 of an LFS one."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

from supervisor.redact import register as register_secret
from supervisor.store.base import AccessDenied
from supervisor.untrusted import Unreadable, json_object


def git_blob_id(data: bytes) -> str:
    """The git object id of a regular file, as the Hub's tree lists it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def remote_etag(o: Any) -> str | None:
    """What the Hub's tree lists for a file (a get_paths_info entry): its LFS sha256, else its git
    blob id; None for a folder."""
    lfs = getattr(o, "lfs", None)
    if lfs is not None:
        return lfs.sha256
    return getattr(o, "blob_id", None)


def choose_upload_path(env: dict[str, str], xet_installed: bool) -> tuple[str, str]:
    """("xet" | "lfs", why) — the same rule huggingface_hub applies, made explicit for status."""
    if (env.get("HF_HUB_DISABLE_XET") or "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "lfs", "HF_HUB_DISABLE_XET is set"
    if not xet_installed:
        return "lfs", "hf_xet is not installed"
    return "xet", "hf_xet is installed (chunk-level dedup; resumes send only missing chunks)"


def stored_token_path(env: dict[str, str]) -> str:
    """Where `hf auth login` keeps the token for this user (huggingface_hub's own rule)."""
    if env.get("HF_TOKEN_PATH"):
        return os.path.expanduser(env["HF_TOKEN_PATH"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    return os.path.join(os.path.expanduser(home), "token")


def find_token(token_file: str, env: dict[str, str]) -> tuple[str | None, str]:
    """(token or None, where it came from — words for an error, never the token)."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as fh:
                tok = fh.read().strip()
        except OSError as e:
            raise AccessDenied(f"cannot read sync.hf_token_file {token_file}: {e.strerror or e}") from None
        if not tok:
            raise AccessDenied(f"sync.hf_token_file {token_file} is empty")
        register_secret(tok)   # a Hub error that echoes it is masked everywhere
        return tok, f"sync.hf_token_file ({token_file})"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if (env.get(var) or "").strip():
            register_secret(env[var].strip())
            return env[var].strip(), f"the {var} environment variable"
    path = stored_token_path(env)
    try:
        with open(path, encoding="utf-8") as fh:
            tok = fh.read().strip()
    except OSError:
        return None, ""
    register_secret(tok)
    return (tok or None), f"the Hugging Face CLI login ({path})"


def parse_trainer_state(data: bytes) -> dict | None:
    try:
        return json_object(data, what="trainer_state.json")
    except Unreadable:
        return None


def unit_summary(unit: str, state: dict | None) -> str:
    """"checkpoint-1200: step 1200/5000, loss 0.412" (as much as trainer_state.json tells)."""
    bits = []
    if state:
        step, mx = state.get("global_step"), state.get("max_steps")
        if isinstance(step, int):
            bits.append(f"step {step}/{mx}" if isinstance(mx, int) and mx > 0 else f"step {step}")
        for rec in reversed(state.get("log_history") or []):
            if isinstance(rec, dict) and isinstance(rec.get("loss"), (int, float)):
                bits.append(f"loss {rec['loss']:.4g}")
                break
    return f"{unit}: {', '.join(bits)}" if bits else unit


def unit_of(keys: Iterable[str]) -> str:
    """The folder the keys share ('' for files at the top)."""
    dirs = [k.rsplit("/", 1)[0] if "/" in k else "" for k in keys]
    if not dirs or "" in dirs:
        return ""
    common = os.path.commonpath(dirs)
    return "" if common in (".", "/") else common


def retry_after_s(headers: Any, default: float = 60.0) -> float:
    v = (headers.get("Retry-After") if headers is not None else None) or ""
    try:
        return max(0.0, float(v))
    except ValueError:
        return default
