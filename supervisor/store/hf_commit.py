"""Landing staged units on the Hub: their files and manifests in as few commits as the Hub takes
(MAX_OPS_PER_COMMIT operations each; a unit's manifest in the commit that holds its last files, so
a unit on the Hub is complete by construction), and the tree at each new commit checked to list
every file with its size and sha256 (LFS) or git blob id before the sink hears `done`. A manifest
a commit landed before a crash is recognised (same digest) and not committed again."""

from __future__ import annotations

from typing import Any

from supervisor.store._log import get_logger
from supervisor.store.base import LocalFile, SourceProblem, TargetError, Uploaded, UploadSink, join_key
from supervisor.store.hf_repo import HubRepo
from supervisor.store.hf_rules import git_blob_id
from supervisor.store.hf_stage import Staged
from supervisor.store.keys import MANIFEST_NAME
from supervisor.untrusted import Unreadable, json_object

log = get_logger("sync.hf")

MAX_OPS_PER_COMMIT = 1000

Plan = tuple[str, list[Staged], bytes | None]   # (unit key, its staged files, its manifest or None)


class Committer:
    def __init__(self, repo: HubRepo):
        self.repo = repo

    def land(self, plans: list[Plan], sink: UploadSink,
             message: str, description: str = "") -> dict[str, str]:
        """Commit the staged files and manifests of several units; unit key -> commit id.
        A unit's manifest goes in the commit that holds its last files."""
        commits: dict[str, str] = {}
        batch: list[Plan] = []
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

    def _verify(self, staged: list[Staged], extra: dict[str, tuple[int, str]], commit: str) -> None:
        """The tree at `commit` lists every file with its size and sha256 (LFS) or blob id."""
        want = {s.op.path_in_repo: (s.f.size, s.etag) for s in staged} | extra
        have = self.repo.paths_info(sorted(want), commit)
        for path, (size, etag) in want.items():
            o = have.get(path)
            got = remote_etag(o) if o is not None else None
            if o is None or getattr(o, "size", None) != size or got != etag:
                raise TargetError(f"the Hub's tree at {commit[:12]} does not hold {path} as sent "
                                  f"(size {getattr(o, 'size', None)}, id {got}; expected {size}, {etag})")

    def _commit_batch(self, batch: list[Plan], sink: UploadSink,
                      message: str, description: str) -> dict[str, str]:
        hh = self.repo.hub()
        ops: list[Any] = []
        extra: dict[str, tuple[int, str]] = {}
        staged_all: list[Staged] = []
        landed: list[str] = []
        mops = {u: hh.CommitOperationAdd(path_in_repo=self.repo.path(join_key(u, MANIFEST_NAME)), path_or_fileobj=m)
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
        oid = self.repo.commit(ops, message, description)
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
        api = self.repo.ensure()
        self.repo.call("preupload", api.preupload_lfs_files, self.repo.repo_id, additions=list(ops.values()),
                       repo_type=self.repo.repo_type, revision=self.repo.revision, free_memory=False)
        out: dict[str, tuple[int, str] | None] = {u: None for u in ops}
        for u, op in ops.items():
            remote, mine = op._remote_oid, manifests[u]
            if remote is None or op._upload_mode != "regular":
                continue
            if remote == git_blob_id(mine):
                out[u] = (len(mine), remote)
                continue
            theirs = self.repo.download(op.path_in_repo)
            if theirs is not None and manifest_digest(theirs) is not None and manifest_digest(theirs) == manifest_digest(mine) \
                    and git_blob_id(theirs) == remote:
                out[u] = (len(theirs), remote)
        return out


def remote_etag(o: Any) -> str | None:
    lfs = getattr(o, "lfs", None)
    if lfs is not None:
        return lfs.sha256
    return getattr(o, "blob_id", None)


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
