"""Email delivery over SMTP (stdlib smtplib/email), the one Mailer the daemon uses.

The password is read at send time (the file may be rotated, and a daemon that never mails never
needs it), is never logged, and never appears in an exception: every smtplib/socket/TLS error is
re-raised as a MailError whose text is built from the error's code and message with the password
scrubbed, and without the original exception chained to it.
"""

from __future__ import annotations

import base64
import os
import re
import smtplib
import socket
import ssl
from email.message import EmailMessage
from email.utils import formatdate, make_msgid

from supervisor.config import Config, EmailConfig
from supervisor.redact import register as register_secret

PASSWORD_ENV = "TRAIN_SUPERVISOR_SMTP_PASSWORD"

_CTRL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]+")


class MailError(Exception):
    """Delivery failed. The message names the cause and never contains the password."""


def clean_header(text: str, limit: int = 200) -> str:
    """One line without control characters, so text from a log can never start a new header."""
    return _CTRL.sub(" ", text).strip()[:limit]


def _host_for_address(hostname: str) -> str:
    h = re.sub(r"[^A-Za-z0-9.-]", "", hostname).strip(".-")
    return h or "localhost"


class SmtpMailer:
    def __init__(self, email_cfg: EmailConfig, hostname: str = ""):
        self.cfg = email_cfg
        self.hostname = _host_for_address(hostname or socket.gethostname())
        self.from_addr = email_cfg.from_ or f"train-supervisor@{self.hostname}"

    # --- the Mailer protocol ---------------------------------------------------------------
    def send(self, subject: str, body: str) -> None:
        """Deliver one mail to every `email.to` address, or raise MailError."""
        password = self._password()
        msg = self.message(subject, body)
        try:
            self._deliver(msg, password)
        except MailError:
            raise
        except smtplib.SMTPResponseException as e:
            raise MailError(self._scrub(f"{self._where()}: server said {e.smtp_code} {_text(e.smtp_error)}",
                                        password)) from None
        except smtplib.SMTPRecipientsRefused as e:
            refused = ", ".join(f"{a} ({c} {_text(m)})" for a, (c, m) in e.recipients.items())
            raise MailError(self._scrub(f"{self._where()}: recipients refused: {refused}", password)) from None
        except ssl.SSLError as e:
            detail = getattr(e, "verify_message", "") or ""
            raise MailError(self._scrub(f"{self._where()}: TLS failed: {e.reason or e}"
                                        + (f" ({detail})" if detail else ""), password)) from None
        except smtplib.SMTPServerDisconnected as e:
            # smtplib turns a read timeout into "Connection unexpectedly closed: timed out".
            if "timed out" in str(e):
                raise MailError(f"{self._where()}: timed out after {self.cfg.timeout:g}s{self._port_hint()}") from None
            raise MailError(self._scrub(f"{self._where()}: {e}", password)) from None
        except smtplib.SMTPException as e:
            raise MailError(self._scrub(f"{self._where()}: {type(e).__name__}: {e}", password)) from None
        except TimeoutError:
            raise MailError(f"{self._where()}: timed out after {self.cfg.timeout:g}s{self._port_hint()}") from None
        except OSError as e:
            what = e.strerror or type(e).__name__
            if e.filename:
                what += f": {e.filename}"
            raise MailError(self._scrub(f"{self._where()}: {what}", password)) from None

    # --- pieces ----------------------------------------------------------------------------
    def message(self, subject: str, body: str) -> EmailMessage:
        msg = EmailMessage()
        prefix = clean_header(self.cfg.subject_prefix)
        msg["Subject"] = clean_header(f"{prefix} {subject}" if prefix else subject, 250)
        msg["From"] = self.from_addr
        msg["To"] = ", ".join(self.cfg.to)
        msg["Date"] = formatdate(usegmt=True)
        msg["Message-ID"] = make_msgid(domain=self.hostname)
        msg["Auto-Submitted"] = "auto-generated"  # RFC 3834: vacation responders stay quiet
        msg.set_content(body)
        return msg

    def _password(self) -> str:
        if not self.cfg.username:
            return ""
        if self.cfg.password_file:
            try:
                with open(self.cfg.password_file, encoding="utf-8") as f:
                    pw = f.read().rstrip("\r\n")
                register_secret(pw)   # an SMTP error that echoes it is masked
                return pw
            except OSError as e:
                raise MailError(f"cannot read email.password_file {self.cfg.password_file}: "
                                f"{e.strerror or type(e).__name__}") from None
            except UnicodeDecodeError:
                raise MailError(f"email.password_file {self.cfg.password_file} is not UTF-8 text") from None
        pw = os.environ.get(PASSWORD_ENV)
        if pw is None:
            raise MailError(f"email.username is set but there is no password "
                            f"(set email.password_file or {PASSWORD_ENV})")
        return pw

    def _tls_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.cfg.ca_file or None)

    def _deliver(self, msg: EmailMessage, password: str) -> None:
        c = self.cfg
        # local_hostname given so smtplib never calls getfqdn(), a DNS lookup that can hang offline.
        if c.security == "ssl":
            smtp: smtplib.SMTP = smtplib.SMTP_SSL(c.smtp_host, c.smtp_port, local_hostname=self.hostname,
                                                  timeout=c.timeout, context=self._tls_context())
        else:
            smtp = smtplib.SMTP(c.smtp_host, c.smtp_port, local_hostname=self.hostname, timeout=c.timeout)
        try:
            if c.security == "starttls":
                # starttls() raises when the server does not offer it: the password never goes out
                # in clear because of a downgrade.
                smtp.starttls(context=self._tls_context())
            if c.username:
                smtp.login(c.username, password)
            smtp.send_message(msg, from_addr=self.from_addr, to_addrs=list(c.to))
        finally:
            try:
                smtp.quit()
            except (smtplib.SMTPException, OSError):
                smtp.close()

    def _where(self) -> str:
        return f"SMTP {self.cfg.smtp_host}:{self.cfg.smtp_port}"

    def _port_hint(self) -> str:
        # Both sides wait for the other to speak first when the TLS mode does not fit the port.
        if self.cfg.security != "ssl" and self.cfg.smtp_port == 465:
            return ' (port 465 usually wants email.security = "ssl")'
        if self.cfg.security == "ssl" and self.cfg.smtp_port in (25, 587):
            return f' (port {self.cfg.smtp_port} usually wants email.security = "starttls")'
        return ""

    def _scrub(self, text: str, password: str) -> str:
        """The password, and the base64 forms AUTH sends it in, never leave in an error text."""
        if not password:
            return text
        for secret in (_b64(f"\0{self.cfg.username}\0{password}"), _b64(password), password):  # longest first
            text = text.replace(secret, "***")
        return text


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _text(b: bytes | str) -> str:
    s = b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)
    return clean_header(s, 300)


def build_mailer(cfg: Config) -> SmtpMailer | None:
    """The mailer for `cfg`, or None when there is no [email] section (alerts then go to the
    journal and `supervisorctl alerts` only)."""
    if cfg.email is None:
        return None
    return SmtpMailer(cfg.email, cfg.hostname or socket.gethostname())
