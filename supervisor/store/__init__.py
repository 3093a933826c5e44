"""The store wing: bytes on the target, for sync (which puts them) and resume (which gets them).

One interface (`base.Target`: put verified, put manifest, list, get into, delete) with one adapter per
kind of `sync.target`: S3 (`s3`, its connection `s3_client`, the one S3 client `s3_light` and where it
connects `s3_endpoint`, `s3_multipart`, `s3_read`), a Hugging Face Hub
repo (`hf*`), rsync over SSH (`rsync*`), a local folder (`local`). `credentials` watches where the
keys come from; `_log` is the lazy logger the one-shot CLIs share. `make_target` builds the adapter from
the parsed `sync.target` (`config.target`, core: the config checks parse it too); `target_identity`
names "the same remote place".

Pure: `keys` (where a unit's manifest lives). Shell: everything else (each adapter talks to its target).
May import: the core. Imported by: sync, resume, cluster, money, disk, the daemon.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

# nothing of the store at the top: `python -m supervisor.sync --once` imports `_log` from here, and its
# no-change pass (cli/sync_stamp.py) must not pay for the adapters, the credentials or botocore
if TYPE_CHECKING:
    from supervisor.config import SyncConfig
    from supervisor.config.target import TargetURL
    from supervisor.store.base import Target
    from supervisor.store.credentials import CredentialWatch

PURE = ("keys",)


def make_target(url: TargetURL, cfg: SyncConfig, state_dir: str | Path,
                creds: CredentialWatch | None = None) -> Target:
    """creds: where its keys come from (the engine watches it; built here when not given)."""
    if url.kind == "s3":
        from supervisor.store.s3 import S3Target

        return S3Target(url, cfg, creds)
    if url.kind == "hf":
        from supervisor.store.hf import HfTarget

        return HfTarget(url, cfg, Path(state_dir) / "sync" / "tmp", creds=creds)
    if url.kind == "rsync":
        from supervisor.store.rsync import RsyncTarget

        return RsyncTarget(url, cfg, Path(state_dir) / "sync" / "tmp")
    from supervisor.store.local import LocalTarget

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
