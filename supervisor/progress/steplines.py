"""Progress from what trainers other than the Hugging Face Trainer print. Pure parsers, no I/O.

Each returns an Observation or None, never guesses and never raises (supervisor.progress.parse
calls them for the lines its own parsers did not take). The lines below are what the real writers
printed to a log that is no TTY (Lightning 2.6.6, tqdm, rich; tests/progress/test_progress_trainers.py):

* **Lightning's TQDMProgressBar** counts ONE epoch, numbered from 0 (trainer.current_epoch); the
  run's epochs are never printed::

      Epoch 1:  45%|████▌     | 9/20 [00:00<00:00, 16.05it/s, v_num=0, train_loss=0.000957]
      Epoch 0: |          | 18/? [00:01<00:00, 9.80it/s, v_num=0]      (an IterableDataset: no length)

  Out comes epoch_bar=(1, None, 0) with step=9, max_steps=20: supervisor.progress.record turns it
  into the run's step (the epochs it saw end, plus 9) and gives no max_steps (so no ETA) unless
  another source says it. A loop's own bar named `Epoch 2/3` is read the same way, its numbering
  (from 0 or from 1) left to the record to learn.
* **Lightning's RichProgressBar** (its default when rich is installed) draws nothing to a file while
  it runs: it prints its last frame once, when the fit ends or fails. The epoch is numbered from 0,
  over the last epoch's number (max_epochs - 1; -2 when only max_steps bounds the run)::

      Epoch 1/1  ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 20/20 0:00:01 • 0:00:00 18.56it/s v_num: 0.000

* **Lightning's end**: "`Trainer.fit` stopped: `max_epochs=2` reached." (or `max_steps=`): done.
* **Printed step counters** of hand-written loops, Accelerate-style scripts, nanoGPT and Megatron::

      iter 115: loss 2.3100, time 45.20ms, mfu 12.34%           (nanoGPT's train.py)
      step 250: train loss 2.1234, val loss 2.2345               (nanoGPT's evaluation)
      step 125/150                                                (the whole line, or after a log prefix)
      04/01/2026 10:00:00 - INFO - __main__ - Step 125/150 | loss 2.31
      step=125 loss=2.3100 lr=3.0e-04
       iteration      100/    1000 | ... | lm loss: 7.210E+00 |  (Megatron)

  Only what is unmistakably the training's step counter: the word step, iter, iteration or
  global_step standing alone, then the number (`/N` gives max_steps), and on the same line a loss,
  unless the counter is all the line holds. Never with a whole epoch number on the line ("Epoch
  [1/10], Step [100/600]" counts steps within an epoch), nor after an evaluation's word ("eval step
  5/20"). nanoGPT's max_iters is in its config, not its lines: no max_steps, so no ETA.
"""

from __future__ import annotations

import math
import re

from supervisor.progress.observation import MAX_STEPS_SANE, Observation

# --- Lightning's bars ----------------------------------------------------------------------------

_EPOCH_TQDM = re.compile(
    r"(?i)^epoch (?P<ep>\d{1,7})(?:\s*/\s*(?P<of>\d{1,7}))?:\s*(?:(?P<pct>\d{1,3})%)?\|[^|]{0,400}\|\s*"
    r"(?P<n>\d{1,13})/(?P<total>\d{1,13}|\?)\s*\[[\d:]{1,12}<(?:[\d:]{1,12}|\?),\s*"
    r"(?P<rate>\?|\d{1,12}(?:\.\d{1,6})?)\s?(?P<unit>it/s|s/it)(?P<postfix>[^\]]{0,400})\]")
_EPOCH_RICH = re.compile(
    r"^Epoch (?P<ep>\d{1,7})/(?P<last>-?\d{1,7})\s+[━╸╺╾╼─=\-\s]{0,400}?(?P<n>\d{1,13})/(?P<total>\d{1,13}|\?)\s+"
    r"\d{1,6}:\d\d:\d\d\s+•\s+(?:\d{1,6}:\d\d:\d\d|-:--:--)\s+\d{1,12}(?:\.\d{1,6})?it/s")
_FIT_STOPPED = re.compile(r"`Trainer\.fit` stopped: `max_(?:epochs|steps)=\d{1,13}` reached")
_POSTFIX_LOSS = re.compile(r"(?:^|[,\s])(?:train_)?loss=([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?=[,\s]|$)")


def epoch_bar(seg: str) -> Observation | None:
    """A bar that counts one epoch (Lightning's tqdm or Rich bar, a loop's own `Epoch 2/3` bar)."""
    m = _EPOCH_TQDM.match(seg)
    if m:
        return _tqdm_epoch(m)
    m = _EPOCH_RICH.match(seg)
    if m:
        n, total = int(m.group("n")), _total(m.group("total"))
        ep, last = int(m.group("ep")), int(m.group("last"))
        if (total is not None and n > total) or (last < 0 and ep > 0):
            # last -2: max_steps alone bounds the run, and Lightning then cuts the last epoch's total
            # to the steps left: the epochs before this one are not known from it
            return None
        # the one frame Rich prints comes at the end: its rate is of no use to an ETA
        return Observation(step=n, max_steps=total, bar=True, source="tqdm",
                           epoch_bar=(ep, last + 1 if last >= 0 else None, 0))
    return None


def _total(s: str) -> int | None:
    return None if s == "?" else int(s)


def _tqdm_epoch(m: re.Match[str]) -> Observation | None:
    n, total = int(m.group("n")), _total(m.group("total"))
    if total is not None:
        if total <= 0 or n > total or total > MAX_STEPS_SANE or m.group("pct") is None:
            return None
        if abs(int(m.group("pct")) - 100.0 * n / total) > 1.0:
            return None  # the pieces of two repaints glued together: trust nothing in it
    elif m.group("pct") is not None:
        return None
    rate = None
    if m.group("rate") != "?":
        r = float(m.group("rate"))
        if r > 0:
            rate = r if m.group("unit") == "it/s" else 1.0 / r
    pm = _POSTFIX_LOSS.search(m.group("postfix"))
    loss = float(pm.group(1)) if pm and math.isfinite(float(pm.group(1))) else None
    of = m.group("of")
    # "Epoch 1" is Lightning's (from 0); "Epoch 2/3" a loop's own, numbered either way: the record learns which
    shape = (int(m.group("ep")), int(of), None) if of is not None else (int(m.group("ep")), None, 0)
    if shape[1] == 0:
        return None
    return Observation(step=n, max_steps=total, steps_per_s=rate, loss=loss, bar=True, epoch_bar=shape,
                       source="tqdm")


def fit_stopped(seg: str) -> Observation | None:
    """Lightning says the fit reached its max_epochs or max_steps: the run completed."""
    return Observation(finished=True, source="log") if _FIT_STOPPED.search(seg) else None


# --- printed step counters -------------------------------------------------------------------------

_COUNTER = re.compile(
    r"(?i)(?:^|(?<=[\s\]\[|:,(>-]))(?P<kw>global[_ ]step|step|iter|iteration)"
    r"(?:\s*[=:]\s*|\s+|\s*\[\s*)(?P<n>\d{1,13})(?:\s*/\s*(?P<total>\d{1,13}))?\]?(?=$|[\s,:;|)\]])")
_LOSS = re.compile(r"(?i)(?<![\w/.-])(?:train[_ ]|lm[_ ])?loss\s*[:=]?\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|nan|inf)(?![\w.])")
_EPOCH_COUNTER = re.compile(r"(?i)\bepoch\b[\s:=#\[]*\d+(?![.\d])")
_EVAL_WORD = re.compile(r"(?i)\b(?:eval\w*|valid\w*|val|test\w*|predict\w*|infer\w*)\b")
_PREFIX_END = ("-", ":", "|", "]", ">")


def step_counter(seg: str) -> Observation | None:
    """A printed training step counter (nanoGPT's `iter 115: loss ...`, `step 125/150`, ...)."""
    m = _COUNTER.search(seg)
    if not m or "%|" in seg or _EPOCH_COUNTER.search(seg):
        return None
    prefix, rest = seg[:m.start()], seg[m.end():]
    if _EVAL_WORD.search(prefix):
        return None
    lm = _LOSS.search(rest)
    if lm is None:
        # no loss beside it: only a counter that is all the line holds, after nothing or a log prefix
        p = prefix.rstrip()
        if rest.strip() or (p and not p.endswith(_PREFIX_END)):
            return None
    n = int(m.group("n"))
    total = int(m.group("total")) if m.group("total") else None
    if n > MAX_STEPS_SANE or (total is not None and not (1 <= total <= MAX_STEPS_SANE and n <= total)):
        return None
    loss = None
    if lm is not None:
        v = float(lm.group(1))
        loss = v if math.isfinite(v) else None
    return Observation(step=n, max_steps=total, loss=loss, source="log")
