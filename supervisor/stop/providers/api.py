"""One HTTPS request to a provider's API or metadata service, with the standard library.

urllib, not each provider's SDK: the calls are a handful of documented JSON requests, the SDKs
(runpod, vastai, azure-mgmt-compute, google-cloud-compute) would add hundreds of MB and their own
retries to a daemon that must make exactly one call per attempt, and a stand-in on loopback serves
the same paths in tests. boto3 stays for AWS (already here, and SigV4 is not a few lines).

Every answer is bounded and parsed through supervisor.untrusted; an error's body is scrubbed of
secrets (the key itself, and whatever redact knows) before it reaches a log line, a mail or status.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from supervisor import redact
from supervisor.stop.providers.base import ProviderError
from supervisor.untrusted import Unreadable, json_doc

ANSWER_MAX = 1 << 20       # a provider's JSON answer; more is not an answer we understand
SHOWN_MAX = 300            # what of an error's body is shown
API_TIMEOUT_S = 20.0
DESCRIBE_TIMEOUT_S = 5.0   # describe runs at the daemon's start: a slow API must not hold the start long
METADATA_TIMEOUT_S = 1.0   # link-local: it answers at once or it is not there


def scrub(text: str, *secrets: str) -> str:
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, redact.MASK)
    return redact.redact(text)


class Api:
    """A base URL and the headers every request carries (the credential among them)."""

    def __init__(self, base: str, headers: dict[str, str] | None = None, *, timeout: float = API_TIMEOUT_S,
                 secrets: tuple[str, ...] = ()):
        self.base = base.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.secrets = tuple(s for s in secrets if s)
        redact.register(*self.secrets)

    def call(self, method: str, path: str, body: Any = None, *, what: str = "",
             timeout: float | None = None) -> tuple[int, Any]:
        """(HTTP status, parsed JSON or None) for a 2xx or a 404; ProviderError otherwise. A 404
        comes back so that a caller asking for a machine that is gone can say "gone"."""
        what = what or f"{method} {path.split('?')[0]}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json", **self.headers}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        wait = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=wait) as r:  # noqa: S310 - the provider's URL
                return r.status, self._parse(r.read(ANSWER_MAX + 1), what)
        except urllib.error.HTTPError as e:
            raw = e.read(ANSWER_MAX + 1) if e.fp is not None else b""
            if e.code == 404:
                return 404, None
            answer = scrub(raw[:4000].decode("utf-8", "replace").strip(), *self.secrets)[:SHOWN_MAX]
            kind = "refused" if 400 <= e.code < 500 else "failed"
            raise ProviderError(f"{what}: HTTP {e.code}{': ' + answer if answer else ''}", kind, e.code,
                                answer) from None
        except TimeoutError:
            raise ProviderError(f"{what}: no answer within {wait:.0f}s", "unknown") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise ProviderError(f"{what}: no answer within {wait:.0f}s", "unknown") from None
            raise ProviderError(f"{what}: {scrub(str(reason), *self.secrets)[:SHOWN_MAX]}", "failed") from None
        except (OSError, ValueError) as e:  # a reset connection, a bad URL
            raise ProviderError(f"{what}: {scrub(str(e), *self.secrets)[:SHOWN_MAX]}", "unknown"
                                if isinstance(e, ConnectionResetError) else "failed") from None

    def _parse(self, raw: bytes, what: str) -> Any:
        if not raw.strip():
            return None
        try:
            return json_doc(raw, limit=ANSWER_MAX, what=f"the answer to {what}")
        except Unreadable:
            return raw[:SHOWN_MAX].decode("utf-8", "replace")  # plain text (a token, an id)


def get_text(url: str, headers: dict[str, str], timeout: float = METADATA_TIMEOUT_S, method: str = "GET") -> str:
    """A metadata service's plain-text answer; ProviderError when it does not answer 200."""
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the metadata service
            return r.read(64 * 1024).decode("utf-8", "replace").strip()
    except urllib.error.HTTPError as e:
        raise ProviderError(f"metadata {url.split('?')[0]}: HTTP {e.code}", "refused", e.code) from None
    except (OSError, ValueError) as e:
        raise ProviderError(f"metadata {url.split('?')[0]} unavailable: {getattr(e, 'reason', e)}",
                            "failed") from None


def dig(doc: Any, *path: str) -> Any:
    """doc[path[0]][path[1]]... or None where a step is missing or not an object."""
    for p in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(p)
    return doc
