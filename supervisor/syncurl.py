"""What `sync.target` names: an S3 prefix, an rsync-over-SSH destination, or a local folder."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetURL:
    kind: str  # "s3" | "rsync" | "local"
    bucket: str = ""
    prefix: str = ""
    user: str = ""
    host: str = ""
    path: str = ""

    def display(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        if self.kind == "rsync":
            return f"{self.user + '@' if self.user else ''}{self.host}:{self.path}"
        return self.path


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
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
    if "://" in t:
        raise ValueError(f"unsupported scheme in {text!r} (use s3://, user@host:path or /local/path)")
    if t.startswith("/"):
        return TargetURL("local", path=t.rstrip("/") or "/")
    m = _RSYNC.fullmatch(t)
    if m:
        if not m.group("path"):
            raise ValueError(f"rsync target {text!r} needs a path after ':'")
        return TargetURL("rsync", user=m.group("user") or "", host=m.group("host"), path=m.group("path"))
    raise ValueError(f"expected s3://bucket/prefix, user@host:path or an absolute path, got {text!r}")
