"""rsync over SSH (`user@host:path`), unattended.

One rsync run per batch (a checkpoint folder), listed with --files-from so nothing outside the
selection ever goes. rsync writes each file under a temporary name and renames it when whole
(its own whole-file checksum verified), keeps interrupted data in `.rsync-partial` (so a crash
resumes instead of restarting), and skips files the remote already holds with the same size and
mtime (so a crash never costs a re-send). After the run a dry run confirms every file is there;
the manifest goes last, as its own file, so a folder is marked complete only when whole.
`missing` (the final sync's check) compares content: one remote `sha256sum` per folder against
the sha256 recorded at upload (the etag this target records); a file found damaged in place is
sent again with `--checksum`, since its size and mtime would fool rsync's quick check.

SSH runs with BatchMode (never prompts), the configured key, port and host-key policy, and
timeouts, so a dead host fails in seconds instead of hanging the worker.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shlex
import signal
import subprocess
from pathlib import Path

from ...config import SyncConfig
from ...syncurl import TargetURL
from .._log import get_logger
from ..policy import MANIFEST_NAME
from .base import (
    LocalFile,
    SourceProblem,
    TargetError,
    Uploaded,
    UploadSink,
    check_unchanged,
    join_key,
    open_source,
)

log = get_logger("sync.rsync")

PARTIAL_DIR = ".rsync-partial"
VANISHED = 24
PARTIAL = 23


def _pdeathsig() -> None:
    # rsync must die with the daemon: a kill -9 must not leave a second writer behind
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class RsyncTarget:
    def __init__(self, url: TargetURL, cfg: SyncConfig, work_dir: str | Path):
        self.url = url
        self.cfg = cfg
        self.display = url.display()
        self.remote_host = f"{url.user + '@' if url.user else ''}{url.host}"
        self.base = url.path.rstrip("/") or "/"
        self.work = Path(work_dir)
        self._ready = False
        self.control_dir = _control_dir(self.work)
        self._suspect: set[str] = set()  # keys whose remote content differed: resend by checksum

    # --- commands -------------------------------------------------------------------------------
    def ssh_argv(self) -> list[str]:
        c = self.cfg
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={c.host_key_policy}",
                "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4",
                "-o", "LogLevel=ERROR", "-p", str(c.ssh_port)]
        if c.ssh_key:
            argv += ["-i", c.ssh_key, "-o", "IdentitiesOnly=yes"]
        if c.known_hosts_file:
            argv += ["-o", f"UserKnownHostsFile={c.known_hosts_file}"]
        if self.control_dir:
            # one SSH connection for the rsync runs of a pass instead of a handshake each
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.control_dir}/%C",
                     "-o", "ControlPersist=15"]
        return argv

    def _rsync_base(self) -> list[str]:
        argv = ["rsync", "-t", "--timeout=120", "--no-human-readable", "-e", shlex.join(self.ssh_argv())]
        if self.cfg.bandwidth_limit:
            argv.append(f"--bwlimit={max(1, self.cfg.bandwidth_limit // 1024)}")
        return argv

    def _remote(self, sub: str = "") -> str:
        p = join_key(self.base, sub) if sub else self.base
        if self.base.startswith("/") and not p.startswith("/"):
            p = "/" + p
        return p

    def _run(self, argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, capture_output=True, timeout=timeout, preexec_fn=_pdeathsig,
                                  env={**os.environ, "LC_ALL": "C"}, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise TargetError(f"{self.display}: {argv[0]} timed out after {timeout:.0f}s") from None
        except FileNotFoundError:
            raise TargetError(f"{argv[0]} is not installed") from None

    def _ssh(self, command: str, timeout: float = 60) -> None:
        r = self._run([*self.ssh_argv(), self.remote_host, command], timeout=timeout)
        if r.returncode != 0:
            raise TargetError(f"{self.display}: ssh failed ({r.returncode}): {_tail(r.stderr)}")

    def _ensure_base(self) -> None:
        if not self._ready:
            self._ssh(f"mkdir -p -- {shlex.quote(self.base)}")
            self._ready = True

    # --- uploads -------------------------------------------------------------------------------
    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        if not files:
            return
        self._ensure_base()
        groups: dict[tuple[str, str], list[tuple[LocalFile, str]]] = {}
        for f in files:
            src, sub, rel = _split(f)
            groups.setdefault((src, sub), []).append((f, rel))
        for (src, sub), items in groups.items():
            if sink.cancelled():
                return
            self._put_group(src, sub, items, sink)

    def _put_group(self, src: str, sub: str, items: list[tuple[LocalFile, str]], sink: UploadSink) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        listing = self.work / f"files-{secrets.token_hex(4)}"
        listing.write_bytes(b"".join(rel.encode() + b"\0" for _, rel in items))
        try:
            for f, _ in items:
                sink.begin(f, {"mode": "rsync"})
            dest = f"{self.remote_host}:{self._remote(sub)}/"
            repair = [f.key for f, _ in items if f.key in self._suspect]
            argv = [*self._rsync_base(), *(["--checksum"] if repair else []), f"--partial-dir={PARTIAL_DIR}",
                    "--from0", f"--files-from={listing}", src.rstrip("/") + "/", dest]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    preexec_fn=_pdeathsig, env={**os.environ, "LC_ALL": "C"})
            # hash while rsync sends: the manifest needs sha256 and this costs no wall time
            hashes: dict[str, str | SourceProblem] = {}
            for f, _ in items:
                try:
                    hashes[f.key] = _sha256_stable(f)
                except SourceProblem as e:
                    hashes[f.key] = e
            out, err = proc.communicate()
            rc = proc.returncode
            if rc not in (0, PARTIAL, VANISHED):
                raise TargetError(f"{self.display}: rsync failed ({rc}): {_tail(err)}")
            pending = self._differs(src, sub, listing)
            for f, rel in items:
                h = hashes[f.key]
                if isinstance(h, SourceProblem):
                    sink.problem(f, h)
                    continue
                try:
                    st = os.stat(f.path, follow_symlinks=False)
                except FileNotFoundError:
                    sink.problem(f, SourceProblem("vanished", f.path))
                    continue
                if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
                    sink.problem(f, SourceProblem("changed", f.path))
                    continue
                if rel in pending:
                    raise TargetError(f"{self.display}: {rel} is not on the target after rsync ({rc}): {_tail(err)}")
                sink.progress(f, f.size)
                self._suspect.discard(f.key)
                sink.done(f, Uploaded(sha256=h, etag=h, sent=f.size))
        finally:
            listing.unlink(missing_ok=True)

    def _differs(self, src: str, sub: str, listing: Path) -> set[str]:
        """Files of the listing whose remote copy is missing or has another size or mtime."""
        argv = [*self._rsync_base(), "--dry-run", "--from0", f"--files-from={listing}", "--out-format=%n",
                src.rstrip("/") + "/", f"{self.remote_host}:{self._remote(sub)}/"]
        r = self._run(argv, timeout=300)
        if r.returncode not in (0, PARTIAL, VANISHED):
            raise TargetError(f"{self.display}: rsync check failed ({r.returncode}): {_tail(r.stderr)}")
        return {ln for ln in r.stdout.decode(errors="replace").splitlines() if ln and not ln.endswith("/")}

    # --- manifests, checks, deletes ------------------------------------------------------------
    def write_manifest(self, unit_key: str, data: bytes) -> None:
        self._ensure_base()
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.work / f"manifest-{secrets.token_hex(4)}.json"
        tmp.write_bytes(data)
        try:
            dest = f"{self.remote_host}:{self._remote(join_key(unit_key, MANIFEST_NAME))}"
            r = self._run([*self._rsync_base(), str(tmp), dest], timeout=120)
            if r.returncode != 0:
                raise TargetError(f"{self.display}: manifest upload failed ({r.returncode}): {_tail(r.stderr)}")
        finally:
            tmp.unlink(missing_ok=True)

    def delete_manifest(self, unit_key: str) -> None:
        self._ssh(f"rm -f -- {shlex.quote(self._remote(join_key(unit_key, MANIFEST_NAME)))}")

    def listing(self, sub: str) -> dict[str, int]:
        """Remote files under sub (relative keys -> size)."""
        path = self._remote(sub)
        r = self._run([*self._rsync_base(), "-r", "--list-only", f"{self.remote_host}:{path}/"], timeout=300)
        if r.returncode == PARTIAL and b"No such file" in r.stderr:
            return {}
        if r.returncode != 0:
            raise TargetError(f"{self.display}: listing failed ({r.returncode}): {_tail(r.stderr)}")
        out: dict[str, int] = {}
        for ln in r.stdout.decode(errors="replace").splitlines():
            parts = ln.split(None, 4)
            if len(parts) < 5 or not parts[0].startswith("-"):
                continue
            try:
                out[join_key(sub, parts[4])] = int(parts[1].replace(",", ""))
            except ValueError:
                continue
        return out

    def missing(self, expected: dict[str, tuple[int, str]]) -> list[str]:
        """Keys not on the host as expected: absent, another size, or (etag = the sha256 recorded
        at upload) another content, by one remote sha256sum per folder."""
        self._ensure_base()
        groups: dict[str, list[str]] = {}
        for k in expected:
            groups.setdefault(k.rsplit("/", 1)[0] if "/" in k else "", []).append(k)
        out = []
        for sub, keys in groups.items():
            have = self.listing(sub) if sub else self._top_listing()
            gone = [k for k in keys if k not in have or (expected[k][0] >= 0 and have[k] != expected[k][0])]
            check = {k: expected[k] for k in keys if k not in gone and expected[k][1]}
            differ = [k for k, sha in self._remote_sha256(check).items() if sha != check[k][1]]
            if differ:
                log.warning("sync_target_content_differs", keys=differ[:10], count=len(differ))
                self._suspect.update(differ)
            out += gone + differ
        return out

    def _remote_sha256(self, expected: dict[str, tuple[int, str]]) -> dict[str, str]:
        """key -> sha256 of the host's copy (absent keys are left out), in one ssh call."""
        if not expected:
            return {}
        keys = list(expected)
        script = (f"cd -- {shlex.quote(self._remote())} && if command -v sha256sum >/dev/null 2>&1; "
                  "then exec xargs -0 -r sha256sum --; else exec xargs -0 -r shasum -a 256 --; fi")
        timeout = 300 + sum(max(0, size) for size, _ in expected.values()) / (20 * 1024 * 1024)
        try:
            r = subprocess.run([*self.ssh_argv(), self.remote_host, script], input=b"".join(
                os.fsencode(k) + b"\0" for k in keys), capture_output=True, timeout=timeout, preexec_fn=_pdeathsig,
                env={**os.environ, "LC_ALL": "C"})
        except subprocess.TimeoutExpired:
            raise TargetError(f"{self.display}: hashing on the host timed out after {timeout:.0f}s") from None
        if r.returncode not in (0, 123):  # 123: some file was missing (the listing says which)
            raise TargetError(f"{self.display}: cannot hash files on the host to verify them "
                              f"(sha256sum or shasum needed there; exit {r.returncode}): {_tail(r.stderr)}")
        return {k: sha for k, sha in _parse_sums(r.stdout).items() if k in expected}

    def _top_listing(self) -> dict[str, int]:
        r = self._run([*self._rsync_base(), "--list-only", f"{self.remote_host}:{self._remote()}/"], timeout=300)
        if r.returncode != 0:
            raise TargetError(f"{self.display}: listing failed ({r.returncode}): {_tail(r.stderr)}")
        out = {}
        for ln in r.stdout.decode(errors="replace").splitlines():
            parts = ln.split(None, 4)
            if len(parts) == 5 and parts[0].startswith("-"):
                try:
                    out[parts[4]] = int(parts[1].replace(",", ""))
                except ValueError:
                    pass
        return out

    def delete_prefix(self, unit_key: str) -> None:
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        self.delete_manifest(unit_key)
        self._ssh(f"rm -rf -- {shlex.quote(self._remote(unit_key))}", timeout=300)

    def close(self) -> None:
        if self.control_dir:
            try:
                subprocess.run([*self.ssh_argv(), "-O", "exit", self.remote_host], capture_output=True, timeout=10,
                               stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                pass


def _control_dir(work: Path) -> str:
    """A private folder for the SSH control socket, short enough for a unix socket path."""
    for d in (work.parent / "cm", Path(f"/tmp/tsync-ssh-{os.getuid()}")):
        if len(str(d)) + 42 > 100:
            continue
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                continue
        except OSError:
            continue
        return str(d)
    return ""


def _split(f: LocalFile) -> tuple[str, str, str]:
    """(source folder, remote sub-folder, relative path) with source/rel == f.path and
    sub/rel == f.key: the longest common tail of the two paths is what rsync copies."""
    pp = f.path.split("/")
    kp = f.key.split("/")
    n = 0
    while n < min(len(pp), len(kp)) and pp[-1 - n] == kp[-1 - n]:
        n += 1
    rel = "/".join(kp[len(kp) - n:])
    src = "/".join(pp[:len(pp) - n]) or "/"
    sub = "/".join(kp[:len(kp) - n])
    return src, sub, rel


def _sha256_stable(f: LocalFile) -> str:
    fd = open_source(f)
    try:
        h = hashlib.sha256()
        with os.fdopen(os.dup(fd), "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        check_unchanged(fd, f)
        return h.hexdigest()
    except OSError as e:
        raise SourceProblem("unreadable", f.path, e.strerror or str(e)) from None
    finally:
        os.close(fd)


_UNESCAPE = {"n": "\n", "r": "\r", "\\": "\\"}


def _parse_sums(out: bytes) -> dict[str, str]:
    """`sha256sum` output -> {name: hex}; a line starting with a backslash has an escaped name."""
    sums: dict[str, str] = {}
    for raw in out.decode(errors="surrogateescape").split("\n"):
        escaped = raw.startswith("\\")
        line = raw[1:] if escaped else raw
        sha, sep, name = line.partition(" ")
        if not sep or len(sha) != 64:
            continue
        name = name[1:] if name[:1] in (" ", "*") else name
        if escaped:
            name = re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), m.group(0)), name)
        sums[name] = sha.lower()
    return sums


def _tail(b: bytes, n: int = 300) -> str:
    return b.decode(errors="replace").strip().replace("\n", " | ")[-n:]
