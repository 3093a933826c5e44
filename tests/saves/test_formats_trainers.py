"""The fifth round's trainers judged by their own rule (issue 50): Accelerate's `save_state`, NeMo 2,
Orbax, torchtune and Composer. The rules first, pure, on the layouts those writers lay out (from
their source: accelerate/checkpointing.py, nemo/lightning/pytorch/callbacks/model_checkpoint.py,
orbax/checkpoint/_src/path/atomicity.py, torchtune/training/checkpointing, composer's
save_filename); then the real Accelerate (in .venv-hf, when TSUP_HF_PYTHON names it) writing
checkpoints that the real engine judges, and a NeMo 2 save in progress through the engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.saves.formats import Facts, Rule, detect, judge, waiting_for
from supervisor.training.ranks import world_size
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes
from tests.waiting import wait_until

HF_PYTHON = os.environ.get("TSUP_HF_PYTHON")
needs_hf = pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf with torch)")


def accel_files(procs: int, custom: int = 1) -> list[str]:
    """save_state's folder (accelerate/checkpointing.py): rank 0's model, optimizer, scheduler and
    sampler, then each process's random_states_{rank}.pkl, then rank 0's custom_checkpoint_{i}.pkl."""
    return (["model.safetensors", "optimizer.bin", "scheduler.bin", "sampler.bin"]
            + [f"random_states_{r}.pkl" for r in range(procs)] + [f"custom_checkpoint_{i}.pkl" for i in range(custom)])


NO_FACTS = Facts()


def rule(name: str, files: list[str], facts: Facts = NO_FACTS, siblings: frozenset[str] = frozenset(),
         above: frozenset[str] = frozenset()) -> tuple[str, Rule]:
    fmt = detect(name, files, siblings, above)
    return fmt, judge(fmt, name, files, Facts(facts.world_size, facts.texts, siblings, facts.text_mtimes,
                                                facts.newest, above=above, mtimes=facts.mtimes))


# --- Accelerate ----------------------------------------------------------------------------------------

def test_accelerate_is_complete_once_every_process_wrote_its_random_states():
    assert rule("checkpoints/checkpoint_3", accel_files(2), Facts(world_size=2)) == ("accelerate", Rule(positive=True))
    fmt, r = rule("checkpoints/checkpoint_3", accel_files(1), Facts(world_size=2))
    assert r == Rule("random_states_1.pkl (process 1 of 2 writes it last)")
    # nothing of the last step yet: rank 0 is still on its model and optimizer
    assert rule("checkpoints/checkpoint_3", ["model.safetensors"], Facts(world_size=1))[1].waiting.startswith(
        "random_states_0.pkl (Accelerate's save_state writes")
    # a save_state("my_dir") without the automatic naming is told by its random states
    assert detect("my_dir", accel_files(1)) == "accelerate"


def test_accelerate_without_the_world_size_waits_and_says_so():
    r = judge("accelerate", "checkpoint_0", accel_files(2), Facts())
    assert r.soft and not r.positive and "the world size (set sync.world_size)" in r.waiting
    assert "random_states_0..1.pkl are there" in r.waiting
    # a gap in the ranks is no missing fact: something is missing, final sync or not
    gap = [f for f in accel_files(3) if f != "random_states_1.pkl"]
    r = judge("accelerate", "checkpoint_0", gap, Facts())
    assert not r.soft and r.waiting.startswith("random_states_1.pkl (process 1 writes it last")
    # one process known (no worker had WORLD_SIZE): rank 0's file is all there is
    assert judge("accelerate", "checkpoint_0", accel_files(1), Facts(world_size=1)) == Rule(positive=True)
    # ... unless the files say more processes ran than were seen: then the size is not known
    r = judge("accelerate", "checkpoint_0", accel_files(2), Facts(world_size=1))
    assert r.soft and "1 process(es) by its WORLD_SIZE but 2 wrote random states" in r.waiting
    # a name claiming a rank no run has is answered at once
    r = judge("accelerate", "checkpoint_0", ["random_states_0.pkl", "random_states_9999999.pkl"], Facts(world_size=2))
    assert "not judged complete" in r.waiting


def test_accelerate_with_deepspeed_inside_waits_for_its_shards_too():
    ds = ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt", "pytorch_model/mp_rank_00_model_states.pt",
          "latest", "random_states_0.pkl"]
    r = judge("accelerate", "checkpoint_1", ds, Facts(world_size=2, texts={"latest": "pytorch_model"}))
    assert r.waiting.startswith("rank 1 of 2: pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt missing")
    assert detect("checkpoint_1", ds) == "accelerate"


def test_the_world_size_of_a_plain_run_is_one_process():
    """No worker was given a WORLD_SIZE (a plain `python train.py`): one process, known; no process
    read (nothing runs): not known."""
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        assert world_size([plain.pid], single_if_unset=True) == 1
        assert world_size([plain.pid]) is None
        assert world_size([], single_if_unset=True) is None
        assert world_size([999_999_999], single_if_unset=True) is None  # gone: nothing read
    finally:
        plain.kill()
        plain.wait()


# --- NeMo 2 ----------------------------------------------------------------------------------------------

NEMO2 = ["weights/.metadata", "weights/__0_0.distcp", "weights/__1_0.distcp", "weights/common.pt",
         "weights/metadata.json", "context/io.json", "context/model.yaml"]
NAME = "model--val_loss=1.20-step=9-consumed_samples=80.0"


def test_a_nemo2_checkpoint_waits_while_its_unfinished_marker_is_beside_it():
    """ModelCheckpoint._save_checkpoint touches `<name>-unfinished` before the first file and
    removes it after the last (the folder is the .ckpt path without its suffix: ckpt_to_dir)."""
    marker = frozenset({NAME, f"{NAME}-unfinished"})
    fmt, r = rule(f"checkpoints/{NAME}", NEMO2, siblings=marker)
    assert fmt == "nemo2"  # not "dcp": its weights/ are DCP files, the marker is NeMo's
    assert r.waiting == f"the save to end ({NAME}-unfinished is still beside {NAME}/)" and not r.positive
    assert rule(f"checkpoints/{NAME}", NEMO2, siblings=frozenset({NAME})) == ("nemo2", Rule(positive=True))
    # the weights alone, marker there, context/ not begun: still NeMo 2, still waiting
    assert rule(NAME, NEMO2[:3], siblings=marker)[1].waiting.endswith("is still beside " + NAME + "/)")
    # the shards without the coordinator's .metadata: DCP's own rule, marker or not
    assert rule(NAME, NEMO2[1:], siblings=frozenset({NAME}))[1].waiting.startswith("weights/.metadata")
    # -last and -EMA checkpoints share the marker of their name
    assert "still beside" in judge("nemo2", f"{NAME}-EMA", NEMO2, Facts(siblings=marker)).waiting


def test_the_weights_folder_of_a_nemo2_checkpoint_is_judged_by_the_marker_beside_its_checkpoint():
    """With the default include the .distcp shards make weights/ a unit of its own: the marker is
    beside the checkpoint folder, one level up."""
    shards = [".metadata", "__0_0.distcp", "common.pt"]
    unit = f"nemo/checkpoints/{NAME}/weights"
    here = frozenset({"weights", "context"})
    assert rule(unit, shards, siblings=here, above=frozenset({NAME, f"{NAME}-unfinished"}))[1].waiting == \
        f"the save to end ({NAME}-unfinished is still beside {NAME}/)"
    assert rule(unit, shards, siblings=here, above=frozenset({NAME})) == ("nemo2", Rule(positive=True))
    # no context/ yet, but the marker above says what it is
    assert rule(unit, shards, siblings=frozenset({"weights"}), above=frozenset({f"{NAME}-unfinished"}))[0] == "nemo2"
    # a weights/ folder of anything else stays what its files say
    assert rule("run/weights", shards, siblings=frozenset({"weights", "logs"}))[0] == "dcp"


# --- Orbax -----------------------------------------------------------------------------------------------

ORBAX = ["_CHECKPOINT_METADATA", "default/_METADATA", "default/_sharding", "default/manifest.ocdbt",
         "default/ocdbt.process_0/manifest.ocdbt", "default/ocdbt.process_0/d/0a1b2c"]


def test_orbax_is_never_complete_under_its_temporary_name():
    for tmp in ("1000.orbax-checkpoint-tmp", "1000.orbax-checkpoint-tmp-1700000000123456"):
        fmt, r = rule(f"ckpts/{tmp}", ORBAX)
        assert fmt == "orbax" and not r.positive and not r.soft
        assert r.waiting == f"Orbax to rename it to 1000/ (it saves into {tmp} and renames it when done)"
    # an item still under its temporary name inside a step folder
    inner = [*ORBAX, "state.orbax-checkpoint-tmp-17/_METADATA"]
    assert judge("orbax", "1000", inner, Facts()).waiting.startswith("Orbax to finish state.orbax-checkpoint-tmp-17")


def test_orbax_is_complete_by_its_commit():
    committed = json.dumps({"item_handlers": {"default": "PyTreeCheckpointHandler"}, "metrics": {},
                            "init_timestamp_nsecs": 1785865624820660699,
                            "commit_timestamp_nsecs": 1785865785076221554})
    assert rule("ckpts/1000", ORBAX, Facts(texts={"_CHECKPOINT_METADATA": committed})) == ("orbax", Rule(positive=True))
    begun = json.dumps({"init_timestamp_nsecs": 1785865624820660699, "commit_timestamp_nsecs": None})
    r = judge("orbax", "1000", ORBAX, Facts(texts={"_CHECKPOINT_METADATA": begun}))
    assert r.waiting.startswith("commit_success.txt or a commit time in _CHECKPOINT_METADATA")
    # commit_success.txt (object stores: no atomic rename) is written last
    assert judge("orbax", "1000", [*ORBAX, "commit_success.txt"], Facts(texts={"_CHECKPOINT_METADATA": begun})) == \
        Rule(positive=True)
    # unreadable metadata, or none (an older Orbax): nothing proven, nothing missing: the quiet period
    for facts in (Facts(texts={"_CHECKPOINT_METADATA": "{not json"}), Facts()):
        assert judge("orbax", "1000", ORBAX, facts) == Rule()


# --- torchtune -------------------------------------------------------------------------------------------

def test_torchtune_waits_for_every_shard_and_is_complete_when_its_recipe_state_follows():
    """save_checkpoint writes epoch_N/model-{i}-of-{n}.safetensors, then (but after the last epoch)
    recipe_state/recipe_state.pt beside epoch_N/."""
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "model.safetensors.index.json", "config.json"]
    newest = 1000.0
    recipe = "../recipe_state/recipe_state.pt"
    assert rule("epoch_0", shards, Facts(newest=newest, mtimes={recipe: 1001.0})) == ("torchtune", Rule(positive=True))
    assert judge("torchtune", "epoch_0", shards, Facts(newest=newest, mtimes={recipe: 990.0})) == Rule()  # last epoch's
    assert judge("torchtune", "epoch_0", shards, Facts(newest=newest)) == Rule()
    r = judge("torchtune", "epoch_0", [shards[0], "config.json"], Facts(newest=newest, mtimes={recipe: 1001.0}))
    assert r.waiting == "model shard 2 of 2 (model-00002-of-00002.*)" and not r.positive


# --- Composer --------------------------------------------------------------------------------------------

def test_composer_waits_for_every_ranks_file_of_its_batch():
    one = "ep1-ba300-rank0.pt"
    # rank 0 saving for all (the default): whole by its zip end record when the run is one process
    assert rule(one, [one], siblings=frozenset({one, "latest-rank0.pt"})) == ("composer", Rule(positive=True))
    # more ranks running and rank 0's file alone: not proven, not waiting: the quiet period decides
    assert rule(one, [one], Facts(world_size=2), siblings=frozenset({one}))[1] == Rule()
    # once a rank other than 0 shows, every rank's file of the batch is awaited
    beside = frozenset({one, "ep0-ba100-rank0.pt", "ep0-ba100-rank1.pt"})
    assert rule(one, [one], siblings=beside)[1].waiting == \
        "ep1-ba300-rank1.pt (Composer writes one file per rank; rank 1 of 2)"
    assert rule(one, [one], siblings=beside | {"ep1-ba300-rank1.pt"})[1] == Rule(positive=True)
    assert rule(one, [one], Facts(world_size=4), siblings=beside | {"ep1-ba300-rank1.pt"})[1].waiting.startswith(
        "ep1-ba300-rank2.pt")


# --- what every format says when it holds ------------------------------------------------------------------

def test_the_formats_positive_rules():
    assert judge("hf", "checkpoint-5", ["model.safetensors", "trainer_state.json"], Facts()) == Rule(positive=True)
    assert judge("hf", "checkpoint-5", ["model.safetensors"], Facts()) == Rule()  # complete.py's marker rule waits
    assert judge("dcp", "step_7", ["__0_0.distcp", ".metadata"], Facts()).positive
    assert judge("megatron", "iter_0000100", ["mp_rank_00/model_optim_rng.pt"],
                 Facts(texts={"../latest_checkpointed_iteration.txt": "100"})).positive
    ds = ["global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step4/mp_rank_00_model_states.pt"]
    assert judge("deepspeed", "global_step4", ds, Facts(world_size=1)).positive
    assert not judge("deepspeed", "global_step4", ds, Facts()).positive  # ranks counted from the files only
    assert judge("files", "ckpt.pt", ["ckpt.pt"], Facts()).positive     # whole by its header: complete.py
    assert judge("lightning", "epoch=0-step=10.ckpt", ["epoch=0-step=10.ckpt"], Facts()).positive
    assert not judge("files", "logs", ["train.log"], Facts()).positive
    assert not judge("adapter", "lora", ["adapter_config.json", "adapter_model.safetensors"], Facts()).positive
    assert waiting_for("accelerate", "checkpoint_0", accel_files(2), Facts(world_size=2)) == ""


# --- the real Accelerate, through the engine ------------------------------------------------------------------

ACCEL_SAVE = r'''
import os, socket, sys
import torch


class Counter:  # registered for checkpointing: custom_checkpoint_0.pkl, after the random states
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, d):
        self.n = d["n"]


def run(rank, out, saves, limit, procs, port):
    if procs > 1:
        os.environ.update(WORLD_SIZE=str(procs), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(procs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                      project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True,
                                                          total_limit=limit))
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 4)),
                                       batch_size=4, shuffle=True)
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    for _ in range(saves):
        for x, y in data:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step(); sched.step(); opt.zero_grad()
            break
        counter.n += 1
        acc.save_state()
    acc.wait_for_everyone()


if __name__ == "__main__":
    out, saves, limit, procs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if procs == 1:
        run(0, out, saves, limit, 1, 0)
    else:
        import torch.multiprocessing as mp
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        mp.spawn(run, args=(out, saves, limit, procs, port), nprocs=procs, join=True)
'''


def accelerate_run(tmp_path: Path, out: Path, saves: int, limit: int, procs: int) -> None:
    script = tmp_path / "accel_save.py"
    script.write_text(ACCEL_SAVE)
    r = subprocess.run([HF_PYTHON, str(script), str(out), str(saves), str(limit), str(procs)],  # type: ignore[list-item]
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_hf
def test_real_accelerate_saves_of_two_processes_go_up_by_their_rule_not_the_quiet_period(make_engine, tmp_path):
    """Two processes (gloo on the CPU), save_state three times with total_limit=2: checkpoint_1 and
    checkpoint_2 hold each process's random_states and rank 0's custom_checkpoint_0.pkl. With a
    30 s quiet period and the world size known they are on the target with a manifest within
    seconds (every file whole by its format, seen twice, settled for 2 s); a copy without
    random_states_1.pkl waits, naming it, and never gets a manifest."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    accelerate_run(tmp_path, out, saves=3, limit=2, procs=2)
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint_1", "checkpoint_2"]  # total_limit took checkpoint_0
    names = sorted(p.name for p in (ck / "checkpoint_2").iterdir())
    assert names == ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                     "random_states_1.pkl", "scheduler.bin"], names
    assert judge("accelerate", "checkpoints/checkpoint_2", names, Facts(world_size=2)) == Rule(positive=True)
    cut = ck / "checkpoint_7"  # what a save whose process 1 has not finished looks like
    shutil.copytree(ck / "checkpoint_2", cut)
    (cut / "random_states_1.pkl").unlink()
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "30s", "world_size": 2})
    for n in (1, 2):
        wait_until(lambda n=n: (remote / "checkpoints" / f"checkpoint_{n}" / "_MANIFEST.json").exists(), 20,
                   what=f"checkpoint_{n} up well before its 30 s quiet period")
    manifest = json.loads((remote / "checkpoints" / "checkpoint_2" / "_MANIFEST.json").read_text())
    assert {f["path"] for f in manifest["files"]} >= {"random_states_0.pkl", "random_states_1.pkl",
                                                     "custom_checkpoint_0.pkl"}
    want = "random_states_1.pkl (process 1 of 2 writes it last)"
    wait_until(lambda: any(x["unit"] == "checkpoints/checkpoint_7" and x["waiting_for"] == want
                           and x["format"] == "accelerate" for x in e.status()["waiting"]), 20,
               what="checkpoint_7 waiting for process 1")
    assert not (remote / "checkpoints" / "checkpoint_7" / "_MANIFEST.json").exists()


@needs_hf
def test_real_accelerate_with_the_world_size_unknown_waits_until_the_final_sync(make_engine, tmp_path):
    """One process, but the engine was not told the world size (no training under the daemon, no
    sync.world_size): its saves wait, saying how to fix it; a final sync (the writers gone) takes
    them as they are, each with its manifest."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    accelerate_run(tmp_path, out, saves=2, limit=3, procs=1)
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s"})
    wait_until(lambda: {x["unit"] for x in e.status()["waiting"]
                        if "the world size (set sync.world_size)" in x["waiting_for"]}
               == {"checkpoints/checkpoint_0", "checkpoints/checkpoint_1"}, 20, what="both waiting for the world size")
    assert not (remote / "checkpoints" / "checkpoint_0" / "_MANIFEST.json").exists()
    r = e.final_sync([str(out)], 60)
    assert r.ok, r
    for n in (0, 1):
        assert (remote / "checkpoints" / f"checkpoint_{n}" / "_MANIFEST.json").exists()


# --- NeMo 2 through the engine ---------------------------------------------------------------------------------

def nemo2_save(folder: Path) -> None:
    (folder / "weights").mkdir(parents=True)
    (folder / "weights" / "__0_0.distcp").write_bytes(b"\1" * 700)
    (folder / "weights" / "__1_0.distcp").write_bytes(b"\2" * 700)
    (folder / "weights" / "common.pt").write_bytes(torch_zip_bytes(500, 4))
    (folder / "weights" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (folder / "weights" / ".metadata").write_bytes(b"\x80\x04never unpickled")
    (folder / "context").mkdir()
    (folder / "context" / "io.json").write_text('{"root": {}}')
    (folder / "context" / "model.yaml").write_text("name: gpt\n")


@pytest.mark.parametrize("include", [None, ["checkpoints/*/**"]])
def test_a_nemo2_checkpoint_is_not_complete_while_its_marker_is_there(make_engine, tmp_path, include):
    """The hidden check of the last round: `<name>/` (weights/ with DCP files and .metadata,
    context/) with `<name>-unfinished` beside it was judged complete as `dcp`. With the default
    include (weights/ is a unit by its .distcp shards) and with the folder a unit, it waits as
    `nemo2` until the marker is gone, then goes up with its manifest."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    ckpts = out / "checkpoints"
    nemo2_save(ckpts / NAME)
    (ckpts / f"{NAME}-unfinished").touch()
    sync = {"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s"}
    if include:
        sync["include"] = include
    e = make_engine(sync)

    def ours() -> list[dict]:
        return [u for u in e.status()["units"] if u["unit"].startswith(f"checkpoints/{NAME}")]
    wait_until(lambda: ours() and all(u["format"] == "nemo2" and not u["complete"] and "-unfinished" in u["waiting_for"]
                                      for u in ours()), 20, what="the NeMo 2 units waiting for the marker")
    e.request_sync()
    assert e.wait_idle(10).ok
    assert not list(remote.rglob("_MANIFEST.json")), "a NeMo 2 save in progress was marked complete"
    (ckpts / f"{NAME}-unfinished").unlink()
    e.request_sync()
    wait_until(lambda: ours() and all(u["complete"] for u in ours()), 20, what="complete once the marker is gone")
    unit = f"checkpoints/{NAME}"  # the whole checkpoint, context/ and all, with the default include too
    wait_until(lambda: (remote / unit / "_MANIFEST.json").exists(), 20, what=f"{unit} up with its manifest")
    assert (remote / "checkpoints" / NAME / "weights" / ".metadata").exists()
    assert (remote / unit / "context" / "model.yaml").read_text() == "name: gpt\n"
    assert not (remote / unit / "weights" / "_MANIFEST.json").exists()
    listed = {f["path"] for f in json.loads((remote / unit / "_MANIFEST.json").read_bytes())["files"]}
    assert {"context/io.json", "context/model.yaml", "weights/.metadata", "weights/__0_0.distcp"} <= listed


def test_a_single_checkpoint_file_is_whole_by_its_header_and_goes_up_before_the_quiet_period(make_engine, tmp_path):
    """A safetensors file and a torch zip, 30 s quiet period: up within seconds (settle, two looks)."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    out.mkdir()
    (out / "model.safetensors").write_bytes(safetensors_bytes({"w": 4096}, 1))
    (out / "ckpt.pt").write_bytes(torch_zip_bytes(4096, 2))
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "30s", "include": ["*.pt",
                                                                                                     "*.safetensors"]})
    for n in ("model.safetensors", "ckpt.pt"):
        wait_until(lambda n=n: (remote / n).exists(), 15, what=f"{n} up before the quiet period")
    assert e.status()["waiting"] == []
