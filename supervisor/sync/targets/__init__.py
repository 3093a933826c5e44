"""Targets by the kind of `sync.target`: S3 (boto3), a Hugging Face Hub repo, rsync over SSH, a
local folder."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.config import SyncConfig
from supervisor.sync.credentials import CredentialWatch
from supervisor.sync.targets.base import LocalFile, SourceProblem, Target, TargetError, Uploaded, UploadSink
from supervisor.syncurl import TargetURL

__all__ = ["LocalFile", "SourceProblem", "Target", "TargetError", "Uploaded", "UploadSink", "make_target",
           "target_identity"]


def make_target(url: TargetURL, cfg: SyncConfig, state_dir: str | Path,
                creds: CredentialWatch | None = None) -> Target:
    """creds: where its keys come from (the engine watches it; built here when not given)."""
    if url.kind == "s3":
        from supervisor.sync.targets.s3 import S3Target

        return S3Target(url, cfg, creds)
    if url.kind == "hf":
        from supervisor.sync.targets.hf import HfTarget

        return HfTarget(url, cfg, Path(state_dir) / "sync" / "tmp", creds=creds)
    if url.kind == "rsync":
        from supervisor.sync.targets.rsync import RsyncTarget

        return RsyncTarget(url, cfg, Path(state_dir) / "sync" / "tmp")
    from supervisor.sync.targets.local import LocalTarget

    return LocalTarget(url.path, cfg.bandwidth_limit)


def target_identity(url: TargetURL, cfg: SyncConfig) -> str:
    """What names 'the same remote place' for the ledger: the URL, plus the endpoint for S3 (the
    same bucket name on another store is another place), the Hub endpoint and branch for hf://, and
    the port for rsync."""
    if url.kind == "s3":
        return f"{url.display()}@{cfg.endpoint_url or 'aws'}"
    if url.kind == "hf":
        endpoint = (cfg.endpoint_url or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        return f"{url.display()}@{endpoint}#{cfg.hf_revision}"
    if url.kind == "rsync":
        return f"{url.display()}#{cfg.ssh_port}"
    return url.display()
