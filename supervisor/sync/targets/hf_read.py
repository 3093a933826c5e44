"""The Hub target's read side (resume): the branch's newest commit pinned once per listing, so a
restore reads one consistent snapshot even while another machine commits; every unit lands on the
Hub in one commit with its manifest, so the newest commit holds each unit complete or not at all,
and a damaged unit there falls back to the one before like on any target. Files come through
`hf_hub_download` into the restore's folder (its cache stays out of the way); the content is
verified by the caller against the manifest's sha256."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from supervisor.sync.targets.base import TargetError, join_key

SMALL_MAX = 64 << 20


class HfReader:
    """Mixed into HfTarget; uses its `repo` (HubRepo)."""

    repo: Any
    _pinned: str | None = None

    def _rev(self) -> str:
        return self._pinned or self.repo.revision

    def list_keys(self) -> dict[str, int]:
        api = self.repo.ensure()
        info = self.repo.call("repo info", api.repo_info, self.repo.repo_id, repo_type=self.repo.repo_type,
                              revision=self.repo.revision)
        self._pinned = str(info.sha)
        pre = self.repo.prefix
        out: dict[str, int] = {}
        items = self.repo.call("tree listing", lambda: list(api.list_repo_tree(
            self.repo.repo_id, path_in_repo=pre or None, recursive=True, repo_type=self.repo.repo_type,
            revision=self._pinned)))
        for it in items:
            size = getattr(it, "size", None)
            if size is None or not hasattr(it, "blob_id"):
                continue  # a folder
            p = str(it.path)
            out[p[len(pre) + 1:] if pre else p] = int(size)
        return out

    def read_file(self, key: str) -> bytes | None:
        d = tempfile.mkdtemp(prefix="hf-read-", dir=self._tmp())
        try:
            try:
                p = self._get(key, d)
            except TargetError as e:
                if "not found" in str(e).lower() or "404" in str(e):
                    return None
                raise
            with open(p, "rb") as fh:
                return fh.read(SMALL_MAX)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def download(self, unit_key: str, files: list[tuple[str, int]], dest_dir: str,
                 progress: Callable[[int], None]) -> None:
        d = tempfile.mkdtemp(prefix="hf-restore-", dir=dest_dir)
        try:
            def one(item: tuple[str, int]) -> None:
                rel, size = item
                p = self._get(join_key(unit_key, rel), d)
                dest = os.path.join(dest_dir, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.replace(p, dest)
                progress(size)

            with ThreadPoolExecutor(8, thread_name_prefix="hf-get") as pool:
                for f in [pool.submit(one, it) for it in files]:
                    f.result()
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _tmp(self) -> str:
        os.makedirs(self.repo.tmp_dir, exist_ok=True)
        return str(self.repo.tmp_dir)

    def _get(self, key: str, local_dir: str) -> str:
        api = self.repo.ensure()
        return str(self.repo.call("download", api.hf_hub_download, self.repo.repo_id, self.repo.path(key),
                                  repo_type=self.repo.repo_type, revision=self._rev(), local_dir=local_dir))
