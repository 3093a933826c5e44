"""Landing staged units on the Hub: their files and manifests in as few commits as the Hub takes
(MAX_OPS_PER_COMMIT operations each; a unit's manifest in the commit that holds its last files, so
a unit on the Hub is complete by construction), and the tree at each new commit checked to list
every file with its size and sha256 (LFS) or git blob id before the sink hears `done`: how the Hub
stored a file is read there, from the tree, not from the client. A manifest a commit landed before
a crash is recognised (same digest, from get_paths_info and a download) and not committed again;
files the branch held already are not in the commit, only checked."""

from __future__ import annotations

from typing import Any

from supervisor.store._log import get_logger
from supervisor.store.base import LocalFile, SourceProblem, TargetError, Uploaded, UploadSink, join_key
from supervisor.store.hf_repo import HubRepo
from supervisor.store.hf_rules import git_blob_id, remote_etag
from supervisor.store.hf_stage import Staged
from supervisor.store.keys import MANIFEST_NAME
from supervisor.untrusted import Unreadable, json_object

log = get_logger("sync.hf")

MAX_OPS_PER_COMMIT = 1000

Plan = tuple[str, list[Staged], bytes | None]   # (unit key, its staged files, its manifest or None)


class Committer:
    def __init__(self, repo: HubRepo):
        self.repo = repo

    def land(self, plans: list[Plan], sink: UploadSink, remote: dict[str, Any],
             message: str, description: str = "") -> dict[str, str]:
        """Commit the staged files and manifests of several units; unit key -> commit id.
        A unit's manifest goes in the commit that holds its last files. `remote`: what the branch
        held at the files' and manifests' paths before staging (HubRepo.existing)."""
        commits: dict[str, str] = {}
        batch: list[Plan] = []
        nops = 0
        for unit, staged, manifest in plans:
            for i in range(0, max(1, len(staged)), MAX_OPS_PER_COMMIT):
                part = staged[i:i + MAX_OPS_PER_COMMIT]
                last = i + MAX_OPS_PER_COMMIT >= len(staged)
                n = len(part) + (1 if manifest is not None and last else 0)
                if batch and nops + n > MAX_OPS_PER_COMMIT:
                    commits.update(self._commit_batch(batch, sink, remote, message, description))
                    batch, nops = [], 0
                batch.append((unit, part, manifest if last else None))
                nops += n
        if batch:
            commits.update(self._commit_batch(batch, sink, remote, message, description))
        return commits

    def _verify(self, staged: list[Staged], extra: dict[str, tuple[int, str]], commit: str) -> dict[str, str]:
        """The tree at `commit` lists every file with its size and our sha256 (a file it keeps in
        LFS) or the git blob id of the bytes we committed (a regular file). path -> that id."""
        have = self.repo.paths_info(sorted({s.path for s in staged} | set(extra)), commit)
        etags: dict[str, str] = {}
        for s in staged:
            o = have.get(s.path)
            etags[s.path] = s.ours(o)
            self._check(s.path, o, s.f.size, etags[s.path], commit)
        for path, (size, etag) in extra.items():
            self._check(path, have.get(path), size, etag, commit)
        return etags

    @staticmethod
    def _check(path: str, o: Any, size: int, etag: str, commit: str) -> None:
        got = remote_etag(o) if o is not None else None
        if o is None or getattr(o, "size", None) != size or not etag or got != etag:
            # (a file sent from its path has no blob id of ours: the Hub must keep it in LFS)
            raise TargetError(f"the Hub's tree at {commit[:12]} does not hold {path} as sent "
                              f"(size {getattr(o, 'size', None)}, id {got}; expected {size}, {etag or 'an LFS file'})")

    def _commit_batch(self, batch: list[Plan], sink: UploadSink, remote: dict[str, Any],
                      message: str, description: str) -> dict[str, str]:
        hh = self.repo.hub()
        ops: list[Any] = []
        extra: dict[str, tuple[int, str]] = {}
        staged_all: list[Staged] = []
        landed: list[str] = []
        for unit, staged, manifest in batch:
            staged_all += staged
            ops += [s.op for s in staged if s.op is not None]
            if manifest is None:
                continue
            path = self.repo.path(join_key(unit, MANIFEST_NAME))
            held = self._manifest_on_hub(path, manifest, remote.get(path))
            if held is not None:
                extra[path] = held
                landed.append(unit)
            else:
                ops.append(hh.CommitOperationAdd(path_in_repo=path, path_or_fileobj=manifest))
                extra[path] = (len(manifest), git_blob_id(manifest))
        if landed:
            log.info("hf_manifest_already_on_hub", units=landed, why="committed before a restart")
        # nothing left to commit (the branch holds all of it): checked at the head as it is
        oid = self.repo.commit(ops, message, description) if ops else self.repo.head()
        etags = self._verify(staged_all, extra, oid)
        for s in staged_all:
            sink.done(s.f, Uploaded(s.sha256, etags[s.path], s.sent))
        return {unit: oid for unit, _, _ in batch}

    def _manifest_on_hub(self, path: str, mine: bytes, o: Any) -> tuple[int, str] | None:
        """The (size, blob id) of a manifest the branch already holds at `path` (`o`, its
        get_paths_info entry) with the same digest as ours (a commit that landed before a crash),
        else None."""
        remote = getattr(o, "blob_id", None)
        if remote is None or getattr(o, "lfs", None) is not None:
            return None
        if remote == git_blob_id(mine):
            return len(mine), remote
        theirs = self.repo.download(path)
        digest = manifest_digest(theirs) if theirs is not None else None
        if digest is not None and digest == manifest_digest(mine) and git_blob_id(theirs) == remote:
            return len(theirs), remote
        return None


def manifest_digest(manifest: bytes) -> str | None:
    try:
        d = json_object(manifest, what="the manifest").get("digest")
    except Unreadable:
        return None
    return d if isinstance(d, str) and d else None


class NoSink:
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
