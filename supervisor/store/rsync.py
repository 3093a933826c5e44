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

import contextlib
import hashlib
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from supervisor.config import SyncConfig
from supervisor.config.target import TargetURL
from supervisor.store._log import get_logger
from supervisor.store.base import (
    LocalFile,
    SourceProblem,
    TargetError,
    UnitPut,
    UnitsPut,
    Uploaded,
    UploadSink,
    check_unchanged,
    join_key,
    open_source,
)
from supervisor.store.keys import MANIFEST_NAME, manifest_key
from supervisor.store.rsync_read import RsyncReader
from supervisor.store.rsync_ssh import AES_FIRST, AES_IN_CPU, control_dir, private_dir

log = get_logger("sync.rsync")

PARTIAL_DIR = ".rsync-partial"
VANISHED = 24
PARTIAL = 23
SHELL_IDLE_S = 10.0


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
        self.control_dir = control_dir(self.work)
        # our own name for the socket (not ssh's %C) so close() knows which one is ours
        ident = f"{self.remote_host}:{cfg.ssh_port}".encode()
        self.control_path = f"{self.control_dir}/{hashlib.sha1(ident).hexdigest()[:20]}" if self.control_dir else ""
        self._warned_control = False
        self._suspect: set[str] = set()  # keys whose remote content differed: resend by checksum
        self._sh: _RemoteShell | None = None
        self._shell_lock = threading.Lock()
        self._shell_idle: threading.Timer | None = None
        self.reader = RsyncReader(self)

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
        if AES_IN_CPU:
            argv += ["-o", f"Ciphers={AES_FIRST}"]
        # checked on every use, not only when first chosen: another run's close() may have removed
        # the folder, and in the /tmp fallback a local user may have made it again first
        if self.control_path and private_dir(self.control_dir):
            # one SSH connection for the rsync runs of a pass instead of a handshake each
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.control_path}",
                     "-o", "ControlPersist=15"]
        elif self.control_path and not self._warned_control:
            self._warned_control = True
            log.warning("ssh_control_dir_unsafe", folder=self.control_dir,
                        why="not a folder of ours with mode 0700; each run opens its own SSH connection")
        return argv

    def rsync_base(self) -> list[str]:
        argv = ["rsync", "-t", "--timeout=120", "--no-human-readable", "-e", shlex.join(self.ssh_argv())]
        if not self._ready:
            # the first run makes the base folder on the host itself: no ssh call of its own
            argv.append(f"--rsync-path=mkdir -p -- {shlex.quote(self.base)} && rsync")
        if self.cfg.bandwidth_limit:
            argv.append(f"--bwlimit={max(1, self.cfg.bandwidth_limit // 1024)}")
        return argv

    def remote_path(self, sub: str = "") -> str:
        p = join_key(self.base, sub) if sub else self.base
        if self.base.startswith("/") and not p.startswith("/"):
            p = "/" + p
        return p

    def run_cmd(self, argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, capture_output=True, timeout=timeout, preexec_fn=_pdeathsig,
                                  env={**os.environ, "LC_ALL": "C"}, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise TargetError(f"{self.display}: {argv[0]} timed out after {timeout:.0f}s") from None
        except FileNotFoundError:
            raise TargetError(f"{argv[0]} is not installed") from None

    def _ssh(self, command: str, timeout: float = 60) -> None:
        r = self.run_cmd([*self.ssh_argv(), self.remote_host, command], timeout=timeout)
        if r.returncode != 0:
            raise TargetError(f"{self.display}: ssh failed ({r.returncode}): {_tail(r.stderr)}")

    # --- uploads -------------------------------------------------------------------------------
    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        if files:
            self._send(files, sink)

    def put_units(self, units: list[UnitPut], sink: UploadSink) -> UnitsPut:
        """Several units in one rsync run, then their manifests in one more (see base.put_units):
        two runs for a whole batch of checkpoints instead of three per checkpoint."""
        out = UnitsPut()
        files = [f for u in units for f in u.files]
        results: dict[str, Uploaded] = {}
        bad: set[str] = set()
        if files:
            results, bad = self._send(files, sink)
        manifests: dict[str, bytes] = {}
        for u in units:
            if sink.cancelled():
                break
            if u.manifest is None or any(f.key in bad or f.key not in results for f in u.files):
                continue
            data = u.manifest({f.key: results[f.key] for f in u.files})
            if data is not None:
                manifests[u.key] = data
        if manifests:
            self._push_manifests(manifests)
            out.manifests = list(manifests)
            out.commits = {k: "" for k in manifests}
        return out

    def _send(self, files: list[LocalFile], sink: UploadSink) -> tuple[dict[str, Uploaded], set[str]]:
        """Send files (one rsync run per source folder), each reported done once its content is
        known to match on the host. Returns (results by key, keys with a source problem)."""
        groups: dict[tuple[str, str], list[tuple[LocalFile, str]]] = {}
        for f in files:
            src, sub, rel = _split(f)
            groups.setdefault((src, sub), []).append((f, rel))
        results: dict[str, Uploaded] = {}
        bad: set[str] = set()
        for (src, sub), items in groups.items():
            if sink.cancelled():
                break
            self._put_group(src, sub, items, sink, results, bad)
        return results, bad

    def _rsync_files(self, src: str, sub: str, rels: list[str], checksum: bool,
                     during: Callable[[], None] | None = None) -> tuple[int, set[str], bytes]:
        """One rsync run over the listed files -> (exit status, files it sent, stderr); `during`
        runs while it sends. A sent file passed rsync's own whole-file check on the host (rsync
        sends it once more if not, and exits 23 when that fails too); a file not sent was judged
        equal there: by size and mtime, or with checksum by content."""
        self.work.mkdir(parents=True, exist_ok=True)
        listing = self.work / f"files-{secrets.token_hex(4)}"
        listing.write_bytes(b"".join(os.fsencode(r) + b"\0" for r in rels))
        try:
            argv = [*self.rsync_base(), *(["--checksum"] if checksum else []), "--omit-dir-times",
                    f"--partial-dir={PARTIAL_DIR}", "--out-format=%n", "--from0", f"--files-from={listing}",
                    src.rstrip("/") + "/", f"{self.remote_host}:{self.remote_path(sub)}/"]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    preexec_fn=_pdeathsig, env={**os.environ, "LC_ALL": "C"})
            worker = None
            if during is not None:
                worker = threading.Thread(target=during, name="rsync-hash", daemon=True)
                worker.start()
            out, err = proc.communicate()
            if worker is not None:
                worker.join()
        finally:
            listing.unlink(missing_ok=True)
        rc = proc.returncode
        if rc not in (0, PARTIAL, VANISHED):
            raise TargetError(f"{self.display}: rsync failed ({rc}): {_tail(err)}")
        self._ready = True
        sent = {_unescape(ln) for ln in out.decode(errors="surrogateescape").splitlines() if ln and not ln.endswith("/")}
        return rc, sent, err

    def _put_group(self, src: str, sub: str, items: list[tuple[LocalFile, str]], sink: UploadSink,
                   results: dict[str, Uploaded], bad: set[str]) -> None:
        for f, _ in items:
            sink.begin(f, {"mode": "rsync"})
        repair = any(f.key in self._suspect for f, _ in items)
        hashes: dict[str, str | SourceProblem] = {}

        def hash_all() -> None:
            # while rsync sends: the manifest and the ledger need sha256, and this costs no wall time
            for f, _ in items:
                try:
                    hashes[f.key] = _sha256_stable(f)
                except SourceProblem as e:
                    hashes[f.key] = e

        rc, sent, err = self._rsync_files(src, sub, [rel for _, rel in items], checksum=repair, during=hash_all)
        readable = [rel for f, rel in items if isinstance(hashes[f.key], str)]
        if rc == PARTIAL:
            ok: set[str] = set()
            unsure = readable  # some file failed: which of the sent ones is whole is not known
        elif repair:
            ok, unsure = set(readable), []  # compared by content already
        else:
            ok = sent
            unsure = [rel for rel in readable if rel not in sent]
        if unsure:
            # Not sent: equal on the host by rsync's quick check (size and mtime), which says nothing
            # of content (a file that arrived before a crash, a copy damaged in place). One run with
            # --checksum compares their content and sends again the ones that differ: verified
            # and repaired in one call.
            rc, _, err = self._rsync_files(src, sub, unsure, checksum=True)
            if rc != PARTIAL:
                ok = ok | set(unsure)
        lost = []
        for f, rel in items:
            h = hashes[f.key]
            if isinstance(h, SourceProblem):
                sink.problem(f, h)
                bad.add(f.key)
                continue
            try:
                st = os.stat(f.path, follow_symlinks=False)
            except FileNotFoundError:
                sink.problem(f, SourceProblem("vanished", f.path))
                bad.add(f.key)
                continue
            if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
                sink.problem(f, SourceProblem("changed", f.path))
                bad.add(f.key)
                continue
            if rel not in ok:
                lost.append(rel)
                continue
            sink.progress(f, f.size)
            self._suspect.discard(f.key)
            r = Uploaded(sha256=h, etag=h, sent=f.size if rel in sent else 0)
            results[f.key] = r
            sink.done(f, r)
        if lost:
            raise TargetError(f"{self.display}: {lost[0]} is not on the target whole after rsync ({rc}): {_tail(err)}")

    # --- manifests, checks, deletes ------------------------------------------------------------
    def write_manifest(self, unit_key: str, data: bytes, kind: str = "dir") -> None:
        """One manifest through the shell kept open on the host: a round trip and a `mv` there,
        not an rsync and an ssh process here for each folder (an engine that sends several
        folders in one put_files writes each one's manifest as its last file is verified)."""
        self.write_object(manifest_key(unit_key, kind), data, unit_key)

    def write_object(self, rel: str, data: bytes, unit_key: str | None = None) -> None:
        """A small object written whole (a manifest, a cluster heartbeat) through the kept shell."""
        dest = self.remote_path(rel)
        folder = dest.rsplit("/", 1)[0] or "/"
        tmp = f"{folder}/.{MANIFEST_NAME}.{secrets.token_hex(4)}"
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"
        if "\0" in text:
            if unit_key is None:
                raise TargetError(f"{self.display}: {rel}: only text goes through the shell")
            self._push_manifests({unit_key: data})
            return
        q = shlex.quote
        command = (f"{{ [ -d {q(folder)} ] || mkdir -p -- {q(folder)}; }} && printf '%s' {q(text)} > {q(tmp)}"
                   f" && mv -f -- {q(tmp)} {q(dest)} || {{ rm -f -- {q(tmp)}; false; }}")
        try:
            self._shell().run(command, "manifest upload")
        except _ShellLost:
            self._shell().run(command, "manifest upload")  # a connection that died while idle: once more
        self._ready = True

    def _shell(self) -> _RemoteShell:
        with self._shell_lock:
            if self._sh is None or not self._sh.alive():
                self._sh = _RemoteShell([*self.ssh_argv(), self.remote_host, "exec sh"], self.display)
            # a shell left open keeps the SSH connection up: it ends SHELL_IDLE_S after its last use
            if self._shell_idle is not None:
                self._shell_idle.cancel()
            self._shell_idle = threading.Timer(SHELL_IDLE_S, self._close_shell)
            self._shell_idle.daemon = True
            self._shell_idle.start()
            return self._sh

    def _close_shell(self) -> None:
        with self._shell_lock:
            sh, self._sh = self._sh, None
        if sh is not None:
            sh.close()  # waits for a command in flight

    def _push_manifests(self, manifests: dict[str, bytes]) -> None:
        """Each unit's manifest, all in one rsync run (each lands whole under its name)."""
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.work / f"manifests-{secrets.token_hex(4)}"
        rels = [join_key(k, MANIFEST_NAME) for k in manifests]
        try:
            for rel, data in zip(rels, manifests.values(), strict=True):
                p = tmp / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            listing = tmp.with_name(tmp.name + ".list")
            listing.write_bytes(b"".join(os.fsencode(r) + b"\0" for r in rels))
            argv = [*self.rsync_base(), "--omit-dir-times", "--from0", f"--files-from={listing}", f"{tmp}/",
                    f"{self.remote_host}:{self.remote_path()}/"]
            r = self.run_cmd(argv, timeout=120)
            if r.returncode != 0:
                raise TargetError(f"{self.display}: manifest upload failed ({r.returncode}): {_tail(r.stderr)}")
            self._ready = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.with_name(tmp.name + ".list").unlink(missing_ok=True)

    def delete_manifest(self, unit_key: str, kind: str = "dir") -> None:
        self._ssh(f"rm -f -- {shlex.quote(self.remote_path(manifest_key(unit_key, kind)))}")

    def listing(self, sub: str) -> dict[str, int]:
        """Remote files under sub (relative keys -> size)."""
        path = self.remote_path(sub)
        r = self.run_cmd([*self.rsync_base(), "-r", "--list-only", f"{self.remote_host}:{path}/"], timeout=300)
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

    def missing(self, expected: dict[str, tuple[int, str]], deep: Collection[str] | None = None) -> list[str]:
        """Keys not on the host as expected: absent, or (etag = the sha256 recorded at upload)
        another content. The keys to check by content (`deep`; all when None) are hashed by one
        remote sha256sum; the rest (checked by content before, or without a sha256) are compared
        by size (-1: presence) from one recursive listing of the target folder."""
        hashed = {k: v for k, v in expected.items() if v[1] and (deep is None or k in deep)}
        sums = self._remote_sha256(hashed)
        gone = [k for k in hashed if k not in sums]
        differ = [k for k, (_, sha) in hashed.items() if k in sums and sums[k] != sha]
        if differ:
            log.warning("sync_target_content_differs", keys=differ[:10], count=len(differ))
            self._suspect.update(differ)
        rest = [k for k in expected if k not in hashed]
        if rest:
            have = self.listing("")
            gone += [k for k in rest if k not in have or (expected[k][0] >= 0 and have[k] != expected[k][0])]
        return gone + differ

    def _remote_sha256(self, expected: dict[str, tuple[int, str]]) -> dict[str, str]:
        """key -> sha256 of the host's copy (absent keys are left out), in one ssh call."""
        if not expected:
            return {}
        keys = list(expected)
        # no base folder: nothing is there (exit 0, no sums)
        script = (f"cd -- {shlex.quote(self.remote_path())} 2>/dev/null || exit 0; if command -v sha256sum >/dev/null 2>&1; "
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

    def delete_file(self, key: str) -> None:
        self._ssh(f"rm -f -- {shlex.quote(self.remote_path(key))}")

    def delete_prefix(self, unit_key: str) -> None:
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        # the manifest first: a folder half deleted must not look complete
        m, d = self.remote_path(join_key(unit_key, MANIFEST_NAME)), self.remote_path(unit_key)
        self._ssh(f"rm -f -- {shlex.quote(m)} && rm -rf -- {shlex.quote(d)}", timeout=300)

    def close(self) -> None:
        """Ends the shared SSH connection (if one is up) and removes its socket, and the socket
        folder when empty (the /tmp fallback too: nothing of ours stays behind; another target
        using it keeps it, as its socket is in it, and makes it again should it be gone)."""
        if self._shell_idle is not None:
            self._shell_idle.cancel()
        self._close_shell()
        if self.control_path and os.path.exists(self.control_path):
            try:
                subprocess.run([*self.ssh_argv(), "-O", "exit", self.remote_host], capture_output=True, timeout=10,
                               stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                pass
            with contextlib.suppress(OSError):
                os.unlink(self.control_path)
        if self.control_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.control_dir)


class _ShellLost(TargetError):
    """The shell on the host is gone (connection lost, no answer); a new one may work."""


class _RemoteShell:
    """`sh` on the host over the shared SSH connection, fed one command at a time: each answers
    with a marker line carrying its exit status. A timeout or a lost connection ends it (the next
    call starts a new one) and raises TargetError."""

    def __init__(self, argv: list[str], display: str):
        self.display = display
        self._lock = threading.RLock()
        try:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=_pdeathsig, env={**os.environ, "LC_ALL": "C"})
        except FileNotFoundError:
            raise TargetError("ssh is not installed") from None
        self._buf = b""

    def alive(self) -> bool:
        return self.p.poll() is None

    def run(self, command: str, what: str, timeout: float = 60) -> None:
        marker = f"__tsync_{secrets.token_hex(6)}__"
        with self._lock:
            assert self.p.stdin is not None and self.p.stdout is not None
            try:
                self.p.stdin.write(f"{{ {command}\n}} </dev/null >/dev/null 2>&1; echo {marker}$?\n".encode())
                self.p.stdin.flush()
            except OSError:
                self._fail(what, "the connection closed")
            deadline = time.monotonic() + timeout
            fd = self.p.stdout.fileno()
            while (i := self._buf.find(marker.encode())) < 0 or b"\n" not in self._buf[i:]:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    self._fail(what, f"no answer within {timeout:.0f}s")
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._fail(what, "the connection closed")
                self._buf += chunk
            line, _, self._buf = self._buf[i:].partition(b"\n")
            rc = line[len(marker):].strip()
            if rc != b"0":
                raise TargetError(f"{self.display}: {what} failed on the host (exit {rc.decode(errors='replace')})")

    def _fail(self, what: str, why: str) -> None:
        err = b""
        self.close()
        with contextlib.suppress(OSError, ValueError):
            assert self.p.stderr is not None
            err = self.p.stderr.read()
        raise _ShellLost(f"{self.display}: {what}: {why}: {_tail(err)}")

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError, ValueError):
                assert self.p.stdin is not None
                self.p.stdin.close()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


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


def _unescape(name: str) -> str:
    """rsync's --out-format writes unprintable bytes of a name as \\#ooo (octal)."""
    if "\\#" not in name:
        return name
    raw = re.sub(r"\\#([0-7]{3})", lambda m: chr(int(m.group(1), 8)), name)
    return os.fsdecode(raw.encode("latin-1", errors="surrogateescape"))


def _tail(b: bytes, n: int = 300) -> str:
    return b.decode(errors="replace").strip().replace("\n", " | ")[-n:]
