"""A Hugging Face Hub repo as the target: `hf://NAMESPACE/REPO[/folder]`, `hf://datasets/...`.

Built on huggingface_hub (HfApi.preupload_lfs_files, create_commit with CommitOperationAdd and
CommitOperationDelete, get_paths_info); the Hub protocol is never written by hand here.

A file is on the Hub only once a commit that holds it landed, so the sink hears `done` only after
the commit, and only after the tree at that commit lists the file with the expected size and
sha256 (LFS) or git blob id (regular files). Content goes up before the commit
(preupload_lfs_files): the Hub answers what it already holds (the preupload's remote oid for a
file already in the tree, the LFS batch API for an object uploaded earlier), so after a kill -9 a
finished file is never sent again, only committed. The sha256 of a large file is journalled
(sink.begin) before its upload starts, so a resume does not even re-read it.

Commits: `put_units` (the optional capability in base.py) lands several units, files and
manifests, in one commit. The plain interface costs two per unit: put_files commits the files,
write_manifest the manifest (still last, so a folder without `_MANIFEST.json` is partial).
A commit answered 429 is retried after Retry-After when that is short (up to
INLINE_RETRY_MAX_S, a few times); a longer wait raises RateLimited so the engine backs off.
A commit whose reply was lost is found on retry: unchanged files are no-ops for create_commit, and
a manifest already on the Hub with the same digest is not committed again.

Upload path: Xet when hf_xet is installed and HF_HUB_DISABLE_XET is not set (huggingface_hub's
own default; the Hub stores new repos with Xet, and its chunk-level dedup makes a resumed or
re-sent large file cost only the chunks the Hub lacks); otherwise the LFS protocol (preupload, LFS
batch, one PUT per missing object). `describe()` says which, and why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import __version__
from ...config import SyncConfig
from ...syncurl import TargetURL
from .._log import get_logger
from ..policy import MANIFEST_NAME
from .base import (
    AccessDenied,
    LocalFile,
    RateLimited,
    SourceProblem,
    TargetError,
    UnitPut,
    UnitsPut,
    Uploaded,
    UploadSink,
    check_unchanged,
    join_key,
    open_source,
    pread_exact,
)
from .hf_rules import (
    choose_upload_path,
    find_token,
    git_blob_id,
    parse_trainer_state,
    retry_after_s,
    unit_of,
    unit_summary,
)

log = get_logger("sync.hf")

DEFAULT_ENDPOINT = "https://huggingface.co"
SMALL = 4 << 20                 # files up to this are read once into memory: hashed and sent from the same bytes
HASH_CHUNK = 8 << 20
GROUP_BYTES = 1 << 30           # content per preupload call (a cancel point and a progress step)
GROUP_FILES = 256               # the preupload endpoint takes at most 256 files per call
PATHS_PER_CALL = 500            # get_paths_info takes at most 1000
MAX_OPS_PER_COMMIT = 1000
INLINE_RETRY_MAX_S = 60.0       # a commit 429 with a Retry-After up to this is waited out here
INLINE_RETRIES = 3
STATE_MAX = 32 << 20            # trainer_state.json read for commit messages only up to this size
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


@dataclass
class _Staged:
    f: LocalFile
    op: Any                  # CommitOperationAdd
    sha256: str
    etag: str                # what the tree must show: sha256 (LFS) or git blob id (regular)
    lfs: bool
    sent: int                # bytes handed to the client for upload (0: the tree held it already)


class HfTarget:
    def __init__(self, url: TargetURL, cfg: SyncConfig, tmp_dir: str | Path,
                 env: dict[str, str] | None = None):
        self.repo_id = url.repo
        self.repo_type = url.repo_type or "model"
        self.prefix = url.prefix.strip("/")
        self.cfg = cfg
        self.revision = cfg.hf_revision or "main"
        self.env = dict(os.environ if env is None else env)
        self.endpoint = (cfg.endpoint_url or self.env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.display = url.display()
        self.tmp_dir = Path(tmp_dir)
        self.upload_path, self.upload_path_why = choose_upload_path(
            self.env, importlib.util.find_spec("hf_xet") is not None)
        self._closing = threading.Event()
        self._api: Any = None
        self._hh: Any = None
        self._errors: Any = None
        self._token_from = ""
        self._ready = False
        self._private: bool | None = None
        self._created = False
        self._warning = ""
        self.stats = {"commits": 0, "commit_429": 0, "inline_waits_s": 0.0}

    # --- plumbing -------------------------------------------------------------------------------
    def _hub(self) -> Any:
        """huggingface_hub, imported on first use (a pass with nothing to send never pays for it)."""
        if self._hh is None:
            # Its switches are read from the environment at import; we set the module's constants
            # instead of os.environ, which the training started by the daemon could inherit.
            import huggingface_hub as hh
            from huggingface_hub import constants, errors
            from huggingface_hub.utils import disable_progress_bars
            from huggingface_hub.utils import logging as hf_logging

            constants.HF_HUB_DISABLE_TELEMETRY = True
            constants.HF_HUB_DISABLE_XET = self.upload_path != "xet"
            disable_progress_bars()
            hf_logging.set_verbosity_error()  # its warnings would go to stderr unstructured; we log our own
            _install_timeouts(hh)
            self._errors = errors
            self._hh = hh
        return self._hh

    def _client(self) -> Any:
        if self._api is None:
            hh = self._hub()
            token, where = find_token(self.cfg.hf_token_file, self.env)
            if token is None:
                raise AccessDenied("no Hugging Face token: set sync.hf_token_file, or HF_TOKEN, or run "
                                   "`hf auth login` as the user the daemon runs as (it needs write access)")
            self._token_from = where
            self._api = hh.HfApi(endpoint=self.endpoint, token=token, library_name="train-supervisor",
                                 library_version=__version__)
        return self._api

    def _path(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _call(self, what: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except TargetError:
            raise
        except Exception as e:  # noqa: BLE001 - every client error becomes one clear TargetError
            raise self._error(what, e) from None

    def _error(self, what: str, e: BaseException) -> TargetError:
        self._hub()
        errors = self._errors
        resp = getattr(e, "response", None) if isinstance(e, errors.HfHubHTTPError) else None
        status = getattr(resp, "status_code", None)
        server = ""
        if resp is not None:
            server = (resp.headers.get("X-Error-Message") or "").strip()
        where = self._token_from or "the configured token"
        repo = f"{self.repo_type} repo {self.repo_id}"
        if status == 401 and (server == INVALID_CREDENTIALS or not isinstance(e, errors.RepositoryNotFoundError)):
            self._forget_token()
            return AccessDenied(f"the Hugging Face Hub rejected the token from {where} (401): it is invalid, "
                                f"expired or revoked; create a write token at https://huggingface.co/settings/tokens")
        if status == 403 or (status == 401 and isinstance(e, errors.RepositoryNotFoundError)):
            who = self._whoami_words()  # with the token that was refused
            self._forget_token()
            return AccessDenied(f"the token from {where}{who} has no write access to {repo} ({status} {what}"
                                f"{': ' + server if server else ''}); give it write permission on the repo "
                                f"or its namespace")
        if status == 429:
            ra = retry_after_s(resp.headers if resp is not None else None)
            return RateLimited(f"the Hub rate-limits {what} on {repo}; retry in {ra:.0f}s"
                               f"{': ' + server if server else ''}", ra)
        if isinstance(e, errors.RepositoryNotFoundError):
            self._ready = False  # deleted while in use: create it again next time
            return TargetError(f"{repo} not found on {self.endpoint} ({what})")
        if isinstance(e, errors.RevisionNotFoundError):
            self._ready = False
            return TargetError(f"branch {self.revision!r} not found in {repo} ({what})")
        if status is not None:
            return TargetError(f"Hub {what}: HTTP {status}{': ' + server if server else ''}")
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, ValueError) and "README.md" in str(e):
            return TargetError(f"Hub {what}: the Hub rejects README.md's metadata at the top of the repo "
                               f"({text}); fix its front matter or use hf://{self.repo_id}/FOLDER")
        return TargetError(f"Hub {what} ({self.endpoint}): {type(e).__name__}: {text[:300]}")

    def _forget_token(self) -> None:
        """Read the token again next time: a person may have fixed it."""
        self._api = None
        self._ready = False

    def _whoami_words(self) -> str:
        """' (user alice, read token)', best effort: whoami is rate-limited, so only on errors."""
        try:
            api = self._api
            if api is None:
                return ""
            me = api.whoami()
            role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
            return f" (user {me.get('name')}{', ' + role + ' token' if role else ''})"
        except Exception:  # noqa: BLE001 - only decorates an error message
            return ""

    def _ensure_repo(self) -> Any:
        """The repo exists (created private when missing) and the branch too. Once per process,
        again after an error that says otherwise."""
        api = self._client()
        if self._ready:
            return api
        errors = self._errors
        try:
            info = api.repo_info(self.repo_id, repo_type=self.repo_type)
            private = bool(info.private)
        except errors.RepositoryNotFoundError:
            self._call("repo create", api.create_repo, self.repo_id, repo_type=self.repo_type,
                       private=self.cfg.hf_private, exist_ok=True)
            private = self.cfg.hf_private
            self._created = True
            log.info("hf_repo_created", repo=self.repo_id, repo_type=self.repo_type, private=private)
        except Exception as e:  # noqa: BLE001
            raise self._error("repo info", e) from None
        self._private = private
        if not private and not self._warning:
            self._warning = (f"{self.repo_id} is a public repo: every checkpoint uploaded there is visible "
                             f"to anyone")
            log.warning("hf_repo_public", repo=self.repo_id)
        if self.revision != "main":
            self._call("branch create", api.create_branch, self.repo_id, branch=self.revision,
                       repo_type=self.repo_type, exist_ok=True)
        self._ready = True
        return api

    # --- staging: content onto the Hub, nothing committed yet ------------------------------------
    def _stage(self, files: list[LocalFile], sink: UploadSink) -> dict[str, _Staged]:
        """Get the content of `files` onto the Hub, group by group (a group's small files are read
        only when its turn comes, so memory stays bounded). Nothing is committed here."""
        if not files:
            return {}
        self._ensure_repo()
        big = [f for f in files if f.size > SMALL]
        hashes = self._hash_large(big, sink) if self.upload_path == "lfs" else {}
        out: dict[str, _Staged] = {}
        for group in _groups(files):
            if sink.cancelled():
                return out
            prepared = []
            for f in group:
                try:
                    prepared.append(self._prepare(f, hashes.get(f.key, "")))
                except SourceProblem as e:
                    sink.problem(f, e)
                    continue
                sink.begin(f, {"mode": "hf", "sha256": prepared[-1][2]})
            for item in self._preupload(prepared, sink):
                try:
                    st = self._staged(*item)
                except SourceProblem as e:
                    sink.problem(item[0], e)
                    continue
                out[st.f.key] = st
                sink.progress(st.f, st.sent)
        return out

    def _prepare(self, f: LocalFile, hashed: Any) -> tuple[LocalFile, Any, str, bytes | None]:
        """(file, CommitOperationAdd, sha256 or "" when hf_xet will compute it, bytes for small files)."""
        hh = self._hub()
        try:
            if f.size <= SMALL:
                data = _read_whole(f)
                return f, hh.CommitOperationAdd(path_in_repo=self._path(f.key), path_or_fileobj=data), \
                    hashlib.sha256(data).hexdigest(), data
            if isinstance(hashed, SourceProblem):
                raise hashed
            _check_path(f)
            op = hh.CommitOperationAdd(path_in_repo=self._path(f.key), path_or_fileobj=f.path)
        except ValueError as e:  # a path the Hub does not take
            raise SourceProblem("unreadable", f.path, str(e)) from None
        if hashed:
            op.upload_info.sha256 = bytes.fromhex(hashed)
        return f, op, hashed or "", None

    def _preupload(self, prepared: list, sink: UploadSink) -> list:
        """preupload_lfs_files for one group; a file the trainer rewrote meanwhile is reported and
        the rest tried once more."""
        api = self._ensure_repo()
        for attempt in (1, 2):
            if not prepared:
                return []
            try:
                self._call("upload", api.preupload_lfs_files, self.repo_id, additions=[p[1] for p in prepared],
                           repo_type=self.repo_type, revision=self.revision,
                           num_threads=max(1, self.cfg.concurrency), free_memory=True)
                return prepared
            except TargetError:
                changed = [p for p in prepared if p[3] is None and not _unchanged(p[0])]
                if not changed or attempt == 2:
                    raise
                for p in changed:  # not the target's fault: the source moved under us
                    sink.problem(p[0], SourceProblem("changed", p[0].path, "while uploading"))
                prepared = [p for p in prepared if p not in changed]
        return prepared

    def _staged(self, f: LocalFile, op: Any, sha: str, data: bytes | None) -> _Staged:
        hh = self._hub()
        lfs = op._upload_mode == "lfs"
        if data is None:
            if not _unchanged(f):
                raise SourceProblem("changed", f.path, "while uploading")
            if not lfs:
                # a large text file the Hub keeps as a regular blob: its content goes in the commit
                # itself, so read it now, once, and commit exactly those bytes
                data = _read_whole(f)
                remote = op._remote_oid
                op = hh.CommitOperationAdd(path_in_repo=op.path_in_repo, path_or_fileobj=data)
                op._upload_mode, op._remote_oid, op._should_ignore = "regular", remote, False
                sha = hashlib.sha256(data).hexdigest()
            elif not sha:
                sha = op.upload_info.sha256.hex()  # computed by hf_xet while it read the file
        etag = sha if lfs else git_blob_id(data or b"")
        in_tree = op._remote_oid is not None and op._remote_oid == (sha if lfs else etag)
        return _Staged(f, op, sha, etag, lfs, 0 if in_tree else f.size)

    def _hash_large(self, files: list[LocalFile], sink: UploadSink) -> dict[str, Any]:
        """sha256 of each large file (the LFS batch API needs it before any byte goes), from the
        journal when an interrupted run already hashed the same version."""
        out: dict[str, Any] = {}
        todo = []
        for f in files:
            prior = sink.in_flight(f.key)
            info = (prior or {}).get("info") or {}
            if (prior and prior.get("size") == f.size and prior.get("mtime_ns") == f.mtime_ns
                    and info.get("mode") == "hf" and len(info.get("sha256") or "") == 64):
                out[f.key] = info["sha256"]
            else:
                todo.append(f)
        if out:
            log.info("hf_resume", files=len(out), why="sha256 journalled by an interrupted run")
        if not todo:
            return out

        def one(f: LocalFile) -> tuple[str, Any]:
            if sink.cancelled():
                return f.key, SourceProblem("unreadable", f.path, "cancelled")
            try:
                return f.key, _hash_file(f)
            except SourceProblem as e:
                return f.key, e

        with ThreadPoolExecutor(min(4, max(1, self.cfg.concurrency), len(todo)), thread_name_prefix="hf-hash") as ex:
            for key, res in ex.map(one, todo):
                out[key] = res
        return out

    # --- commits ----------------------------------------------------------------------------------
    def _commit(self, ops: list[Any], message: str, description: str = "") -> str:
        api = self._ensure_repo()
        attempt = 0
        while True:
            try:
                ci = self._call("commit", api.create_commit, self.repo_id, operations=ops,
                                commit_message=message[:1000], commit_description=description,
                                repo_type=self.repo_type, revision=self.revision,
                                num_threads=max(1, self.cfg.concurrency))
            except RateLimited as e:
                self.stats["commit_429"] += 1
                attempt += 1
                if e.retry_after > INLINE_RETRY_MAX_S or attempt > INLINE_RETRIES:
                    raise
                log.info("hf_commit_rate_limited", repo=self.repo_id, retry_after_s=e.retry_after, attempt=attempt)
                self.stats["inline_waits_s"] += e.retry_after
                if self._closing.wait(e.retry_after):
                    raise TargetError("closing while waiting out the Hub's rate limit") from None
                continue
            self.stats["commits"] += 1
            return str(ci.oid)

    def _paths_info(self, paths: list[str], revision: str) -> dict[str, Any]:
        api = self._ensure_repo()
        out: dict[str, Any] = {}
        for i in range(0, len(paths), PATHS_PER_CALL):
            for item in self._call("tree listing", api.get_paths_info, self.repo_id, paths[i:i + PATHS_PER_CALL],
                                   repo_type=self.repo_type, revision=revision):
                out[item.path] = item
        return out

    def _verify(self, staged: list[_Staged], extra: dict[str, tuple[int, str]], commit: str) -> None:
        """The tree at `commit` lists every file with its size and sha256 (LFS) or blob id."""
        want = {s.op.path_in_repo: (s.f.size, s.etag) for s in staged} | extra
        have = self._paths_info(sorted(want), commit)
        for path, (size, etag) in want.items():
            o = have.get(path)
            got = _remote_etag(o) if o is not None else None
            if o is None or getattr(o, "size", None) != size or got != etag:
                raise TargetError(f"the Hub's tree at {commit[:12]} does not hold {path} as sent "
                                  f"(size {getattr(o, 'size', None)}, id {got}; expected {size}, {etag})")

    def _land(self, plans: list[tuple[str, list[_Staged], bytes | None]], sink: UploadSink,
              message: str, description: str = "") -> dict[str, str]:
        """Commit the staged files and manifests of several units; unit key -> commit id.
        A unit's manifest goes in the commit that holds its last files."""
        commits: dict[str, str] = {}
        batch: list[tuple[str, list[_Staged], bytes | None]] = []
        nops = 0
        for unit, staged, manifest in plans:
            for i in range(0, max(1, len(staged)), MAX_OPS_PER_COMMIT):
                part = staged[i:i + MAX_OPS_PER_COMMIT]
                last = i + MAX_OPS_PER_COMMIT >= len(staged)
                n = len(part) + (1 if manifest is not None and last else 0)
                if batch and nops + n > MAX_OPS_PER_COMMIT:
                    commits.update(self._commit_batch(batch, sink, message, description))
                    batch, nops = [], 0
                batch.append((unit, part, manifest if last else None))
                nops += n
        if batch:
            commits.update(self._commit_batch(batch, sink, message, description))
        return commits

    def _commit_batch(self, batch: list[tuple[str, list[_Staged], bytes | None]], sink: UploadSink,
                      message: str, description: str) -> dict[str, str]:
        hh = self._hub()
        ops: list[Any] = []
        extra: dict[str, tuple[int, str]] = {}
        staged_all: list[_Staged] = []
        landed: list[str] = []
        mops = {u: hh.CommitOperationAdd(path_in_repo=self._path(join_key(u, MANIFEST_NAME)), path_or_fileobj=m)
                for u, _, m in batch if m is not None}
        held = self._manifests_on_hub(mops, {u: m for u, _, m in batch if m is not None})
        for unit, staged, manifest in batch:
            staged_all += staged
            ops += [s.op for s in staged]
            if manifest is not None:
                path = mops[unit].path_in_repo
                if held.get(unit) is not None:
                    extra[path] = held[unit]
                    landed.append(unit)
                else:
                    ops.append(mops[unit])
                    extra[path] = (len(manifest), git_blob_id(manifest))
        if landed:
            log.info("hf_manifest_already_on_hub", units=landed, why="committed before a restart")
        oid = self._commit(ops, message, description)
        self._verify(staged_all, extra, oid)
        for s in staged_all:
            sink.done(s.f, Uploaded(s.sha256, s.etag, s.sent))
        return {unit: oid for unit, _, _ in batch}

    def _manifests_on_hub(self, ops: dict[str, Any], manifests: dict[str, bytes]) -> dict[str, tuple[int, str] | None]:
        """For each unit whose manifest we are about to commit: the (size, blob id) of a manifest
        already on the Hub with the same digest (a commit that landed before a crash), else None.
        The preupload call that create_commit would make anyway says what the Hub holds there."""
        if not ops:
            return {}
        api = self._ensure_repo()
        self._call("preupload", api.preupload_lfs_files, self.repo_id, additions=list(ops.values()),
                   repo_type=self.repo_type, revision=self.revision, free_memory=False)
        out: dict[str, tuple[int, str] | None] = {u: None for u in ops}
        for u, op in ops.items():
            remote, mine = op._remote_oid, manifests[u]
            if remote is None or op._upload_mode != "regular":
                continue
            if remote == git_blob_id(mine):
                out[u] = (len(mine), remote)
                continue
            theirs = self._download(op.path_in_repo)
            if theirs is not None and _digest(theirs) is not None and _digest(theirs) == _digest(mine) \
                    and git_blob_id(theirs) == remote:
                out[u] = (len(theirs), remote)
        return out

    def _download(self, path: str) -> bytes | None:
        api = self._ensure_repo()
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        d = tempfile.mkdtemp(prefix="hf-", dir=self.tmp_dir)
        try:
            p = self._call("download", api.hf_hub_download, self.repo_id, path, repo_type=self.repo_type,
                           revision=self.revision, local_dir=d)
            with open(p, "rb") as fh:
                return fh.read(STATE_MAX)
        except TargetError as e:
            log.info("hf_manifest_download_failed", path=path, error=str(e))
            return None
        finally:
            shutil.rmtree(d, ignore_errors=True)

    # --- the Target interface -----------------------------------------------------------------------
    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        """Upload and commit these files (one commit; more only past MAX_OPS_PER_COMMIT files)."""
        staged = self._stage(files, sink)
        if not staged or sink.cancelled():
            return
        items = list(staged.values())
        unit = unit_of(f.key for f in files)
        state = _trainer_state([s.f for s in items])
        what = unit or ", ".join(sorted(s.f.key for s in items)[:3]) + (" ..." if len(items) > 3 else "")
        msg = f"{unit_summary(what, state)} ({len(items)} file{'s' if len(items) != 1 else ''})"
        self._land([(unit, items, None)], sink, msg)

    def put_units(self, units: list[UnitPut], sink: UploadSink) -> UnitsPut:
        """Files and manifests of several units in one commit (see base.put_units)."""
        if not units:
            return UnitsPut()
        staged = self._stage([f for u in units for f in u.files], sink)
        out = UnitsPut()
        if sink.cancelled():
            return out
        plans: list[tuple[str, list[_Staged], bytes | None]] = []
        names = []
        for u in units:
            mine = [staged[f.key] for f in u.files if f.key in staged]
            whole = len(mine) == len(u.files)
            manifest = None
            if whole and u.manifest is not None:
                manifest = u.manifest({s.f.key: Uploaded(s.sha256, s.etag, s.sent) for s in mine})
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
        commits = self._land(plans, sink, message, description)
        for unit, _, manifest in plans:
            out.commits[unit] = commits.get(unit, "")
            if manifest is not None:
                out.manifests.append(unit)
        return out

    def write_manifest(self, unit_key: str, data: bytes) -> str | None:
        """The manifest in a commit of its own (put_units puts it in the files' commit)."""
        state = self._state_from_manifest(data)
        msg = f"{unit_summary(unit_key or '(top)', state)} (complete: {MANIFEST_NAME})"
        return self._land([(unit_key, [], data)], _NoSink(), msg).get(unit_key)

    def delete_manifest(self, unit_key: str) -> None:
        path = self._path(join_key(unit_key, MANIFEST_NAME))
        if path not in self._paths_info([path], self.revision):
            return
        hh = self._hub()
        self._commit([hh.CommitOperationDelete(path_in_repo=path)],
                     f"{unit_key or '(top)'}: changed since its manifest; {MANIFEST_NAME} withdrawn")

    def missing(self, expected: dict[str, tuple[int, str]]) -> list[str]:
        paths = {self._path(k): k for k in expected}
        have = self._paths_info(sorted(paths), self.revision)
        out = []
        for path, key in paths.items():
            size, etag = expected[key]
            o = have.get(path)
            if o is None or not hasattr(o, "size") or (size >= 0 and o.size != size) \
                    or (etag and _remote_etag(o) != etag):
                out.append(key)
        return out

    def delete_prefix(self, unit_key: str) -> None:
        """keep_last: the folder goes in one commit. Its files stay in the repo's history (see the
        README for squashing it)."""
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        folder = self._path(unit_key.strip("/"))
        if folder not in self._paths_info([folder], self.revision):
            return
        hh = self._hub()
        self._commit([hh.CommitOperationDelete(path_in_repo=folder + "/", is_folder=True)],
                     f"keep_last={self.cfg.keep_last}: delete {unit_key.strip('/')}")

    def describe(self) -> dict:
        return {"kind": "hf", "repo": self.repo_id, "repo_type": self.repo_type, "revision": self.revision,
                "folder": self.prefix, "endpoint": self.endpoint, "upload_path": self.upload_path,
                "upload_path_reason": self.upload_path_why, "private": self._private, "created": self._created,
                "token_from": self._token_from or None, "warning": self._warning or None}

    def close(self) -> None:
        self._closing.set()

    # --- small helpers --------------------------------------------------------------------------------
    def _state_from_manifest(self, data: bytes | None) -> dict | None:
        try:
            src = json.loads(data or b"").get("source") or ""
        except (ValueError, AttributeError):
            return None
        return _read_state(os.path.join(src, "trainer_state.json")) if src else None


class _NoSink:
    """For commits that carry no source files (a manifest alone)."""

    def begin(self, f: LocalFile, info: dict) -> None:
        pass

    def part(self, f: LocalFile, n: int, etag: str, checksum: str, size: int) -> None:
        pass

    def done(self, f: LocalFile, result: Uploaded) -> None:
        pass

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        pass

    def progress(self, f: LocalFile, nbytes: int) -> None:
        pass

    def in_flight(self, key: str) -> dict | None:
        return None

    def cancelled(self) -> bool:
        return False


def _remote_etag(o: Any) -> str | None:
    lfs = getattr(o, "lfs", None)
    if lfs is not None:
        return lfs.sha256
    return getattr(o, "blob_id", None)


def _digest(manifest: bytes) -> str | None:
    try:
        d = json.loads(manifest).get("digest")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, str) and d else None


def _read_whole(f: LocalFile) -> bytes:
    fd = open_source(f)
    try:
        data = pread_exact(fd, f, f.size, 0) if f.size else b""
        check_unchanged(fd, f)
        return data
    finally:
        os.close(fd)


def _hash_file(f: LocalFile) -> str:
    fd = open_source(f)
    try:
        h = hashlib.sha256()
        off = 0
        while off < f.size:
            chunk = pread_exact(fd, f, min(HASH_CHUNK, f.size - off), off)
            h.update(chunk)
            off += len(chunk)
        check_unchanged(fd, f)
        return h.hexdigest()
    finally:
        os.close(fd)


def _check_path(f: LocalFile) -> None:
    """Still the regular file (not a symlink) of the size and mtime judged complete."""
    try:
        st = os.lstat(f.path)
    except FileNotFoundError:
        raise SourceProblem("vanished", f.path) from None
    except OSError as e:
        raise SourceProblem("unreadable", f.path, e.strerror or str(e)) from None
    if not stat.S_ISREG(st.st_mode):
        raise SourceProblem("unreadable", f.path, "not a regular file")
    if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
        raise SourceProblem("changed", f.path, f"size {st.st_size} mtime_ns {st.st_mtime_ns}")


def _unchanged(f: LocalFile) -> bool:
    try:
        _check_path(f)
    except SourceProblem:
        return False
    return True


def _groups(files: list[LocalFile]) -> list[list[LocalFile]]:
    """Up to GROUP_FILES files and GROUP_BYTES per preupload call, small files first."""
    out: list[list[LocalFile]] = []
    cur: list[LocalFile] = []
    size = 0
    for f in sorted(files, key=lambda f: f.size):
        if cur and (len(cur) >= GROUP_FILES or size + f.size > GROUP_BYTES):
            out.append(cur)
            cur, size = [], 0
        cur.append(f)
        size += f.size
    if cur:
        out.append(cur)
    return out


def _read_state(path: str) -> dict | None:
    try:
        with open(path, "rb") as fh:
            return parse_trainer_state(fh.read(STATE_MAX + 1)[:STATE_MAX])
    except OSError:
        return None


def _trainer_state(files: list[LocalFile]) -> dict | None:
    for f in files:
        if f.key.rsplit("/", 1)[-1] == "trainer_state.json" and f.size <= STATE_MAX:
            return _read_state(f.path)
    return None


_timeouts_installed = False


def _install_timeouts(hh: Any) -> None:
    """huggingface_hub's shared HTTP client has no timeouts at all: a stalled connection would hang
    the sync worker for good. Same client, with timeouts (once per process)."""
    global _timeouts_installed
    if _timeouts_installed:
        return
    import httpx2

    try:
        from huggingface_hub.utils._http import default_client_factory as base
    except ImportError:  # a later release may move it; a plain client then
        def base() -> Any:
            return httpx2.Client(follow_redirects=True)

    def factory() -> Any:
        c = base()
        c.timeout = httpx2.Timeout(connect=15.0, read=300.0, write=300.0, pool=60.0)
        return c

    hh.set_client_factory(factory)
    _timeouts_installed = True
