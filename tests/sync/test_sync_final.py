"""What a final sync guarantees, against real targets (a local folder, rsync over a loopback sshd,
SeaweedFS S3): every selected file goes up, also one that fails its format check; nothing
written while it ran is left behind; "verified" means the target holds the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.sync.manifest import check_folder
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.hf_writer import HFWriter
from tests.waiting import wait_until

MiB = 1024 * 1024


class Remote:
    """One real target: its [sync] keys and a way to read what it holds."""

    def __init__(self, kind: str, tmp_path: Path, request):
        self.kind = kind
        if kind == "s3":
            self.s3 = request.getfixturevalue("s3_server")
            self.prefix = request.getfixturevalue("s3_prefix")
            self.sync = self.s3.sync_config(self.prefix)
        else:
            self.path = tmp_path / "remote"
            if kind == "rsync":
                self.sync = request.getfixturevalue("sshd_server").sync_config(self.path)
            else:
                self.sync = {"target": str(self.path)}

    def read(self, key: str) -> bytes | None:
        if self.kind == "s3":
            objs = self.s3.objects(self.prefix)
            return self.s3.get(f"{self.prefix}/{key}") if key in objs else None
        p = self.path / key
        return p.read_bytes() if p.is_file() else None

    def keys(self) -> set[str]:
        if self.kind == "s3":
            return set(self.s3.objects(self.prefix))
        return {str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file()}

    def manifest(self, unit: str) -> dict | None:
        data = self.read(f"{unit}/{MANIFEST_NAME}")
        return json.loads(data) if data is not None else None


@pytest.fixture(params=["local", "rsync", "s3"])
def remote(request, tmp_path) -> Remote:
    return Remote(request.param, tmp_path, request)


def not_safetensors(n: int) -> bytes:
    """Bytes this daemon cannot parse as safetensors (a damaged save, or a newer format)."""
    return b"\xff" * 8 + os.urandom(n)


# --- 1: every selected file goes up --------------------------------------------------------------

def test_a_file_failing_its_format_check_goes_up_and_is_named(make_engine, hf_writer, remote):
    out = hf_writer.out
    hf_writer.checkpoint(3)
    hf_writer.checkpoint(4, stop_before="trainer_state.json")  # died mid-save
    lora = hf_writer.adapter("adapter")
    bad = not_safetensors(MiB)
    (lora / "adapter_model.safetensors").write_bytes(bad)
    hf_writer.age(60)
    e = make_engine({**remote.sync, "watch": [str(out)], "quiet_period": "1h"})
    r = e.final_sync([str(out)], 60)
    assert r.ok, r
    assert r.damaged == [str(lora / "adapter_model.safetensors")]
    assert sorted(r.partial_units) == [
        "adapter (truncated or damaged: adapter_model.safetensors)",
        "checkpoint-4 (never finished: no trainer_state.json)"]
    # every selected file is on the target with the machine's bytes
    assert remote.read("adapter/adapter_model.safetensors") == bad
    for unit in ("checkpoint-3", "checkpoint-4", "adapter"):
        for name, data in hf_writer.contents[unit].items():
            if unit == "adapter" and name == "adapter_model.safetensors":
                continue
            assert remote.read(f"{unit}/{name}") == data, (unit, name)
    # the adapter's manifest says what is wrong with it; the dead checkpoint has none; the good one is complete
    doc = remote.manifest("adapter")
    assert doc is not None and doc["complete"] is False and doc["damaged"] == ["adapter_model.safetensors"]
    assert "adapter_model.safetensors" in doc["partial"] and len(doc["files"]) == 3
    assert remote.manifest("checkpoint-4") is None
    assert remote.manifest("checkpoint-3")["complete"] is True
    st = e.status()
    assert st["pending_files"] == 0, st
    # a second final sync has nothing to send and the same to say
    r2 = e.final_sync([str(out)], 60)
    assert r2.ok and r2.uploaded_files == 0 and r2.damaged == r.damaged, r2
    if remote.kind != "s3":
        problems = check_folder(str(remote.path / "adapter"))
        assert problems == [f"{remote.path / 'adapter'}: not complete (truncated or damaged: "
                            "adapter_model.safetensors; damaged: adapter_model.safetensors)"]


def test_a_damaged_folder_that_is_saved_again_gets_a_complete_manifest(make_engine, tmp_path):
    w = HFWriter(tmp_path / "out")
    lora = w.adapter("lora")
    good = (lora / "adapter_model.safetensors").read_bytes()
    (lora / "adapter_model.safetensors").write_bytes(good[: len(good) // 2])  # cut short
    w.age(60)
    remote = tmp_path / "remote"
    e = make_engine({"target": str(remote), "watch": [str(w.out)], "quiet_period": "0.2s"})
    r = e.final_sync([str(w.out)], 60)
    assert r.ok and r.damaged == [str(lora / "adapter_model.safetensors")], r
    assert json.loads((remote / "lora" / MANIFEST_NAME).read_text())["complete"] is False
    (lora / "adapter_model.safetensors").write_bytes(good)  # the writer came back and saved it whole
    w.age(60)
    assert e.wait_idle(30).ok
    assert check_folder(str(remote / "lora")) == []
    assert (remote / "lora" / "adapter_model.safetensors").read_bytes() == good


# --- 2: what is written while the final sync runs goes up too ------------------------------------

def test_a_checkpoint_completed_during_the_final_sync_is_on_the_target_before_it_returns(
        make_engine, hf_writer, remote):
    out = hf_writer.out
    hf_writer.checkpoint(1, model_bytes=2 * MiB)
    hf_writer.age(60)
    e = make_engine({**remote.sync, "watch": [str(out)], "quiet_period": "1h", "bandwidth_limit": "1M"})
    result: list = []
    t = hf_writer.in_background(lambda: result.append(e.final_sync([str(out)], 120)))
    wait_until(lambda: e.status()["current_file"].startswith("checkpoint-1/"), 30, interval=0.01,
               what="the final sync under way")
    hf_writer.checkpoint(2)  # the trainer's last save lands while the final sync runs
    t.join(150)
    assert result and result[0].ok, result
    r = result[0]
    for step in (1, 2):
        unit = f"checkpoint-{step}"
        for name, data in hf_writer.contents[unit].items():
            assert remote.read(f"{unit}/{name}") == data, (unit, name)
        assert remote.manifest(unit)["complete"] is True
    assert r.files == len(hf_writer.contents["checkpoint-1"]) + len(hf_writer.contents["checkpoint-2"])



# --- 4: "verified" means the same bytes ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["local", "rsync"])
def test_a_remote_copy_damaged_in_place_is_found_and_repaired(make_engine, hf_writer, tmp_path, request, kind):
    remote = Remote(kind, tmp_path, request)
    out = hf_writer.out
    hf_writer.checkpoint(4)
    hf_writer.adapter("lora")
    hf_writer.age(60)
    e = make_engine({**remote.sync, "watch": [str(out)]})
    assert e.wait_idle(60).ok
    damaged = []
    for key in ("checkpoint-4/optimizer.pt", "lora/adapter_model.safetensors"):
        p = remote.path / key
        st = p.stat()
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF  # bit rot: same size, same mtime
        p.write_bytes(bytes(data))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert p.stat().st_size == st.st_size and p.stat().st_mtime_ns == st.st_mtime_ns
        damaged.append(key)
    assert e.wait_idle(30).ok  # a normal pass trusts the ledger (no LIST, no rehash)
    r = e.final_sync([str(out)], 120)
    assert r.ok and r.uploaded_files == 2, r
    for unit in ("checkpoint-4", "lora"):
        assert check_folder(str(remote.path / unit)) == []
        for name, data in hf_writer.contents[unit].items():
            assert remote.read(f"{unit}/{name}") == data, (unit, name)
    r = e.final_sync([str(out)], 60)
    assert r.ok and r.uploaded_files == 0, r


@pytest.mark.parametrize("kind", ["local", "rsync"])
def test_a_final_sync_checks_by_content_only_what_came_since_the_last_one(make_engine, hf_writer, tmp_path,
                                                                           request, kind):
    """A stop's cost grows with what is new: the files a final sync checked by content are
    checked again by size only (one listing), what came since by content; a copy of an old file
    that lost bytes is still found and sent again."""
    remote = Remote(kind, tmp_path, request)
    out = hf_writer.out
    hf_writer.checkpoint(4)
    hf_writer.age(60)
    e = make_engine({**remote.sync, "watch": [str(out)]})
    assert e.final_sync([str(out)], 120).ok
    first = {k: v.checked for k, v in e.ledger.files.items()}
    assert first and all(first.values()), first  # each file checked by content once
    hf_writer.checkpoint(8)
    hf_writer.age(60, out / "checkpoint-8")
    truncated = remote.path / "checkpoint-4" / "optimizer.pt"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    r = e.final_sync([str(out)], 120)
    assert r.ok and r.uploaded_files == len(hf_writer.contents["checkpoint-8"]) + 1, r
    assert remote.read("checkpoint-4/optimizer.pt") == hf_writer.contents["checkpoint-4"]["optimizer.pt"]
    now = {k: v.checked for k, v in e.ledger.files.items()}
    kept = [k for k in first if k != "checkpoint-4/optimizer.pt"]
    assert all(now[k] == first[k] for k in kept), "an old copy was hashed again"
    new = [k for k in now if k.startswith("checkpoint-8/")] + ["checkpoint-4/optimizer.pt"]
    assert all(now[k] > max(first.values()) for k in new), now
    # and it survives a restart: a new engine on the same state dir trusts the same records
    e.close()
    e2 = make_engine({**remote.sync, "watch": [str(out)]}, start=False)
    assert {k: v.checked for k, v in e2.ledger.files.items()} == now


def test_sha256sum_output_is_read_with_escaped_names():
    from supervisor.store.rsync import _parse_sums

    a, b = "a" * 64, "B" * 64
    out = (f"{a}  checkpoint-1/model.safetensors\n\\{b}  odd\\nname\\\\x\n{a} *bin mode\nshort  x\n").encode()
    assert _parse_sums(out) == {"checkpoint-1/model.safetensors": a, "odd\nname\\x": b.lower(), "bin mode": a}


# --- a pass that meets a file failing its check says so ------------------------------------------

def test_once_names_a_checkpoint_whose_json_does_not_parse_and_fails(sync_proc, hf_writer, tmp_path):
    cp = hf_writer.checkpoint(5)
    (cp / "trainer_state.json").write_bytes(b'{"global_step": 5, "log_history": [')  # cut short
    hf_writer.checkpoint(6)
    hf_writer.age(60)
    proc = sync_proc({"target": str(tmp_path / "remote"), "watch": [str(hf_writer.out)]})
    r = subprocess.run([sys.executable, "-m", "supervisor.sync", "--config", str(proc.config_path), "--once",
                        "--timeout", "60"], capture_output=True, text=True, env=proc.env, timeout=120)
    assert r.returncode == 1, r
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["ok"] is False
    assert f"{cp}: trainer_state.json is not valid JSON" in res["error"], res
    assert str(cp / "trainer_state.json") in res["unsynced"]
    assert f"{cp}: trainer_state.json is not valid JSON" in r.stderr
    # the healthy checkpoint went up all the same
    assert check_folder(str(tmp_path / "remote" / "checkpoint-6")) == []
    assert not (tmp_path / "remote" / "checkpoint-5").exists()


# --- an extra final-sync folder never lands on a watched folder's subfolder -----------------------

def test_a_final_sync_folder_named_like_a_watched_subfolder_is_synced_once_beside_it(make_engine, tmp_path):
    w = HFWriter(tmp_path / "work" / "out")
    w.adapter("lora", step=1)
    w.checkpoint(2)
    other = HFWriter(tmp_path / "elsewhere")
    other.adapter("lora", step=9)  # /elsewhere/lora: the same name as out/lora
    w.age(60)
    other.age(60)
    remote = tmp_path / "remote"
    e = make_engine({"target": str(remote), "watch": [str(w.out)], "quiet_period": "0.2s"})
    assert e.wait_idle(30).ok
    sent = e.stats["files_uploaded"]
    extra = other.out / "lora"
    # the watched folder, a folder beside it with a clashing name, and a folder above it
    r = e.final_sync([str(w.out), str(extra), str(tmp_path / "work")], 60)
    assert r.ok, r
    # what the include globs select in it (an adapter folder given as the root itself: not its README)
    assert e.stats["files_uploaded"] == sent + 2, "something was sent twice"
    assert check_folder(str(remote / "lora")) == []
    assert (remote / "lora" / "adapter_model.safetensors").read_bytes() == w.contents["lora"][
        "adapter_model.safetensors"]
    beside = [p for p in remote.iterdir() if p.name.startswith("lora-")]
    assert len(beside) == 1 and check_folder(str(beside[0])) == []
    assert (beside[0] / "adapter_model.safetensors").read_bytes() == other.contents["lora"][
        "adapter_model.safetensors"]
    assert not [p for p in remote.iterdir() if p.name.startswith("work-")], "the watched folder went up twice"
    r = e.final_sync([str(w.out), str(extra), str(tmp_path / "work")], 60)
    assert r.ok and r.uploaded_files == 0, r
