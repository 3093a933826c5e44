"""Signed webhooks per the Standard Webhooks spec (standardwebhooks.com).

Each alert is one POST of JSON `{"type", "timestamp", "data"}` with three headers:
`webhook-id` (the same on every retry, so a receiver can drop duplicates), `webhook-timestamp`
(Unix seconds of this attempt) and `webhook-signature`: `v1,` + base64(HMAC-SHA256(key,
"{id}.{timestamp}.{body}")), the key being the base64 part of the `whsec_...` secret. The secret
is read from its file at each send (it may be rotated), never logged, never in an error text.
Redirects are not followed: a signed body goes only where it was configured to go.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

from supervisor import __version__
from supervisor.config import redact_url
from supervisor.notify.channels import Message, scrub, url_secret_parts
from supervisor.redact import redact_obj
from supervisor.status import Block, View
from supervisor.status.gpu import GpusBlock
from supervisor.status.health import HealthBlock
from supervisor.status.idle import IdleBlock, StopBlock
from supervisor.status.sync import SyncBlock
from supervisor.status.training import CostBlock, TrainingBlock

SECRET_PREFIX = "whsec_"


class WebhookError(Exception):
    """Delivery failed; the text holds neither the secret nor the URL's secret parts."""


# --- the pure part: payload and signature --------------------------------------------------------

def decode_secret(text: str) -> bytes:
    """The HMAC key from a `whsec_<base64>` secret (the prefix is optional)."""
    s = text.strip()
    if s.startswith(SECRET_PREFIX):
        s = s[len(SECRET_PREFIX):]
    try:
        key = base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise WebhookError("notify.webhook_secret_file: not a whsec_ secret (base64 after \"whsec_\"); "
                           "make one with: echo \"whsec_$(head -c 32 /dev/urandom | base64)\"") from None
    if len(key) < 16:
        raise WebhookError("notify.webhook_secret_file: the secret is shorter than 16 bytes; "
                           "make one with: echo \"whsec_$(head -c 32 /dev/urandom | base64)\"")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def payload(msg: Message) -> dict[str, Any]:
    """The JSON body: what happened, and the `status --json` sections it is about (as it went out)."""
    return {
        "type": f"alert.{msg.state}",
        "timestamp": _iso(msg.created),
        "data": {"id": msg.id, "host": msg.host, "key": msg.key, "kind": msg.kind, "severity": msg.severity,
                 "state": msg.state, "subject": msg.subject, "body": msg.body, "created_at": msg.created,
                 **({"status": msg.facts} if msg.facts else {})},
    }


def headers(key: bytes, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(key, msg_id, timestamp, body),
            "Content-Type": "application/json", "User-Agent": f"train-supervisor/{__version__}"}


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


# --- the channel ---------------------------------------------------------------------------------

def _opener() -> Any:
    """An opener that follows no redirect (a webhook URL that answers 3xx is a failure, never a
    second receiver). urllib.request is ~1 MiB: imported only when a webhook is configured."""
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, hdrs, newurl):  # noqa: ANN001
            return None

    return urllib.request.build_opener(NoRedirect)


class WebhookChannel:
    kind = "webhook"

    def __init__(self, url: str, secret_file: str, *, timeout: float = 10.0,
                 facts: Callable[[str], dict] | None = None, wall: Callable[[], float] = time.time,
                 name: str = "webhook"):
        self.url = url
        self.secret_file = secret_file
        self.timeout = timeout
        self.facts = facts
        # The signature's timestamp is the attempt's real time: receivers reject old ones (replay).
        self.wall = wall
        self.name = name
        self.target = redact_url(url)
        self._secrets = url_secret_parts(url, self.target)
        self._opener = _opener()

    def _key(self) -> bytes:
        try:
            with open(self.secret_file, encoding="utf-8") as f:
                return decode_secret(f.read())
        except OSError as e:
            raise WebhookError(f"cannot read notify.webhook_secret_file {self.secret_file}: "
                               f"{e.strerror or type(e).__name__}") from None
        except UnicodeDecodeError:
            raise WebhookError(f"notify.webhook_secret_file {self.secret_file} is not text") from None

    def send(self, msg: Message) -> None:
        key = self._key()
        if self.facts is not None and not msg.facts:
            try:
                # the status sections go out of the machine: secrets masked as on the socket
                msg = _with_facts(msg, redact_obj(self.facts(msg.kind)))
            except Exception:  # noqa: BLE001 - the alert goes out without facts rather than not at all
                pass
        import urllib.error
        import urllib.request

        body = json.dumps(payload(msg), default=str, separators=(",", ":")).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers=headers(key, msg.id, int(self.wall()), body))
        try:
            with self._opener.open(req, timeout=self.timeout) as r:
                r.read(4096)
        except urllib.error.HTTPError as e:
            raise WebhookError(self._clean(f"HTTP {e.code} {e.reason}")) from None
        except urllib.error.URLError as e:
            why = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else str(e.reason)
            raise WebhookError(self._clean(f"{why}")) from None
        except TimeoutError:
            raise WebhookError(f"timed out after {self.timeout:g}s") from None
        except OSError as e:
            raise WebhookError(self._clean(f"{e.strerror or type(e).__name__}")) from None

    def _clean(self, text: str) -> str:
        return scrub(text, self._secrets)[:300]


def _with_facts(msg: Message, facts: dict) -> Message:
    from dataclasses import replace

    return replace(msg, facts=facts or {})


# The status blocks each kind of alert is about (the rest of status --json is one call away). Named
# by their block classes, not by key: a renamed key moves with its block instead of dropping a section.
_FACTS: dict[str, tuple[type[Block], ...]] = {
    "sync_failing": (SyncBlock,),
    "disk_full": (SyncBlock,),
    "host_mem_low": (TrainingBlock,),
    "gpu_mem_limit": (GpusBlock, TrainingBlock),
    "gpu_failed": (GpusBlock,),
    "gpu_xid": (GpusBlock, TrainingBlock),
    "gpu_health": (HealthBlock, TrainingBlock),
    "training_stalled": (TrainingBlock, GpusBlock, CostBlock),
    "idle_warning": (IdleBlock, StopBlock, CostBlock, SyncBlock),
    "stop_cancelled": (IdleBlock, StopBlock),
    "stopping": (IdleBlock, StopBlock, SyncBlock, CostBlock),
    "stop_failed": (IdleBlock, StopBlock, SyncBlock),
}
_DEFAULT_FACTS: tuple[type[Block], ...] = (TrainingBlock, CostBlock)


def facts_for(kind: str, status: dict | None) -> dict:
    """The blocks of a `status --json` dict that an alert of `kind` is about, as each may leave the
    machine (shared_json: the training's command line, which may carry a token, stays here)."""
    if not status:
        return {}
    v = View(status)
    out: dict = {}
    for cls in _FACTS.get(kind, _DEFAULT_FACTS):
        b = v.block(cls)
        if b.given:
            out.update(b.shared_json())
    if v.now_known:
        out.update(at=v.now)
    return out
