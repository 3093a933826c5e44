"""A real TRL SFTTrainer + PEFT (LoRA) run on the CPU, offline: a 2-layer GPT-2 built from a config
and a word-level tokenizer built in memory (no download), a small text dataset, checkpoints every
--every steps keeping two, and the final adapter saved at the top of OUT (trainer.save_model()).

    python trl_sft_train.py OUT [--steps 20] [--every 5] [--sleep 0]

Checkpoints land in OUT/checkpoint-N/ (adapter_model.safetensors, trainer_state.json, ...); the
HF Trainer's tqdm bar gives `N/M`. Resumes from $TRAIN_SUPERVISOR_RESUME_FROM when set."""

from __future__ import annotations

import argparse
import os
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

WORDS = ["the", "a", "model", "trains", "on", "small", "text", "and", "saves", "checkpoints", "every", "step",
         "loss", "goes", "down", "slowly", "while", "gpu", "is", "busy"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


class Slow(TrainerCallback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kw):
        if self.seconds:
            time.sleep(self.seconds)  # a test's cadence


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = tokenizer()
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(64)]
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=len(tok), n_positions=64,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    args = SFTConfig(output_dir=a.out, max_steps=a.steps, save_steps=a.every, save_total_limit=2,
                     per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
                     dataloader_num_workers=0, max_length=32, packing=False, dataset_text_field="text")
    trainer = SFTTrainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tok, callbacks=[Slow(a.sleep)],
                         peft_config=LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    trainer.train(resume_from_checkpoint=os.environ.get("TRAIN_SUPERVISOR_RESUME_FROM") or None)
    trainer.save_model(a.out)


if __name__ == "__main__":
    main()
