"""Training output no include selects (issue 50): found by what it is in every trainer's layout,
counted, named (20 at most), never what the user excluded or what is not output; the stop waits
only for a checkpoint nothing of which is selected and that is newer than everything selected.
The walk's part (the folders it does not enter) on real folders; the words on every surface."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.config.schema import SyncConfig
from supervisor.saves import unselected as un
from supervisor.sync import scan as sc
from supervisor.sync import unreached
from supervisor.sync.policy import Policy

ROOT = "/w/out"
MB = 1024 * 1024
DEFAULT = SyncConfig().include
HF_ONLY = ["checkpoint-*/**"]


def look(files: dict[str, int | tuple[int, float]], include: list[str], exclude: list[str] = (),
         root: str = ROOT, downloaded=lambda d: False) -> un.Report:
    """The report for `files` (rel -> size, or (size, mtime)) under one root, grouped into units by
    the real policy as the scan does."""
    policy = Policy(list(include), list(exclude))
    sizes = {rel: (v if isinstance(v, tuple) else (v, 100.0)) for rel, v in files.items()}
    raw = {rel: (size, int(mtime * 1e9)) for rel, (size, mtime) in sizes.items()}
    units = sc.group(sc.Root(root, ""), raw, {}, policy).values()
    selected = [s.path for u in units for s in u.selected]
    mtimes = [s.mtime_ns / 1e9 for u in units for s in u.selected]
    seen = [un.Seen(root, rel, size, mtime) for rel, (size, mtime) in sizes.items()]
    return un.find(seen, selected, [u.abspath for u in units if u.kind == "dir"], policy.allowed,
                   max(mtimes) if mtimes else None, downloaded=downloaded)


# --- every trainer's layout ---------------------------------------------------------------------

def test_the_default_include_leaves_nothing_of_the_known_layouts_unselected():
    files = {"checkpoint-5/model.safetensors": 10, "checkpoint-5/trainer_state.json": 1,
             "checkpoints/checkpoint_3/model.safetensors": 10, "checkpoints/checkpoint_3/random_states_0.pkl": 1,
             "ckpt.pt": 10, "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt": 10,
             "global_step100/mp_rank_00_model_states.pt": 10, "iter_0000100/mp_rank_00/model_optim_rng.pt": 10,
             "epoch_0/model-00001-of-00001.safetensors": 10, "dcp/__0_0.distcp": 10,
             "model.safetensors": 10, "config.json": 1, "train.log": 5 * MB, "runs/events.out.tfevents.1.box": 1}
    r = look(files, DEFAULT)
    assert not r and r.names == () and r.files == 0 and not r.hold


@pytest.mark.parametrize("files, name, count", [
    # Accelerate's save_state, before this round's default selected it
    ({"checkpoints/checkpoint_3/model.safetensors": 30, "checkpoints/checkpoint_3/optimizer.bin": 60,
      "checkpoints/checkpoint_3/random_states_0.pkl": 1}, "checkpoints/checkpoint_3", 3),
    # nanoGPT: one torch.save file
    ({"out/ckpt.pt": 48 * MB}, "out/ckpt.pt", 1),
    # a 2 GB model.bin, and a Lightning .ckpt
    ({"model.bin": 2048 * MB}, "model.bin", 1),
    ({"lightning_logs/version_0/checkpoints/epoch=1-step=20.ckpt": 5}, "lightning_logs/version_0/checkpoints/"
                                                                       "epoch=1-step=20.ckpt", 1),
    # Orbax: <step>/ with _CHECKPOINT_METADATA, its items in folders
    ({"ckpts/300/_CHECKPOINT_METADATA": 1, "ckpts/300/default/ocdbt.process_0/d/abc": 9,
      "ckpts/300/default/_METADATA": 1}, "ckpts/300", 3),
    # torchtune's epoch_N/, DeepSpeed's global_stepN/, Megatron's iter_NNNNNNN/
    ({"epoch_0/model-00001-of-00002.safetensors": 9, "epoch_0/model-00002-of-00002.safetensors": 9},
     "epoch_0", 2),
    ({"global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt": 9}, "global_step100", 1),
    ({"iter_0000100/mp_rank_00/model_optim_rng.pt": 9}, "iter_0000100", 1),
    # NeMo 2: <name>/weights/ (DCP shards) and <name>/context/; the outermost folder is named
    ({"nemo/model--step=9-last/weights/__0_0.distcp": 9, "nemo/model--step=9-last/weights/.metadata": 1,
      "nemo/model--step=9-last/context/io.json": 1}, "nemo/model--step=9-last", 3),
    # a plain torch.distributed.checkpoint folder
    ({"fsdp/__0_0.distcp": 9, "fsdp/__1_0.distcp": 9, "fsdp/.metadata": 1}, "fsdp", 3),
    # a Lightning DeepSpeed .ckpt folder, checkpoint-N under a narrow include
    ({"last.ckpt/checkpoint/mp_rank_00_model_states.pt": 9}, "last.ckpt", 1),
    ({"run/checkpoint-40/adapter_model.safetensors": 9}, "run/checkpoint-40", 1),
])
def test_each_layout_missed_by_the_include_is_named_counted_and_holds_a_stop(files, name, count):
    r = look(files, ["./nothing-*/**"])
    assert r.names == (f"{ROOT}/{name}",) and r.files == count and r.items == 1
    assert r.bytes == sum(files.values())
    assert r.hold  # nothing is selected at all: any checkpoint here is the only copy


def test_a_large_file_of_any_kind_is_named_but_holds_nothing_and_data_logs_and_libraries_are_not():
    files = {"final_params.npz": 100 * MB, "small.npz": 1 * MB, "train.log": 900 * MB,
             "data/openwebtext/train.bin": 17_000 * MB, "data/openwebtext/val.bin": 8 * MB,
             "data/wiki_text_document.bin": 900 * MB, "data/wiki_text_document.idx": 90 * MB,
             "shards/shard-000.tar": 500 * MB, "wandb/run-1/run-1.wandb": 200 * MB,
             "runs/events.out.tfevents.17.box": 100 * MB, "lib/libtorch_cuda.so": 900 * MB}
    r = look(files, HF_ONLY)
    assert r.names == (f"{ROOT}/final_params.npz",) and r.bytes == 100 * MB
    assert not r.hold  # not a checkpoint format: named, never a reason to keep a machine billing


def test_what_the_user_excluded_the_caches_virtualenvs_and_temp_files_are_not_named():
    files = {"checkpoint-5/model.safetensors": 9, "checkpoint-5/optimizer.pt": 9, "out/optimizer.pt": 9,
             ".cache/huggingface/hub/models--x/blobs/abc": 900 * MB,
             "models--gpt2/snapshots/1/model.safetensors": 9,
             ".venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so": 900 * MB,
             ".venv/lib/python3.11/site-packages/distutils-precedence.pth": 1,
             "env1/pyvenv.cfg": 1, "env1/lib/python3.11/site-packages/_virtualenv.pth": 1,
             "node_modules/x/model.onnx": 9,
             "out/ckpt.pt.tmp": 9, "tmp-checkpoint-7/model.safetensors": 9,
             "old/checkpoint-1/model.safetensors": 9}
    r = look(files, HF_ONLY, exclude=["**/optimizer.pt", "old/**"])
    assert not r, r.names


def test_a_model_downloaded_into_a_watched_folder_is_not_training_output():
    files = {"models/llama/model-00001-of-00002.safetensors": 5000 * MB, "out/ckpt.pt": 9}
    r = look(files, ["./nothing/**"], downloaded=lambda d: d == f"{ROOT}/models/llama")
    assert r.names == (f"{ROOT}/out/ckpt.pt",)


def test_a_checkpoint_partly_selected_is_named_but_holds_nothing_an_older_one_neither():
    # include only the weights: the optimizer state of each checkpoint stays here (named)
    files = {"checkpoints/checkpoint_3/model.safetensors": (9, 300.0),
             "checkpoints/checkpoint_3/optimizer.bin": (9, 301.0)}
    r = look(files, ["**/*.safetensors"])
    assert r.names == (f"{ROOT}/checkpoints/checkpoint_3",) and r.files == 1 and not r.hold
    # an unselected checkpoint older than the newest selected file: a previous experiment
    files = {"checkpoint-9/model.safetensors": (9, 500.0), "old/ckpt.pt": (9, 100.0)}
    r = look(files, HF_ONLY)
    assert r.names == (f"{ROOT}/old/ckpt.pt",) and not r.hold
    # the same file written after the newest selected one holds the stop
    files = {"checkpoint-9/model.safetensors": (9, 500.0), "out/ckpt.pt": (9, 600.0)}
    assert look(files, HF_ONLY).hold


def test_names_are_capped_at_20_newest_first_and_every_file_counted():
    files = {f"saves/step{i:03d}.pt": (10, 1000.0 + i) for i in range(30)}
    files["saves/note.txt"] = 5
    r = look(files, HF_ONLY)
    assert r.items == 30 and r.files == 30 and r.bytes == 300 and len(r.names) == un.NAMES_MAX
    assert r.names[0] == f"{ROOT}/saves/step029.pt" and r.names[-1] == f"{ROOT}/saves/step010.pt"


def test_files_in_a_selected_unit_folder_are_covered_even_when_a_glob_leaves_them_out():
    # a unit folder goes up whole; a file the unit holds is never named on its own
    files = {"lora/adapter_config.json": 1, "lora/adapter_model.safetensors": 9, "lora/extra_state.pt": 9}
    assert not look(files, DEFAULT)


def test_the_words_are_one_sentence_everywhere():
    from supervisor.notify.mails.sync import Unselected, unselected_line

    line = unselected_line(3, 48 * MB, ["/w/out/ckpt.pt", "/w/out/b.pt", "/w/out/c.pt", "/w/out/d.pt"], 4)
    assert line == ("3 files, 48.0 MiB in the watched folders are NOT selected: /w/out/ckpt.pt, /w/out/b.pt, "
                    "/w/out/c.pt and 1 more (add a sync.include glob; see docs/sync.md)")
    assert unselected_line(1, 10, ["/w/a.pt"]).startswith("1 file, 10 B in the watched folders is NOT selected")
    u = Unselected.of({"unselected": ["/w/out/ckpt.pt"], "unselected_files": 1, "unselected_bytes": 9,
                       "unselected_newer": True})
    assert u and u.hold and "  /w/out/ckpt.pt\n" in u.block() and "a stop waits for it" in u.block()
    assert not Unselected.of({}) and Unselected.of({}).block() == ""


# --- the folders the walk does not enter, on real folders ----------------------------------------

def test_a_folder_no_include_reaches_is_listed_bounded_and_cached(tmp_path: Path):
    root = tmp_path / "w"
    (root / "out").mkdir(parents=True)
    (root / "out" / "ckpt.pt").write_bytes(b"x" * 10)
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "big.pt").write_bytes(b"x")
    (root / "skip").mkdir()
    (root / "skip" / "a.pt").write_bytes(b"x")
    os.symlink(root / "out", root / "link")
    policy = Policy(["./checkpoint-*/**"], ["skip/**"])
    from supervisor.store._log import Once, get_logger
    from supervisor.sync.walk import Walker

    w = Walker(policy, SyncConfig(), Once(get_logger("test")))
    units = w.scan([sc.Root(str(root), "")], [], 1e9, 0.0, lambda p: [])
    assert (str(root), "out") in w.unreached and (str(root), "skip") in w.unreached
    files, complete = unreached.list_under(w.unreached, policy)
    assert complete and [(f.rel, f.size) for f in files] == [("out/ckpt.pt", 10)]
    r = unreached.report(w.seen, files, complete, units.values(), policy)
    assert r.names == (str(root / "out" / "ckpt.pt"),) and r.hold
    # the cap: a listing that stops says so, and the counts are a lower bound
    assert unreached.list_under(w.unreached, policy, cap=0) == ([], False)
    outside = unreached.Outside()
    assert outside.files(w.unreached, policy, 0.0)[0] == files
    (root / "out" / "ckpt2.pt").write_bytes(b"x")
    assert outside.files(w.unreached, policy, 1.0)[0] == files  # listed again at most every REFRESH_S ...
    assert len(outside.files(w.unreached, policy, 1.0, force=True)[0]) == 2  # ... except for a final sync
    assert len(outside.files(w.unreached, policy, unreached.REFRESH_S + 2)[0]) == 2


# --- the mails ----------------------------------------------------------------------------------

def _run_end():
    from supervisor.notify.mails import training as run_words

    return run_words.RunEnd(True, 3, 0, None, "python train.py", 0.0, 60.0, "/w/train.log", "/w")


def test_the_finish_mail_never_says_verified_of_a_run_nothing_of_which_was_selected():
    from supervisor.notify.mails import training as run_words

    nothing = run_words.Outputs(True, 0, 0, "s3://b/run", paths=("/w/out",), unselected=("/w/out/ckpt.pt",),
                                unselected_files=1, unselected_bytes=48 * MB, unselected_hold=True)
    mail = run_words.ended(run_words.Ended(_run_end(), None, nothing, run_words.Next("stop", 1000.0, 60.0)))
    assert "verified" not in mail.subject + mail.body, mail.body
    assert mail.subject == "training finished (exit code 0); 1 file NOT selected for sync"
    assert "NOTHING of this run's output is on s3://b/run" in mail.body and "  /w/out/ckpt.pt\n" in mail.body
    assert "WAITS while the output NOT SELECTED above" in mail.body
    # some selected and verified, some not: both said, the count of each
    some = run_words.Outputs(True, 12, 1 << 20, "s3://b/run", paths=("/w/out",), unselected=("/w/out/x.npz",),
                             unselected_files=1, unselected_bytes=100 * MB)
    mail = run_words.ended(run_words.Ended(_run_end(), None, some, run_words.Next("stop", 1000.0, 60.0)))
    assert ("Outputs: final sync: 12 files (1.0 MiB) verified at s3://b/run; NOT SELECTED (stay on this "
            "machine): 1 file, 100.0 MiB") in mail.body
    assert "WAITS" not in mail.body and "after a verified final sync" in mail.body
    # nothing unselected: the words of before, the count said right
    one = run_words.Outputs(True, 1, 10, "s3://b/run", paths=("/w/out",))
    assert "final sync verified, 1 file (10 B)" in run_words.ended(
        run_words.Ended(_run_end(), None, one, run_words.Next("none"))).body


def test_the_idle_warning_the_held_stop_and_the_stopping_mail_name_it():
    from supervisor.notify.mails import idle as words
    from supervisor.notify.mails.sync import Unselected

    plan = words.StopPlan(("/w/out",), "s3://b/run", "systemctl poweroff")
    left = Unselected(("/w/out/ckpt.pt",), 1, 48 * MB, True)
    m = words.warning(words.IdleWarning(7200, 0.0, 9000.0, 3600, plan, unselected=left))
    assert m.subject.endswith("; 1 file, 48.0 MiB NOT selected for sync") and "  /w/out/ckpt.pt\n" in m.body
    m = words.unselected_held(words.UnselectedHeld("idle", plan, left, 120.0))
    assert m.subject == "NOT stopping: 1 file, 48.0 MiB of training output NOT selected for sync"
    assert "stop.stop_even_if_sync_fails" in m.body and "verified" not in m.body
    synced = {"ok": True, "target": "s3://b/run", "files": 0, "bytes": 0, "unselected": ["/w/out/ckpt.pt"],
              "unselected_files": 1, "unselected_bytes": 48 * MB, "unselected_hold": True}
    m = words.stopping(words.Stopping(5000.0, True, 0.0, synced, "stop.stop_even_if_sync_fails is set", plan))
    assert "verified" not in m.subject + m.body, (m.subject, m.body)
    assert m.subject == ("stopping now (training finished): 1 file, 48.0 MiB NOT selected for sync stay here; "
                         "nothing selected")
    assert "The machine stops anyway because stop.stop_even_if_sync_fails is set." in m.body
    m = words.stopping(words.Stopping(5000.0, True, 0.0, {**synced, "files": 3, "bytes": 30}, "", plan))
    assert "3 files verified at s3://b/run" in m.subject and "NOT SELECTED (stay on this machine)" in m.body
