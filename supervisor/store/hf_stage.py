"""Content onto the Hub before any commit: each file is hashed (large ones from the journal when an
interrupted run already did), grouped, and handed to HfApi.preupload_lfs_files, which asks the Hub
how to store each file and sends what the Hub lacks. What the branch already holds with the same
content (HfApi.get_paths_info, asked by the caller: `remote`) is not handed over at all, and stays
out of the commit. After a kill -9 a finished file is therefore never sent again, only committed.
Nothing here commits; a file the trainer rewrote meanwhile is reported to the sink and left out.

Only huggingface_hub's public API: how the Hub stored a file (LFS or a regular blob) is read back
from the tree after the commit (hf_commit.py), so every file that may become a regular blob (the
Hub keeps none above 10 MiB) is read here once, into memory, and committed from those bytes."""

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
from supervisor.store.hf_rules import git_blob_id, remote_etag

log = get_logger("sync.hf")

SMALL = 10 << 20                # files up to this (the Hub's largest regular blob) are read once into memory
HASH_CHUNK = 8 << 20
GROUP_BYTES = 1 << 30           # content per preupload call (a cancel point, a progress step, the memory bound)
GROUP_FILES = 256               # the preupload endpoint takes at most 256 files per call


@dataclass
class Staged:
    f: LocalFile
    path: str                # in the repo
    op: Any                  # the CommitOperationAdd to commit; None: the branch holds this content already
    sha256: str
    blob: str                # git blob id of the bytes read here ("" for a file sent from its path)
    sent: int                # bytes handed to the client for upload (0: the tree held it already)

    def ours(self, o: Any) -> str:
        """The id of ours the Hub's tree must list for this file, as it keeps it (`o`, a
        get_paths_info entry): the sha256 of an LFS file, else the git blob id of our bytes
        ("" when a file sent from its path became a regular blob: no id of ours to match)."""
        return self.sha256 if getattr(o, "lfs", None) is not None else self.blob


class Stager:
    def __init__(self, repo: HubRepo):
        self.repo = repo

    def stage(self, files: list[LocalFile], sink: UploadSink, remote: dict[str, Any]) -> dict[str, Staged]:
        """Get the content of `files` onto the Hub, group by group (a group's small files are read
        only when its turn comes, so memory stays bounded). `remote`: path -> what get_paths_info
        says the branch holds there. Nothing is committed here."""
        if not files:
            return {}
        self.repo.ensure()
        big = [f for f in files if f.size > SMALL]
        hashes = self._hash_large(big, sink) if self.repo.upload_path == "lfs" else {}
        out: dict[str, Staged] = {}
        sent_sha: set[str] = set()   # content handed to preupload in this batch
        twins = 0
        for group in groups(files):
            if sink.cancelled():
                return out
            fresh: list[Staged] = []
            for f in group:
                try:
                    st = self._prepare(f, hashes.get(f.key, ""))
                except SourceProblem as e:
                    sink.problem(f, e)
                    continue
                sink.begin(f, {"mode": "hf", "sha256": st.sha256})
                if in_tree(st, remote.get(st.path)):
                    st.op, st.sent = None, 0
                    out[f.key] = st
                    sink.progress(f, 0)
                elif st.sha256 and st.sha256 in sent_sha:
                    # a twin (two checkpoints' identical training_args.bin): not handed to preupload,
                    # which would PUT the same object twice; the commit finds its content on the Hub
                    st.sent = 0
                    twins += 1
                    out[f.key] = st
                    sink.progress(f, 0)
                else:
                    fresh.append(st)
                    if st.sha256:
                        sent_sha.add(st.sha256)
            for st in self._preupload(fresh, sink):
                try:
                    self._after(st, remote.get(st.path))
                except SourceProblem as e:
                    sink.problem(st.f, e)
                    continue
                out[st.f.key] = st
                sink.progress(st.f, st.sent)
        if twins:
            log.info("hf_twins", files=twins, why="same sha256 as another file of the batch")
        return out

    def _prepare(self, f: LocalFile, hashed: Any) -> Staged:
        """The file's CommitOperationAdd: from its bytes (read once, hashed, blob id known) when small,
        else from its path with the sha256 hashed or journalled ("" when hf_xet will compute it)."""
        hh = self.repo.hub()
        path = self.repo.path(f.key)
        try:
            if f.size <= SMALL:
                data = read_whole(f)
                return Staged(f, path, hh.CommitOperationAdd(path_in_repo=path, path_or_fileobj=data),
                              hashlib.sha256(data).hexdigest(), git_blob_id(data), f.size)
            if isinstance(hashed, SourceProblem):
                raise hashed
            check_path(f)
            op = hh.CommitOperationAdd(path_in_repo=path, path_or_fileobj=f.path)
        except ValueError as e:  # a path the Hub does not take
            raise SourceProblem("unreadable", f.path, str(e)) from None
        if hashed:
            op.upload_info.sha256 = bytes.fromhex(hashed)
        return Staged(f, path, op, hashed or "", "", f.size)

    def _preupload(self, fresh: list[Staged], sink: UploadSink) -> list[Staged]:
        """preupload_lfs_files for one group; a file the trainer rewrote meanwhile is reported and
        the rest tried once more."""
        api = self.repo.ensure()
        for attempt in (1, 2):
            if not fresh:
                return []
            try:
                self.repo.call("upload", api.preupload_lfs_files, self.repo.repo_id, additions=[s.op for s in fresh],
                               repo_type=self.repo.repo_type, revision=self.repo.revision,
                               num_threads=max(1, self.repo.cfg.concurrency), free_memory=True)
                return fresh
            except TargetError:
                changed = [s for s in fresh if not s.blob and not unchanged(s.f)]
                if not changed or attempt == 2:
                    raise
                for s in changed:  # not the target's fault: the source moved under us
                    sink.problem(s.f, SourceProblem("changed", s.f.path, "while uploading"))
                fresh = [s for s in fresh if s not in changed]
        return fresh

    def _after(self, st: Staged, remote: Any) -> None:
        """A file sent from its path is still the version judged complete, and its sha256 is known
        (hf_xet computes it while it reads); content the branch turned out to hold stays out of the commit."""
        if st.blob:
            return
        if not unchanged(st.f):
            raise SourceProblem("changed", st.f.path, "while uploading")
        if not st.sha256:
            info = st.op.upload_info
            st.sha256 = info.sha256.hex() if info.is_hashed else hash_file(st.f)
        if in_tree(st, remote):
            st.op, st.sent = None, 0

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


def in_tree(st: Staged, o: Any) -> bool:
    """The branch holds this file's content at its path: same size, and the sha256 (LFS) or git
    blob id (a regular file) the Hub lists equals ours."""
    if o is None or getattr(o, "size", None) != st.f.size:
        return False
    mine = st.ours(o)
    return bool(mine) and remote_etag(o) == mine


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
