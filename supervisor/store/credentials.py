"""Where the target's credentials come from, and whether any of that changed since the last look.

A daemon started at boot inherits the environment of that moment; keys a user writes down later
(exported into the environment file, added to ~/.aws/credentials, or to `sync.credentials_file`)
must be seen without a restart, or the Trainer's rotation deletes checkpoints that never left the
machine while the daemon still has no keys (issue 37). So the engine asks `changed()` on every
loop (a handful of stat calls) and, when a source changed, has the target build its client again.

The environment file (ENV_FILE, or TRAIN_SUPERVISOR_ENV_FILE) is the one place a user writes
variables for the daemon: KEY=VALUE lines as systemd's EnvironmentFile= reads them. The start
script and the unit both load it at every start; the daemon reads the credential names in it
(CREDENTIAL_NAMES) afresh whenever it changes. It is read only when root (or the daemon's own
user) owns it and nobody else may write it: keys planted by the training user would send the
checkpoints to their bucket. Values from the file win over the inherited environment: the file is
the later word. They are never put in os.environ, which the training would inherit.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from supervisor.redact import register
from supervisor.store._log import get_logger
from supervisor.untrusted.fileopen import open_regular

log = get_logger("sync.credentials")

ENV_FILE = "/etc/train-supervisor/environment"
ENV_FILE_MAX = 64 * 1024
CREDENTIAL_NAMES = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH",
})


def env_file_path(env: Mapping[str, str]) -> str:
    return env.get("TRAIN_SUPERVISOR_ENV_FILE") or ENV_FILE


def parse_env_file(text: str) -> tuple[dict[str, str], list[str]]:
    """(variables, problems) of an EnvironmentFile= text: `KEY=VALUE` lines, `#`/`;` comments,
    an optional `export `, one pair of matching quotes around the value. A bad line is named in
    the problems and skipped, never guessed at."""
    out: dict[str, str] = {}
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not key or not (key[0].isalpha() or key[0] == "_") \
                or not all(c.isalnum() or c == "_" for c in key):
            problems.append(f"line {n}: not KEY=VALUE")
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out, problems


def read_env_file(path: str) -> tuple[dict[str, str], str]:
    """(variables, problem): {} and "" when there is no file; a problem names why it was not read."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return {}, ""
    except OSError as e:
        return {}, f"{path}: {e.strerror or e} (not read)"
    try:
        st = os.fstat(fd)
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return {}, (f"{path} is not read: it must belong to root and be writable by nobody else "
                        f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        data = os.read(fd, ENV_FILE_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > ENV_FILE_MAX:
        return {}, f"{path} is larger than {ENV_FILE_MAX} bytes (not read)"
    values, problems = parse_env_file(data.decode("utf-8", "replace"))
    return values, f"{path}: {'; '.join(problems)}" if problems else ""


def aws_files(env: Mapping[str, str]) -> tuple[str, str]:
    """~/.aws/credentials and ~/.aws/config of the daemon's HOME, as botocore finds them."""
    home = os.path.expanduser("~")
    return (os.path.expanduser(env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")),
            os.path.expanduser(env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")))


def hf_token_path(env: Mapping[str, str]) -> str:
    from supervisor.store.hf_rules import stored_token_path

    return stored_token_path(dict(env))


@dataclass(frozen=True)
class Looks:
    """Where the daemon looks, in words for a "no credentials" message."""
    env_file: str
    files: tuple[str, ...]

    def words(self, kind: str) -> str:
        if kind == "hf":
            names = "HF_TOKEN"
        else:
            names = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        where = ", ".join(self.files)
        return (f"the daemon looks for {names} in its environment and in {self.env_file} (KEY=VALUE lines, "
                f"read again when it changes), then in {where}; a change there is picked up without a restart")


def _stat_key(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class CredentialWatch:
    """The sources of one target's credentials and their last seen state.

    `env()` is the environment the target's client is built from; `changed()` says which sources
    moved since the last call (the first call sets the baseline and returns [])."""

    def __init__(self, credentials_file: str = "", hf_token_file: str = "", kind: str = "s3",
                 base: Callable[[], Mapping[str, str]] = lambda: os.environ):
        self.kind = kind
        self._base = base
        self._extra = [p for p in (credentials_file, hf_token_file) if p]
        self.env_file = env_file_path(base())
        self._from_file: dict[str, str] = {}
        self.problem = ""
        self._seen: dict[str, tuple[int, int, int, int] | None] = {}
        self._load_env_file()
        self._seen = {p: _stat_key(p) for p in self.paths()}

    def paths(self) -> list[str]:
        env = self.env()
        if self.kind == "hf":
            files = [hf_token_path(env)]
        elif self.kind == "s3":
            files = list(aws_files(env))
        else:
            files = []
        return [self.env_file, *self._extra, *files]

    def looks(self) -> Looks:
        return Looks(self.env_file, tuple(self.paths()[1:]))

    def env(self) -> dict[str, str]:
        merged = dict(self._base())
        merged.update(self._from_file)
        return merged

    def overrides(self) -> dict[str, str]:
        """The credential variables the environment file sets (they win over the inherited ones)."""
        return dict(self._from_file)

    def _load_env_file(self) -> None:
        values, problem = read_env_file(self.env_file)
        if problem and problem != self.problem:
            log.warning("sync_env_file_problem", problem=problem)
        self.problem = problem
        self._from_file = {k: v for k, v in values.items() if k in CREDENTIAL_NAMES}
        register(*(v for k, v in self._from_file.items() if "SECRET" in k or "TOKEN" in k))

    def changed(self) -> list[str]:
        moved = []
        for p in self.paths():
            now = _stat_key(p)
            if p not in self._seen or self._seen[p] != now:
                moved.append(p)
                self._seen[p] = now
                if p == self.env_file:
                    self._load_env_file()
        return moved


def run_key(path: str) -> tuple[bytes | None, str]:
    """(the run's shared secret, "") from cluster.key_file (its first line, at least 16 bytes); (None,
    why) when it is set and cannot be used; (None, "") when it is not set. Registered with the
    redactor: it is never written into a message."""
    if not path:
        return None, ""
    from supervisor import redact
    from supervisor.untrusted import signed

    try:
        fd = open_regular(os.path.expanduser(path))
        try:
            key = signed.key_of(os.read(fd, 64 * 1024))
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:
        return None, f"{path}: {getattr(e, 'strerror', None) or e}"
    redact.register(key.decode("utf-8", "replace"))
    return key, ""


# --- S3 keys: static ones read here, every other setup through botocore's credential chain -------------
# botocore is a credentials library here, never an S3 client: no client is made from it (one S3 client:
# s3_light.py). It is imported only when the keys are not static, so the one-shot no-change pass and a
# plain setup's start-up never pay for it.
CHAIN_ENV = ("AWS_PROFILE",)  # with it set, the profile names the keys: the chain reads them


def static_keys(credentials_file: str, env: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(access key, secret, session token) when they are static and found the way botocore finds
    them (the environment first, then the configured file's [default]); None: the chain's to find."""
    import configparser

    if any(env.get(k) for k in CHAIN_ENV):
        return None
    ak, sk = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
    if ak and sk:
        return ak, sk, env.get("AWS_SESSION_TOKEN", "") or env.get("AWS_SECURITY_TOKEN", "")
    if ak or sk or not credentials_file:
        return None
    cp = configparser.RawConfigParser()
    try:
        with open(credentials_file, encoding="utf-8") as fh:
            cp.read_file(fh)
        sec = cp["default"]
    except (OSError, configparser.Error, KeyError, UnicodeDecodeError):
        return None  # the chain says what is wrong with it, in its words
    ak, sk = sec.get("aws_access_key_id", "").strip(), sec.get("aws_secret_access_key", "").strip()
    if not ak or not sk or set(sec) - {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}:
        return None
    return ak, sk, sec.get("aws_session_token", "").strip()


class KeysUnavailable(Exception):
    """No keys: none found (`missing`), or a source that failed (an expired SSO token, a role whose
    refresh failed, a profile that does not exist): the words say which."""

    def __init__(self, words: str, missing: bool):
        super().__init__(words)
        self.missing = missing


@dataclass(frozen=True)
class S3Keys:
    """Where one S3 target's requests get their keys, and what the profile says about the store.

    `get()` is called for every request: the chain's credentials are frozen per request, so a
    role's keys refresh when they near their expiry. `config`: the profile's own settings that
    name the store (region, endpoint_url, ca_bundle, use_fips_endpoint, use_dualstack_endpoint,
    s3 = ...), empty for static keys."""
    get: Callable[[], tuple[str, str, str]]
    source: str
    config: Mapping[str, object]


def s3_keys(credentials_file: str, env: Mapping[str, str], overrides: Mapping[str, str]) -> S3Keys:
    """Static keys when there are (no botocore), else botocore's chain: a profile (AWS_PROFILE, SSO,
    an assumed role, credential_process), ~/.aws, the container's or the instance's role (IMDSv2).
    `overrides`: the environment file's credential names (they win over the inherited ones)."""
    keys = static_keys(credentials_file, env)
    if keys is not None:
        return S3Keys(lambda: keys, "static", {})
    return _chain(credentials_file, env, overrides)


def _chain(credentials_file: str, env: Mapping[str, str], over: Mapping[str, str]) -> S3Keys:
    import botocore.session
    from botocore.exceptions import BotoCoreError

    try:
        bs = botocore.session.Session()
        for var, name in (("AWS_SHARED_CREDENTIALS_FILE", "credentials_file"), ("AWS_CONFIG_FILE", "config_file"),
                          ("AWS_PROFILE", "profile")):
            if over.get(var):
                bs.set_config_variable(name, os.path.expanduser(over[var]))
        if credentials_file:
            bs.set_config_variable("credentials_file", credentials_file)
        if over.get("AWS_ACCESS_KEY_ID") and over.get("AWS_SECRET_ACCESS_KEY"):
            bs.set_credentials(over["AWS_ACCESS_KEY_ID"], over["AWS_SECRET_ACCESS_KEY"],
                               over.get("AWS_SESSION_TOKEN") or over.get("AWS_SECURITY_TOKEN") or None)
        creds = bs.get_credentials()
        config = dict(bs.get_scoped_config())
        for name in ("region", "ca_bundle", "use_fips_endpoint", "use_dualstack_endpoint"):
            v = bs.get_config_variable(name)
            if v not in (None, ""):
                config[name] = v
    except BotoCoreError as e:
        raise KeysUnavailable(f"{type(e).__name__}: {e}", missing=False) from None
    if creds is None:
        raise KeysUnavailable("none found", missing=True)
    method = str(getattr(creds, "method", "") or "chain")

    def get() -> tuple[str, str, str]:
        try:
            f = creds.get_frozen_credentials()  # refreshes a role's keys near their expiry
        except BotoCoreError as e:
            raise KeysUnavailable(f"{method}: {type(e).__name__}: {e}", missing=False) from None
        return f.access_key, f.secret_key, f.token or ""

    log.info("s3_credentials_chain", source=method, profile=bs.profile or "default")
    return S3Keys(get, method, config)
