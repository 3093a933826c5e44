"""A nanoGPT-style loop on the CPU (train.py's shape, a tiny model): every --every iterations it
`torch.save`s one dict to OUT/ckpt.pt, in place, and prints what nanoGPT prints:
`step N: train loss X, val loss Y`, `saving checkpoint to OUT`, and `iter N: loss X, time Yms, mfu Z%`.
nanoGPT never prints its total, so nothing in its output gives max_iters.

    python nanogpt_train.py OUT [--iters 40] [--every 10] [--sleep 0] [--size 64]

--size is the model's width (the checkpoint grows with its square). Resumes from ckpt.pt when
$TRAIN_SUPERVISOR_RESUME_FROM names it (nanoGPT's init_from='resume')."""

from __future__ import annotations

import argparse
import os
import time

import torch

ALWAYS_SAVE_CHECKPOINT = True  # nanoGPT's default: a save at every eval, whatever the val loss


class Tiny(torch.nn.Module):
    def __init__(self, vocab: int, n: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, n)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(n, 4 * n), torch.nn.GELU(), torch.nn.Linear(4 * n, n))
        self.head = torch.nn.Linear(n, vocab)

    def forward(self, idx, targets):
        logits = self.head(self.mlp(self.emb(idx)))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--size", type=int, default=64)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(1337)
    model_args = {"vocab": 64, "n": a.size}
    model = Tiny(**model_args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    iter_num, best_val_loss = 0, 1e9
    resume = os.environ.get("TRAIN_SUPERVISOR_RESUME_FROM")
    if resume:
        path = resume if resume.endswith(".pt") else os.path.join(resume, "ckpt.pt")
        ckpt = torch.load(path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        print(f"Resuming training from {resume} at iter {iter_num}", flush=True)
    data = torch.randint(0, 64, (4096,))

    def batch():
        i = torch.randint(0, len(data) - 17, (8,))
        return torch.stack([data[j:j + 16] for j in i]), torch.stack([data[j + 1:j + 17] for j in i])

    t0 = time.time()
    while True:
        if iter_num % a.every == 0:
            with torch.no_grad():
                losses = [model(*batch()).item() for _ in range(2)]
            print(f"step {iter_num}: train loss {losses[0]:.4f}, val loss {losses[1]:.4f}", flush=True)
            if (losses[1] < best_val_loss or ALWAYS_SAVE_CHECKPOINT) and iter_num > 0:
                best_val_loss = min(best_val_loss, losses[1])
                ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": model_args,
                        "iter_num": iter_num, "best_val_loss": best_val_loss, "config": vars(a)}
                print(f"saving checkpoint to {a.out}", flush=True)
                torch.save(ckpt, os.path.join(a.out, "ckpt.pt"))
        if iter_num >= a.iters:
            break
        loss = model(*batch())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.sleep:
            time.sleep(a.sleep)  # a test's cadence
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms, mfu -100.00%", flush=True)
        iter_num += 1


if __name__ == "__main__":
    main()
