"""A target that serves hostile names (issue 35, finding 1): whoever can write the bucket must not
get a write as root outside the run folder.

AWS S3 keeps keys verbatim (`..`, a leading `/`, `//` are legal), so the restore is driven against
tests/fixtures/verbatim_s3.py, a loopback endpoint that serves whatever it holds; SeaweedFS would
normalize the names away. Each case plants canary files outside the run folder and checks that they
are byte-for-byte and stat-for-stat unchanged, that the hostile unit is refused and named, and that
the good unit beside it is still restored. Then the same names through the Hub, rsync and local
readers' own edge (Staging), and through `supervisorctl resume` of a real daemon."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.config import from_dict
from supervisor.config.target import parse_target
from supervisor.resume.choose import REFUSED, judge
from supervisor.resume.place import Staging
from supervisor.resume.restore import NothingToRestore, Restorer
from supervisor.store import make_target
from supervisor.sync.manifest import ManifestFile, build, parse_doc
from supervisor.sync.scan import watch_roots
from supervisor.untrusted.names import BadName, check_tree, problem, remote_path
from tests.fixtures.verbatim_s3 import BUCKET, VerbatimS3

PREFIX = "run1"
GOOD = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x08" * 4096,
        "trainer_state.json": b'{"global_step": 10, "max_steps": 40}'}


# --- the names, pure ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/cron.d/x", "a//b", "a/", "./a", "a/./b", "",
                                  "a\x00b", "a\\b", "a\nb", "a\x1bb", "a\x7fb", "x" * 256, "a/" * 600 + "b",
                                  "..", "."])
def test_a_name_that_leaves_its_folder_is_refused(name):
    assert problem(name)
    with pytest.raises(BadName, match="refused"):
        remote_path(name)


@pytest.mark.parametrize("name", ["checkpoint-10", "out/checkpoint-10/adapter_model.safetensors",
                                  "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt", "ünï cödé.json",
                                  "..a", "a..", "...", ".hidden", "x" * 255])
def test_ordinary_names_pass(name):
    assert remote_path(name) == name and not problem(name)


@given(st.lists(st.sampled_from(["a", "b", "..", ".", "", "c.pt", "/", "\\", "\x00", "d e"]), min_size=1, max_size=6))
def test_a_path_that_passes_stays_inside_any_folder(parts):
    name = "/".join(parts)
    if problem(name):
        return
    base = "/srv/run/out"
    joined = os.path.normpath(os.path.join(base, name))
    assert joined.startswith(base + "/") and joined != base


def test_a_file_list_that_is_not_one_folder_is_refused():
    assert "twice" in check_tree([remote_path("a"), remote_path("a")])
    assert "as a file and as a folder" in check_tree([remote_path("a"), remote_path("a/b")])
    assert check_tree([remote_path("a/b"), remote_path("a/c"), remote_path("b")]) == ""


def manifest(unit: str, files: dict[str, bytes], wrong: set[str] = frozenset()) -> bytes:
    mfs = [ManifestFile(p, len(d), "0" * 64 if p in wrong else hashlib.sha256(d).hexdigest())
           for p, d in files.items()]
    return build(unit, mfs, time.time(), host="box-a")


@pytest.mark.parametrize("bad", ["../../x", "/root/.ssh/authorized_keys", "a//b", "a\x00b"])
def test_judge_refuses_a_manifest_with_a_bad_path_and_names_it(bad):
    data = manifest("checkpoint-9", {"ok.json": b"{}", bad: b"pwned"})
    with pytest.raises(ValueError, match="refused"):
        parse_doc(data)
    keys = {"checkpoint-9/ok.json": 2, f"checkpoint-9/{bad}": 5, "checkpoint-9/_MANIFEST.json": len(data)}
    u = judge("checkpoint-9", data, keys)
    assert u.state == REFUSED and "refused" in u.why and repr(bad)[1:-1][:10] in u.why


@pytest.mark.parametrize("key", ["../evil/checkpoint-9", "/etc/checkpoint-9", "a//checkpoint-9"])
def test_judge_refuses_a_unit_key_that_leaves_the_target(key):
    u = judge(key, manifest("checkpoint-9", {"ok.json": b"{}"}), {})
    assert u.state == REFUSED and "key" in u.why


# --- the restore from an endpoint that serves names verbatim -------------------------------------------

@pytest.fixture
def hostile():
    s = VerbatimS3()
    yield s
    s.close()


def put_unit(s3: VerbatimS3, unit_key: str, files: dict[str, bytes], wrong: set[str] = frozenset()) -> None:
    for rel, data in files.items():
        s3.objects[f"{PREFIX}/{unit_key}/{rel}"] = data
    s3.objects[f"{PREFIX}/{unit_key}/_MANIFEST.json"] = manifest(unit_key.rsplit("/", 1)[-1], files, wrong)


def restorer(s3: VerbatimS3, tmp: Path, out: Path) -> Restorer:
    creds = tmp / "creds"
    creds.write_text("[default]\naws_access_key_id = AKIDHOSTILE\naws_secret_access_key = hostile-secret\n")
    cfg = from_dict({"state_dir": str(tmp / "state"),
                     "sync": {"target": f"s3://{BUCKET}/{PREFIX}", "endpoint_url": s3.endpoint,
                              "credentials_file": str(creds), "region": "us-east-1", "watch": [str(out)]}})
    target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
    return Restorer(target, None, watch_roots(cfg.sync.watch), time.time)


class Canaries:
    """Files outside the run folder that a write through a hostile name would reach."""

    def __init__(self, tmp: Path):
        self.paths = [tmp / "x", tmp / "canary" / "x", tmp / "root-ssh" / "authorized_keys"]
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"untouched " + p.name.encode())
        self.before = {p: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in self.paths}

    def unchanged(self) -> bool:
        return all((p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) == v for p, v in self.before.items())


def cases(tmp: Path) -> list[tuple[str, str, dict[str, bytes]]]:
    """(label, unit key, files) of hostile units, the out folder being tmp/run/out."""
    evil = {"x": b"pwned"}
    newer = {**GOOD, "trainer_state.json": b'{"global_step": 30, "max_steps": 40}'}  # tried first
    return [
        ("climbing path", "checkpoint-30", {**newer, "../../../x": b"pwned"}),
        ("absolute path", "checkpoint-30", {**newer, str(tmp / "root-ssh" / "authorized_keys"): b"ssh-ed25519 AAAA pwned"}),
        ("double slash", "checkpoint-30", {**newer, "a//../../../../x": b"pwned"}),
        ("climbing unit key", "../../canary/checkpoint-30", evil),
        ("absolute unit key", f"{tmp}/canary/checkpoint-30", evil),
    ]


@pytest.mark.parametrize("wrong_digest", [False, True], ids=["right-digest", "wrong-digest"])
@pytest.mark.parametrize("case", range(5))
def test_a_hostile_unit_on_s3_is_refused_and_writes_nothing_outside(hostile, tmp_path, case, wrong_digest):
    out = tmp_path / "run" / "out"
    canaries = Canaries(tmp_path)
    put_unit(hostile, "checkpoint-10", GOOD)
    label, key, files = cases(tmp_path)[case]
    bad = {p for p in files if p not in GOOD or p == "trainer_state.json"} - {"trainer_state.json"} \
        if wrong_digest else set()
    put_unit(hostile, key, files, bad)
    res = restorer(hostile, tmp_path, out).restore()
    assert canaries.unchanged(), label
    assert res.unit.key == "checkpoint-10"
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-10").iterdir()} == GOOD
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10"], label  # no staging, nothing else
    refused = [u for u in res.skipped if u.state == REFUSED]
    assert refused and "refused" in refused[0].why, (label, res.skipped)
    assert not any(g.endswith("pwned") or "/../" in g or "//" in g for g in hostile.gets), hostile.gets


def test_a_hostile_unit_alone_is_nothing_to_restore(hostile, tmp_path):
    out = tmp_path / "run" / "out"
    canaries = Canaries(tmp_path)
    put_unit(hostile, "checkpoint-30", {**GOOD, "../../../x": b"pwned"})
    with pytest.raises(NothingToRestore, match="refused"):
        restorer(hostile, tmp_path, out).restore()
    assert canaries.unchanged()
    assert not out.exists() or list(out.iterdir()) == []


# --- each reader's own edge --------------------------------------------------------------------------

def staging(tmp: Path, allowed: set[str]) -> tuple[Staging, int]:
    d = tmp / "stage"
    d.mkdir(0o700)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    return Staging(fd, allowed), fd


@pytest.mark.parametrize("bad", ["../x", "/tmp/x", "a//b", "not-listed.json"])
def test_staging_creates_only_listed_clean_names(tmp_path, bad):
    canaries = Canaries(tmp_path)
    into, fd = staging(tmp_path, {"a/b.json"} | ({bad} if problem(bad) else set()))
    try:
        with pytest.raises((BadName, OSError)):
            into.create(bad)
        os.close(into.create("a/b.json", 10))
        assert (tmp_path / "stage" / "a" / "b.json").stat().st_size == 10
    finally:
        os.close(fd)
    assert canaries.unchanged()


def test_staging_does_not_follow_a_link_planted_inside(tmp_path):
    into, fd = staging(tmp_path, {"a/b.json", "c.json"})
    try:
        target = tmp_path / "elsewhere"
        target.mkdir()
        (tmp_path / "stage" / "a").symlink_to(target)
        (tmp_path / "stage" / "c.json").symlink_to(tmp_path / "x")
        with pytest.raises(OSError):
            into.create("a/b.json")
        with pytest.raises(OSError):
            into.create("c.json")
        assert list(target.iterdir()) == []
        assert into.extras() == []  # links sit at listed names: the verify (open_inside) refuses them
        (tmp_path / "stage" / "planted").write_bytes(b"?")
        assert into.extras() == ["planted"]
    finally:
        os.close(fd)


def test_the_hub_reader_writes_only_through_staging(tmp_path):
    from supervisor.store.hf_read import HfReader

    class Resp:
        status_code = 200

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def iter_bytes(self, n):
            yield b"pwned"

    rd = HfReader(None)  # type: ignore[arg-type]  # no repo: the three calls below are the test's
    rd._stream = lambda key: Resp()  # type: ignore[method-assign]
    rd._raise_for_status = lambda r: None  # type: ignore[method-assign]
    rd._retrying = lambda what, fn: fn()  # type: ignore[method-assign]
    canaries = Canaries(tmp_path)
    into, fd = staging(tmp_path, {"ok.json"})
    try:
        assert rd.download("checkpoint-1", [("ok.json", 5)], into, lambda n: None)["ok.json"] == \
            hashlib.sha256(b"pwned").hexdigest()
        with pytest.raises((BadName, OSError)):
            rd.download("checkpoint-1", [("../../x", 5)], into, lambda n: None)
    finally:
        os.close(fd)
    assert canaries.unchanged()


def test_the_local_reader_refuses_a_hostile_manifest_and_a_fifo(tmp_path):
    remote = tmp_path / "remote"
    out = tmp_path / "run" / "out"
    canaries = Canaries(tmp_path)
    (remote / "checkpoint-10").mkdir(parents=True)
    for n, d in GOOD.items():
        (remote / "checkpoint-10" / n).write_bytes(d)
    (remote / "checkpoint-10" / "_MANIFEST.json").write_bytes(manifest("checkpoint-10", GOOD))
    (remote / "checkpoint-30").mkdir()
    (remote / "checkpoint-30" / "_MANIFEST.json").write_bytes(manifest("checkpoint-30", {**GOOD, "../../../x": b"pwned"}))
    (remote / "checkpoint-40").mkdir()
    for n, d in GOOD.items():
        (remote / "checkpoint-40" / n).write_bytes(d)
    (remote / "checkpoint-40" / "_MANIFEST.json").write_bytes(manifest("checkpoint-40", GOOD))
    os.unlink(remote / "checkpoint-40" / "adapter_model.safetensors")
    os.mkfifo(remote / "checkpoint-40" / "adapter_model.safetensors")  # listed at its size? no: -1 from stat
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "sync": {"target": str(remote), "watch": [str(out)]}})
    target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
    res = Restorer(target, None, watch_roots(cfg.sync.watch), time.time).restore()
    assert res.unit.key == "checkpoint-10" and canaries.unchanged()
    assert {u.key: u.state for u in res.skipped}["checkpoint-30"] == REFUSED


# --- through the real daemon: `supervisorctl resume` ---------------------------------------------------

def test_supervisorctl_resume_refuses_the_hostile_unit(make_daemon, hostile, tmp_path):
    out = tmp_path / "run" / "out"
    canaries = Canaries(tmp_path)
    put_unit(hostile, "checkpoint-10", GOOD)
    put_unit(hostile, "checkpoint-30", {**GOOD, "../../../../x": b"pwned"}, {"../../../../x"})
    put_unit(hostile, "../../canary/checkpoint-40", {"x": b"pwned"})
    creds = tmp_path / "creds"
    creds.write_text("[default]\naws_access_key_id = AKIDHOSTILE\naws_secret_access_key = hostile-secret\n")
    d = make_daemon({"sync": {"target": f"s3://{BUCKET}/{PREFIX}", "endpoint_url": hostile.endpoint,
                              "credentials_file": str(creds), "region": "us-east-1", "watch": [str(out)],
                              "quiet_period": "0.3s"},
                     "alerts": {"first_delay": "0"}})
    listing = d.ctl("resume", "--list")
    assert listing.returncode == 0, listing.stderr
    assert "refused" in listing.stdout, listing.stdout
    r = d.ctl("resume", "--checkpoint", "checkpoint-30")
    assert r.returncode != 0 and "refused" in (r.stdout + r.stderr), (r.stdout, r.stderr)
    r = d.ctl("resume")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "checkpoint-10" in r.stdout
    assert canaries.unchanged()
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-10").iterdir()} == GOOD
    assert json.loads(json.dumps(d.status()["sync"]))  # the daemon is still well
