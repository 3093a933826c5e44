"""The local look finds other trainers' saves (issue 50): a restore from the target is held back
while a Lightning `.ckpt`, a nanoGPT `ckpt.pt` or an Accelerate `checkpoint_N/` is here, so a newer
local save is never set aside for an older one from the target; a torn torch file is no save."""

from __future__ import annotations

import os

from supervisor.resume.local import newest_local
from tests.fixtures.hf_writer import HFWriter, torch_zip_bytes


def put(path, data: bytes, mtime: float | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return str(path)


def test_lightning_files_rank_by_their_named_step(tmp_path):
    ck = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    put(ck / "epoch=0-step=10.ckpt", torch_zip_bytes(100, 1), mtime=2000)
    best = put(ck / "epoch=1-step=20.ckpt", torch_zip_bytes(100, 2), mtime=1000)
    put(ck / "last.ckpt", torch_zip_bytes(100, 3), mtime=3000)
    assert newest_local([str(tmp_path)]) == (best, 20)


def test_nanogpt_ckpt_pt_and_a_torn_one(tmp_path):
    p = put(tmp_path / "out" / "ckpt.pt", torch_zip_bytes(100, 1))
    assert newest_local([str(tmp_path)]) == (p, None)
    put(tmp_path / "out" / "ckpt.pt", torch_zip_bytes(100, 1)[:-30])  # torch.save cut short
    assert newest_local([str(tmp_path)]) is None


def test_accelerate_folder_counts_once_its_random_states_are_there(tmp_path):
    d = tmp_path / "checkpoints" / "checkpoint_3"
    put(d / "model.safetensors", b"x")
    assert newest_local([str(tmp_path)]) is None
    put(d / "random_states_0.pkl", b"x")
    assert newest_local([str(tmp_path)]) == (str(d), None)


def test_an_hf_checkpoint_still_wins_and_links_are_not_followed(tmp_path):
    w = HFWriter(tmp_path / "out")
    w.checkpoint(30)
    put(tmp_path / "out" / "other.ckpt", torch_zip_bytes(100, 1))
    assert newest_local([str(tmp_path / "out")]) == (str(tmp_path / "out" / "checkpoint-30"), 30)
    elsewhere = tmp_path / "elsewhere"
    put(elsewhere / "x.ckpt", torch_zip_bytes(100, 1))
    (tmp_path / "w2").mkdir()
    os.symlink(elsewhere, tmp_path / "w2" / "link")
    os.symlink(elsewhere / "x.ckpt", tmp_path / "w2" / "y.ckpt")
    assert newest_local([str(tmp_path / "w2")]) is None


def test_the_files_of_an_unfinished_hf_checkpoint_are_no_save(tmp_path):
    """checkpoint-20/ without trainer_state.json holds rng_state.pth and optimizer.pt (torch zips):
    the HF rule decides for that folder, and it is not complete, so nothing is here."""
    put(tmp_path / "out" / "checkpoint-20" / "rng_state.pth", torch_zip_bytes(100, 1))
    put(tmp_path / "out" / "checkpoint-20" / "optimizer.pt", torch_zip_bytes(100, 2))
    assert newest_local([str(tmp_path / "out")]) is None
