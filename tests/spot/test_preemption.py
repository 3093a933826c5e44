"""Spot notices: the providers' replies read by pure functions, and the watcher asking real HTTP
servers on loopback that speak each provider's metadata protocol."""

from __future__ import annotations

import datetime as dt
import json

from supervisor.spot.notices import (
    MetadataWatcher,
    parse_azure_events,
    parse_ec2_action,
    parse_ec2_rebalance,
    parse_gcp_preempted,
)
from tests.fixtures.metadata import metadata_servers  # noqa: F401 - the fixture

NOW = 1_800_000_000.0


# --- the pure readers ----------------------------------------------------------------------------
def test_ec2_no_notice_is_404():
    assert parse_ec2_action(404, b"Not Found", NOW) is None


def test_ec2_notice_carries_action_and_time():
    n = parse_ec2_action(200, b'{"action": "terminate", "time": "2027-01-15T08:02:00Z"}', NOW)
    assert n is not None and n.provider == "ec2" and n.kind == "terminate" and n.final
    assert n.deadline == dt.datetime(2027, 1, 15, 8, 2, tzinfo=dt.UTC).timestamp()


def test_ec2_stop_and_hibernate_kept():
    for action in ("stop", "hibernate"):
        n = parse_ec2_action(200, json.dumps({"action": action, "time": "2027-01-15T08:02:00Z"}).encode(), NOW)
        assert n is not None and n.kind == action


def test_ec2_garbage_reply_still_counts_as_a_notice_with_the_typical_deadline():
    # a 200 on instance-action means the machine is going, whatever the body says
    for body in (b"", b"not json", b"[1,2]", b'{"action": "explode"}'):
        n = parse_ec2_action(200, body, NOW)
        assert n is not None and n.kind == "terminate" and n.deadline == NOW + 120


def test_ec2_rebalance_is_not_final():
    assert parse_ec2_rebalance(404, b"") is None
    r = parse_ec2_rebalance(200, b'{"noticeTime": "2027-01-15T08:00:00Z"}')
    assert r is not None and not r.final and r.deadline is None


def test_gcp_preempted():
    assert parse_gcp_preempted(200, b"FALSE", NOW) is None
    assert parse_gcp_preempted(503, b"TRUE", NOW) is None
    n = parse_gcp_preempted(200, b"TRUE\n", NOW)
    assert n is not None and n.kind == "preempt" and n.deadline == NOW + 30


def test_azure_preempt_event_with_not_before():
    doc = {"DocumentIncarnation": 2, "Events": [
        {"EventId": "A", "EventType": "Freeze", "NotBefore": ""},
        {"EventId": "B", "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["vm1"],
         "EventStatus": "Scheduled", "NotBefore": "Fri, 15 Jan 2027 08:00:30 GMT"}]}
    n = parse_azure_events(200, json.dumps(doc).encode(), NOW)
    assert n is not None and n.provider == "azure" and "B" in n.detail
    assert n.deadline == dt.datetime(2027, 1, 15, 8, 0, 30, tzinfo=dt.UTC).timestamp()


def test_azure_no_preempt_or_garbage():
    assert parse_azure_events(200, b'{"DocumentIncarnation": 1, "Events": []}', NOW) is None
    assert parse_azure_events(200, b'{"Events": [{"EventType": "Reboot"}]}', NOW) is None
    for body in (b"", b"{", b"[]", b'{"Events": "x"}', b'{"Events": [1, null]}'):
        assert parse_azure_events(200, body, NOW) is None
    n = parse_azure_events(200, b'{"Events": [{"EventType": "Preempt", "NotBefore": "garbage"}]}', NOW)
    assert n is not None and n.deadline == NOW + 30


# --- the watcher against the real protocols on loopback -------------------------------------------
def _watcher(servers, watch=()):
    return MetadataWatcher(list(watch), {p: s.url for p, s in servers.items()}, timeout=2.0)


def test_detect_finds_each_provider_by_its_own_handshake(metadata_servers):  # noqa: F811
    for p, s in metadata_servers.items():
        others = {q: "http://127.0.0.1:9" for q in metadata_servers if q != p}
        w = MetadataWatcher([], {p: s.url, **others}, timeout=2.0)
        assert w.detect() == [p]


def test_nothing_answers_means_nothing_watched():
    w = MetadataWatcher([], {p: "http://127.0.0.1:9" for p in ("ec2", "gcp", "azure")}, timeout=0.5)
    assert w.poll(NOW) == [] and w.detected == []


def test_ec2_notice_through_imdsv2(metadata_servers):  # noqa: F811
    ec2 = metadata_servers["ec2"]
    w = _watcher(metadata_servers, ["ec2"])
    assert w.poll(NOW) == []
    ec2.rebalance = {"noticeTime": "2027-01-15T08:00:00Z"}
    assert [n.kind for n in w.poll(NOW)] == ["rebalance"]
    ec2.notice = {"action": "terminate", "time": "2027-01-15T08:02:00Z"}
    got = w.poll(NOW)
    assert [n.kind for n in got] == ["terminate"] and got[0].final
    # every GET carried the session token from a PUT (IMDSv1 would have been refused with 401)
    assert ("PUT", "/latest/api/token", True) in ec2.requests
    assert all(ok for _, _, ok in ec2.requests)


def test_gcp_and_azure_notices(metadata_servers):  # noqa: F811
    w = _watcher(metadata_servers, ["gcp", "azure"])
    assert w.poll(NOW) == []
    metadata_servers["gcp"].notice = "TRUE"
    metadata_servers["azure"].notice = {"EventId": "E1", "EventType": "Preempt", "NotBefore": ""}
    got = sorted((n.provider, n.kind) for n in w.poll(NOW))
    assert got == [("azure", "preempt"), ("gcp", "preempt")]


def test_a_service_that_goes_away_is_an_error_not_a_notice(metadata_servers):  # noqa: F811
    w = _watcher(metadata_servers, ["ec2"])
    metadata_servers["ec2"].stop()
    assert w.poll(NOW) == []
    assert w.last_error.startswith("ec2:")
