"""Hide secrets in text that is shown, mailed or logged: commands, URLs, log events, status.

Provider CLIs take keys on the command line (`vastai stop instance 7 --api-key KEY`), trainers take
hub tokens (`--hub_token hf_...`), URLs carry `user:password@` and signed query strings. What is
redacted (the value only; the name stays so the reader still sees what was passed):

- an option whose name says secret: `--api-key V`, `--token=V`, `--hub_token V`, `--apiKey V`;
- an assignment whose name says secret: `HF_TOKEN=V`, `export AWS_SECRET_ACCESS_KEY=V`,
  `?X-Amz-Signature=V&token=V`, `password='V'`, and `"api_key": "V"` in JSON text;
- the password in a URL (`https://user:V@host`) and in `-u/--user name:V`;
- `Bearer V`, `Authorization: Basic V`;
- values that are secrets by their shape wherever they stand: Hugging Face `hf_...`, AWS key ids
  `AKIA...`/`ASIA...`, GitHub `ghp_...`/`github_pat_...`, GitLab `glpat-...`, Slack `xox?-...`,
  OpenAI-style `sk-...`, Google `AIza...`, JWTs.

A name "says secret" when one of its words (split at `-`, `_`, `.` and camelCase) is token, secret,
password, passwd, passphrase, pwd, pass, credential(s), signature, sig, apikey, a key after
api/access/secret/private/..., or auth as the last word - unless the last word says the value is
something else (file, path, dir, id, name, type, url, ...): `--token-file PATH` stays readable.
`--max_tokens` and `--tokenizer` are not secrets (tokens and tokenizer are other words).

By value as well as by pattern: every secret the daemon reads (the Hub token, the SMTP password, the
webhook secret, S3 keys, secret-looking `training.env` values, the words of `stop.command` that carry
a value) is `register`ed once, at start, and replaced by *** wherever it appears verbatim, whatever
surrounds it (a Hub error message that echoes the token, `sshpass -p Hunter2pw`, `mysql -pS3cret`).

No I/O. The registry is the module's one piece of state: written at start (and when a secret is read
again), read by every `redact`. Over-redacting a harmless value is accepted, letting a secret through
is not.
"""

from __future__ import annotations

import functools
import re
import shlex
import threading
from typing import Any
from urllib.parse import quote

MASK = "***"
MIN_SECRET = 6      # shorter registered values would mask ordinary words and numbers

_registry_lock = threading.Lock()
_registered: frozenset[str] = frozenset()
_by_value: re.Pattern | None = None


def register(*values: str | None) -> None:
    """Add secret values to the registry: each is masked wherever it appears from now on (also
    URL-quoted). Values shorter than MIN_SECRET are ignored."""
    global _registered, _by_value
    new = set()
    for v in values:
        v = (v or "").strip()
        if len(v) >= MIN_SECRET:
            new.update({v, quote(v, safe="")})
    with _registry_lock:
        if new <= _registered:
            return
        _registered = _registered | new
        alts = sorted(_registered, key=len, reverse=True)   # the longest first: no half-masked value
        _by_value = re.compile("|".join(re.escape(a) for a in alts))
        _redact_cached.cache_clear()


def registered() -> frozenset[str]:
    """Every secret value registered so far (the job's environment withholds them)."""
    return _registered


def forget_registered() -> None:
    """Empty the registry (tests)."""
    global _registered, _by_value
    with _registry_lock:
        _registered, _by_value = frozenset(), None
        _redact_cached.cache_clear()


def command_secrets(command: str) -> list[str]:
    """The values in a shell command that may be secrets, to `register`: the value of every option
    (`--key V`, `-p V`, `--key=V`), a short option's attached value (`-pS3cret`), the word after a
    secret-named word (`aws configure set aws_secret_access_key V`), `NAME=V` values, and every URL
    (a hook URL is its own secret). Over-registering a harmless value only masks it."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    out = []
    for i, w in enumerate(words):
        prev = words[i - 1] if i else ""
        if "://" in w:
            out.append(w)
        if w.startswith("--") and "=" in w:
            out.append(w.split("=", 1)[1])
        elif re.fullmatch(r"-[A-Za-z][^-\s].+", w):
            out.append(w[2:])                       # -pS3cret
        elif "=" in w and not w.startswith("-"):
            out.append(w.split("=", 1)[1])
        if prev.startswith("-") and not w.startswith("-") and len(prev) > 1:
            out.append(w)
        elif prev and secret_name(prev.split("=", 1)[0]) and not w.startswith("-"):
            out.append(w)
    # a path is not a secret, and masking it would hide where things are
    return [v for v in out if len(v) >= MIN_SECRET and not v.startswith(("/", "./", "~/"))]

_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "passphrase", "pwd", "pass", "credential",
                           "credentials", "signature", "sig", "apikey", "cookie", "privatekey"})
_KEY_OWNERS = frozenset({"api", "access", "secret", "private", "account", "license", "licence", "encryption",
                         "master", "client", "app", "signing", "session", "auth", "hmac", "service", "user",
                         "storage", "subscription", "wandb", "hf", "openai", "anthropic"})
_SUFFIXES = ("token", "secret", "password", "passwd", "apikey", "accesskey", "secretkey", "privatekey")
# a last word that says the value is not the secret itself
_NOT_A_VALUE = frozenset({"file", "files", "path", "paths", "dir", "directory", "folder", "env", "var", "name",
                          "type", "kind", "id", "url", "uri", "endpoint", "length", "len", "count", "limit",
                          "size", "max", "min", "mode", "format", "cmd", "command", "helper", "prompt"})
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


# The shell's own variables whose names merely look like one: PWD is the working folder, not a
# password (registered as a secret it masked every path under it in every message).
_SHELL_VARS = frozenset({"PWD", "OLDPWD"})


@functools.lru_cache(maxsize=2048)
def secret_name(name: str) -> bool:
    """Does an option, variable or field with this name hold a secret?"""
    if name.strip() in _SHELL_VARS:
        return False
    words = [w for w in re.split(r"[-_.\s]+", _CAMEL.sub("_", name.strip("-").strip())) if w]
    words = [w.lower() for w in words]
    if not words:
        return False
    if words[-1] in _NOT_A_VALUE and len(words) > 1:
        return False
    for i, w in enumerate(words):
        if w in _SECRET_WORDS or w.endswith(_SUFFIXES):
            return True
        if w == "key" and i > 0 and words[i - 1] in _KEY_OWNERS:  # a bare `key` is an S3 object's name
            return True
        if w.endswith("key") and w[:-3] in _KEY_OWNERS:
            return True
        if w == "auth" and i == len(words) - 1:
            return True
    return False


# one shell word: quoted parts and unquoted runs, up to a blank or a shell operator (a comma or a
# bracket is part of a word: `--password a,b` passes "a,b")
_VALUE = r"""(?:'[^']*'|"(?:\\.|[^"\\])*"|[^\s'"`&;|<>()])+"""
_OPTION = re.compile(r"""(?<![^\s'"=(\[,])(--?[A-Za-z][\w.-]*)(=|[ \t]+)(""" + _VALUE + ")")
_ASSIGN = re.compile(r"""(?<![\w.-])([A-Za-z_][\w.-]*)(=)(""" + _VALUE + ")")
_JSONISH = re.compile(r"""(["'])([A-Za-z_][\w.-]*)\1(\s*:\s*)("(?:\\.|[^"\\])*"|'[^']*')""")
_URL_USERINFO = re.compile(r"""(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://[^\s/@:'"]*:)([^\s/'"]+)(@)""")  # to the last @
_USER_OPT = re.compile(r"""((?<!\S)(?:-u|--user)(?:=|[ \t]+)['"]?[^\s:'"]+:)([^\s'"]+)""")
_BEARER = re.compile(r"""(?i)\b(bearer)([ \t]+)([A-Za-z0-9._~+/=:-]{4,})""")
_AUTH_HEADER = re.compile(r"""(?i)\b((?:proxy-)?authorization|x-api-key|api-key|x-auth-token|cookie)(\s*[:=]\s*)"""
                          r"""((?:(?:bearer|basic|digest|token|negotiate)[ \t]+)?)([^\s'"]+)""")
_SHAPES = re.compile("|".join([
    r"\bhf_[A-Za-z0-9]{20,}",                          # Hugging Face
    r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA)[A-Z0-9]{16}\b",  # AWS key ids
    r"\bgh[pousr]_[A-Za-z0-9]{30,}",                   # GitHub
    r"\bgithub_pat_[A-Za-z0-9_]{20,}",
    r"\bglpat-[A-Za-z0-9_-]{20,}",                     # GitLab
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",                # Slack
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}",         # OpenAI / Anthropic style
    r"\bAIza[0-9A-Za-z_-]{35}",                        # Google API key
    r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JWT
]))


def _opt(m: re.Match) -> str:
    name, sep, value = m.group(1), m.group(2), m.group(3)
    if not secret_name(name) or (sep != "=" and value.startswith("-")):
        return m.group(0)  # not secret, or a flag followed by the next option
    return f"{name}{sep}{MASK}"


def _assign(m: re.Match) -> str:
    return f"{m.group(1)}={MASK}" if secret_name(m.group(1)) else m.group(0)


def _jsonish(m: re.Match) -> str:
    q, name, sep, value = m.groups()
    return f"{q}{name}{q}{sep}{value[0]}{MASK}{value[0]}" if secret_name(name) else m.group(0)


def redact(text: str) -> str:
    """`text` with every secret value replaced by ***. Linear in the text's length."""
    if not text:
        return text
    if len(text) <= 4096:
        return _redact_cached(text)  # status asks for the same strings every few seconds
    return _redact(text)


@functools.lru_cache(maxsize=4096)
def _redact_cached(text: str) -> str:
    return _redact(text)


def _redact(text: str) -> str:
    by_value = _by_value
    if by_value is not None:
        text = by_value.sub(MASK, text)
    # each pattern only where its anchor occurs: most strings (states, paths, numbers) pass untouched
    text = _SHAPES.sub(MASK, text)
    if "://" in text and "@" in text:
        text = _URL_USERINFO.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    if "-u" in text:
        text = _USER_OPT.sub(lambda m: m.group(1) + MASK, text)
    low = text.lower()
    if "auth" in low or "api-key" in low or "cookie" in low:
        text = _AUTH_HEADER.sub(lambda m: m.group(1) + m.group(2) + m.group(3) + MASK, text)
    if "bearer" in low:
        text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    if ":" in text and ('"' in text or "'" in text):
        text = _JSONISH.sub(_jsonish, text)
    if "-" in text:
        text = _OPTION.sub(_opt, text)
    if "=" in text:
        text = _ASSIGN.sub(_assign, text)
    return text


def redact_obj(obj: Any, _depth: int = 0) -> Any:
    """A copy of plain data (dicts, lists, strings) with secrets redacted: every string through
    `redact`, and the whole string value of a key that names a secret (`{"hf_token": "..."}`)."""
    if isinstance(obj, str):
        return redact(obj)
    if _depth > 64:
        return obj
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(k, str) and isinstance(v, str) and v and secret_name(k)
                    else redact_obj(v, _depth + 1)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v, _depth + 1) for v in obj)
    return obj

