"""SmtpMailer against real aiosmtpd servers: STARTTLS, implicit TLS, plain, AUTH, failures."""

from __future__ import annotations

import time
import traceback

import pytest

from supervisor.config import from_dict
from supervisor.notify.mail import PASSWORD_ENV, MailError, SmtpMailer, build_mailer

PASSWORD = "pa55-w0rd-that-must-never-leak"

# aiosmtpd warns about AUTH without its own STARTTLS check on the implicit-TLS server (which is TLS).
pytestmark = pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")


def email_cfg(port: int, **kw):
    e = {"to": ["owner@example.com"], "smtp_host": "127.0.0.1", "smtp_port": port, "security": "none"}
    e.update(kw)
    return from_dict({"email": e}).email


@pytest.fixture
def password_file(tmp_path):
    p = tmp_path / "smtp-password"
    p.write_text(PASSWORD + "\n")  # as `echo secret > file` writes it
    p.chmod(0o600)
    return p


def _assert_no_secret(e: BaseException) -> None:
    text = "".join(traceback.format_exception(e))
    assert PASSWORD not in text
    assert e.__cause__ is None and e.__suppress_context__


@pytest.mark.parametrize("mode", ["starttls", "ssl"])
def test_tls_with_login_delivers(mode, smtp_factory, tls_ca, password_file):
    srv = smtp_factory(mode, auth=("trainer", PASSWORD))
    m = SmtpMailer(email_cfg(srv.port, security=mode, username="trainer", password_file=str(password_file),
                             ca_file=tls_ca.ca_file), hostname="gpu-box-7")
    m.send("idle for 2h", "The machine stops at 14:00.\n.leading dot line\nünïcode ✓")
    (msg,) = srv.wait_for(1)
    assert srv.logins == [(srv.logins[0][0], "trainer", True, True)]  # logged in, over TLS
    assert msg["Subject"] == "[train-supervisor] idle for 2h"
    assert msg["From"] == "train-supervisor@gpu-box-7"
    assert msg["To"] == "owner@example.com"
    assert msg["Auto-Submitted"] == "auto-generated"
    assert msg["Date"] and msg["Message-ID"].endswith("@gpu-box-7>")
    body = msg.get_payload(decode=True).decode(msg.get_content_charset())
    assert ".leading dot line" in body.splitlines() and "ünïcode ✓" in body
    assert srv.envelopes == [("train-supervisor@gpu-box-7", ["owner@example.com"])]


def test_plain_smtp_without_login(smtp_factory):
    srv = smtp_factory("none")
    m = SmtpMailer(email_cfg(srv.port, to=["a@example.com", "b@example.com"], **{"from": "sv@example.org"},
                             subject_prefix=""), hostname="h")
    m.send("hello", "body")
    (msg,) = srv.wait_for(1)
    assert msg["Subject"] == "hello" and msg["From"] == "sv@example.org"
    assert srv.envelopes == [("sv@example.org", ["a@example.com", "b@example.com"])]


def test_untrusted_certificate_is_refused(smtp_factory, password_file):
    srv = smtp_factory("starttls", auth=("trainer", PASSWORD))
    m = SmtpMailer(email_cfg(srv.port, security="starttls", username="trainer",
                             password_file=str(password_file)))  # no ca_file: the test CA is unknown
    with pytest.raises(MailError, match="TLS failed.*CERTIFICATE_VERIFY_FAILED") as ei:
        m.send("s", "b")
    _assert_no_secret(ei.value)
    assert srv.logins == [] and srv.messages == []


def test_starttls_not_offered_never_sends_the_password(smtp_factory, password_file):
    srv = smtp_factory("none")  # a server (or a downgrading middlebox) without STARTTLS
    m = SmtpMailer(email_cfg(srv.port, security="starttls", username="trainer",
                             password_file=str(password_file)))
    with pytest.raises(MailError, match="STARTTLS") as ei:
        m.send("s", "b")
    _assert_no_secret(ei.value)
    assert srv.messages == []


def test_wrong_password_is_a_clear_error_without_the_password(smtp_factory, tls_ca, tmp_path):
    srv = smtp_factory("starttls", auth=("trainer", "the-right-one"))
    wrong = tmp_path / "pw"
    wrong.write_text(PASSWORD)
    m = SmtpMailer(email_cfg(srv.port, security="starttls", username="trainer", password_file=str(wrong),
                             ca_file=tls_ca.ca_file))
    with pytest.raises(MailError, match=rf"127\.0\.0\.1:{srv.port}: server said 535") as ei:
        m.send("s", "b")
    _assert_no_secret(ei.value)
    assert srv.logins[-1][2] is False


def test_password_is_read_at_send_time(smtp_factory, tls_ca, password_file):
    srv = smtp_factory("ssl", auth=("trainer", PASSWORD))
    m = SmtpMailer(email_cfg(srv.port, security="ssl", username="trainer", password_file=str(password_file),
                             ca_file=tls_ca.ca_file))
    m.send("one", "b")
    srv.authenticator.password = "rotated"
    password_file.write_text("rotated\r\n")
    m.send("two", "b")
    assert [s.rsplit(" ", 1)[-1] for s in srv.subjects()] == ["one", "two"]


def test_password_from_environment(smtp_factory, tls_ca, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    srv = smtp_factory("starttls", auth=("trainer", PASSWORD))
    m = SmtpMailer(email_cfg(srv.port, security="starttls", username="trainer", ca_file=tls_ca.ca_file))
    m.send("env", "b")
    srv.wait_for(1)
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(MailError, match=PASSWORD_ENV):
        m.send("env", "b")


def test_unreadable_password_file_names_the_key(tmp_path):
    m = SmtpMailer(email_cfg(1, username="u", password_file=str(tmp_path / "missing")))
    with pytest.raises(MailError, match=r"cannot read email.password_file .*missing: No such file"):
        m.send("s", "b")


def test_connection_refused_names_the_server(smtp_factory):
    srv = smtp_factory("none")
    srv.stop()
    m = SmtpMailer(email_cfg(srv.port))
    with pytest.raises(MailError, match=rf"SMTP 127\.0\.0\.1:{srv.port}: Connection refused"):
        m.send("s", "b")


def test_silent_server_times_out(blackhole_port):
    m = SmtpMailer(email_cfg(blackhole_port, timeout="1s"))
    t0 = time.monotonic()
    with pytest.raises(MailError, match="timed out after 1s"):
        m.send("s", "b")
    assert time.monotonic() - t0 < 5


def test_tls_mode_that_does_not_fit_the_port_gets_a_hint(blackhole_port):
    m = SmtpMailer(email_cfg(blackhole_port, timeout="1s"))
    m.cfg.smtp_port = 465  # what the hint keys on; the connection still goes to the silent server
    assert "usually wants email.security" in m._port_hint()


def test_header_injection_in_subject_is_impossible(smtp_factory):
    srv = smtp_factory("none")
    m = SmtpMailer(email_cfg(srv.port, subject_prefix="[ts]\r\nX-Evil: 1"), hostname="h")
    m.send("CUDA out of memory\r\nBcc: victim@example.com\nX-Injected: yes\x00\u2028Reply-To: x@y",
           "Bcc: in-body@example.com\r\n\r\nbody text")
    (msg,) = srv.wait_for(1)
    assert msg["Bcc"] is None and msg["X-Injected"] is None and msg["X-Evil"] is None
    assert msg["Reply-To"] is None
    assert len(msg.get_all("Subject")) == 1
    subject = " ".join(str(msg["Subject"]).split())  # unfold the long line
    assert subject.startswith("[ts] X-Evil: 1 CUDA out of memory Bcc: victim@example.com")
    assert srv.envelopes == [("train-supervisor@h", ["owner@example.com"])]


def test_build_mailer():
    assert build_mailer(from_dict({})) is None
    m = build_mailer(from_dict({"hostname": "box_1 (gpu)", "email": {"to": ["a@b.c"], "smtp_host": "h"}}))
    assert isinstance(m, SmtpMailer) and m.from_addr == "train-supervisor@box1gpu"


def test_error_texts_are_scrubbed_of_the_password_in_every_form_auth_sends():
    import base64

    m = SmtpMailer(email_cfg(1, security="starttls", username="trainer", password_file="/nonexistent"))
    plain = base64.b64encode(f"\0trainer\0{PASSWORD}".encode()).decode()
    text = f"535 bad {PASSWORD} {base64.b64encode(PASSWORD.encode()).decode()} {plain}"
    assert m._scrub(text, PASSWORD) == "535 bad *** *** ***"
