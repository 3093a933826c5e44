"""Other trainers' saves are selected by the default config (issue 50): Accelerate's
`checkpoints/checkpoint_N/`, a nanoGPT-style `ckpt.pt`, torchtune's `epoch_N/`, Composer's per-rank
`.pt`, laid out as those writers lay them out. With the old default they matched nothing and
a final sync said "verified, 0 files" while the only copy stayed on the machine."""

from __future__ import annotations

from supervisor.resume.choose import COMPLETE, UnitInfo, choose
from supervisor.training.checkpoints import name_order
from tests.fixtures.hf_writer import HFWriter, safetensors_bytes, torch_zip_bytes


def accelerate_save(out, i: int, procs: int = 2) -> None:
    d = out / "checkpoints" / f"checkpoint_{i}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(safetensors_bytes({"w": 4096}, i))
    for name in ("optimizer.bin", "scheduler.bin", "sampler.bin"):
        (d / name).write_bytes(torch_zip_bytes(512, i))
    for r in range(procs):  # written last, one per process
        (d / f"random_states_{r}.pkl").write_bytes(b"\x80\x04" + bytes(64))


def test_the_default_config_selects_accelerate_nanogpt_torchtune_and_composer_saves(make_engine, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    accelerate_save(out, 0)
    accelerate_save(out, 1)
    (out / "ckpt.pt").write_bytes(torch_zip_bytes(8192, 1))                   # nanoGPT: one file, in place
    (out / "epoch_0").mkdir()
    (out / "epoch_0" / "model-00001-of-00001.safetensors").write_bytes(safetensors_bytes({"w": 64}))
    (out / "epoch_0" / "recipe_state").mkdir()
    (out / "epoch_0" / "recipe_state" / "recipe_state.pt").write_bytes(torch_zip_bytes(64))
    (out / "ep0-ba300-rank0.pt").write_bytes(torch_zip_bytes(256, 3))            # Composer, one per rank
    HFWriter(out).age(60)
    remote = tmp_path / "remote"
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.5s"})
    r = e.final_sync([str(out)], 60)
    assert r.ok, r
    for rel in ("checkpoints/checkpoint_0/random_states_1.pkl", "checkpoints/checkpoint_1/model.safetensors",
                "ckpt.pt", "epoch_0/recipe_state/recipe_state.pt", "ep0-ba300-rank0.pt"):
        assert (remote / rel).read_bytes() == (out / rel).read_bytes(), rel
    assert (remote / "checkpoints" / "checkpoint_1" / "_MANIFEST.json").exists()
    assert (remote / "ckpt.pt._MANIFEST.json").exists()  # a single save is resumable too
    assert (remote / "ep0-ba300-rank0.pt._MANIFEST.json").exists()


def test_installed_software_in_the_workdir_is_never_output(make_engine, tmp_path):
    """The default `**/*.pth` must not pick site-packages' distutils-precedence.pth out of a venv."""
    out = tmp_path / "work"
    sp = out / ".venv" / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    (sp / "distutils-precedence.pth").write_bytes(b"import os\n")
    (out / "env" / "lib" / "site-packages").mkdir(parents=True)
    (out / "env" / "lib" / "site-packages" / "x.pth").write_bytes(b"x\n")
    (out / "node_modules" / "m").mkdir(parents=True)
    (out / "node_modules" / "m" / "w.pt").write_bytes(torch_zip_bytes(64))
    (out / "ckpt.pt").write_bytes(torch_zip_bytes(512, 1))
    HFWriter(out).age(60)
    remote = tmp_path / "remote"
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.5s"})
    r = e.final_sync([str(out)], 60)
    assert r.ok, r
    sent = sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file())
    assert sent == ["ckpt.pt", "ckpt.pt._MANIFEST.json"], sent


def test_units_named_by_number_rank_by_it_before_the_time_they_were_saved():
    same_second = "2026-12-07T01:00:00Z"
    units = [UnitInfo(f"out/checkpoints/checkpoint_{i}", COMPLETE, "", None, saved_at=same_second) for i in (6, 7)]
    assert choose(units).order[0].key == "out/checkpoints/checkpoint_7"
    lightning = [UnitInfo(f"out/{n}", COMPLETE, "", None, saved_at=same_second)
                 for n in ("epoch=1-step=200.ckpt", "epoch=0-step=100.ckpt", "epoch=9-step=90.ckpt")]
    assert choose(lightning).order[0].key == "out/epoch=1-step=200.ckpt"
    assert [name_order(n) for n in ("checkpoint_12", "epoch_3", "300", "ckpt.pt", "epoch=2-step=300.ckpt")] == \
        [12, 3, 300, -1, 300]


def test_a_model_saved_below_the_top_goes_up_whole_and_a_downloaded_one_does_not(make_engine, tmp_path):
    """`trainer.save_model("out/final")` (the demo's tiny trainer does this) is one unit, config,
    weights and tokenizer with a manifest; a model `hf download --local-dir` put in the watched
    folder is not sent (it was not trained here)."""
    out = tmp_path / "out"
    final = out / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"model_type": "tiny"}')
    (final / "model.safetensors").write_bytes(safetensors_bytes({"w": 244}))
    (final / "tokenizer.json").write_text("{}")
    base = out / "base"
    (base / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / "model-00001-of-00002.safetensors").write_bytes(safetensors_bytes({"w": 64}))
    HFWriter(out).age(60)
    remote = tmp_path / "remote"
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.5s"})
    r = e.final_sync([str(out)], 60)
    assert r.ok, r
    for n in ("config.json", "model.safetensors", "tokenizer.json", "_MANIFEST.json"):
        assert (remote / "final" / n).exists(), n
    assert not (remote / "base").exists()
