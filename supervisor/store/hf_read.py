"""The Hub target's read side (resume): the branch's newest commit pinned once per listing, so a
restore reads one consistent snapshot even while another machine commits; every unit lands on the
Hub in one commit with its manifest, so the newest commit holds each unit complete or not at all,
and a damaged unit there falls back to the one before like on any target.

Files come by one GET each of their `resolve` URL at the pinned commit, over huggingface_hub's own
HTTP client (its timeouts, redirects to the CDN, token handling), straight into the restore's
folder and hashed on the way. `hf_hub_download` asks a HEAD before each GET and goes through a temp
folder and a lock file: for the forty small reads of a LoRA run's survey that was 105 requests
against `hf download`'s 26 for the same folder."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from supervisor import __version__
from supervisor.store.base import TargetError, join_key, write_all

if TYPE_CHECKING:
    from supervisor.store.base import Into
    from supervisor.store.hf_repo import HubRepo

SMALL_MAX = 64 << 20
CHUNK = 256 << 10
ATTEMPTS = 3
DOWNLOAD_THREADS = 8


class HfReader:
    """The read side of HfTarget (a restore): keys and files of the repo at one pinned revision."""

    def __init__(self, repo: HubRepo):
        self.repo = repo
        self._pinned: str | None = None   # the revision a restore reads, fixed at its first listing


    def _rev(self) -> str:
        return self._pinned or self.repo.revision

    def list_keys(self) -> dict[str, int]:
        self.repo.head_sha = None
        api = self.repo.ensure()
        head, self.repo.head_sha = self.repo.head_sha, None  # set only when ensure read it just now
        if head is None:
            head = str(self.repo.call("repo info", api.repo_info, self.repo.repo_id, repo_type=self.repo.repo_type,
                                      revision=self.repo.revision).sha)
        self._pinned = head
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
        def fetch() -> bytes | None:
            with self._stream(key) as r:
                if self._missing(r):
                    return None
                self._raise_for_status(r)
                out = bytearray()
                for chunk in r.iter_bytes(CHUNK):
                    out += chunk
                    if len(out) >= SMALL_MAX:
                        break
                return bytes(out[:SMALL_MAX])
        return self._retrying("download", fetch)

    def download(self, unit_key: str, files: list[tuple[str, int]], into: Into,
                 progress: Callable[[int], None]) -> dict[str, str]:
        """rel -> sha256 of what was written, hashed as it arrived; each file created through
        `into` (no path is joined here), afresh on a retry."""
        def one(item: tuple[str, int]) -> tuple[str, str]:
            rel, _size = item
            got = [0]

            def fetch() -> str:
                if got[0]:
                    progress(-got[0])  # a retry starts the file again
                    got[0] = 0
                h = hashlib.sha256()
                with self._stream(join_key(unit_key, rel)) as r:
                    self._raise_for_status(r)
                    fd = into.create(rel)
                    try:
                        for chunk in r.iter_bytes(CHUNK):
                            h.update(chunk)
                            write_all(fd, chunk)
                            got[0] += len(chunk)
                            progress(len(chunk))
                    finally:
                        os.close(fd)
                return h.hexdigest()
            return rel, self._retrying("download", fetch)

        with ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="hf-get") as pool:
            return dict(pool.map(one, files))

    # --- one GET -------------------------------------------------------------------------------
    def _stream(self, key: str) -> Any:
        """The GET of key at the pinned commit (a context manager giving the response), the body as
        the file's bytes (the Hub gzips text files; the client undoes it)."""
        hh = self.repo.hub()
        api = self.repo.client()
        from huggingface_hub.utils import build_hf_headers, get_session

        url = hh.hf_hub_url(self.repo.repo_id, self.repo.path(key), repo_type=self.repo.repo_type,
                            revision=self._rev(), endpoint=self.repo.endpoint)
        headers = build_hf_headers(token=api.token, library_name="train-supervisor", library_version=__version__)
        return get_session().stream("GET", url, headers=headers)

    def _missing(self, r: Any) -> bool:
        if r.status_code != 404:
            return False
        code = r.headers.get("X-Error-Code", "")
        return code in ("", "EntryNotFound")  # not RepoNotFound / RevisionNotFound: those are errors

    def _raise_for_status(self, r: Any) -> None:
        from huggingface_hub.utils import hf_raise_for_status

        if r.status_code >= 400:
            r.read()  # the error's words are in the body
        hf_raise_for_status(r)

    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn with the Hub's errors made TargetErrors; a dropped or stalled connection is tried again
        (ATTEMPTS in all), since the whole restore would otherwise start over."""
        import httpx2

        for attempt in range(1, ATTEMPTS + 1):
            try:
                return fn()
            except TargetError:
                raise
            except httpx2.TransportError as e:
                if attempt == ATTEMPTS:
                    raise self.repo.error(what, e) from None
            except Exception as e:  # noqa: BLE001 - every client error becomes one clear TargetError
                raise self.repo.error(what, e) from None
        raise AssertionError("unreachable")
