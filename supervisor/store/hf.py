"""A Hugging Face Hub repo as the target: `hf://NAMESPACE/REPO[/folder]`, `hf://datasets/...`.

Built on huggingface_hub's public API only (HfApi.get_paths_info, preupload_lfs_files,
create_commit with CommitOperationAdd and CommitOperationDelete, repo_info); the Hub protocol is
never written by hand here, and no private part of the library is read or set
(tests/core/test_layout.py checks). The parts:
hf_repo.py (token, client, repo and branch, errors, commit with the inline 429 wait, tree listing),
hf_stage.py (content onto the Hub before any commit, never sending what it holds), hf_commit.py
(landing units in commits and checking the tree at each), hf_rules.py (the pure rules).

A file is on the Hub only once a commit that holds it landed, so the sink hears `done` only after
the commit, and only after the tree at that commit lists the file with the expected size and
sha256 (LFS) or git blob id (regular files). The sha256 of a large file is journalled
(sink.begin) before its upload starts, so a resume does not even re-read it.

Commits: `put_units` (the optional capability in base.py, what the engine uses for folders) lands
several units, files and manifests, in one commit, so a unit on the Hub is complete by
construction. The plain interface costs two per unit: put_files commits the files, write_manifest
the manifest (still last, so a folder without `_MANIFEST.json` is partial). Before staging, one
get_paths_info asks what the branch holds at the batch's paths (only those the repo's listing or
our own commits say exist: a new checkpoint costs no request), so a commit whose reply was lost is
found on retry: files the branch holds with the same content are neither sent nor committed, only
checked, and a manifest already on the Hub with the same digest is not committed again.

Upload path: Xet when hf_xet is installed and HF_HUB_DISABLE_XET is not set (huggingface_hub's
own default; the Hub stores new repos with Xet, and its chunk-level dedup makes a resumed or
re-sent large file cost only the chunks the Hub lacks); otherwise the LFS protocol (preupload, LFS
batch, one PUT per missing object). `describe()` says which, and why.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from supervisor.config import SyncConfig
from supervisor.config.target import TargetURL
from supervisor.store._log import get_logger
from supervisor.store.base import (
    LocalFile,
    TargetError,
    UnitPut,
    UnitsPut,
    Uploaded,
    UploadSink,
)
from supervisor.store.credentials import CredentialWatch
from supervisor.store.hf_commit import Committer, NoSink, Plan
from supervisor.store.hf_read import HfReader
from supervisor.store.hf_repo import HubRepo
from supervisor.store.hf_rules import parse_trainer_state, remote_etag, unit_of, unit_summary
from supervisor.store.hf_stage import Stager
from supervisor.store.keys import MANIFEST_NAME, manifest_key
from supervisor.untrusted import Unreadable, json_object
from supervisor.untrusted.fileopen import open_regular

STATE_MAX = 32 << 20            # trainer_state.json read for commit messages only up to this size

log = get_logger("sync.hf")


class HfTarget:
    """The Target (and its optional put_units and describe) for one hf:// URL."""

    lands_units = True  # put_units is one commit: a unit's files and manifest appear together or not at all

    def __init__(self, url: TargetURL, cfg: SyncConfig, tmp_dir: str | Path,
                 env: dict[str, str] | None = None, creds: CredentialWatch | None = None):
        self.creds = creds
        if env is None:
            env = creds.env() if creds is not None else dict(os.environ)
        self.repo = HubRepo(url, cfg, tmp_dir, dict(env))
        self.stager = Stager(self.repo)
        self.committer = Committer(self.repo)
        self.display = url.display()
        self.stats = self.repo.stats
        self.reader = HfReader(self.repo)

    def reload_credentials(self, why: str) -> None:
        """Find the token again at the next request, in the sources as they are then."""
        if self.creds is not None:
            self.repo.env = self.creds.env()
        self.repo.forget_token()
        log.info("hf_credentials_reread", why=why)

    # --- the Target interface -----------------------------------------------------------------------
    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        """Upload and commit these files (one commit; more only past MAX_OPS_PER_COMMIT files)."""
        remote = self.repo.existing([self.repo.path(f.key) for f in files])
        staged = self.stager.stage(files, sink, remote)
        if not staged or sink.cancelled():
            return
        items = list(staged.values())
        unit = unit_of(f.key for f in files)
        state = _trainer_state([s.f for s in items])
        what = unit or ", ".join(sorted(s.f.key for s in items)[:3]) + (" ..." if len(items) > 3 else "")
        msg = f"{unit_summary(what, state)} ({len(items)} file{'s' if len(items) != 1 else ''})"
        self.committer.land([(unit, items, None)], sink, remote, msg)

    def put_units(self, units: list[UnitPut], sink: UploadSink) -> UnitsPut:
        """Files and manifests of several units in one commit (see base.put_units)."""
        if not units:
            return UnitsPut()
        files = [f for u in units for f in u.files]
        # one question for the whole batch: what the branch holds at its files' and manifests' paths
        remote = self.repo.existing([self.repo.path(f.key) for f in files]
                                    + [self.repo.path(manifest_key(u.key)) for u in units if u.manifest is not None])
        staged = self.stager.stage(files, sink, remote)
        out = UnitsPut()
        if sink.cancelled():
            return out
        plans: list[Plan] = []
        names = []
        for u in units:
            mine = [staged[f.key] for f in u.files if f.key in staged]
            whole = len(mine) == len(u.files)
            manifest = None
            if whole and u.manifest is not None:
                # (the etag, LFS sha256 or blob id, is read from the tree after the commit)
                manifest = u.manifest({s.f.key: Uploaded(s.sha256, "", s.sent) for s in mine})
            if not mine and manifest is None:
                continue
            plans.append((u.key, mine, manifest))
            names.append(unit_summary(u.key or "(top)", _trainer_state([s.f for s in mine])
                                      or self._state_from_manifest(manifest)))
        if not plans:
            return out
        message = names[0] if len(names) == 1 else f"{len(names)} units: " + ", ".join(
            n.split(":")[0] for n in names)
        description = "\n".join(names) if len(names) > 1 else ""
        commits = self.committer.land(plans, sink, remote, message, description)
        for unit, _, manifest in plans:
            out.commits[unit] = commits.get(unit, "")
            if manifest is not None:
                out.manifests.append(unit)
        return out

    def write_manifest(self, unit_key: str, data: bytes, kind: str = "dir") -> str | None:
        """The manifest in a commit of its own (put_units puts it in the files' commit)."""
        if kind == "file":  # beside a single file: no folder to land with it
            hh = self.repo.hub()
            return self.repo.commit([hh.CommitOperationAdd(path_in_repo=self.repo.path(manifest_key(unit_key, kind)),
                                                           path_or_fileobj=data)],
                                    f"{unit_key}: complete ({MANIFEST_NAME} beside it)")
        state = self._state_from_manifest(data)
        msg = f"{unit_summary(unit_key or '(top)', state)} (complete: {MANIFEST_NAME})"
        remote = self.repo.existing([self.repo.path(manifest_key(unit_key))])
        return self.committer.land([(unit_key, [], data)], NoSink(), remote, msg).get(unit_key)

    def delete_manifest(self, unit_key: str, kind: str = "dir") -> None:
        path = self.repo.path(manifest_key(unit_key, kind))
        if path not in self.repo.paths_info([path], self.repo.revision):
            return
        hh = self.repo.hub()
        self.repo.commit([hh.CommitOperationDelete(path_in_repo=path)],
                         f"{unit_key or '(top)'}: changed since its manifest; {MANIFEST_NAME} withdrawn")

    def missing(self, expected: dict[str, tuple[int, str]], deep: Collection[str] | None = None) -> list[str]:
        """By the repo's own record of each file: its size and the LFS sha256 (or git blob id)
        the Hub computed, against the one it returned at upload; `deep` changes nothing here."""
        paths = {self.repo.path(k): k for k in expected}
        have = self.repo.paths_info(sorted(paths), self.repo.revision)
        out = []
        for path, key in paths.items():
            size, etag = expected[key]
            o = have.get(path)
            if o is None or not hasattr(o, "size") or (size >= 0 and o.size != size) \
                    or (etag and remote_etag(o) != etag):
                out.append(key)
        return out

    def delete_file(self, key: str) -> None:
        path = self.repo.path(key)
        if path not in self.repo.paths_info([path], self.repo.revision):
            return
        hh = self.repo.hub()
        self.repo.commit([hh.CommitOperationDelete(path_in_repo=path)], f"follow_deletions: delete {key}")

    def delete_prefix(self, unit_key: str) -> None:
        """keep_last: the folder goes in one commit. Its files stay in the repo's history (see the
        README for squashing it)."""
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        folder = self.repo.path(unit_key.strip("/"))
        if folder not in self.repo.paths_info([folder], self.repo.revision):
            return
        hh = self.repo.hub()
        self.repo.commit([hh.CommitOperationDelete(path_in_repo=folder + "/", is_folder=True)],
                         f"keep_last={self.repo.cfg.keep_last}: delete {unit_key.strip('/')}")

    def describe(self) -> dict:
        return self.repo.facts()

    def close(self) -> None:
        self.repo.closing.set()

    # --- small helpers --------------------------------------------------------------------------------
    def _state_from_manifest(self, data: bytes | None) -> dict | None:
        try:
            src = json_object(data or b"", what="the manifest").get("source") or ""
        except Unreadable:
            return None
        if not isinstance(src, str):
            return None
        return _read_state(os.path.join(src, "trainer_state.json")) if src else None


def _read_state(path: str) -> dict | None:
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            return parse_trainer_state(fh.read(STATE_MAX + 1)[:STATE_MAX])
    except OSError:
        return None


def _trainer_state(files: list[LocalFile]) -> dict | None:
    for f in files:
        if f.key.rsplit("/", 1)[-1] == "trainer_state.json" and f.size <= STATE_MAX:
            return _read_state(f.path)
    return None
