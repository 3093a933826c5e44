"""What `sync.target` names: an S3 prefix, a Hugging Face Hub repo, an rsync-over-SSH destination, or a
local folder."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetURL:
    kind: str  # "s3" | "hf" | "rsync" | "local"
    bucket: str = ""
    prefix: str = ""     # s3: key prefix; hf: folder inside the repo
    user: str = ""
    host: str = ""
    path: str = ""
    repo: str = ""       # hf: "namespace/name"
    repo_type: str = ""  # hf: "model" | "dataset"

    def display(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        if self.kind == "hf":
            kind = "datasets/" if self.repo_type == "dataset" else ""
            return f"hf://{kind}{self.repo}/{self.prefix}".rstrip("/")
        if self.kind == "rsync":
            return f"{self.user + '@' if self.user else ''}{self.host}:{self.path}"
        return self.path


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
# The Hub's rules for a namespace or repo name: letters, digits, '-', '_', '.'; no leading or
# trailing '-'/'.', no '--' or '..', at most 96 characters.
_HF_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?")
_RSYNC = re.compile(r"(?:(?P<user>[A-Za-z0-9_.\-]+)@)?(?P<host>[A-Za-z0-9_.\-]+|\[[0-9a-fA-F:]+\]):(?P<path>.*)")


def parse_target(text: str) -> TargetURL:
    """Parse `sync.target`; ValueError with a sentence saying what is wrong."""
    t = text.strip()
    if t.startswith("s3://"):
        rest = t[5:]
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ValueError(f"not a valid S3 bucket name in {text!r}")
        return TargetURL("s3", bucket=bucket, prefix=prefix.strip("/"))
    if t.startswith("hf://"):
        return _parse_hf(text, t[5:])
    if "://" in t:
        raise ValueError(f"unsupported scheme in {text!r} (use s3://, hf://, user@host:path or /local/path)")
    if t.startswith("/"):
        return TargetURL("local", path=t.rstrip("/") or "/")
    m = _RSYNC.fullmatch(t)
    if m:
        if not m.group("path"):
            raise ValueError(f"rsync target {text!r} needs a path after ':'")
        return TargetURL("rsync", user=m.group("user") or "", host=m.group("host"), path=m.group("path"))
    raise ValueError(f"expected s3://bucket/prefix, hf://namespace/repo, user@host:path or an absolute path, "
                     f"got {text!r}")


def _parse_hf(text: str, rest: str) -> TargetURL:
    """hf://NAMESPACE/REPO[/sub/path], hf://datasets/NAMESPACE/REPO[/...] (hf://models/... also)."""
    parts = [p for p in rest.split("/") if p]
    repo_type = "model"
    if parts and parts[0] in ("datasets", "models", "spaces"):
        if parts[0] == "spaces":
            raise ValueError(f"{text!r}: a Space is not a place for checkpoints (use a model or dataset repo)")
        repo_type = "dataset" if parts[0] == "datasets" else "model"
        parts = parts[1:]
    if len(parts) < 2:
        raise ValueError(f"{text!r}: expected hf://NAMESPACE/REPO (your user or organization name, then the repo)")
    ns, name, sub = parts[0], parts[1], parts[2:]
    for what, v in (("namespace", ns), ("repo name", name)):
        if not _HF_NAME.fullmatch(v) or "--" in v or ".." in v:
            raise ValueError(f"{text!r}: {v!r} is not a valid Hugging Face {what}")
    if any(p in (".", "..") for p in sub) or any(p in (".git", ".cache") for p in sub):
        raise ValueError(f"{text!r}: the folder inside the repo may not contain '.', '..', .git or .cache")
    return TargetURL("hf", prefix="/".join(sub), repo=f"{ns}/{name}", repo_type=repo_type)
