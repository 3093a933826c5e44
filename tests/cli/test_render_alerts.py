"""`supervisorctl alerts`: one line per alert, its mail's fate folded in (the log keeps them apart)."""

from __future__ import annotations

from supervisor.cli.render import render_alerts


def ev(at, what, key, subject, **kw):
    return {"at": at, "what": what, "key": key, "kind": key.split(":")[0], "subject": subject, **kw}


def test_an_alert_and_its_delivery_are_one_line():
    res = {"recent": [
        ev(100, "event", "training_finished", "training finished (exit code 0)"),
        ev(100, "not_mailed", "training_finished", "training finished (exit code 0)",
           reason="no [email] configured"),
        ev(120, "event", "stopping", "stopping now"),
        ev(121, "mailed", "stopping", "stopping now"),
    ]}
    lines = render_alerts(res).splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("training finished (exit code 0)  (not mailed: no [email] configured)")
    assert "stopping now  (mailed " in lines[1]


def test_a_retried_mail_shows_its_latest_fate_and_a_resolved_mail_joins_its_resolve():
    res = {"recent": [
        ev(100, "raised", "disk:/", "disk almost full"),
        ev(101, "mail_failed", "disk:/", "disk almost full", error="SMTPConnectError: refused"),
        ev(170, "mailed", "disk:/", "disk almost full"),
        ev(200, "resolved", "disk:/", "disk almost full"),
        ev(201, "mailed", "disk:/", "RESOLVED: disk almost full"),
        ev(300, "mailed", "disk:/", "STILL: disk almost full"),  # a reminder has no alert line of its own
    ]}
    lines = render_alerts(res).splitlines()
    assert len(lines) == 3, lines
    assert "raised" in lines[0] and "(mailed " in lines[0] and "refused" not in lines[0]
    assert "resolved" in lines[1] and "(mailed " in lines[1]
    assert "STILL: disk almost full" in lines[2]


def test_a_failure_alone_still_says_why():
    res = {"recent": [ev(101, "mail_failed", "x", "s", error="535 auth")]}
    assert render_alerts(res).endswith("s  (535 auth)")
    assert render_alerts({"recent": []}) == "no alerts"
