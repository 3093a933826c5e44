"""Spot / preemptible notices from the cloud's metadata service.

A spot machine gets a short warning before it is taken: EC2 about 2 minutes
(`/latest/meta-data/spot/instance-action`, 404 until then, and sometimes an earlier rebalance
recommendation), GCP about 30 s (`instance/preempted` turns TRUE), Azure a Scheduled Event of type
`Preempt`. Container hosts send SIGTERM instead; that path is the daemon's signal handler.

Reading a reply is a pure function (`parse_*`), so every shape a provider sends is tested without a
network; `MetadataWatcher` is the thin shell that asks, with short timeouts, and never raises.
"""

from __future__ import annotations

import email.utils
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from supervisor.untrusted import Unreadable, json_doc

PROVIDERS = ("ec2", "gcp", "azure")
DEFAULT_URLS = {
    "ec2": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
# what each provider promises between the notice and the end, when the notice names no time
TYPICAL_NOTICE_S = {"ec2": 120.0, "gcp": 30.0, "azure": 30.0}


@dataclass(frozen=True)
class Notice:
    provider: str           # ec2 | gcp | azure | signal
    kind: str               # terminate | stop | hibernate | preempt | rebalance | sigterm
    deadline: float | None  # wall time the machine is expected to go, when known
    detail: str = ""

    @property
    def final(self) -> bool:
        """The machine WILL go (a rebalance recommendation only says it might)."""
        return self.kind != "rebalance"

    @property
    def key(self) -> str:
        return f"{self.provider}:{self.kind}:{int(self.deadline or 0)}"


def _iso(t: str) -> float | None:
    try:
        return datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


def parse_ec2_action(status: int, body: bytes, now: float) -> Notice | None:
    """`/latest/meta-data/spot/instance-action`: 404 means no notice; 200 carries
    {"action": "terminate"|"stop"|"hibernate", "time": "2026-12-03T08:22:00Z"}."""
    if status != 200:
        return None
    try:
        doc = json_doc(body, limit=1 << 20, what="the metadata service's answer")
    except Unreadable:
        return Notice("ec2", "terminate", now + TYPICAL_NOTICE_S["ec2"], "unreadable instance-action reply")
    if not isinstance(doc, dict):
        return Notice("ec2", "terminate", now + TYPICAL_NOTICE_S["ec2"], "unreadable instance-action reply")
    action = str(doc.get("action") or "terminate")
    when = _iso(str(doc.get("time") or "")) or now + TYPICAL_NOTICE_S["ec2"]
    return Notice("ec2", action if action in ("terminate", "stop", "hibernate") else "terminate", when,
                  f"spot instance-action {action}")


def parse_ec2_rebalance(status: int, body: bytes) -> Notice | None:
    """`/latest/meta-data/events/recommendations/rebalance`: 200 {"noticeTime": ...} when the
    instance is at elevated risk; no deadline follows from it."""
    if status != 200:
        return None
    return Notice("ec2", "rebalance", None, "rebalance recommendation: interruption risk is elevated")


def parse_gcp_preempted(status: int, body: bytes, now: float) -> Notice | None:
    """`computeMetadata/v1/instance/preempted`: the text TRUE once the preemption has begun."""
    if status != 200 or body.strip().upper() != b"TRUE":
        return None
    return Notice("gcp", "preempt", now + TYPICAL_NOTICE_S["gcp"], "instance/preempted is TRUE")


def parse_azure_events(status: int, body: bytes, now: float) -> Notice | None:
    """Azure Scheduled Events: a `Preempt` event (spot eviction) is final; `NotBefore` is an HTTP date
    (empty once the event started)."""
    if status != 200:
        return None
    try:
        doc = json_doc(body, limit=1 << 20, what="the metadata service's answer")
    except Unreadable:
        return None
    events = doc.get("Events") if isinstance(doc, dict) else None
    for ev in events if isinstance(events, list) else []:
        if not isinstance(ev, dict) or ev.get("EventType") != "Preempt":
            continue
        when = None
        nb = ev.get("NotBefore")
        if isinstance(nb, str) and nb:
            try:
                when = email.utils.parsedate_to_datetime(nb).timestamp()
            except (TypeError, ValueError):
                when = None
        return Notice("azure", "preempt", when or now + TYPICAL_NOTICE_S["azure"],
                      f"scheduled event {ev.get('EventId', '?')} Preempt")
    return None


# --- the shell -------------------------------------------------------------------------------------
Fetch = Callable[[str, str, dict[str, str], float], tuple[int, bytes, dict[str, str]]]


def http_fetch(method: str, url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers); a refused or timed-out request raises OSError. Through http.client,
    not urllib.request: no proxy from the environment ever sees a metadata request (the services
    answer on a link-local address only), and a daemon at rest that finds no service has not
    loaded urllib.request's 1 MiB for the one look at start."""
    import http.client

    u = urllib.parse.urlsplit(url)
    if not u.hostname or u.scheme not in ("http", "https"):
        raise OSError(f"not an http URL with a host: {url}")
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname or "", u.port, timeout=timeout)
    try:
        conn.request(method, (u.path or "/") + (f"?{u.query}" if u.query else ""),
                     body=b"" if method == "PUT" else None, headers=headers)
        r = conn.getresponse()
        return r.status, r.read(65536), {k.lower(): v for k, v in r.getheaders()}
    except http.client.HTTPException as e:  # a garbled answer: as unreachable as no answer
        raise OSError(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()


class MetadataWatcher:
    """Asks each configured metadata service for a notice. `watch` empty = detect: the first
    `detect()` keeps the providers whose service answers in its own way (EC2's token, GCP's
    Metadata-Flavor header, Azure's Scheduled Events document)."""

    def __init__(self, watch: list[str], urls: dict[str, str] | None = None, timeout: float = 1.0,
                 fetch: Fetch = http_fetch):
        self.watch = list(watch)
        self.urls = {**DEFAULT_URLS, **(urls or {})}
        self.timeout = timeout
        self._fetch = fetch
        self.detected: list[str] | None = list(watch) or None
        self.last_error: str = ""

    def detect(self) -> list[str]:
        found = [p for p in PROVIDERS if self._answers(p)]
        self.detected = found
        return found

    def _answers(self, p: str) -> bool:
        try:
            if p == "ec2":
                return self._ec2_token() is not None
            if p == "gcp":
                st, _, hd = self._fetch("GET", f"{self.urls['gcp']}/computeMetadata/v1/instance/id",
                                        {"Metadata-Flavor": "Google"}, self.timeout)
                return st == 200 and hd.get("metadata-flavor", "").lower() == "google"
            st, body, _ = self._fetch("GET", self._azure_url(), {"Metadata": "true"}, self.timeout)
            return st == 200 and b"Events" in body
        except OSError:
            return False

    def _azure_url(self) -> str:
        return f"{self.urls['azure']}/metadata/scheduledevents?api-version=2020-07-01"

    def _ec2_token(self) -> str | None:
        st, body, _ = self._fetch("PUT", f"{self.urls['ec2']}/latest/api/token",
                                  {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, self.timeout)
        return body.decode(errors="replace").strip() if st == 200 and body else None

    def poll(self, now: float) -> list[Notice]:
        """Every notice the watched services show now (empty when none; errors in last_error)."""
        if self.detected is None:
            self.detect()
        out: list[Notice] = []
        errors = []
        for p in self.detected or []:
            try:
                out.extend(self._poll_one(p, now))
            except OSError as e:
                errors.append(f"{p}: {getattr(e, 'reason', e)}")
        self.last_error = "; ".join(errors)
        return out

    def _poll_one(self, p: str, now: float) -> list[Notice]:
        if p == "ec2":
            token = self._ec2_token()
            if token is None:
                raise OSError("no IMDSv2 token")
            h = {"X-aws-ec2-metadata-token": token}
            base = f"{self.urls['ec2']}/latest/meta-data"
            st, body, _ = self._fetch("GET", f"{base}/spot/instance-action", h, self.timeout)
            n = parse_ec2_action(st, body, now)
            if n is not None:
                return [n]
            st, body, _ = self._fetch("GET", f"{base}/events/recommendations/rebalance", h, self.timeout)
            r = parse_ec2_rebalance(st, body)
            return [r] if r else []
        if p == "gcp":
            st, body, _ = self._fetch("GET", f"{self.urls['gcp']}/computeMetadata/v1/instance/preempted",
                                      {"Metadata-Flavor": "Google"}, self.timeout)
            n = parse_gcp_preempted(st, body, now)
            return [n] if n else []
        st, body, _ = self._fetch("GET", self._azure_url(), {"Metadata": "true"}, self.timeout)
        n = parse_azure_events(st, body, now)
        return [n] if n else []
