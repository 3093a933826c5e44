"""Every trainer's checkpoint judged by the trainer's own rule (issue 38). The rules first (pure,
with the layouts DeepSpeed, torch.distributed.checkpoint, Megatron, NeMo and Lightning write,
taken from their source), then through the real sync engine: a DeepSpeed ZeRO checkpoint written
by worker processes carrying torchrun's environment (WORLD_SIZE read from /proc), a crafted pickle
that would run code if anything unpickled it, and the static check that nothing in supervisor/ can."""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from supervisor.saves.formats import Facts, detect, judge, waiting_for
from supervisor.training.ranks import world_size
from tests.fixtures.hf_writer import HFWriter, torch_zip_bytes
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def ds_files(step: int, ranks: int, bf16: bool = False, zero3: bool = False) -> list[str]:
    """DeepSpeed's engine.save_checkpoint layout inside the HF Trainer's checkpoint-N/."""
    tag = f"global_step{step}"
    pre = "bf16_" if bf16 else ""
    out = [f"{tag}/{pre}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)]
    out += ([f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ranks)] if zero3
            else [f"{tag}/mp_rank_00_model_states.pt"])
    return out + ["latest", "zero_to_fp32.py", "trainer_state.json", "config.json"]


# --- the rules --------------------------------------------------------------------------------------

def test_formats_are_told_from_the_files():
    assert detect("checkpoint-400", ds_files(400, 4)) == "deepspeed"
    assert detect("checkpoint-400", ["pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                                     "trainer_state.json"]) == "dcp"
    assert detect("step_100", ["__0_0.distcp", "__1_0.distcp"]) == "dcp"
    assert detect("iter_0000100", ["mp_rank_00/model_optim_rng.pt"]) == "megatron"
    assert detect("megatron_gpt--step=100.ckpt", ["model_weights/common.pt"]) == "nemo"
    assert detect("epoch=1-step=100.ckpt", ["epoch=1-step=100.ckpt"]) == "lightning"
    assert detect("checkpoint-5", ["adapter_config.json", "adapter_model.safetensors"]) == "adapter"
    assert detect("checkpoint-5", ["model.safetensors", "trainer_state.json"]) == "hf"
    assert detect("results.json", ["results.json"]) == "files"


def test_deepspeed_waits_for_every_ranks_shard_whatever_latest_says():
    files = ds_files(400, 4)
    facts = Facts(world_size=4, texts={"latest": "global_step400\n"})
    assert waiting_for("deepspeed", "checkpoint-400", files, facts) == ""
    # rank 0 writes `latest` before the last barrier: rank 3's shard may not be there yet
    short = [f for f in files if "zero_pp_rank_3_" not in f]
    assert waiting_for("deepspeed", "checkpoint-400", short, facts) == \
        "rank 3 of 4: global_step400/zero_pp_rank_3_mp_rank_00_optim_states.pt missing"
    # without the world size, a missing top rank cannot be seen; a gap still can
    gap = [f for f in files if "zero_pp_rank_1_" not in f]
    assert "rank 1 of 4" in waiting_for("deepspeed", "checkpoint-400", gap, Facts(texts={"latest": "global_step400"}))
    assert "world size not known" in waiting_for("deepspeed", "checkpoint-400", gap, Facts())
    # 3 ranks it looks like, and rank 3 may still be writing: not complete while the world is not known
    # (issue 53: a first look before the workers existed judged a ZeRO-3 save complete by quiet alone)
    r = judge("deepspeed", "checkpoint-400", short, Facts())
    assert r.waiting.startswith("the world size") and r.soft and not r.positive
    bf16 = ds_files(400, 2, bf16=True, zero3=True)
    assert waiting_for("deepspeed", "checkpoint-400", bf16, Facts(world_size=2, texts={"latest": "global_step400"})) == ""
    assert waiting_for("deepspeed", "x", bf16, Facts(world_size=3, texts={"latest": "global_step400"})) == \
        "rank 2 of 3: global_step400/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt missing"
    # `latest` names a tag whose folder is not there yet
    assert "global_step500/ (named by `latest`)" in waiting_for(
        "deepspeed", "checkpoint-400", files, Facts(world_size=4, texts={"latest": "global_step500"}))
    assert "mp_rank_00_model_states.pt" in waiting_for(
        "deepspeed", "ck", [f for f in files if "model_states" not in f], Facts(world_size=4))


def test_two_model_parallel_ranks_count_in_the_world():
    files = [f"global_step10/zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" for dp in range(2) for mp in range(2)]
    files += ["global_step10/mp_rank_00_model_states.pt", "global_step10/mp_rank_01_model_states.pt"]
    assert waiting_for("deepspeed", "global_step10", files, Facts(world_size=4)) == ""
    assert waiting_for("deepspeed", "global_step10", files, Facts(world_size=6)) == \
        "rank 4 of 6: global_step10/zero_pp_rank_2_mp_rank_00_optim_states.pt missing"  # dp 2, mp 0: rank 2 x 2 + 0


def test_dcp_waits_for_the_coordinators_metadata():
    shards = ["pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp", "trainer_state.json"]
    assert waiting_for("dcp", "checkpoint-7", shards, Facts()).startswith("pytorch_model_fsdp_0/.metadata")
    assert waiting_for("dcp", "checkpoint-7", [*shards, "pytorch_model_fsdp_0/.metadata"], Facts()) == ""
    assert waiting_for("dcp", "step_7", ["__0_0.distcp"], Facts()).startswith(".metadata (")


def test_megatron_waits_for_its_tracker_to_name_the_iteration():
    files = ["mp_rank_00/model_optim_rng.pt"]
    t = "../latest_checkpointed_iteration.txt"
    assert waiting_for("megatron", "iter_0000200", files, Facts(texts={t: "200\n"})) == ""
    assert waiting_for("megatron", "iter_0000200", files, Facts(texts={t: "300"})) == ""
    assert waiting_for("megatron", "iter_0000200", files, Facts(texts={t: "release"})) == ""
    assert "(it names 100)" in waiting_for("megatron", "iter_0000200", files, Facts(texts={t: "100"}))
    assert "beside it to name iteration 200" in waiting_for("megatron", "iter_0000200", files, Facts())
    assert "it holds 'garbage'" in waiting_for("megatron", "iter_0000200", files, Facts(texts={t: "garbage"}))


def test_nemo_waits_while_its_unfinished_marker_is_there():
    name = "megatron_gpt--val_loss=1.20-step=100.ckpt"
    marker = "megatron_gpt--val_loss=1.20-step=100-unfinished"
    files = ["model_weights/common.pt", "model_weights/__0_0.distcp", "model_weights/.metadata"]
    assert "-unfinished is still beside it" in waiting_for("nemo", name, files, Facts(siblings=frozenset({name, marker})))
    assert waiting_for("nemo", name, files, Facts(siblings=frozenset({name}))) == ""
    assert detect(name, [name], {marker}) == "nemo"  # a single-file .ckpt with NeMo's marker beside it


def test_the_world_size_is_read_from_the_workers_environment():
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**env, "WORLD_SIZE": "4", "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        wait_until(lambda: world_size([p.pid for p in procs]) == 4, 10, what="WORLD_SIZE read")
        assert world_size([plain.pid]) is None and world_size([999_999_999]) is None
    finally:
        for p in [*procs, plain]:
            p.kill()
            p.wait()


# --- through the engine ------------------------------------------------------------------------------

def write_ds_rank(ck: Path, step: int, rank: int) -> None:
    tag = ck / f"global_step{step}"
    tag.mkdir(parents=True, exist_ok=True)
    (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(torch_zip_bytes(40_000, rank))
    if rank == 0:
        (tag / "mp_rank_00_model_states.pt").write_bytes(torch_zip_bytes(60_000, 99))
        (ck / "latest").write_text(f"global_step{step}")


def test_a_deepspeed_checkpoint_waits_for_its_last_rank_then_goes_up(make_engine, tmp_path):
    out, remote = tmp_path / "out", tmp_path / "remote"
    w = HFWriter(out)
    w.checkpoint(400)  # the Trainer's files and trainer_state.json (it writes them on rank 0)
    ck = out / "checkpoint-400"
    for r in range(3):
        write_ds_rank(ck, 400, r)
    os.utime(ck, None)
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s", "world_size": 4})
    want = "rank 3 of 4: global_step400/zero_pp_rank_3_mp_rank_00_optim_states.pt missing"
    wait_until(lambda: any(x.get("waiting_for") == want for x in e.status()["waiting"]), 20,
               what=f"the unit waiting for rank 3; got {e.status()['waiting']}")
    assert not (remote / "checkpoint-400" / "_MANIFEST.json").exists()
    entry = next(x for x in e.status()["waiting"] if x["unit"] == "checkpoint-400")
    assert entry["format"] == "deepspeed"
    write_ds_rank(ck, 400, 3)
    e.request_sync()
    wait_until(lambda: (remote / "checkpoint-400" / "_MANIFEST.json").exists(), 20, what="the manifest")
    assert (remote / "checkpoint-400" / "global_step400" / "zero_pp_rank_3_mp_rank_00_optim_states.pt").exists()


class Boom:
    """Unpickling this runs a command that leaves a file behind."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_crafted_pickle_is_never_run(make_engine, tmp_path):
    """A DCP .metadata (a pickle by format), a legacy torch .pt (a bare pickle) and a torch zip
    whose data.pkl is the payload: the daemon judges, uploads and verifies them without ever
    unpickling one (it runs as root; the files are the training user's)."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    flag = tmp_path / "PWNED"
    payload = pickle.dumps(Boom(flag))
    step = out / "step_100"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"\0" * 1000)
    (step / ".metadata").write_bytes(payload)
    ck = out / "checkpoint-5"
    ck.mkdir()
    (ck / "optimizer.pt").write_bytes(payload)          # a legacy (pre-zip) torch.save: a bare pickle
    with zipfile.ZipFile(ck / "rng_state.pth", "w", zipfile.ZIP_STORED) as z:  # torch.save's zip: data.pkl inside
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")
    (ck / "trainer_state.json").write_text('{"global_step": 5}')
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s",
                     "include": ["checkpoint-*/**", "step_*/**"]})
    assert e.wait_idle(30).ok
    assert (remote / "step_100" / ".metadata").read_bytes() == payload
    assert (remote / "checkpoint-5" / "_MANIFEST.json").exists()
    r = e.final_sync([str(out)], 30)
    assert r.ok, r
    assert not flag.exists(), "something unpickled a file the training wrote"


def test_nothing_in_the_daemon_can_unpickle():
    """Static: no module of supervisor/ imports pickle, dill, joblib or torch, nor calls a loader
    that unpickles (torch.load, numpy.load with allow_pickle, pandas.read_pickle)."""
    banned_modules = {"pickle", "_pickle", "cPickle", "dill", "joblib", "torch", "shelve", "cloudpickle"}
    banned_calls = {"load", "loads", "read_pickle", "Unpickler"}
    found = []
    for path in sorted((REPO / "supervisor").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in banned_modules]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in banned_modules:
                found.append(f"{path.name}: from {node.module} import ...")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in banned_calls:
                owner = node.func.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name in ("np", "numpy", "torch", "pickle", "pd", "pandas", "joblib", "dill"):
                    found.append(f"{path.name}:{node.lineno}: {name}.{node.func.attr}(...)")
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                found.append(f"{path.name}:{node.value.lineno}: allow_pickle=")
    assert not found, found


@pytest.mark.skipif(not os.environ.get("TSUP_HF_PYTHON"), reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf with torch)")
def test_a_real_dcp_save_with_two_ranks_is_judged_by_its_metadata(make_engine, tmp_path):
    """torch.distributed.checkpoint with gloo, world size 2 (real torch on CPU): complete once its
    .metadata is there; the same shards without it wait for it and are never marked complete."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    script = tmp_path / "dcp_save.py"
    script.write_text(DCP_SAVE)
    r = subprocess.run([os.environ["TSUP_HF_PYTHON"], str(script), str(out / "step_10")], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in (out / "step_10").iterdir())
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == 2, names
    # a copy without the coordinator's file: what a save cut short leaves
    cut = out / "step_20"
    cut.mkdir()
    for n in names:
        if n != ".metadata":
            (cut / n).write_bytes((out / "step_10" / n).read_bytes())
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s", "include": ["step_*/**"]})
    wait_until(lambda: (remote / "step_10" / "_MANIFEST.json").exists(), 30, what="step_10 complete")
    wait_until(lambda: any(x["unit"] == "step_20" and x["format"] == "dcp" and x["waiting_for"].startswith(".metadata")
                           for x in e.status()["waiting"]), 20, what=f"step_20 waiting; got {e.status()['waiting']}")
    assert not (remote / "step_20" / "_MANIFEST.json").exists()


DCP_SAVE = r"""
import os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

def worker(rank, path, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    state = {"model": {f"layer{rank}.weight": torch.randn(64, 64)}, "step": torch.tensor(10)}
    dcp.save(state, checkpoint_id=path)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(sys.argv[1], port), nprocs=2, join=True)
"""


def test_a_unit_waiting_far_longer_than_its_siblings_took_is_alerted(make_engine, tmp_path):
    """Rank 3 died mid-save: checkpoint-400 will never be complete. Its siblings took seconds to
    save; after far longer (10 times that, at least 5 minutes) one alert names what is missing."""
    import time

    from supervisor.clock import FakeClock
    from supervisor.sync.scan import STUCK_MIN_S, stuck_after
    from tests.fixtures.sync_engine import ListMailer

    assert stuck_after([], 0.2) == STUCK_MIN_S and stuck_after([120.0], 0.2) == 1200.0
    out, remote = tmp_path / "out", tmp_path / "remote"
    w = HFWriter(out)
    w.checkpoint(300)
    for r in range(4):
        write_ds_rank(out / "checkpoint-300", 300, r)
    w.checkpoint(400)
    for r in range(3):
        write_ds_rank(out / "checkpoint-400", 400, r)
    clock, mails = FakeClock(start=time.time()), ListMailer()
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s", "world_size": 4},
                    clock=clock, mailer=mails)

    def settle() -> bool:  # the fake clock moves on only when told: let the quiet period pass
        clock.advance(1)
        e.request_sync()
        return (remote / "checkpoint-300" / "_MANIFEST.json").exists()
    wait_until(settle, 20, interval=0.2, what="checkpoint-300 up")
    assert not [a for a in e.alerts.active() if a["kind"] == "checkpoint_stuck"]
    clock.advance(STUCK_MIN_S + 60)
    e.request_sync()
    wait_until(lambda: [a for a in e.alerts.active() if a["kind"] == "checkpoint_stuck"], 20, what="the stuck alert")
    e.alerts.tick()
    wait_until(lambda: mails.subjects(), 10, what="the stuck mail")
    subject, body = mails.sent[0]
    assert "checkpoint STUCK: checkpoint-400 waits for rank 3 of 4" in subject, subject
    assert "zero_pp_rank_3_mp_rank_00_optim_states.pt missing" in body and "(deepspeed)" in body
    write_ds_rank(out / "checkpoint-400", 400, 3)  # it was only slow after all
    clock.advance(STUCK_MIN_S)  # its new file is in the fake clock's past: quiet at once

    def up() -> bool:
        clock.advance(1)
        e.request_sync()
        return (remote / "checkpoint-400" / "_MANIFEST.json").exists()
    wait_until(up, 20, interval=0.2, what="checkpoint-400 up")
    wait_until(lambda: not [a for a in e.alerts.active() if a["kind"] == "checkpoint_stuck"], 20, what="resolved")


def test_the_other_trainers_saves_are_found_and_judged_with_the_default_include(make_engine, tmp_path):
    """No include configured: Megatron's iter_NNNNNNN/ waits for its tracker, a raw DCP folder for
    its .metadata, NeMo's .ckpt while its -unfinished marker is beside it; a Lightning .ckpt file
    goes up whole."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    it = out / "megatron" / "iter_0000100" / "mp_rank_00"
    it.mkdir(parents=True)
    (it / "model_optim_rng.pt").write_bytes(torch_zip_bytes(3000, 1))
    (out / "megatron" / "latest_checkpointed_iteration.txt").write_text("50")
    dcp = out / "fsdp" / "step_7"
    dcp.mkdir(parents=True)
    (dcp / "__0_0.distcp").write_bytes(b"\1" * 500)
    (dcp / "__1_0.distcp").write_bytes(b"\2" * 500)
    nemo = out / "nemo" / "checkpoints"
    (nemo / "gpt--step=9.ckpt" / "weights").mkdir(parents=True)
    (nemo / "gpt--step=9.ckpt" / "weights" / "common.pt").write_bytes(torch_zip_bytes(1000, 2))
    (nemo / "gpt--step=9-unfinished").write_text("")
    lt = out / "lightning_logs" / "version_0" / "checkpoints"
    lt.mkdir(parents=True)
    (lt / "epoch=0-step=10.ckpt").write_bytes(torch_zip_bytes(2000, 3))
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s"})

    def waits() -> dict[str, str]:
        return {x["unit"]: x["format"] for x in e.status()["waiting"]}
    want = {"megatron/iter_0000100": "megatron", "fsdp/step_7": "dcp", "nemo/checkpoints/gpt--step=9.ckpt": "nemo"}
    wait_until(lambda: waits() == want, 20, what=f"three units waiting by their rules; got {e.status()['waiting']}")
    wait_until(lambda: (remote / "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt").exists(), 20,
               what="the Lightning checkpoint up")
    (out / "megatron" / "latest_checkpointed_iteration.txt").write_text("100")
    (dcp / ".metadata").write_bytes(b"\x80\x04crafted, never read")
    (nemo / "gpt--step=9-unfinished").unlink()
    e.request_sync()
    for unit in want:
        wait_until(lambda unit=unit: (remote / unit / "_MANIFEST.json").exists(), 20, what=f"{unit} complete")
    assert (remote / "fsdp" / "step_7" / ".metadata").exists()
    assert (remote / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "100"
    # every unit names its format in status, not only the waiting ones
    wait_until(lambda: {u["unit"]: (u["format"], u["complete"]) for u in e.status()["units"]}.items() >= {
        "megatron/iter_0000100": ("megatron", True), "fsdp/step_7": ("dcp", True),
        "nemo/checkpoints/gpt--step=9.ckpt": ("nemo", True)}.items(), 20, what=f"units: {e.status()['units']}")
