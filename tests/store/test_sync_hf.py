"""hf:// targets: the real huggingface_hub client (LFS path, HF_HUB_DISABLE_XET=1) against a Hub
server on loopback (tests/fixtures/fake_hub.py) that stores what it receives and counts it.

First upload of real HF-shaped checkpoints, nothing sent twice (second pass, lost ledger, kill -9
mid-upload and right after a commit landed), 429 on commits, bad and read-only tokens, the final
sync checked against the tree, keep_last, one commit for several units (put_units)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.config import ConfigError, from_dict
from supervisor.config.target import parse_target
from supervisor.store import base
from supervisor.store.base import LocalFile, UnitPut, Uploaded
from supervisor.store.hf import HfTarget
from supervisor.store.hf_rules import choose_upload_path, find_token, unit_of, unit_summary
from supervisor.store.hf_stage import SMALL
from supervisor.store.local import LocalTarget
from supervisor.sync import manifest as mf
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.fake_hub import FakeHub, git_blob_id
from tests.fixtures.hf_writer import HFWriter, safetensors_bytes, torch_zip_bytes
from tests.waiting import wait_until

MiB = 1024 * 1024
TOKEN = "hf_writetoken"
LFS_NAMES = (".safetensors", ".pt", ".pth", ".bin")


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # the fake Hub speaks LFS, not Xet
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # never the developer's stored token
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


@pytest.fixture
def token_file(tmp_path) -> Path:
    p = tmp_path / "hf-token"
    p.write_text(TOKEN + "\n")
    return p


def hf_sync(hub: FakeHub, token_file: Path, target: str = "hf://alice/run1", **kw) -> dict:
    return {"target": target, "endpoint_url": hub.url, "hf_token_file": str(token_file), **kw}


def assert_on_hub(hub: FakeHub, repo: str, unit: str, files: dict[str, bytes], rev: str = "main",
                  repo_type: str = "model") -> dict:
    tree = hub.tree(repo, rev, repo_type)
    pre = f"{unit}/" if unit else ""
    have = {p[len(pre):]: e for p, e in tree.items() if p.startswith(pre) and "/" not in p[len(pre):]
            and p != ".gitattributes"}
    assert set(have) == set(files) | {MANIFEST_NAME}, sorted(have)
    for name, data in files.items():
        e = have[name]
        assert Path(e.data).read_bytes() == data, name
        if name.endswith(LFS_NAMES):
            assert e.lfs == hashlib.sha256(data).hexdigest(), f"{name} not stored as LFS"
        elif name.endswith(".json") or name.endswith(".md"):
            assert e.lfs is None and e.blob_id == git_blob_id(data), f"{name} not a regular file"
    listed = {f.path: (f.size, f.sha256) for f in mf.parse(Path(have[MANIFEST_NAME].data).read_bytes())}
    assert listed == {n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}
    return have


def snapshot(hub: FakeHub) -> tuple:
    return dict(hub.requests), dict(hub.object_puts), sum(len(r.commits) for r in hub.repos.values())


# --- pure parts ---------------------------------------------------------------------------------

def test_hf_urls_parse_and_reject_clearly():
    u = parse_target("hf://alice/run1")
    assert (u.kind, u.repo, u.repo_type, u.prefix, u.display()) == ("hf", "alice/run1", "model", "", "hf://alice/run1")
    u = parse_target("hf://datasets/org-x/data.v2/runs/a/")
    assert (u.repo, u.repo_type, u.prefix, u.display()) == ("org-x/data.v2", "dataset", "runs/a",
                                                            "hf://datasets/org-x/data.v2/runs/a")
    assert parse_target("hf://models/alice/m").repo_type == "model"
    for bad, words in [("hf://alice", "expected hf://NAMESPACE/REPO"), ("hf://spaces/a/b", "Space"),
                       ("hf://al--ice/x", "not a valid Hugging Face namespace"),
                       ("hf://alice/-x", "not a valid Hugging Face repo name"),
                       ("hf://alice/x/a/../b", "'..'"), ("hf://alice/x/.git", ".git")]:
        with pytest.raises(ValueError, match=words):
            parse_target(bad)
    with pytest.raises(ConfigError, match="sync.hf_revision"):
        from_dict({"sync": {"target": "hf://alice/x", "hf_revision": "bad branch"}})
    cfg = from_dict({"sync": {"target": "hf://datasets/alice/x", "hf_revision": "runs/exp-1"}})
    assert cfg.sync.hf_private is True and cfg.sync.hf_token_file == ""


def test_words_and_choices():
    assert unit_summary("checkpoint-1200", {"global_step": 1200, "max_steps": 5000,
                                            "log_history": [{"loss": 0.5}, {"loss": 0.41234, "step": 1200},
                                                            {"eval_loss": 0.6}]}) \
        == "checkpoint-1200: step 1200/5000, loss 0.4123"
    assert unit_summary("lora", None) == "lora"
    assert unit_of(["checkpoint-1/a", "checkpoint-1/sub/b"]) == "checkpoint-1"
    assert unit_of(["model.safetensors", "checkpoint-1/a"]) == ""
    assert choose_upload_path({"HF_HUB_DISABLE_XET": "1"}, True) == ("lfs", "HF_HUB_DISABLE_XET is set")
    assert choose_upload_path({}, False)[0] == "lfs" and choose_upload_path({}, True)[0] == "xet"


def test_token_lookup_order(tmp_path):
    stored = tmp_path / "home" / "token"
    stored.parent.mkdir()
    stored.write_text("hf_stored\n")
    env = {"HF_HOME": str(stored.parent)}
    assert find_token("", env) == ("hf_stored", f"the Hugging Face CLI login ({stored})")
    assert find_token("", {**env, "HF_TOKEN": "hf_env"}) == ("hf_env", "the HF_TOKEN environment variable")
    f = tmp_path / "tok"
    f.write_text(" hf_file \n")
    tok, where = find_token(str(f), {**env, "HF_TOKEN": "hf_env"})
    assert tok == "hf_file" and where.startswith("sync.hf_token_file") and "hf_file" not in where
    assert find_token("", {"HF_HOME": str(tmp_path / "nowhere")}) == (None, "")


# --- through the engine ----------------------------------------------------------------------------

def test_first_upload_of_a_checkpoint_and_an_adapter(make_engine, hf_writer, fake_hub, token_file):
    hf_writer.checkpoint(50, model_bytes=11 * MiB, optimizer_bytes=3 * MiB, peft=True)
    hf_writer.adapter("lora")
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    r = e.wait_idle(60)
    assert r.ok, r
    repo = fake_hub.repo("alice/run1")
    assert repo.private, "a repo the daemon creates is private"
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-50", hf_writer.contents["checkpoint-50"])
    assert_on_hub(fake_hub, "alice/run1", "lora", hf_writer.contents["lora"])
    # every object went up exactly once
    assert fake_hub.object_puts and set(fake_hub.object_puts.values()) == {1}
    assert set(fake_hub.objects_stored.values()) == {1}
    # both units ready at once: one commit naming each, manifests in it (complete by construction)
    history = fake_hub.history("alice/run1")
    assert len(history) == 2 and history[-1].summary == "2 units: lora, checkpoint-50", [c.summary for c in history]
    assert "checkpoint-50: step 50, loss" in history[-1].description
    assert {f"checkpoint-50/{MANIFEST_NAME}", f"lora/{MANIFEST_NAME}"} <= set(history[-1].tree)
    # the ledger records the commit that holds each unit
    assert e.ledger.manifest("checkpoint-50")["commit"] == history[-1].oid
    assert e.ledger.manifest("lora")["commit"] == history[-1].oid
    assert e.status()["uploaded_files"] == 14 and e.status()["state"] == "idle"
    info = base.describe(e.target)
    assert info["upload_path"] == "lfs" and "HF_HUB_DISABLE_XET" in info["upload_path_reason"]
    assert info["private"] is True and info["created"] is True and info["warning"] is None
    text = json.dumps(e.status()) + json.dumps(info) + json.dumps([r.__dict__ for r in [r]])
    assert TOKEN not in text


def test_unchanged_pass_restart_and_lost_ledger_send_nothing(make_engine, hf_writer, fake_hub, token_file):
    hf_writer.checkpoint(3, model_bytes=2 * MiB)
    hf_writer.age(60)
    sync = {**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]}
    e = make_engine(sync)
    assert e.wait_idle(60).ok
    before = snapshot(fake_hub)
    assert e.wait_idle(30).ok
    assert snapshot(fake_hub) == before, "a pass with nothing new must not talk to the Hub at all"
    e.close()
    e2 = make_engine(sync)  # a restarted daemon: the ledger knows
    assert e2.wait_idle(30).ok
    calls, objects, commits_before = before
    # only its start probe (sync/probe.py) asked the Hub anything: the repo and the token's role
    probe = {"repo_info": calls["repo_info"] + 1, "whoami": calls["whoami"] + 1}
    assert snapshot(fake_hub) == ({**calls, **probe}, objects, commits_before)
    e2.close()
    # the ledger is gone (a new machine, same repo): the Hub already holds all of it
    puts, commits = dict(fake_hub.object_puts), fake_hub.commits("alice/run1")
    # (an hour later, so its new manifest differs in created_at: the Hub's copy is read and compared)
    e3 = make_engine(sync, state="state-new", clock=FakeClock(start=time.time() + 3600))
    r = e3.wait_idle(60)
    assert r.ok, r
    assert dict(fake_hub.object_puts) == puts, "content already on the Hub was sent again"
    assert fake_hub.commits("alice/run1") == commits, "an unchanged unit was committed again"
    assert fake_hub.requests["resolve"] >= 1
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-3", hf_writer.contents["checkpoint-3"])


def _proc_dead(proc) -> bool:
    return proc.proc is not None and proc.proc.poll() is not None


@pytest.mark.slow
def test_kill9_mid_upload_and_after_a_commit_sends_nothing_finished_twice(sync_proc, hf_writer, fake_hub,
                                                                            token_file):
    cp = hf_writer.out / "checkpoint-9"
    cp.mkdir(parents=True)
    files = {"model.safetensors": safetensors_bytes({"w": SMALL + MiB}, 9)}  # above SMALL: hashed apart
    for i in range(5):
        files[f"optimizer-{i}.pt"] = torch_zip_bytes(MiB + i, 10 + i)
    files["config.json"] = b'{"model_type": "tiny"}'
    files["trainer_state.json"] = json.dumps({"global_step": 9, "max_steps": 90,
                                              "log_history": [{"loss": 1.5, "step": 9}]}).encode()
    for n, d in files.items():
        (cp / n).write_bytes(d)
    hf_writer.age(60)
    proc = sync_proc({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)], "concurrency": 1})
    proc.env["HF_HUB_DISABLE_XET"] = "1"
    kill = threading.Event()

    def kill_now(*_a) -> None:
        if kill.is_set() and proc.proc is not None and proc.proc.poll() is None:
            kill.clear()
            os.killpg(proc.proc.pid, signal.SIGKILL)  # inside the request: the reply never arrives

    # 1: kill -9 right after the second object was stored
    stored = []
    fake_hub.on("object_stored", lambda oid: (stored.append(oid), len(stored) == 2 and kill_now()))
    kill.set()
    proc.start()
    wait_until(lambda: _proc_dead(proc), 60, what="killed mid-upload")
    assert len(stored) == 2 and fake_hub.commits("alice/run1") == 0
    # 2: kill -9 right after the files' commit landed, before the client heard of it
    fake_hub.clear_hooks()
    fake_hub.on("commit", lambda repo, c: kill_now())
    kill.set()
    proc.start()
    wait_until(lambda: _proc_dead(proc), 60, what="killed after the commit")
    assert fake_hub.commits("alice/run1") == 1
    fake_hub.clear_hooks()
    # 3: the one-shot runner finishes the job
    r = proc.once(60)
    assert r["ok"], r
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-9", files)
    lfs = {hashlib.sha256(d).hexdigest() for n, d in files.items() if n.endswith(LFS_NAMES)}
    assert set(fake_hub.objects_stored) == lfs and set(fake_hub.objects_stored.values()) == {1}
    assert dict(fake_hub.object_puts) == dict.fromkeys(lfs, 1), "a finished object was sent again"
    # one commit for the whole unit, manifest included; the restart found it and committed nothing
    history = fake_hub.history("alice/run1")
    assert [c.summary for c in history[1:]] == ["checkpoint-9: step 9/90, loss 1.5"]
    assert f"checkpoint-9/{MANIFEST_NAME}" in history[-1].tree
    assert "hf_resume" in proc.log_text(), "the resumed run hashed again what the journal knew"
    done = [x["k"] for x in proc.journal() if x.get("op") == "done"]
    assert sorted(done) == sorted(f"checkpoint-9/{n}" for n in files)
    landed = [x for x in proc.journal() if x.get("op") == "man" and x.get("u") == "checkpoint-9"]
    assert landed and landed[-1]["c"] == history[-1].oid, "the ledger records the unit's commit"


def test_commit_429_is_waited_out_and_a_long_one_backs_off(make_engine, hf_writer, fake_hub, token_file):
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    fake_hub.commit_429, fake_hub.retry_after = 2, "1"
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    r = e.wait_idle(60)
    assert r.ok, r
    t = fake_hub.commit_attempts
    assert t[1] - t[0] >= 0.95 and t[2] - t[1] >= 0.95, "Retry-After was not honoured"
    assert e.status()["state"] == "idle" and e.target.stats["commit_429"] == 2
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-1", hf_writer.contents["checkpoint-1"])
    # an hour-long Retry-After: no hour-long sleep in the worker, the engine backs off instead
    fake_hub.commit_429, fake_hub.retry_after = 1, "3600"
    hf_writer.checkpoint(2)
    hf_writer.age(60)
    puts = dict(fake_hub.object_puts)
    t0 = time.monotonic()
    r = e.wait_idle(30)
    assert not r.ok and "rate-limits commit" in r.error and "3600s" in r.error, r
    assert time.monotonic() - t0 < 20 and e.status()["state"] == "failing"
    e.request_sync()  # the limit is over (commit_429 is used up)
    r = e.wait_idle(60)
    assert r.ok, r
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-2", hf_writer.contents["checkpoint-2"])
    new = {k: v for k, v in fake_hub.object_puts.items() if k not in puts}
    assert new and set(new.values()) == {1}, "the retry re-sent content the Hub had"


def test_bad_token_then_read_only_token_fail_clearly_and_recover(make_engine, hf_writer, fake_hub, token_file):
    fake_hub.users["hf_readonly"] = {"name": "alice", "role": "read", "orgs": []}
    hf_writer.checkpoint(4)
    hf_writer.age(60)
    token_file.write_text("hf_WRONG_SECRET\n")
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    r = e.wait_idle(30)
    assert not r.ok and "rejected the token from sync.hf_token_file" in r.error and "401" in r.error, r
    st = e.status()
    assert st["state"] == "failing" and "hf_WRONG_SECRET" not in json.dumps(st) + r.error
    fake_hub.make_repo("alice/run1", private=True)
    token_file.write_text("hf_readonly\n")
    e.request_sync()
    r = e.wait_idle(30)
    assert not r.ok and "has no write access to model repo alice/run1" in r.error, r
    assert "user alice, read token" in r.error and "hf_readonly" not in r.error
    assert e.thread is not None and e.thread.is_alive(), "the worker must survive"
    token_file.write_text(TOKEN + "\n")
    e.request_sync()
    r = e.wait_idle(60)
    assert r.ok, r
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-4", hf_writer.contents["checkpoint-4"])


def test_no_token_anywhere_says_where_to_put_one(make_engine, hf_writer, fake_hub, tmp_path):
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    e = make_engine({"target": "hf://alice/run1", "endpoint_url": fake_hub.url, "watch": [str(hf_writer.out)]})
    r = e.wait_idle(30)
    assert not r.ok and "no Hugging Face token" in r.error and "sync.hf_token_file" in r.error, r
    assert fake_hub.requests == {}


def test_final_sync_checks_the_tree_and_repairs_it(make_engine, hf_writer, fake_hub, token_file):
    hf_writer.checkpoint(2, model_bytes=2 * MiB)
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    files = hf_writer.contents["checkpoint-2"]
    # behind our back: one file deleted, one LFS file and one regular file with other content of the same size
    fake_hub.tamper("alice/run1", "checkpoint-2/optimizer.pt", None)
    sched = files["scheduler.pt"]
    fake_hub.tamper("alice/run1", "checkpoint-2/scheduler.pt", bytes(len(sched)), lfs=True)
    fake_hub.tamper("alice/run1", "checkpoint-2/config.json", b" " * len(files["config.json"]))
    assert e.wait_idle(30).ok  # a normal pass trusts the ledger and asks nothing
    r = e.final_sync([str(hf_writer.out)], 60)
    assert r.ok and r.uploaded_files == 3, r
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-2", files)


def test_keep_last_deletes_old_checkpoints_in_a_commit(make_engine, hf_writer, fake_hub, token_file):
    hf_writer.checkpoint(100)
    hf_writer.checkpoint(200)
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)], "keep_last": 2})
    assert e.wait_idle(60).ok
    hf_writer.checkpoint(300)
    hf_writer.age(60)
    assert e.wait_idle(60).ok
    tree = fake_hub.tree("alice/run1")
    assert {p.split("/")[0] for p in tree if "/" in p} == {"checkpoint-200", "checkpoint-300"}
    history = fake_hub.history("alice/run1")
    assert history[-1].summary == "keep_last=2: delete checkpoint-100"
    assert [op["key"] for op in history[-1].ops] == ["deletedFolder"]
    # the Hub's history still holds it (the README says how to squash)
    assert f"checkpoint-100/{MANIFEST_NAME}" in history[-2].tree


def test_public_repo_is_used_with_a_warning_when_allowed(make_engine, hf_writer, fake_hub, token_file):
    fake_hub.make_repo("alice/open", private=False)
    hf_writer.adapter("lora")
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file, "hf://alice/open", hf_allow_public=True),
                     "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    info = base.describe(e.target)
    assert info["private"] is False and info["created"] is False
    assert "public" in info["warning"] and "visible to anyone" in info["warning"]
    assert not fake_hub.repo("alice/open").private, "an existing repo is used as it is"
    assert_on_hub(fake_hub, "alice/open", "lora", hf_writer.contents["lora"])


def test_dataset_repo_folder_and_branch(make_engine, hf_writer, fake_hub, token_file):
    hf_writer.checkpoint(5)
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file, "hf://datasets/alice/runs/exp/a", hf_revision="exp-1",
                               hf_private=False, hf_allow_public=True),
                     "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    repo = fake_hub.repo("alice/runs", "dataset")
    assert not repo.private and set(repo.branches) == {"main", "exp-1"}
    assert_on_hub(fake_hub, "alice/runs", "exp/a/checkpoint-5", hf_writer.contents["checkpoint-5"],
                  rev="exp-1", repo_type="dataset")
    assert set(fake_hub.tree("alice/runs", "main", "dataset")) == {".gitattributes"}


# --- the optional capability: several units, one commit ------------------------------------------

class RecordingSink:
    def __init__(self, hub: FakeHub | None = None, repo: str = ""):
        self.hub, self.repo = hub, repo
        self.results: dict[str, Uploaded] = {}
        self.commits_at_done: list[int] = []
        self.problems: list = []
        self.begun: dict[str, dict] = {}

    def begin(self, f, info):
        self.begun[f.key] = {"size": f.size, "mtime_ns": f.mtime_ns, "info": info, "parts": {}}

    def part(self, *a):
        pass

    def done(self, f, r):
        self.results[f.key] = r
        if self.hub is not None:
            self.commits_at_done.append(self.hub.commits(self.repo))

    def problem(self, f, err):
        self.problems.append(err)

    def progress(self, f, n):
        pass

    def in_flight(self, key):
        return self.begun.get(key)

    def cancelled(self):
        return False


def _unit(out: Path, name: str, key: str) -> tuple[list[LocalFile], Callable[[dict], bytes]]:
    files = []
    for p in sorted((out / name).iterdir()):
        st = p.stat()
        files.append(LocalFile(str(p), f"{key}/{p.name}", st.st_size, st.st_mtime_ns))

    def manifest(results: dict[str, Uploaded]) -> bytes:
        listed = [mf.ManifestFile(f.key.split("/", 1)[1], f.size, results[f.key].sha256) for f in files]
        return mf.build(name, listed, time.time(), "testbox", str(out / name))

    return files, manifest


def test_put_units_lands_several_units_and_their_manifests_in_one_commit(hf_writer, fake_hub, token_file,
                                                                         tmp_path):
    hf_writer.checkpoint(7, model_bytes=MiB)
    hf_writer.adapter("lora")
    cfg = from_dict({"sync": hf_sync(fake_hub, token_file)}).sync
    target = HfTarget(parse_target("hf://alice/run1"), cfg, tmp_path / "tmp")
    cp_files, cp_manifest = _unit(hf_writer.out, "checkpoint-7", "checkpoint-7")
    lora_files, lora_manifest = _unit(hf_writer.out, "lora", "lora")
    sink = RecordingSink(fake_hub, "alice/run1")
    res = base.put_units(target, [UnitPut("checkpoint-7", cp_files, cp_manifest),
                                  UnitPut("lora", lora_files, lora_manifest)], sink)
    assert fake_hub.commits("alice/run1") == 1
    head = fake_hub.history("alice/run1")[-1]
    assert res.commits == {"checkpoint-7": head.oid, "lora": head.oid}
    assert res.manifests == ["checkpoint-7", "lora"]
    assert head.summary == "2 units: checkpoint-7, lora" and "checkpoint-7: step 7, loss" in head.description
    assert set(sink.results) == {f.key for f in cp_files + lora_files}
    assert sink.commits_at_done and set(sink.commits_at_done) == {1}, "done before the commit landed"
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-7", hf_writer.contents["checkpoint-7"])
    assert_on_hub(fake_hub, "alice/run1", "lora", hf_writer.contents["lora"])
    for f in cp_files:
        r = sink.results[f.key]
        data = Path(f.path).read_bytes()
        assert r.sha256 == hashlib.sha256(data).hexdigest()
        assert r.etag == (r.sha256 if f.key.endswith(LFS_NAMES) else git_blob_id(data))
    # the same again (the ledger lost, say): nothing sent, nothing committed
    puts = dict(fake_hub.object_puts)
    res2 = base.put_units(target, [UnitPut("checkpoint-7", cp_files, cp_manifest)], RecordingSink())
    assert fake_hub.commits("alice/run1") == 1 and dict(fake_hub.object_puts) == puts
    assert res2.manifests == ["checkpoint-7"] and res2.commits["checkpoint-7"] == head.oid
    target.close()


def test_put_units_asks_the_tree_only_where_the_hub_may_hold_something(hf_writer, fake_hub, token_file, tmp_path):
    """The public API only: what the branch holds comes from get_paths_info, asked only about the
    paths the repo's listing (or this process's own commits) says exist. A new checkpoint costs the
    requests it always did; the same unit again from a new process (the ledger lost) is neither
    preuploaded nor committed, only checked."""
    cfg = from_dict({"sync": hf_sync(fake_hub, token_file)}).sync

    def put(target: HfTarget, step: int) -> tuple[dict, base.UnitsPut]:
        before = Counter(fake_hub.requests)
        files, manifest = _unit(hf_writer.out, f"checkpoint-{step}", f"checkpoint-{step}")
        res = base.put_units(target, [UnitPut(f"checkpoint-{step}", files, manifest)], RecordingSink())
        return dict(Counter(fake_hub.requests) - before), res

    hf_writer.checkpoint(3)
    hf_writer.checkpoint(4)
    a = HfTarget(parse_target("hf://alice/run1"), cfg, tmp_path / "tmp")
    calls, _ = put(a, 3)  # a new repo: nothing to ask about
    assert calls.pop("lfs_put") == 5  # model, optimizer, scheduler, rng_state, training_args: LFS files
    assert calls == {"repo_info": 1, "create_repo": 1, "preupload": 2, "lfs_batch": 1, "commit": 1,
                     "paths_info": 1}, calls  # the files' preupload, the manifest's (in create_commit), the check
    calls, _ = put(a, 4)  # new paths in a repo this process knows
    assert calls.pop("lfs_put") == 5 and calls == {"preupload": 2, "lfs_batch": 1, "commit": 1, "paths_info": 1}, calls
    a.close()
    # a new process, the ledger lost: the listing says checkpoint-4 is there; asked, found, checked
    b = HfTarget(parse_target("hf://alice/run1"), cfg, tmp_path / "tmp2")
    head = fake_hub.history("alice/run1")[-1]
    calls, res = put(b, 4)
    assert calls.pop("resolve", 0) <= 1  # its manifest, read back when our new one differs in created_at only
    assert calls == {"repo_info": 2, "paths_info": 2}, calls  # the listing, the head; before, the check
    assert fake_hub.history("alice/run1")[-1] == head and res.commits == {"checkpoint-4": head.oid}
    assert res.manifests == ["checkpoint-4"]
    b.close()


def test_put_units_falls_back_to_put_files_and_write_manifest(hf_writer, tmp_path):
    HFWriter(hf_writer.out).adapter("lora")
    files, manifest = _unit(hf_writer.out, "lora", "lora")
    target = LocalTarget(str(tmp_path / "dest"))
    res = base.put_units(target, [UnitPut("lora", files, manifest)], RecordingSink())
    assert res.manifests == ["lora"] and res.commits == {"lora": ""}
    assert mf.check_folder(str(tmp_path / "dest" / "lora")) == []


def test_adapter_saved_in_the_watched_folder_goes_to_the_repo_root(make_engine, hf_writer, fake_hub, token_file):
    files = {"adapter_model.safetensors": safetensors_bytes({"lora_A": 4096}, 1),
             "adapter_config.json": b'{"peft_type": "LORA", "r": 8}'}
    for n, d in files.items():
        (hf_writer.out / n).write_bytes(d)
    (hf_writer.out / "train.log").write_text("not selected\n")
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    assert_on_hub(fake_hub, "alice/run1", "", files)
    assert "train.log" not in fake_hub.tree("alice/run1")


def test_a_file_rewritten_while_it_goes_up_is_not_committed_stale(make_engine, hf_writer, fake_hub, token_file):
    cp = hf_writer.out / "checkpoint-8"
    cp.mkdir(parents=True)
    # both above SMALL: sent from their paths (a smaller file is read once, and sent as read)
    files = {"optimizer.pt": torch_zip_bytes(SMALL + MiB, 1),
             "model.safetensors": safetensors_bytes({"w": SMALL + 2 * MiB}, 2),
             "trainer_state.json": b'{"global_step": 8}'}
    for n, d in files.items():
        (cp / n).write_bytes(d)
    hf_writer.age(60)
    newer = safetensors_bytes({"w": SMALL + 2 * MiB}, 3)

    def rewrite(oid: str) -> None:  # the first object is in: the trainer rewrites the other one now
        if oid == hashlib.sha256(files["optimizer.pt"]).hexdigest():
            (cp / "model.safetensors").write_bytes(newer)

    fake_hub.on("object_stored", rewrite)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)], "concurrency": 1})
    wait_until(lambda: f"checkpoint-8/{MANIFEST_NAME}" in fake_hub.tree("alice/run1"), 60, what="complete")
    assert e.wait_idle(30).ok
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-8", {**files, "model.safetensors": newer})
    assert fake_hub.objects_stored[hashlib.sha256(files["optimizer.pt"]).hexdigest()] == 1
    assert hashlib.sha256(files["model.safetensors"]).hexdigest() not in fake_hub.objects_stored
