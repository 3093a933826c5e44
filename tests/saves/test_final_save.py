"""The final artifact (issue 38): what the training saved at the top of its output folder
(`trainer.save_model(output_dir)`: the adapter or the model, LLaMA-Factory's all_results.json) is
what the user wants most and is written last. The final sync verifies it before the finish stop,
and the finish mail names it, or says plainly that the run left no final save and which
checkpoint is the newest complete one."""

from __future__ import annotations

import json

from supervisor.notify.mails import training as run_words
from supervisor.sync.scan import final_saves
from tests.fixtures.hf_writer import HFWriter, safetensors_bytes


def test_final_saves_name_the_adapter_at_the_top_or_say_there_is_none(make_engine, tmp_path):
    out, remote = tmp_path / "out", tmp_path / "remote"
    w = HFWriter(out / "run1")
    w.checkpoint(20)
    w.checkpoint(40)
    (out / "run1" / "adapter_model.safetensors").write_bytes(safetensors_bytes({"lora_A": 4096}, 1))
    (out / "run1" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (out / "run1" / "all_results.json").write_text(json.dumps({"train_loss": 0.42}))
    HFWriter(out / "run2").checkpoint(10)  # a run that crashed before its save_model
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0.2s"})
    r = e.final_sync([str(out)], 60)
    assert r.ok, r
    assert r.finals == ["run1: adapter_config.json, adapter_model.safetensors, all_results.json",
                        "run2: no final save (newest complete checkpoint: run2/checkpoint-10)"], r.finals
    assert (remote / "run1" / "adapter_model.safetensors").exists()
    assert final_saves([]) == []


def test_the_finish_mail_names_the_final_save():
    run = run_words.RunEnd(True, 3, 0, None, "python train.py", 0.0, 60.0, "/w/train.log", "/w")
    outputs = run_words.Outputs(True, 12, 1 << 20, "s3://b/run", paths=("/w/out",),
                                finals=("out: adapter_config.json, adapter_model.safetensors",))
    mail = run_words.ended(run_words.Ended(run, None, outputs, run_words.Next("none")))
    assert "Final save (verified on the target):\n  out: adapter_config.json, adapter_model.safetensors\n" in mail.body
    none = run_words.Outputs(True, 12, 1 << 20, "s3://b/run", paths=("/w/out",),
                             finals=("out: no final save (newest complete checkpoint: checkpoint-40)",))
    mail = run_words.ended(run_words.Ended(run, None, none, run_words.Next("none")))
    assert "out: no final save (newest complete checkpoint: checkpoint-40)" in mail.body
