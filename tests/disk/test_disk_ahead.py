"""The disk guard ahead of the trainer (issue 37, finding 4), through the real daemon: a real small
tmpfs, a trainer process saving a 6 MiB checkpoint every 1.5 s (faster than the daemon's 10 s disk
duty), the real sync to a folder target. The guard sees each save start through inotify and
prunes verified checkpoints before the save needs the room: no ENOSPC, all on the target. With
prune off, the same trainer dies of the full disk with torch's words (which name no errno), and
the failure mail says "disk full", naming the folder, its free bytes and the biggest checkpoints."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tests.e2e.test_first_hour import base_config
from tests.fixtures.hf_writer import safetensors_bytes
from tests.fixtures.inproc import wait_mail
from tests.fixtures.tmpfs import small_tmpfs

REPO = Path(__file__).resolve().parents[2]
MIB = 1024**2
SAVES = 24
EVERY = 1.5
CKPT = 6 * MIB

# A Trainer-shaped save loop: checkpoint-N/ with model.safetensors, optimizer.pt, then
# trainer_state.json last; on a failed write it dies as torch.save does on a full disk.
TRAINER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[5])
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes
out, n, every, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
os.makedirs(out, exist_ok=True)
t0 = time.monotonic()
for step in range(1, n + 1):
    time.sleep(max(0.0, t0 + step * every - time.monotonic()))
    d = os.path.join(out, f"checkpoint-{step}")
    os.makedirs(d, exist_ok=True)
    try:
        for name, data in (("model.safetensors", safetensors_bytes({"w": size * 3 // 4}, step)),
                           ("optimizer.pt", torch_zip_bytes(size // 4, step))):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
    except OSError as e:
        print(f"saving checkpoint-{step}: {e}", file=sys.stderr, flush=True)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4194368 vs 4194304. "
                           "PytorchStreamWriter failed writing file data/0: file write failed") from None
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "log_history": [{"loss": 1.0 / step, "step": step}]}, f)
    print(f"saved checkpoint-{step}", flush=True)
print("done", flush=True)
"""


@pytest.fixture
def disk():
    with small_tmpfs(40 * MIB, "tsv-ahead-") as mnt:
        yield mnt


def config(tmp_path: Path, smtp, fake_nvml, out: Path, target: Path, prune: str) -> dict:
    script = tmp_path / "saver.py"
    script.write_text(TRAINER)
    return base_config(tmp_path, smtp, fake_nvml,
                       training={"command": f"{sys.executable} {script} {out} {SAVES} {EVERY} {CKPT} {REPO}",
                                 "on_finish": "none"},
                       sync={"target": str(target), "watch": [str(out)], "quiet_period": "0.3s"},
                       disk={"prune": prune, "keep_local": 2})


def test_each_save_is_seen_as_it_starts_and_room_is_made_before_it_needs_it(
        tmp_path, disk, make_daemon, smtp_server, fake_nvml):
    out, target = disk / "out", tmp_path / "target"
    d = make_daemon(config(tmp_path, smtp_server, fake_nvml, out, target, "synced"))
    assert d.ctl("start").returncode == 0
    info = d.wait_training("FINISHED", timeout=SAVES * EVERY + 60)
    assert info["exit_code"] == 0, Path(info["log"]).read_text()[-2000:]
    r = d.ctl("sync", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    for step in range(1, SAVES + 1):  # every save on the target, whole
        got = (target / f"checkpoint-{step}" / "model.safetensors").read_bytes()
        assert hashlib.sha256(got).digest() == hashlib.sha256(safetensors_bytes({"w": CKPT * 3 // 4}, step)).digest()
    st = d.status()["disk"]
    assert st["deleted"] >= SAVES - 6 and not any(e.get("event") == "delete_failed" for e in st["recent"])


def test_a_run_that_dies_of_the_full_disk_gets_a_disk_full_mail(tmp_path, disk, make_daemon, smtp_server, fake_nvml):
    out, target = disk / "out", tmp_path / "target"
    d = make_daemon(config(tmp_path, smtp_server, fake_nvml, out, target, "off"))
    assert d.ctl("start").returncode == 0
    d.wait_training("FAILED", timeout=SAVES * EVERY + 60)
    subject, body = wait_mail(smtp_server, "training FAILED")
    assert "training FAILED: disk full (exit code 1)" in subject, subject
    assert f"The disk is full: {out} (on {disk})" in body and " free of 40 MiB" in body, body
    assert "Biggest here:" in body and f"{out}/checkpoint-1: 6 MiB" in body, body
    assert "PytorchStreamWriter failed" in body  # the log's own last lines stay below


def test_what_a_full_disk_looks_like_at_a_runs_end():
    from supervisor.disk.forecast import died_of_full_disk

    gib = 1024**3
    torch_words = ["RuntimeError: [enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing "
                   "file data/0: file write failed"]
    assert died_of_full_disk(["OSError: [Errno 28] No space left on device: 'out/x'"], 50 * gib, 100 * gib, None)
    assert died_of_full_disk(["OSError: [Errno 122] Disk quota exceeded"], 50 * gib, 100 * gib, None)
    assert died_of_full_disk(torch_words, 0, 100 * gib, None)                    # nothing free: torch's words suffice
    assert died_of_full_disk(torch_words, 3 * gib, 100 * gib, 4 * gib)           # less than the next save needs
    assert not died_of_full_disk(torch_words, 30 * gib, 100 * gib, 4 * gib)      # room enough: some other failure
    assert not died_of_full_disk(["CUDA out of memory"], 0, 100 * gib, None)     # full, but it died of something else
    assert not died_of_full_disk([], 0, 100 * gib, None)


def test_a_folder_made_after_the_watch_began_is_watched_and_told(tmp_path):
    """The daemon starts at boot; the trainer makes its output folder later, two levels down."""
    import threading

    from supervisor.sync.watch import FolderWatcher
    from tests.waiting import wait_until

    seen: list[str] = []
    lock = threading.Lock()

    def on_change(path: str) -> None:
        with lock:
            seen.append(path)

    root = tmp_path / "runs" / "out"
    w = FolderWatcher(on_change)
    try:
        w.ensure([str(root)])
        (root / "checkpoint-1").mkdir(parents=True)
        wait_until(lambda: str(root) in seen, 10, what="the new folder told")
        (root / "checkpoint-1" / "trainer_state.json").write_text("{}")
        wait_until(lambda: any(p.endswith("trainer_state.json") for p in seen), 10, what="a file in it")
    finally:
        w.close()
