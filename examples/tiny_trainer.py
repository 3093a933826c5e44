#!/usr/bin/env python3
"""A tiny CPU training job that behaves like a Hugging Face Trainer run. Standard library only.

It trains a logistic-regression "model" by SGD on synthetic data, and prints and writes what the
Trainer does, so train-supervisor can be shown (and tested) without a GPU or torch:

* on stderr, the banner (`***** Running training *****`, `Total optimization steps = 400`) and a
  tqdm-style bar repainted with carriage returns (` 32%|███▏      | 128/400 [00:32<01:08,  3.98it/s]`);
* on stdout, the log dicts every --logging-steps (`{'loss': '0.6931', 'grad_norm': ..., 'learning_rate':
  ..., 'epoch': ...}`, strings as in transformers >= 4.47, or --log-style repr for older floats), the
  supervisor's own `TSUP {...}` line, and the final `{'train_runtime': ...}` metrics;
* every --save-steps, `OUTPUT/checkpoint-N/` in the Trainer's order: model.safetensors (a real
  safetensors file) or, with --peft, adapter_model.safetensors + adapter_config.json; config.json,
  training_args.bin, optimizer.pt, scheduler.pt, rng_state.pth, and trainer_state.json last;
  older checkpoints removed with --save-total-limit, as the Trainer's rotation does;
* at the end, `OUTPUT/final/` (the `trainer.save_model()` folder).

--fail-at STEP raises an exception (traceback, exit 1); --oom-at STEP dies the way PyTorch does when
CUDA runs out of memory (`torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...`, exit 1).
--resume continues from the newest checkpoint; TRAIN_SUPERVISOR_RESUME_FROM (set by train-supervisor)
continues from that one. The .pt/.bin files are placeholders (JSON), not
torch pickles; only their place and order in the folder matter here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import struct
import sys
import time

NUM_EXAMPLES = 3200


class OutOfMemoryError(RuntimeError):
    """Printed as `torch.OutOfMemoryError`, like PyTorch's own."""


OutOfMemoryError.__module__ = "torch"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default="out", help="output_dir for checkpoint-N/ and final/ (default: out)")
    p.add_argument("--steps", type=int, default=400, help="max_steps (default 400)")
    p.add_argument("--step-time", type=float, default=0.5, help="seconds per step (default 0.5)")
    p.add_argument("--save-steps", type=int, default=100, help="checkpoint every K steps (default 100)")
    p.add_argument("--save-total-limit", type=int, default=0, help="keep only the newest L checkpoints (0: all)")
    p.add_argument("--logging-steps", type=int, default=10, help="log dict every N steps (default 10)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per example, for the token count")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.5, help="peak learning rate (linear decay)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fail-at", type=int, default=None, metavar="STEP", help="raise an error at STEP")
    p.add_argument("--oom-at", type=int, default=None, metavar="STEP", help="die with a CUDA OOM at STEP")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    p.add_argument("--peft", action="store_true", help="save adapter_model.safetensors + adapter_config.json")
    p.add_argument("--pad-mb", type=float, default=0.0, help="pad optimizer.pt to this many MiB")
    p.add_argument("--log-style", choices=("str", "repr"), default="str",
                   help="floats in log dicts as strings (transformers >= 4.47) or plain repr (older)")
    p.add_argument("--no-tsup", action="store_true", help="do not print the TSUP progress line")
    p.add_argument("--no-banner", action="store_true", help="do not print the Running training banner")
    p.add_argument("--no-tokens", action="store_true", help="leave num_input_tokens_seen out of the logs")
    a = p.parse_args(argv)
    if a.steps < 1 or a.save_steps < 1 or a.logging_steps < 1 or a.batch_size < 1 or a.features < 1:
        p.error("--steps, --save-steps, --logging-steps, --batch-size and --features must be at least 1")
    if a.step_time < 0 or a.save_total_limit < 0 or a.pad_mb < 0:
        p.error("--step-time, --save-total-limit and --pad-mb must not be negative")
    return a


# --- the terminal side: a tqdm look-alike ------------------------------------------------------

def _interval(s: float) -> str:
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


class Bar:
    """What tqdm(total=max_steps) prints to a non-terminal: 10-cell bar, `\\r` repaints at most
    every 0.1 s, and `write()` that clears the bar, prints a line on stdout and repaints."""

    UTF = " " + "".join(chr(c) for c in range(0x258F, 0x2587, -1))
    ASCII = " 123456789#"

    def __init__(self, total: int, initial: int = 0):
        self.total, self.n, self.initial = total, initial, initial
        self.start = time.monotonic()
        self.last_print = -1.0
        self.last_len = 0
        enc = (getattr(sys.stderr, "encoding", "") or "").lower().replace("-", "")
        self.chars = self.UTF if enc.startswith("utf") else self.ASCII

    def _text(self) -> str:
        elapsed = time.monotonic() - self.start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        frac = self.n / self.total
        nsyms = len(self.chars) - 1
        full, part = divmod(int(frac * 10 * nsyms), nsyms)
        bar = self.chars[-1] * full
        if full < 10:
            bar += self.chars[part] + self.chars[0] * (10 - full - 1)
        if rate is None:
            rate_fmt, remaining = "?it/s", "?"
        else:
            rate_fmt = f"{1 / rate:5.2f}s/it" if rate < 1 else f"{rate:5.2f}it/s"
            remaining = _interval((self.total - self.n) / rate)
        return f"{frac * 100:3.0f}%|{bar}| {self.n}/{self.total} [{_interval(elapsed)}<{remaining}, {rate_fmt}]"

    def refresh(self) -> None:
        s = self._text()
        sys.stderr.write("\r" + s + " " * max(self.last_len - len(s), 0))
        sys.stderr.flush()
        self.last_len = len(s)
        self.last_print = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.total or time.monotonic() - self.last_print >= 0.1:
            self.refresh()

    def write(self, msg: str) -> None:
        sys.stderr.write("\r" + " " * self.last_len + "\r")
        sys.stderr.flush()
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()
        self.refresh()

    def close(self) -> None:
        self.refresh()
        sys.stderr.write("\n")
        sys.stderr.flush()


# --- the files: the Trainer's checkpoint layout ------------------------------------------------

def safetensors_bytes(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """A real safetensors file: u64 LE header length, JSON header (space-padded to 8 bytes), F32 data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, (shape, values) in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def read_safetensors(path: str) -> dict[str, list[float]]:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        out[name] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return out


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:  # in place, like the Trainer: no temp file, no rename
        f.write(data)


def save_model(folder: str, w: list[float], b: float, args: argparse.Namespace) -> None:
    os.makedirs(folder, exist_ok=True)
    tensors = {"linear.weight": ([1, len(w)], w), "linear.bias": ([1], [b])}
    if args.peft:
        _write(os.path.join(folder, "adapter_model.safetensors"), safetensors_bytes(tensors))
        _write(os.path.join(folder, "adapter_config.json"), json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
            "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "tiny/logreg"}, indent=2).encode())
    else:
        _write(os.path.join(folder, "model.safetensors"), safetensors_bytes(tensors))
    _write(os.path.join(folder, "config.json"), json.dumps({
        "architectures": ["TinyLogisticRegression"], "model_type": "tiny-logreg",
        "num_features": len(w), "torch_dtype": "float32"}, indent=2).encode())
    _write(os.path.join(folder, "training_args.bin"),
           b"tiny_trainer training args (placeholder, not a torch pickle)\n" + json.dumps(vars(args)).encode())


def trainer_state(step: int, args: argparse.Namespace, history: list[dict], tokens: int) -> dict:
    return {
        "best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
        "epoch": step / steps_per_epoch(args), "eval_steps": 500, "global_step": step,
        "is_hyper_param_search": False, "is_local_process_zero": True, "is_world_process_zero": True,
        "log_history": history, "logging_steps": args.logging_steps, "max_steps": args.steps,
        "num_input_tokens_seen": 0 if args.no_tokens else tokens, "num_train_epochs": num_epochs(args),
        "save_steps": args.save_steps,
        "stateful_callbacks": {"TrainerControl": {"args": {
            "should_epoch_stop": False, "should_evaluate": False, "should_log": False,
            "should_save": True, "should_training_stop": step >= args.steps}, "attributes": {}}},
        "total_flos": float(step * args.batch_size * args.features * 6), "train_batch_size": args.batch_size,
        "trial_name": None, "trial_params": None,
    }


def save_checkpoint(step: int, w: list[float], b: float, velocity: list[float], lr: float,
                    args: argparse.Namespace, history: list[dict], tokens: int) -> str:
    folder = os.path.join(args.output, f"checkpoint-{step}")
    save_model(folder, w, b, args)
    pad = b"\0" * int(args.pad_mb * 1024 * 1024)
    _write(os.path.join(folder, "optimizer.pt"),
           b"tiny_trainer optimizer state (placeholder)\n" + json.dumps({"velocity": velocity}).encode() + pad)
    _write(os.path.join(folder, "scheduler.pt"),
           b"tiny_trainer scheduler state (placeholder)\n" + json.dumps({"last_lr": lr, "step": step}).encode())
    _write(os.path.join(folder, "rng_state.pth"),
           b"tiny_trainer rng state (placeholder)\n" + json.dumps({"seed": args.seed, "step": step}).encode())
    state = trainer_state(step, args, history, tokens)
    _write(os.path.join(folder, "trainer_state.json"),
           (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
    rotate(args)
    return folder


def checkpoints(output: str) -> list[tuple[int, str]]:
    out = []
    try:
        names = os.listdir(output)
    except OSError:
        return out
    for n in names:
        if n.startswith("checkpoint-") and n[len("checkpoint-"):].isdigit():
            out.append((int(n[len("checkpoint-"):]), os.path.join(output, n)))
    return sorted(out)


def rotate(args: argparse.Namespace) -> None:
    if args.save_total_limit <= 0:
        return
    ck = checkpoints(args.output)
    for _, path in ck[: max(0, len(ck) - args.save_total_limit)]:
        shutil.rmtree(path, ignore_errors=True)


# --- the "model" ------------------------------------------------------------------------------

def steps_per_epoch(args: argparse.Namespace) -> int:
    return max(1, NUM_EXAMPLES // args.batch_size)


def num_epochs(args: argparse.Namespace) -> int:
    return math.ceil(args.steps / steps_per_epoch(args))


_EXAMPLES: dict[int, tuple[list[float], float]] = {}


def example(i: int, true_w: list[float], args: argparse.Namespace) -> tuple[list[float], float]:
    if i in _EXAMPLES:
        return _EXAMPLES[i]
    _EXAMPLES[i] = _make_example(i, true_w, args)
    return _EXAMPLES[i]


def _make_example(i: int, true_w: list[float], args: argparse.Namespace) -> tuple[list[float], float]:
    rng = random.Random(args.seed * 1_000_003 + i)
    x = [rng.gauss(0, 1) for _ in range(args.features)]
    z = sum(a * b for a, b in zip(true_w, x, strict=True)) + 0.3
    y = 1.0 if rng.random() < 1 / (1 + math.exp(-z)) else 0.0
    return x, y


def training_step(step: int, w: list[float], b: float, velocity: list[float], lr: float,
                  true_w: list[float], args: argparse.Namespace) -> tuple[float, float, float]:
    if args.fail_at is not None and step == args.fail_at:
        raise RuntimeError(f"tiny_trainer: simulated failure at step {step} (--fail-at)")
    if args.oom_at is not None and step == args.oom_at:
        raise OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of "
            f"which 1.23 GiB is free. Process {os.getpid()} has 77.91 GiB memory in use. Of the allocated "
            "memory 75.12 GiB is allocated by PyTorch, and 1.54 GiB is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    spe = steps_per_epoch(args)
    base = ((step - 1) % spe) * args.batch_size
    gw = [0.0] * len(w)
    gb = 0.0
    loss = 0.0
    for i in range(base, base + args.batch_size):
        x, y = example(i, true_w, args)
        z = sum(a * c for a, c in zip(w, x, strict=True)) + b
        p = 1 / (1 + math.exp(-max(-30.0, min(30.0, z))))
        loss -= y * math.log(max(p, 1e-12)) + (1 - y) * math.log(max(1 - p, 1e-12))
        for k, xv in enumerate(x):
            gw[k] += (p - y) * xv
        gb += p - y
    n = args.batch_size
    gw = [g / n for g in gw]
    gb /= n
    grad_norm = math.sqrt(sum(g * g for g in gw) + gb * gb)
    for k in range(len(w)):
        velocity[k] = 0.9 * velocity[k] + gw[k]
        w[k] -= lr * velocity[k]
    b -= lr * gb
    return loss / n, grad_norm, b


def fmt_logs(logs: dict, style: str) -> str:
    if style == "str":  # transformers >= 4.47: floats shown with 4 significant digits, as strings
        logs = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items()}
    return str(logs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    rng = random.Random(args.seed)
    true_w = [rng.uniform(-2, 2) for _ in range(args.features)]
    w = [0.0] * args.features
    b = 0.0
    velocity = [0.0] * args.features
    history: list[dict] = []
    start_step = 0
    tokens_per_step = args.batch_size * args.seq_len
    # train-supervisor names the newest complete checkpoint here (restored from the target on a new
    # machine), as `trainer.train(resume_from_checkpoint=os.environ.get("TRAIN_SUPERVISOR_RESUME_FROM"))`
    resume_from = os.environ.get("TRAIN_SUPERVISOR_RESUME_FROM")
    found = [(int(json.load(open(os.path.join(resume_from, "trainer_state.json")))["global_step"]), resume_from)] \
        if resume_from else checkpoints(args.output) if args.resume else []
    if found:
        step0, folder = found[-1]
        weights = read_safetensors(os.path.join(
            folder, "adapter_model.safetensors" if args.peft else "model.safetensors"))
        w, b = weights["linear.weight"], weights["linear.bias"][0]
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
            history = json.load(f).get("log_history", [])
        start_step = step0
    if not args.no_banner:
        err = sys.stderr
        err.write("***** Running training *****\n")
        err.write(f"  Num examples = {NUM_EXAMPLES:,}\n")
        err.write(f"  Num Epochs = {num_epochs(args):,}\n")
        err.write(f"  Instantaneous batch size per device = {args.batch_size:,}\n")
        err.write(f"  Total train batch size (w. parallel, distributed & accumulation) = {args.batch_size:,}\n")
        err.write("  Gradient Accumulation steps = 1\n")
        err.write(f"  Total optimization steps = {args.steps:,}\n")
        err.write(f"  Number of trainable parameters = {args.features + 1:,}\n")
        if start_step:
            err.write(f"  Continuing training from checkpoint, will skip to saved global_step\n"
                      f"  Continuing training from global step {start_step}\n")
        err.flush()

    # as the HF Trainer's ProgressCallback: a bar from 0 whose first update leaps to the resumed
    # step (its printed it/s counts the leap too)
    bar = Bar(args.steps)
    bar.refresh()
    t0 = time.monotonic()
    loss_sum, loss_n, total_loss = 0.0, 0, 0.0
    lr = args.lr
    for step in range(start_step + 1, args.steps + 1):
        due = t0 + (step - start_step) * args.step_time
        lr = args.lr * (1 - (step - 1) / args.steps)
        loss, grad_norm, b = training_step(step, w, b, velocity, lr, true_w, args)
        loss_sum += loss
        loss_n += 1
        total_loss += loss
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        bar.update(step - bar.n)
        tokens = step * tokens_per_step
        epoch = step / steps_per_epoch(args)
        if step % args.logging_steps == 0 or step == args.steps:
            logs: dict = {"loss": round(loss_sum / loss_n, 4), "grad_norm": grad_norm,
                          "learning_rate": lr, "epoch": epoch}
            if not args.no_tokens:
                logs["num_input_tokens_seen"] = tokens
            loss_sum, loss_n = 0.0, 0
            bar.write(fmt_logs(logs, args.log_style))
            history.append({**logs, "step": step})
            if not args.no_tsup:
                bar.write("TSUP " + json.dumps({"step": step, "max_steps": args.steps, "epoch": round(epoch, 4),
                                                "loss": logs["loss"], "learning_rate": lr, "tokens": tokens,
                                                "done": step == args.steps, "time": round(time.time(), 3)}))
        if step % args.save_steps == 0 or step == args.steps:
            save_checkpoint(step, w, b, velocity, lr, args, history, tokens)
    runtime = time.monotonic() - t0
    done = args.steps - start_step
    metrics = {"train_runtime": round(runtime, 4),
               "train_samples_per_second": round(done * args.batch_size / runtime, 3) if runtime > 0 else 0.0,
               "train_steps_per_second": round(done / runtime, 3) if runtime > 0 else 0.0,
               "total_flos": float(args.steps * args.batch_size * args.features * 6),
               "train_loss": total_loss / max(1, done), "epoch": args.steps / steps_per_epoch(args)}
    bar.write(fmt_logs({k: v for k, v in metrics.items() if k != "total_flos"}, args.log_style))
    bar.close()
    save_model(os.path.join(args.output, "final"), w, b, args)
    print(f"Saved the final model to {os.path.join(args.output, 'final')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
