"""Training progress read from what trainers already print and write. Pure parsers, no I/O.

Sources, each tolerant of partial and garbage input (a parser returns None or leaves a field
unknown; it never guesses and never raises):

* **Our own line** — the most reliable; print it from your own training loop::

      TSUP {"step": 120, "max_steps": 3750, "epoch": 0.32, "loss": 1.21, "tokens": 1966080}

  The marker `TSUP ` (at the start of the line, or after a logging prefix ending in a space,
  `]` or `:`) followed by one JSON object on the same line. Every key is optional; unknown keys
  are ignored; a value of the wrong type makes that key unknown, the others still count:

  | key            | type            | meaning                                                   |
  |----------------|-----------------|-----------------------------------------------------------|
  | `step`         | int >= 0        | optimizer steps done in this run (the Trainer's global_step) |
  | `max_steps`    | int > 0         | steps the run will make in total                          |
  | `epoch`        | number >= 0     | fractional epoch (0.32 = a third through the first epoch)  |
  | `num_epochs`   | number > 0      | epochs the run will make                                  |
  | `loss`         | number          | the latest training loss                                  |
  | `learning_rate` (or `lr`) | number >= 0 | the current learning rate                      |
  | `tokens`       | int >= 0        | tokens processed so far in this run, cumulative (all GPUs) |
  | `tokens_per_s` | number >= 0     | your own throughput figure, used when `tokens` is absent   |
  | `done`         | bool            | true on the last line: the run completed                  |
  | `time`         | number          | Unix time the line was printed (`time.time()`): rates are then exact instead of as coarse as the log poll; ignored when more than 10 minutes off |

* **Hugging Face Trainer** (and TRL, Unsloth, Axolotl, which print through it): the tqdm bar on
  stderr (`' 32%|███▏      | 1200/3750 [33:50<1:11:52,  1.69s/it]'`, repainted with carriage
  returns), the log dicts (`{'loss': 1.2345, 'grad_norm': 0.5, 'learning_rate': 4.9e-05,
  'epoch': 0.05}`; since transformers 4.47 floats are printed as strings, `{'loss': '1.234', ...}`),
  the final metrics dict (`{'train_runtime': ..., 'train_loss': ...}`, which marks the run done),
  `num_input_tokens_seen` (with `include_num_input_tokens_seen=True`) and TRL's `num_tokens` as
  cumulative tokens, and the banners: the Trainer's `Total optimization steps = 3,750` /
  `Num Epochs = 3` / `Continuing training from global step 1200` and Unsloth's `Total steps = 60`.
* **trainer_state.json** in a checkpoint folder: `global_step`, `max_steps`, `epoch`,
  `num_train_epochs`, `num_input_tokens_seen`, and the latest `loss`/`learning_rate` in `log_history`.

tqdm bars with a description (`Map: 100%|...`, `Loading checkpoint shards: ...`) or a unit other
than it/s and s/it (`examples/s`, `MB/s`) are never training bars; telling the training bar from an
evaluation bar is the tracker's job (it knows max_steps), so a bar comes out marked `bar=True`.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import replace

from supervisor.progress import steplines
from supervisor.progress.observation import MAX_EPOCHS_SANE, MAX_STEPS_SANE, MAX_TOKENS_SANE, Observation

__all__ = ["MAX_EPOCHS_SANE", "MAX_LINE", "MAX_STEPS_SANE", "MAX_TOKENS_SANE", "Observation", "parse_line",
           "parse_trainer_state"]

MAX_LINE = 16384          # longer lines are cut: nothing a trainer prints for progress is this long


# --- value sanitizers: a value is returned only when it is what the key promises -----------------

def _num(v: object) -> tuple[float, float] | None:
    """(value, absolute rounding error) from a number or a numeric string; None otherwise."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return (float(v), 0.0) if abs(v) < 10**300 else None
    if isinstance(v, float):
        return (v, 0.0) if math.isfinite(v) else None
    if isinstance(v, str):
        s = v.strip().replace(",", "")
        if not _NUMSTR.fullmatch(s):
            return None
        try:
            x = float(s)
        except ValueError:
            return None
        if not math.isfinite(x):
            return None
        return x, _rounding_error(s)
    return None


_NUMSTR = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _rounding_error(s: str) -> float:
    """Half a unit in the last printed digit: '1.235e+06' -> 500, '1234' -> 0.5."""
    mant, _, exp = s.lower().partition("e")
    decimals = len(mant.split(".", 1)[1]) if "." in mant else 0
    e = int(exp) if exp else 0
    return 0.5 * 10.0 ** (e - decimals)


def _int(v: object, lo: int = 0, hi: int = MAX_STEPS_SANE, *, strict: bool = False) -> int | None:
    if strict and not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
        return None
    n = _num(v)
    if n is None or not n[0].is_integer() or n[1] > 0.5:
        return None
    x = int(n[0])
    return x if lo <= x <= hi else None


def _float(v: object, lo: float = -math.inf, hi: float = math.inf, *, strict: bool = False) -> float | None:
    if strict and (isinstance(v, bool) or not isinstance(v, (int, float))):
        return None
    n = _num(v)
    if n is None or not (lo <= n[0] <= hi):
        return None
    return n[0]


def _tokens(v: object, *, strict: bool = False) -> tuple[int, float] | None:
    if strict and (isinstance(v, bool) or not isinstance(v, (int, float))):
        return None
    n = _num(v)
    if n is None or not (0 <= n[0] <= MAX_TOKENS_SANE):
        return None
    return int(round(n[0])), n[1]


# --- our own line ------------------------------------------------------------------------------

_TSUP = re.compile(r"(?:^|[\s\]:])TSUP (\{.*\})\s*$")


def _parse_tsup(line: str) -> Observation | None:
    m = _TSUP.search(line)
    if not m:
        return None
    try:
        d = json.loads(m.group(1))
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict):
        return None
    tok = _tokens(d.get("tokens"), strict=True)
    lr = d.get("learning_rate", d.get("lr"))
    obs = Observation(
        step=_int(d.get("step"), strict=True),
        max_steps=_int(d.get("max_steps"), lo=1, strict=True),
        epoch=_float(d.get("epoch"), 0, MAX_EPOCHS_SANE, strict=True),
        num_epochs=_float(d.get("num_epochs"), 1e-9, MAX_EPOCHS_SANE, strict=True),
        loss=_float(d.get("loss"), strict=True),
        learning_rate=_float(lr, 0, strict=True),
        tokens=tok[0] if tok else None,
        tokens_per_s=_float(d.get("tokens_per_s"), 0, MAX_TOKENS_SANE, strict=True),
        finished=d.get("done") is True,
        at=_float(d.get("time"), 0, 1e11, strict=True),
        source="tsup",
    )
    if obs.step is not None and obs.max_steps is not None and obs.step > obs.max_steps:
        obs = replace(obs, step=None, max_steps=None)
    return obs


# --- tqdm bars ---------------------------------------------------------------------------------

_TQDM = re.compile(
    r"(?P<pct>\d{1,3})%\|(?P<bar>[^|]{0,400})\|\s*(?P<n>\d{1,13})/(?P<total>\d{1,13})\s*"
    r"\[(?P<elapsed>[\d:]{1,12})<(?P<remaining>[\d:]{1,12}|\?),\s*"
    r"(?P<rate>\?|\d{1,12}(?:\.\d{1,6})?)\s?(?P<unit>it/s|s/it)(?P<postfix>[^\]]{0,400})\]")
# descriptions a training loop's own bar may carry; anything else (Map, Tokenizing, a file
# name, Loading checkpoint shards) is some other bar
# ("Epoch 1" and "Epoch 2/3" count one epoch: supervisor.progress.steplines reads those)
_TRAIN_DESC = re.compile(r"(?i)(?:train(?:ing)?|steps?|epoch|iterations?|it)")
_POSTFIX_LOSS = re.compile(r"(?:^|[,\s])(?:train_)?loss=([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?=[,\s]|$)")


def _parse_tqdm(line: str) -> Observation | None:
    m = _TQDM.search(line)
    if not m:
        return None
    desc = line[:m.start()].strip().rstrip(":").strip()
    if desc and not _TRAIN_DESC.fullmatch(desc):
        return None
    n, total, pct = int(m.group("n")), int(m.group("total")), int(m.group("pct"))
    if total <= 0 or n > total or total > MAX_STEPS_SANE:
        return None
    if abs(pct - 100.0 * n / total) > 1.0:
        return None  # the pieces of two repaints glued together: trust nothing in it
    rate = None
    if m.group("rate") != "?":
        r = float(m.group("rate"))
        if r > 0:
            rate = r if m.group("unit") == "it/s" else 1.0 / r
    loss = None
    pm = _POSTFIX_LOSS.search(m.group("postfix"))
    if pm:
        loss = _float(pm.group(1))
    return Observation(step=n, max_steps=total, steps_per_s=rate, loss=loss, bar=True, source="tqdm")


# --- the Trainer's log dicts ---------------------------------------------------------------------

_FLAT_DICT = re.compile(r"\{[^{}\n]{1,8000}\}")
_BARE_NONFINITE = re.compile(r"(?<=[:\s\[,])(-?)(nan|inf|NaN|Infinity)(?=\s*[,}\]])")
_PAIR = re.compile(r"""['"]([A-Za-z_][\w/.-]{0,80})['"]\s*:\s*(?:'([^'\n]{0,64})'|"([^"\n]{0,64})"|([-+\w.]{1,64}))\s*(?=[,}])""")
_ANCHORS = ("loss", "epoch", "train_runtime", "eval_loss")
_TOKEN_KEYS = ("num_input_tokens_seen", "num_tokens")
_TPS_KEYS = ("tokens_per_second", "tokens_per_sec", "tokens_per_s", "tokens/s", "tok/s", "tok_per_s")


def _dict_candidates(line: str) -> list[dict]:
    out = []
    for m in _FLAT_DICT.finditer(line):
        text = m.group(0)
        d = None
        try:
            d = json.loads(text)
        except (ValueError, RecursionError):
            try:
                d = ast.literal_eval(_BARE_NONFINITE.sub(r"'\1\2'", text))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                d = None
        if isinstance(d, dict):
            out.append(d)
    if not out and "{" in line:
        # a dict cut short (a truncated log line): take only the pairs that were finished
        tail = line[line.rfind("{"):]
        d = {}
        for pm in _PAIR.finditer(tail):
            d[pm.group(1)] = next(g for g in pm.groups()[1:] if g is not None)
        if d:
            out.append(d)
    return out


def _parse_dict(line: str) -> Observation | None:
    if "{" not in line:
        return None
    for d in reversed(_dict_candidates(line)):
        if not any(k in d for k in _ANCHORS):
            continue
        tok = None
        for k in _TOKEN_KEYS:
            if k in d:
                tok = _tokens(d[k])
                break
        tps = None
        for k in _TPS_KEYS:
            if k in d:
                tps = _float(d[k], 0, MAX_TOKENS_SANE)
                break
        lr = d.get("learning_rate", d.get("lr"))
        obs = Observation(
            step=_int(d.get("step", d.get("global_step"))),
            max_steps=_int(d.get("max_steps"), lo=1),
            epoch=_float(d.get("epoch"), 0, MAX_EPOCHS_SANE),
            loss=_float(d.get("loss")),
            learning_rate=_float(lr, 0),
            tokens=tok[0] if tok else None,
            tokens_err=tok[1] if tok else 0.0,
            tokens_per_s=tps,
            finished="train_runtime" in d and "train_loss" in d,
            source="log",
        )
        if not obs.empty():
            return obs
    return None


# --- banners and free text ---------------------------------------------------------------------

_MAX_STEPS_TEXT = re.compile(r"\bTotal (?:optimization )?steps = (\d{1,3}(?:,\d{3})+|\d{1,13})\b")
_EPOCHS_TEXT = re.compile(r"\bNum Epochs = (\d{1,7}(?:\.\d+)?)\b")
_RESUME_TEXT = re.compile(r"\bContinuing training from global step (\d{1,13})\b")
_NUMBER = r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d{1,15}(?:\.\d+)?)"
_PER_DEVICE = r"(?!\s*/\s*(?:gpu|dev)|\s+per\s+(?:gpu|device))"
_TPS_TEXT = (
    re.compile(r"(?i)(?<![\w.,])" + _NUMBER + r"\s*(?:tokens|toks|tok)/s(?:ec)?\b" + _PER_DEVICE),
    re.compile(r"(?i)(?<![\w/])(?:tokens|tok)(?:/s(?:ec)?|_per_sec(?:ond)?|\s+per\s+second)\s*[:=]\s*"
               + _NUMBER + r"(?![\d.])" + _PER_DEVICE),
)


def _parse_text(line: str) -> Observation | None:
    obs = Observation(source="banner")
    m = _MAX_STEPS_TEXT.search(line)
    if m:
        obs = replace(obs, max_steps=_int(m.group(1).replace(",", ""), lo=1))
    m = _EPOCHS_TEXT.search(line)
    if m:
        obs = replace(obs, num_epochs=_float(m.group(1), 1e-9, MAX_EPOCHS_SANE))
    m = _RESUME_TEXT.search(line)
    if m:
        obs = replace(obs, step=_int(m.group(1)))
    if obs.empty():
        for rx in _TPS_TEXT:
            m = rx.search(line)
            if m:
                obs = replace(obs, tokens_per_s=_float(m.group(1), 0, MAX_TOKENS_SANE), source="log")
                break
    return None if obs.empty() else obs


# --- the entry points -------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def _parse_segment(seg: str) -> Observation | None:
    if "\x1b" in seg:
        seg = _ANSI.sub("", seg)
    seg = seg.strip()
    if not seg:
        return None
    obs = _parse_stripped(seg)
    if "`Trainer.fit` stopped" in seg and (done := steplines.fit_stopped(seg)) is not None:
        # Lightning logs it to stderr while its bar's last repaint on stdout has no line end yet
        obs = done if obs is None else replace(obs, finished=True)
    return obs


def _parse_stripped(seg: str) -> Observation | None:
    # cheap substring tests first: most lines of a training log are none of these
    if "TSUP {" in seg and (obs := _parse_tsup(seg)) is not None:
        return obs
    if ("%|" in seg or "/? [" in seg or "it/s" in seg) and (obs := steplines.epoch_bar(seg)) is not None:
        return obs  # a bar that counts one epoch (Lightning's): before the bars that count the run
    if "%|" in seg and (obs := _parse_tqdm(seg)) is not None:
        return obs
    if "{" in seg and (obs := _parse_dict(seg)) is not None:
        return obs
    if (" = " in seg or "/s" in seg or "tok" in seg or "Tok" in seg or "global step" in seg) \
            and (obs := _parse_text(seg)) is not None:
        return obs
    if "tep" in seg or "ter" in seg or "TEP" in seg or "TER" in seg:  # step, Step, iter, iteration
        return steplines.step_counter(seg)
    return None


def parse_line(line: str) -> Observation | None:
    """What one log line says about progress, or None. Carriage-return repaints inside the line
    are read in order, the later ones winning; never raises."""
    try:
        if not isinstance(line, str):
            return None
        line = line[:MAX_LINE]
        out: Observation | None = None
        for seg in line.split("\r"):
            obs = _parse_segment(seg)
            if obs is not None:
                out = obs if out is None else out.merged(obs)
        return out
    except Exception:  # noqa: BLE001 - garbage in a log must never reach the daemon as an exception
        return None


def parse_trainer_state(data: bytes) -> Observation | None:
    """What a checkpoint's trainer_state.json says, or None when it is unreadable (truncated
    while being written, not JSON, not the Trainer's shape). Never raises."""
    try:
        return _parse_trainer_state(data)
    except Exception:  # noqa: BLE001
        return None


def _parse_trainer_state(data: bytes) -> Observation | None:
    if not isinstance(data, (bytes, bytearray)) or not data:
        return None
    try:
        d = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or "global_step" not in d:
        return None
    step = _int(d.get("global_step"), strict=True)
    max_steps = _int(d.get("max_steps"), lo=1, strict=True)   # -1 in some writers: unknown
    if step is not None and max_steps is not None and step > max_steps:
        max_steps = None
    tok = _tokens(d.get("num_input_tokens_seen"), strict=True)
    tokens = tok[0] if tok else None
    if tokens == 0 and step:
        tokens = None  # the Trainer writes 0 when it is not counting tokens
    loss = lr = None
    finished = False
    hist = d.get("log_history")
    if isinstance(hist, list):
        # the newest entry that carries a key decides it: a nan there means unknown, never the
        # older value before it
        seen_loss = seen_lr = False
        for entry in reversed(hist):
            if not isinstance(entry, dict):
                continue
            if not seen_loss and "loss" in entry:
                seen_loss, loss = True, _float(entry["loss"], strict=True)
            if not seen_lr and "learning_rate" in entry:
                seen_lr, lr = True, _float(entry["learning_rate"], 0, strict=True)
            if seen_loss and seen_lr:
                break
        last = hist[-1] if hist and isinstance(hist[-1], dict) else {}
        finished = "train_runtime" in last
        if tokens is None and isinstance(last, dict) and "num_input_tokens_seen" in last:
            t2 = _tokens(last.get("num_input_tokens_seen"), strict=True)
            tokens = t2[0] if t2 and t2[0] > 0 else None
    return Observation(
        step=step,
        max_steps=max_steps,
        epoch=_float(d.get("epoch"), 0, MAX_EPOCHS_SANE, strict=True),
        num_epochs=_float(d.get("num_train_epochs"), 1e-9, MAX_EPOCHS_SANE, strict=True),
        loss=loss,
        learning_rate=lr,
        tokens=tokens,
        finished=finished,
        source="trainer_state",
    )

