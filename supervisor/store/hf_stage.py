"""Content onto the Hub before any commit: each file is hashed (large ones from the journal when an
interrupted run already did), grouped, and handed to HfApi.preupload_lfs_files, which asks the Hub
what it already holds (the remote oid of a file in the tree, the LFS batch API for an object
uploaded earlier) and sends only the rest. After a kill -9 a finished file is therefore never sent
again, only committed. Nothing here commits; a file the trainer rewrote meanwhile is reported to
the sink and left out."""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from supervisor.store._log import get_logger
from supervisor.store.base import (
    LocalFile,
    SourceProblem,
    TargetError,
    UploadSink,
    check_unchanged,
    open_source,
    pread_exact,
    sha256_fd,
)
from supervisor.store.hf_repo import HubRepo
from supervisor.store.hf_rules import git_blob_id

log = get_logger("sync.hf")

SMALL = 4 << 20                 # files up to this are read once into memory: hashed and sent from the same bytes
HASH_CHUNK = 8 << 20
GROUP_BYTES = 1 << 30           # content per preupload call (a cancel point and a progress step)
GROUP_FILES = 256               # the preupload endpoint takes at most 256 files per call


@dataclass
class Staged:
    f: LocalFile
    op: Any                  # CommitOperationAdd
    sha256: str
    etag: str                # what the tree must show: sha256 (LFS) or git blob id (regular)
    lfs: bool
    sent: int                # bytes handed to the client for upload (0: the tree held it already)


class Stager:
    def __init__(self, repo: HubRepo):
        self.repo = repo

    def stage(self, files: list[LocalFile], sink: UploadSink) -> dict[str, Staged]:
        """Get the content of `files` onto the Hub, group by group (a group's small files are read
        only when its turn comes, so memory stays bounded). Nothing is committed here."""
        if not files:
            return {}
        self.repo.ensure()
        big = [f for f in files if f.size > SMALL]
        hashes = self._hash_large(big, sink) if self.repo.upload_path == "lfs" else {}
        out: dict[str, Staged] = {}
        sent_sha: dict[str, Any] = {}   # sha256 -> the op that got that content up, in this batch
        for group in groups(files):
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
            for item, twin in self._preupload_once(prepared, sink, sent_sha):
                try:
                    st = self._staged(*item)
                except SourceProblem as e:
                    sink.problem(item[0], e)
                    continue
                if twin:
                    st.sent = 0   # its content went up with its twin's
                out[st.f.key] = st
                sink.progress(st.f, st.sent)
        return out

    def _preupload_once(self, prepared: list, sink: UploadSink, sent_sha: dict[str, Any]) -> list:
        """_preupload, sending each distinct content once per batch: a file whose sha256 another of
        the batch already got up (two checkpoints' identical training_args.bin or rng_state.pth)
        is not handed to the client (which would PUT the same object twice) but takes over how
        its twin was staged. [(item, is_twin)]."""
        fresh, twins, here = [], [], set()
        for p in prepared:
            sha = p[2]
            if sha and (sha in sent_sha or sha in here):
                twins.append(p)
            else:
                fresh.append(p)
                if sha:
                    here.add(sha)
        done = [(p, False) for p in self._preupload(fresh, sink)]
        for p, _ in done:
            if p[2]:
                sent_sha.setdefault(p[2], p[1])
        orphans = [p for p in twins if p[2] not in sent_sha]   # its twin was dropped (changed meanwhile)
        if orphans:
            for p in self._preupload(orphans, sink):
                done.append((p, False))
                sent_sha.setdefault(p[2], p[1])
        for p in twins:
            if p in orphans:
                continue
            src, op = sent_sha[p[2]], p[1]
            op._upload_mode, op._should_ignore = src._upload_mode, src._should_ignore
            op._is_uploaded = getattr(src, "_is_uploaded", False)
            done.append((p, True))
        if twins:
            log.info("hf_twins", files=len(twins) - len(orphans), why="same sha256 as another file of the batch")
        return done

    def _prepare(self, f: LocalFile, hashed: Any) -> tuple[LocalFile, Any, str, bytes | None]:
        """(file, CommitOperationAdd, sha256 or "" when hf_xet will compute it, bytes for small files)."""
        hh = self.repo.hub()
        try:
            if f.size <= SMALL:
                data = read_whole(f)
                return f, hh.CommitOperationAdd(path_in_repo=self.repo.path(f.key), path_or_fileobj=data), \
                    hashlib.sha256(data).hexdigest(), data
            if isinstance(hashed, SourceProblem):
                raise hashed
            check_path(f)
            op = hh.CommitOperationAdd(path_in_repo=self.repo.path(f.key), path_or_fileobj=f.path)
        except ValueError as e:  # a path the Hub does not take
            raise SourceProblem("unreadable", f.path, str(e)) from None
        if hashed:
            op.upload_info.sha256 = bytes.fromhex(hashed)
        return f, op, hashed or "", None

    def _preupload(self, prepared: list, sink: UploadSink) -> list:
        """preupload_lfs_files for one group; a file the trainer rewrote meanwhile is reported and
        the rest tried once more."""
        api = self.repo.ensure()
        for attempt in (1, 2):
            if not prepared:
                return []
            try:
                self.repo.call("upload", api.preupload_lfs_files, self.repo.repo_id, additions=[p[1] for p in prepared],
                               repo_type=self.repo.repo_type, revision=self.repo.revision,
                               num_threads=max(1, self.repo.cfg.concurrency), free_memory=True)
                return prepared
            except TargetError:
                changed = [p for p in prepared if p[3] is None and not unchanged(p[0])]
                if not changed or attempt == 2:
                    raise
                for p in changed:  # not the target's fault: the source moved under us
                    sink.problem(p[0], SourceProblem("changed", p[0].path, "while uploading"))
                prepared = [p for p in prepared if p not in changed]
        return prepared

    def _staged(self, f: LocalFile, op: Any, sha: str, data: bytes | None) -> Staged:
        hh = self.repo.hub()
        lfs = op._upload_mode == "lfs"
        if data is None:
            if not unchanged(f):
                raise SourceProblem("changed", f.path, "while uploading")
            if not lfs:
                # a large text file the Hub keeps as a regular blob: its content goes in the commit
                # itself, so read it now, once, and commit exactly those bytes
                data = read_whole(f)
                remote = op._remote_oid
                op = hh.CommitOperationAdd(path_in_repo=op.path_in_repo, path_or_fileobj=data)
                op._upload_mode, op._remote_oid, op._should_ignore = "regular", remote, False
                sha = hashlib.sha256(data).hexdigest()
            elif not sha:
                sha = op.upload_info.sha256.hex()  # computed by hf_xet while it read the file
        etag = sha if lfs else git_blob_id(data or b"")
        in_tree = op._remote_oid is not None and op._remote_oid == (sha if lfs else etag)
        return Staged(f, op, sha, etag, lfs, 0 if in_tree else f.size)

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
                return f.key, hash_file(f)
            except SourceProblem as e:
                return f.key, e

        with ThreadPoolExecutor(min(4, max(1, self.repo.cfg.concurrency), len(todo)), thread_name_prefix="hf-hash") as ex:
            for key, res in ex.map(one, todo):
                out[key] = res
        return out


def read_whole(f: LocalFile) -> bytes:
    fd = open_source(f)
    try:
        data = pread_exact(fd, f, f.size, 0) if f.size else b""
        check_unchanged(fd, f)
        return data
    finally:
        os.close(fd)


def hash_file(f: LocalFile) -> str:
    fd = open_source(f)
    try:
        return sha256_fd(fd, f, HASH_CHUNK)
    finally:
        os.close(fd)


def check_path(f: LocalFile) -> None:
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


def unchanged(f: LocalFile) -> bool:
    try:
        check_path(f)
    except SourceProblem:
        return False
    return True


def groups(files: list[LocalFile]) -> list[list[LocalFile]]:
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
