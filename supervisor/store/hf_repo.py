"""The Hub repo behind an hf:// target: huggingface_hub imported on first use (with timeouts), the
token and the client, the repo and branch made sure of (created private when missing), and the calls
the target makes (commit, tree listing, download), each client error turned into one clear
TargetError: AccessDenied for a refused token (401) or one without write access (403), RateLimited
for 429. A commit answered 429 is retried here after Retry-After when that is short (up to
INLINE_RETRY_MAX_S, a few times); a longer wait raises RateLimited so the engine backs off."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor import __version__
from supervisor.config import SyncConfig
from supervisor.config.target import TargetURL
from supervisor.store._log import get_logger
from supervisor.store.base import (
    AccessDenied,
    NoCredentials,
    PublicRepoRefused,
    RateLimited,
    TargetError,
    join_key,
)
from supervisor.store.credentials import env_file_path
from supervisor.store.hf_rules import choose_upload_path, find_token, retry_after_s

log = get_logger("sync.hf")

DEFAULT_ENDPOINT = "https://huggingface.co"
PATHS_PER_CALL = 500            # get_paths_info takes at most 1000
INLINE_RETRY_MAX_S = 60.0       # a commit 429 with a Retry-After up to this is waited out here
INLINE_RETRIES = 3
DOWNLOAD_MAX = 32 << 20         # a file read back from the Hub (a manifest) only up to this size
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


class HubRepo:
    """One repo at one revision, with the token found by hf_rules.find_token."""

    def __init__(self, url: TargetURL, cfg: SyncConfig, tmp_dir: str | Path, env: dict[str, str]):
        self.repo_id = url.repo
        self.repo_type = url.repo_type or "model"
        self.prefix = url.prefix.strip("/")
        self.cfg = cfg
        self.revision = cfg.hf_revision or "main"
        self.env = env
        self.endpoint = (cfg.endpoint_url or self.env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.tmp_dir = Path(tmp_dir)
        self.upload_path, self.upload_path_why = choose_upload_path(
            self.env, importlib.util.find_spec("hf_xet") is not None)
        self.closing = threading.Event()
        self._api: Any = None
        self._hh: Any = None
        self._errors: Any = None
        self._token_from = ""
        self._ready = False
        self._private: bool | None = None
        self._created = False
        self._warning = ""
        self.head_sha: str | None = None
        # the paths at the branch's head as this process knows them (the repo's listing at first
        # contact, then its own commits); None: not known, ask. A path known absent is not asked about.
        self.known: set[str] | None = None
        self.stats = {"commits": 0, "commit_429": 0, "inline_waits_s": 0.0}

    def hub(self) -> Any:
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

    def client(self) -> Any:
        if self._api is None:
            hh = self.hub()
            token, where = find_token(self.cfg.hf_token_file, self.env)
            if token is None:
                raise NoCredentials(f"no Hugging Face token: set sync.hf_token_file, or HF_TOKEN (in the daemon's "
                                    f"environment or in {env_file_path(self.env)}), or run `hf auth login` as "
                                    "the user the daemon runs as (it needs write access); a token added later "
                                    "is picked up without a restart")
            self._token_from = where
            self._api = hh.HfApi(endpoint=self.endpoint, token=token, library_name="train-supervisor",
                                 library_version=__version__)
        return self._api

    def path(self, key: str) -> str:
        return join_key(self.prefix, key)

    def call(self, what: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except TargetError:
            raise
        except Exception as e:  # noqa: BLE001 - every client error becomes one clear TargetError
            raise self.error(what, e) from None

    def error(self, what: str, e: BaseException) -> TargetError:
        self.hub()
        errors = self._errors
        resp = getattr(e, "response", None) if isinstance(e, errors.HfHubHTTPError) else None
        status = getattr(resp, "status_code", None)
        server = ""
        if resp is not None:
            server = (resp.headers.get("X-Error-Message") or "").strip()
        where = self._token_from or "the configured token"
        repo = f"{self.repo_type} repo {self.repo_id}"
        if status == 401 and (server == INVALID_CREDENTIALS or not isinstance(e, errors.RepositoryNotFoundError)):
            self.forget_token()
            return AccessDenied(f"the Hugging Face Hub rejected the token from {where} (401): it is invalid, "
                                f"expired or revoked; create a write token at https://huggingface.co/settings/tokens")
        if status == 403 or (status == 401 and isinstance(e, errors.RepositoryNotFoundError)):
            who = self._whoami_words()  # with the token that was refused
            self.forget_token()
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

    def forget_token(self) -> None:
        """Read the token again next time: a person may have fixed it."""
        self._api = None
        self._ready = False

    def check_writable(self) -> None:
        """The probe's question (sync/probe.py), asked at start and at `run`, not per pass: a
        classic read token is refused here, before a checkpoint waits on it. Fine-grained tokens
        carry per-repo scopes that only a write answers; those pass and the first commit tells."""
        self.ensure()
        api = self.client()
        try:
            me = api.whoami()
        except Exception as e:  # noqa: BLE001
            raise self.error("whoami", e) from None
        role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
        if role == "read":
            self.forget_token()
            where = self._token_from or "the configured token"
            raise AccessDenied(f"the token from {where} (user {me.get('name')}, read token) has no write access to "
                               f"{self.repo_type} repo {self.repo_id}; create a write token at "
                               f"https://huggingface.co/settings/tokens")

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

    def ensure(self) -> Any:
        """The repo exists (created private when missing) and the branch too. Once per process,
        again after an error that says otherwise."""
        api = self.client()
        if self._ready:
            return api
        errors = self._errors
        try:
            info = api.repo_info(self.repo_id, repo_type=self.repo_type)
            private = bool(info.private)
            if self.revision == "main" and info.sha:
                self.head_sha = str(info.sha)  # the restore's listing pins this commit without asking again
            self.known = listed(info) if self.revision == "main" else None
        except errors.RepositoryNotFoundError:
            self.call("repo create", api.create_repo, self.repo_id, repo_type=self.repo_type,
                      private=self.cfg.hf_private, exist_ok=True)
            private = self.cfg.hf_private
            self._created = True
            self.known = set()
            log.info("hf_repo_created", repo=self.repo_id, repo_type=self.repo_type, private=private)
        except Exception as e:  # noqa: BLE001
            raise self.error("repo info", e) from None
        self._private = private
        if not private and not self.cfg.hf_allow_public:
            log.warning("hf_repo_public_refused", repo=self.repo_id)
            raise PublicRepoRefused(
                f"{self.repo_id} is a public {self.repo_type} repo: everything uploaded there is visible to "
                f"anyone, so nothing is uploaded (make it private on the Hub, or set "
                f"sync.hf_allow_public = true if it is meant to be public)")
        if not private and not self._warning:
            self._warning = (f"{self.repo_id} is a public repo: every checkpoint uploaded there is visible "
                             f"to anyone")
            log.warning("hf_repo_public", repo=self.repo_id)
        if self.revision != "main":
            self.call("branch create", api.create_branch, self.repo_id, branch=self.revision,
                      repo_type=self.repo_type, exist_ok=True)
        self._ready = True
        return api

    def is_public(self) -> bool | None:
        """Whether the repo exists and is public; None when the Hub cannot say (not reachable, no
        token, no such repo). Creates nothing: for check-config."""
        try:
            return not bool(self.client().repo_info(self.repo_id, repo_type=self.repo_type).private)
        except Exception:  # noqa: BLE001 - check-config only says what it could find out
            return None

    def commit(self, ops: list[Any], message: str, description: str = "") -> str:
        api = self.ensure()
        attempt = 0
        while True:
            try:
                ci = self.call("commit", api.create_commit, self.repo_id, operations=ops,
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
                if self.closing.wait(e.retry_after):
                    raise TargetError("closing while waiting out the Hub's rate limit") from None
                continue
            except TargetError:
                # it may have landed (a lost reply): the branch's paths are not known any more;
                # the next ensure() lists them again
                self.known, self._ready = None, False
                raise
            self.stats["commits"] += 1
            self._note(ops)
            return str(ci.oid)

    def _note(self, ops: list[Any]) -> None:
        """What a commit that landed changed in the branch's paths."""
        if self.known is None:
            return
        hh = self.hub()
        for op in ops:
            if isinstance(op, hh.CommitOperationAdd):
                self.known.add(op.path_in_repo)
            elif isinstance(op, hh.CommitOperationDelete) and op.is_folder:
                pre = op.path_in_repo.rstrip("/") + "/"
                self.known = {k for k in self.known if not k.startswith(pre)}
            elif isinstance(op, hh.CommitOperationDelete):
                self.known.discard(op.path_in_repo)

    def head(self) -> str:
        """The branch's head commit now (for a batch with nothing left to commit)."""
        api = self.ensure()
        info = self.call("repo info", api.repo_info, self.repo_id, repo_type=self.repo_type, revision=self.revision)
        self.known = listed(info)
        return str(info.sha)

    def existing(self, paths: list[str]) -> dict[str, Any]:
        """What the branch holds at these paths (get_paths_info), asking only about the paths
        not known to be absent: a new checkpoint's files cost no request."""
        if not paths:
            return {}
        self.ensure()
        ask = sorted(set(paths) if self.known is None else set(paths) & self.known)
        return self.paths_info(ask, self.revision)

    def paths_info(self, paths: list[str], revision: str) -> dict[str, Any]:
        api = self.ensure()
        out: dict[str, Any] = {}
        for i in range(0, len(paths), PATHS_PER_CALL):
            for item in self.call("tree listing", api.get_paths_info, self.repo_id, paths[i:i + PATHS_PER_CALL],
                                  repo_type=self.repo_type, revision=revision):
                out[item.path] = item
        return out

    def download(self, path: str) -> bytes | None:
        api = self.ensure()
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        d = tempfile.mkdtemp(prefix="hf-", dir=self.tmp_dir)
        try:
            p = self.call("download", api.hf_hub_download, self.repo_id, path, repo_type=self.repo_type,
                          revision=self.revision, local_dir=d)
            with open(p, "rb") as fh:
                return fh.read(DOWNLOAD_MAX)
        except TargetError as e:
            log.info("hf_manifest_download_failed", path=path, error=str(e))
            return None
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def facts(self) -> dict:
        """For status: the repo, the upload path and why, private or public (None before the first
        contact), where the token came from (never the token)."""
        return {"kind": "hf", "repo": self.repo_id, "repo_type": self.repo_type, "revision": self.revision,
                "folder": self.prefix, "endpoint": self.endpoint, "upload_path": self.upload_path,
                "upload_path_reason": self.upload_path_why, "private": self._private, "created": self._created,
                "token_from": self._token_from or None, "warning": self._warning or None}


def listed(info: Any) -> set[str] | None:
    """The file paths a repo_info answer lists (its siblings); None when it lists none."""
    sib = getattr(info, "siblings", None)
    return None if sib is None else {s.rfilename for s in sib}


_timeouts_installed = False


def _install_timeouts(hh: Any) -> None:
    """huggingface_hub's shared HTTP client has no timeouts at all: a stalled connection would hang
    the sync worker for good. A client of our own with timeouts, through the public
    `set_client_factory` (once per process); the library's own factory is private, and what it adds
    (a request id, the HF_HUB_OFFLINE check) a daemon that was told to upload does not need."""
    global _timeouts_installed
    if _timeouts_installed:
        return
    import httpx2

    def factory() -> Any:
        return httpx2.Client(follow_redirects=True,
                             timeout=httpx2.Timeout(connect=15.0, read=300.0, write=300.0, pool=60.0))

    hh.set_client_factory(factory)
    _timeouts_installed = True
