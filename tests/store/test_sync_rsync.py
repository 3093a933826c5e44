"""The engine over rsync+SSH to a real sshd on loopback (throwaway keys): integrity, atomic
completion, kill -9 mid-transfer, host key policy, and an unreachable host."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from supervisor.sync.manifest import check_folder
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes
from tests.waiting import wait_until

MiB = 1024 * 1024


def tree(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def test_checkpoint_and_adapter_over_rsync(make_engine, hf_writer, sshd_server, tmp_path):
    remote = tmp_path / "remote"
    hf_writer.checkpoint(30)
    hf_writer.adapter("lora")
    hf_writer.final_model()
    hf_writer.age(60)
    e = make_engine({**sshd_server.sync_config(remote), "watch": [str(hf_writer.out)]})
    r = e.wait_idle(60)
    assert r.ok, r
    for unit in ("checkpoint-30", "lora"):
        got = tree(remote / unit)
        assert {k: v for k, v in got.items() if k != MANIFEST_NAME} == hf_writer.contents[unit]
        assert check_folder(str(remote / unit)) == []
    assert (remote / "model.safetensors").read_bytes() == (hf_writer.out / "model.safetensors").read_bytes()
    src = hf_writer.out / "checkpoint-30" / "optimizer.pt"
    assert (remote / "checkpoint-30" / "optimizer.pt").stat().st_mtime_ns // 10**9 == src.stat().st_mtime_ns // 10**9
    assert not list(remote.rglob(".rsync-partial")) and not [p for p in remote.rglob(".*") if p.is_file()]
    assert e.status()["target"] == f"{sshd_server.user}@127.0.0.1:{remote}"


def test_final_sync_finds_a_file_lost_on_the_host(make_engine, hf_writer, sshd_server, tmp_path):
    remote = tmp_path / "remote"
    hf_writer.checkpoint(4)
    hf_writer.age(60)
    e = make_engine({**sshd_server.sync_config(remote), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    (remote / "checkpoint-4" / "scheduler.pt").unlink()
    r = e.final_sync([str(hf_writer.out)], 60)
    assert r.ok and r.uploaded_files == 1, r
    assert check_folder(str(remote / "checkpoint-4")) == []


@pytest.mark.slow
def test_kill9_mid_transfer_resumes_and_resends_nothing_finished(sync_proc, hf_writer, sshd_server, tmp_path):
    remote = tmp_path / "remote"
    cp = hf_writer.out / "checkpoint-12"
    cp.mkdir(parents=True)
    files = {"a_model.safetensors": safetensors_bytes({"w": 3 * MiB}, 1),
             "b_optimizer.pt": torch_zip_bytes(6 * MiB, 2),
             "config.json": b'{"a": 1}', "trainer_state.json": json.dumps({"global_step": 12}).encode()}
    for n, d in files.items():
        (cp / n).write_bytes(d)
    hf_writer.age(60)
    proc = sync_proc({**sshd_server.sync_config(remote, bandwidth_limit="3M"), "watch": [str(hf_writer.out)]})
    inodes: dict[str, int] = {}

    def finished() -> dict[str, int]:
        d = remote / "checkpoint-12"
        return {n: (d / n).stat().st_ino for n in files if (d / n).exists()} if d.exists() else {}

    def partial_data() -> bool:
        return any(p.is_file() and p.stat().st_size > 256 * 1024 for p in remote.rglob("*")
                   if ".rsync-partial" in p.parts or p.name.startswith("."))

    proc.start()
    wait_until(partial_data, 60, interval=0.02, what="rsync under way")
    proc.kill9()
    inodes.update(finished())
    proc.start()
    wait_until(lambda: len(finished()) >= 1 and partial_data(), 60, interval=0.02, what="second file under way")
    proc.kill9()
    inodes.update(finished())
    assert inodes, "nothing finished before the second kill"
    proc.start()
    wait_until(lambda: (remote / "checkpoint-12" / MANIFEST_NAME).exists(), 90, what="complete")
    proc.stop()
    assert {k: v for k, v in tree(remote / "checkpoint-12").items() if k != MANIFEST_NAME} == files
    assert check_folder(str(remote / "checkpoint-12")) == []
    for n, ino in inodes.items():
        assert (remote / "checkpoint-12" / n).stat().st_ino == ino, f"{n} was sent again after it arrived"
    assert not [p for p in remote.rglob("*") if p.is_file() and (p.name.startswith(".") or ".rsync-partial" in p.parts)]


def test_unreachable_host_fails_fast_and_clearly(make_engine, hf_writer, sshd_server, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    e = make_engine({**sshd_server.sync_config(tmp_path / "remote"), "ssh_port": dead_port,
                     "watch": [str(hf_writer.out)]})
    r = e.wait_idle(60)
    assert not r.ok and "Connection refused" in r.error, r
    assert e.status()["state"] == "failing"


def test_strict_host_key_policy_refuses_an_unknown_host(make_engine, hf_writer, sshd_server, tmp_path):
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    e = make_engine({**sshd_server.sync_config(tmp_path / "remote"), "host_key_policy": "yes",
                     "known_hosts_file": str(tmp_path / "empty_known_hosts"), "watch": [str(hf_writer.out)]})
    r = e.wait_idle(60)
    assert not r.ok and "Host key verification failed" in r.error, r
    assert not (tmp_path / "remote").exists()


def test_final_sync_repairs_a_copy_damaged_in_place(make_engine, hf_writer, sshd_server, tmp_path):
    """Same size and mtime on the host, other bytes: rsync's quick check would call it equal;
    the content check finds it and the resend compares by checksum."""
    remote = tmp_path / "remote"
    for step in (10, 20, 30):
        hf_writer.checkpoint(step)
    hf_writer.age(60)
    e = make_engine({**sshd_server.sync_config(remote), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    victim = remote / "checkpoint-20" / "optimizer.pt"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[100:110] = bytes(10 * [0xAB]) if data[100:110] != bytes(10 * [0xAB]) else bytes(10)
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = e.final_sync([str(hf_writer.out)], 60)
    assert r.ok and r.uploaded_files == 1, r
    for step in (10, 20, 30):
        assert check_folder(str(remote / f"checkpoint-{step}")) == []
    assert victim.read_bytes() == (hf_writer.out / "checkpoint-20" / "optimizer.pt").read_bytes()


def test_folders_in_one_put_files_take_one_rsync_run_and_manifests_one_shell(sshd_server, hf_writer, tmp_path):
    """What the engine does when several folders are ready (one put_files, each folder's manifest
    as its last file is verified): one rsync run for the files, every manifest through the one
    shell kept open on the host, and the shared connection's socket gone after close."""
    from supervisor.config import SyncConfig
    from supervisor.config.target import parse_target
    from supervisor.store import base
    from supervisor.store.rsync import RsyncTarget

    remote = tmp_path / "remote"
    for step in (1, 2, 3):
        hf_writer.checkpoint(step)
    cfg = SyncConfig(**{k: v for k, v in sshd_server.sync_config(remote).items()})
    t = RsyncTarget(parse_target(cfg.target), cfg, tmp_path / "st" / "sync" / "tmp")
    runs: list[int] = []
    real_run = t._rsync_files
    t._rsync_files = lambda src, sub, rels, checksum, during=None: (runs.append(len(rels)),
                                                                     real_run(src, sub, rels, checksum, during))[1]
    files = [base.LocalFile(str(p), str(p.relative_to(hf_writer.out)), p.stat().st_size, p.stat().st_mtime_ns)
             for p in sorted(hf_writer.out.rglob("*")) if p.is_file()]
    done: dict[str, str] = {}
    shells = []

    class Sink:
        def begin(self, f, info): pass
        def part(self, f, n, etag, checksum, size): pass
        def problem(self, f, err): raise AssertionError(err)
        def progress(self, f, n): pass
        def in_flight(self, key): return None
        def cancelled(self): return False

        def done(self, f, r):
            done[f.key] = r.sha256
            unit = f.key.split("/")[0]
            if all(g.key in done for g in files if g.key.startswith(unit + "/")):
                t.write_manifest(unit, json.dumps({"unit": unit}).encode())
                shells.append(t._sh)

    try:
        t.put_files(files, Sink())
        assert runs == [len(files)]
        assert len(shells) == 3 and shells[0] is shells[1] is shells[2]
        for step in (1, 2, 3):
            d = remote / f"checkpoint-{step}"
            assert json.loads((d / MANIFEST_NAME).read_text()) == {"unit": f"checkpoint-{step}"}
            assert {n: (d / n).read_bytes() for n in hf_writer.contents[f"checkpoint-{step}"]} == \
                hf_writer.contents[f"checkpoint-{step}"]
        assert not [p for p in remote.rglob(".*") if p.is_file()]
        assert os.path.exists(t.control_path)
    finally:
        t.close()
    assert not os.path.exists(t.control_path), "the SSH control socket outlived the target"


def test_manifest_shell_survives_a_dropped_connection_and_ends_when_idle(sshd_server, tmp_path, monkeypatch):
    from supervisor.config import SyncConfig
    from supervisor.config.target import parse_target
    from supervisor.store import rsync as rs

    monkeypatch.setattr(rs, "SHELL_IDLE_S", 0.5)
    remote = tmp_path / "remote"
    cfg = SyncConfig(**sshd_server.sync_config(remote))
    t = rs.RsyncTarget(parse_target(cfg.target), cfg, tmp_path / "st" / "sync" / "tmp")
    try:
        t.write_manifest("a", b'{"n": 1}')
        first = t._sh
        assert first is not None
        first.p.kill()  # the connection dropped while idle
        first.p.wait()
        t.write_manifest("b/c", b"{\"it's\": \"quoted\\n\"}")
        assert t._sh is not first
        assert (remote / "a" / MANIFEST_NAME).read_bytes() == b'{"n": 1}'
        assert (remote / "b" / "c" / MANIFEST_NAME).read_bytes() == b"{\"it's\": \"quoted\\n\"}"
        wait_until(lambda: t._sh is None, 10, what="the idle shell closed")
    finally:
        t.close()
    assert not [p for p in remote.rglob(".*") if p.is_file()]
