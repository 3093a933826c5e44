"""The progress parsers against the shapes trainers really print and write, and against garbage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.progress.parse import MAX_LINE, Observation, parse_line, parse_trainer_state

DATA = Path(__file__).parents[1] / "data" / "progress"


def log_lines(name: str) -> list[str]:
    """A capture split the way the log follower hands it over: undecodable bytes replaced,
    one string per newline (carriage-return repaints stay inside the string)."""
    return (DATA / name).read_bytes().decode("utf-8", errors="replace").split("\n")


def observations(name: str) -> list[Observation]:
    out = []
    for line in log_lines(name):
        for seg in line.split("\r"):
            o = parse_line(seg)
            if o is not None:
                out.append(o)
    return out


def valid(o: Observation) -> None:
    """What every observation must satisfy, whatever the input."""
    assert o.step is None or (isinstance(o.step, int) and o.step >= 0)
    assert o.max_steps is None or (isinstance(o.max_steps, int) and o.max_steps >= 1)
    if o.step is not None and o.max_steps is not None and o.source in ("tqdm", "tsup"):
        assert o.step <= o.max_steps
    for v in (o.epoch, o.num_epochs, o.loss, o.learning_rate, o.tokens_per_s, o.steps_per_s):
        assert v is None or (isinstance(v, float) and math.isfinite(v))
    for v in (o.epoch, o.learning_rate, o.tokens_per_s, o.steps_per_s):
        assert v is None or v >= 0
    assert o.tokens is None or (isinstance(o.tokens, int) and o.tokens >= 0)
    assert o.source in ("tsup", "tqdm", "log", "banner", "trainer_state")


# --- single lines --------------------------------------------------------------------------------

@pytest.mark.parametrize("line, want", [
    ("  5%|▌         | 50/1000 [00:10<03:10,  5.00it/s]",
     dict(step=50, max_steps=1000, steps_per_s=5.0, bar=True, source="tqdm")),
    (" 32%|███▏      | 1200/3750 [33:50<1:11:52,  1.69s/it]",
     dict(step=1200, max_steps=3750, steps_per_s=pytest.approx(1 / 1.69), bar=True)),
    ("  0%|          | 0/1000 [00:00<?, ?it/s]", dict(step=0, max_steps=1000, steps_per_s=None)),
    ("100%|##########| 60/60 [02:00<00:00,  2.00s/it]", dict(step=60, max_steps=60, steps_per_s=0.5)),
    ("Training: 10%|#         | 10/100 [00:01<00:09, 10.00it/s, loss=0.523, lr=1e-4]",
     dict(step=10, max_steps=100, loss=0.523)),
    ("Epoch 2/3:  50%|█████     | 50/100 [00:05<00:05,  9.87it/s]", dict(step=50, max_steps=100)),
    ("\x1b[32m 10%|#         | 10/100 [00:01<00:09, 10.00it/s]\x1b[0m", dict(step=10, max_steps=100)),
    # repaints inside one line: the last one wins
    ("\r 10%|#         | 10/100 [00:01<00:09, 10.00it/s]\r 11%|#1        | 11/100 [00:01<00:09, 10.00it/s]",
     dict(step=11)),
    ("{'loss': 1.2345, 'grad_norm': 0.5, 'learning_rate': 4.9e-05, 'epoch': 0.05}",
     dict(loss=1.2345, learning_rate=4.9e-05, epoch=0.05, source="log", step=None)),
    # transformers >= 4.47 prints floats as strings with 4 significant digits
    ("{'loss': '1.234', 'grad_norm': '0.5123', 'learning_rate': '4.9e-05', 'epoch': '0.05'}",
     dict(loss=1.234, learning_rate=4.9e-05, epoch=0.05)),
    ("{'loss': 0.6, 'grad_norm': 0.4, 'learning_rate': 1e-05, 'num_input_tokens_seen': 1966080, 'epoch': 0.32}",
     dict(tokens=1966080, tokens_err=0.0)),
    ("{'loss': '0.61', 'num_tokens': '1.638e+05', 'mean_token_accuracy': '0.71', 'epoch': '0.1'}",
     dict(tokens=163800, tokens_err=50.0)),
    ('{"loss": 0.7, "epoch": 1.5, "step": 300, "max_steps": 600}', dict(step=300, max_steps=600, loss=0.7)),
    # a diverged run: nan is not a number we show
    ("{'loss': nan, 'grad_norm': nan, 'learning_rate': 4.9e-05, 'epoch': 0.05}",
     dict(loss=None, learning_rate=4.9e-05, epoch=0.05)),
    ("{'loss': 'nan', 'learning_rate': '4.9e-05', 'epoch': '0.05'}", dict(loss=None, learning_rate=4.9e-05)),
    ("{'eval_loss': 1.0423, 'eval_runtime': 2.7, 'eval_samples_per_second': 370.1, 'epoch': 0.5}",
     dict(epoch=0.5, loss=None)),
    ("{'train_runtime': 200.1234, 'train_samples_per_second': 63.96, 'train_steps_per_second': 1.999, "
     "'train_loss': 0.4123, 'epoch': 1.0}", dict(finished=True, loss=None, epoch=1.0)),
    ("{'train_runtime': '200.1', 'train_samples_per_second': '63.96', 'train_steps_per_second': '1.999', "
     "'train_loss': '0.4123', 'epoch': '1'}", dict(finished=True)),
    # a dict cut short: only the pairs that finished count
    ("{'loss': 1.2, 'grad_norm': 0.5, 'learn", dict(loss=1.2, learning_rate=None)),
    ("[2023-09-17 13:15:13,336] [INFO] [axolotl.train:190] [PID:1] [RANK:0] {'loss': 1.0226, "
     "'learning_rate': 0.00014229432213209734, 'epoch': 0.89}", dict(loss=1.0226, epoch=0.89)),
    ("  Total optimization steps = 3,750", dict(max_steps=3750, source="banner")),
    ("[2024-05-17 13:01:02,336] [INFO] [transformers.trainer._inner_training_loop:2053] [PID:11100] "
     "[RANK:0]   Total optimization steps = 873", dict(max_steps=873)),
    ("  Num Epochs = 3", dict(num_epochs=3.0)),
    ("   \\\\   /|    Num examples = 51,760 | Num Epochs = 1 | Total steps = 60", dict(max_steps=60, num_epochs=1.0)),
    ("  Continuing training from global step 1200", dict(step=1200)),
    ('TSUP {"step": 120, "max_steps": 3750, "epoch": 0.32, "loss": 1.21, "tokens": 1966080}',
     dict(step=120, max_steps=3750, epoch=0.32, loss=1.21, tokens=1966080, source="tsup")),
    ('2025-01-01 10:00:00 INFO train: TSUP {"step": 5, "lr": 0.0002, "tokens_per_s": 2410.5, "done": true}',
     dict(step=5, learning_rate=0.0002, tokens_per_s=2410.5, finished=True)),
    ('[rank0]: TSUP {"step": 7}', dict(step=7)),
    ('TSUP {"step": 8, "time": 1800000000.25}', dict(step=8, at=1800000000.25)),
    ('TSUP {"step": 9, "time": "now"}', dict(step=9, at=None)),
    # wrong types make that key unknown, the rest still counts
    ('TSUP {"step": "12", "max_steps": 3750, "loss": true, "tokens": -5, "epoch": 1e400}',
     dict(step=None, max_steps=3750, loss=None, tokens=None, epoch=None)),
    ('TSUP {"step": 5000, "max_steps": 3750}', dict(step=None, max_steps=None)),
    ("step 10 | 2,410 tok/s | loss 1.2", dict(tokens_per_s=2410.0)),
    ("tokens/s: 2410.5", dict(tokens_per_s=2410.5)),
    ("throughput tokens_per_second=1234.5", dict(tokens_per_s=1234.5)),
])
def test_lines(line, want):
    o = parse_line(line)
    assert o is not None, line
    valid(o)
    for k, v in want.items():
        assert getattr(o, k) == v, (k, getattr(o, k), v)


@pytest.mark.parametrize("line", [
    "",
    "Map: 100%|██████████| 52002/52002 [00:05<00:00, 9876.54 examples/s]",
    "Loading checkpoint shards: 100%|██████████| 2/2 [00:03<00:00,  1.60s/it]",
    "model.safetensors: 100%|██████████| 5.00G/5.00G [00:30<00:00, 166MB/s]",
    "Unsloth: Tokenizing [\"text\"] (num_proc=2):  50%|█████     | 100/200 [00:01<00:01, 99.0 examples/s]",
    " 50%|#####     | 10/1000 [00:10<16:30,  1.00it/s]",      # the percentage contradicts the counts
    " 20%|##        | 2001000/1000 [03:20<13:20,  1.00it/s]",   # more done than total
    "{'lr': 0.001, 'batch_size': 8}",                           # a config dump, not a log dict
    "{'loss': 0.91",                                            # cut mid-number
    "{'loss': 'abc', 'epoch': 'x'}",
    "TSUP {not json}",
    "TSUP [1, 2, 3]",
    "NOTSUP {\"step\": 3}",
    "speed 1200 tokens/s/gpu",
    "warnings.warn(",
    "\x00\x01\x02\ufffd\ufffd",
])
def test_lines_that_say_nothing(line):
    assert parse_line(line) is None


def test_rounding_error_of_printed_numbers():
    assert parse_line("{'loss': '1', 'num_tokens': '1.235e+06', 'epoch': '1'}").tokens_err == 500.0
    assert parse_line("{'loss': '1', 'num_tokens': '1234', 'epoch': '1'}").tokens_err == 0.5
    assert parse_line("{'loss': 1.0, 'num_tokens': 1234.0, 'epoch': 1.0}").tokens_err == 0.0


def test_never_raises_on_hostile_input():
    for line in ["{" * 5000 + "'loss': 1}" + "}" * 5000, "x" * (MAX_LINE * 5), "TSUP " + "[" * 100000,
                 "{'loss': " + "9" * 5000 + ", 'epoch': 1}", "\r" * 10000, "%|" * 10000,
                 "{'loss': (1, 2), 'epoch': {1: 2}}", "{'loss': 1e999999, 'epoch': 1}"]:
        o = parse_line(line)
        if o is not None:
            valid(o)
    assert parse_line(None) is None  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text(text):
    o = parse_line(text)
    if o is not None:
        valid(o)


_pieces = st.sampled_from([
    "{", "}", "'loss': ", "'epoch': ", "1.5", "'1.5'", "nan", ", ", "TSUP ", '"step": ', "-3", "e+05",
    " 42%|", "####", "| ", "42/100 ", "[00:10<00:14, ", " 3.00it/s]", "s/it]", "\r", "Total steps = ",
    "1,000", "\x1b[A", "\ufffd", "tok/s", "'num_tokens': ", "True", "[]"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_pieces, max_size=25).map("".join))
def test_near_miss_text(text):
    o = parse_line(text)
    if o is not None:
        valid(o)


# --- whole captures ----------------------------------------------------------------------------------

def test_hf_trainer_446_capture():
    obs = observations("hf_trainer_4.46.log")
    for o in obs:
        valid(o)
    bars = [o for o in obs if o.bar]
    assert {o.max_steps for o in bars} == {120, 25}  # training bar and evaluation bar; Map/shards rejected
    train = [o.step for o in bars if o.max_steps == 120]
    assert train == sorted(train) and train[-1] == 120
    losses = [o.loss for o in obs if o.loss is not None]
    assert len(losses) == 12 and all(0 < x < 3 for x in losses)
    assert obs[-1].finished or any(o.finished for o in obs[-3:])


def test_hf_trainer_450_strings_capture():
    obs = observations("hf_trainer_4.50_strings.log")
    toks = [o.tokens for o in obs if o.tokens is not None]
    assert toks == [16384 * s for s in range(5, 91, 5)]
    assert any(o.finished for o in obs)
    assert not any(o.bar and o.max_steps == 2000 for o in obs)  # the tokenizing bar has a description


def test_unsloth_capture():
    obs = observations("unsloth.log")
    assert any(o.source == "banner" and o.max_steps == 60 for o in obs)
    assert not any(o.max_steps == 51760 for o in obs)
    assert max(o.step for o in obs if o.bar) == 60


def test_axolotl_capture():
    obs = observations("axolotl.log")
    banner = [o for o in obs if o.source == "banner"]
    assert any(o.max_steps == 873 for o in banner) and any(o.num_epochs == 3.0 for o in banner)
    assert not any(o.step == 26275 or o.max_steps == 3492 for o in obs)  # token estimate, examples count
    assert max(o.step for o in obs if o.bar) == 260


def test_trl_capture_tokens_are_rounded_and_say_so():
    obs = [o for o in observations("trl_sft.log") if o.tokens is not None]
    assert len(obs) == 20
    last = obs[-1]
    assert abs(last.tokens - 200 * 16384) <= last.tokens_err and last.tokens_err > 0


def test_garbage_capture():
    obs = observations("garbage.log")
    for o in obs:
        valid(o)
    assert [o.step for o in obs if o.bar] == [100, 200, 300, 400]
    assert [o.max_steps for o in obs if o.max_steps is not None and not o.bar] == [1000]
    assert [o.loss for o in obs if o.loss is not None and o.loss != 1.0] == [0.9, 0.8123]


def test_rotated_capture_fragments_say_nothing():
    tail_of_old = log_lines("rotated-train.log.1")[-1].split("\r")[-1]
    head_of_new = log_lines("rotated-train.log")[0].split("\r")[0]
    assert parse_line(tail_of_old) is None and parse_line(head_of_new) is None
    assert parse_line(tail_of_old + head_of_new).step == 201  # rejoined, it is a whole bar again


# --- trainer_state.json --------------------------------------------------------------------------------

def test_trainer_state_450():
    o = parse_trainer_state((DATA / "trainer_state_4.50.json").read_bytes())
    assert o == Observation(step=1200, max_steps=3750, epoch=0.96, num_epochs=3.0, loss=1.22,
                            learning_rate=pytest.approx(2e-4 * (1 - 1200 / 3750)), tokens=1200 * 16384,
                            source="trainer_state")


def test_trainer_state_436_eval_entry_last():
    o = parse_trainer_state((DATA / "trainer_state_4.36.json").read_bytes())
    assert (o.step, o.max_steps, o.epoch, o.loss, o.learning_rate, o.tokens) == (300, 600, 1.5, 0.55, 3.5e-05, None)


def test_trainer_state_nan_loss_is_unknown_not_nan():
    o = parse_trainer_state((DATA / "trainer_state_nan.json").read_bytes())
    assert o.step == 300 and o.loss is None and o.learning_rate == 3.5e-05


def test_trainer_state_truncated_is_none():
    raw = (DATA / "trainer_state_4.50.json").read_bytes()
    assert parse_trainer_state((DATA / "trainer_state_truncated.json").read_bytes()) is None
    for cut in (0, 1, 10, len(raw) // 2, len(raw) - 3):
        assert parse_trainer_state(raw[:cut]) is None


@pytest.mark.parametrize("doc, want", [
    ({"global_step": 10, "max_steps": -1}, dict(step=10, max_steps=None)),          # custom writers use -1
    ({"global_step": 10, "num_input_tokens_seen": 0}, dict(tokens=None)),           # 0 = not counted
    ({"global_step": 0, "num_input_tokens_seen": 0}, dict(step=0, tokens=0)),
    ({"global_step": 700, "max_steps": 600}, dict(step=700, max_steps=None)),
    ({"global_step": True, "epoch": "1.0"}, dict(step=None, epoch=None)),
    ({"global_step": 10**400, "max_steps": 600, "epoch": 1.0}, dict(step=None, max_steps=600, epoch=1.0)),
    ({"global_step": 5, "log_history": "nope"}, dict(step=5, loss=None)),
    ({"global_step": 5, "log_history": [None, {"loss": 0.5}, 3, {"eval_loss": 0.4}]}, dict(loss=0.5)),
    ({"global_step": 5, "log_history": [{"loss": 0.5}, {"loss": "x"}]}, dict(loss=None)),
    ({"global_step": 5, "log_history": [{"train_runtime": 3.0, "train_loss": 0.2}]}, dict(finished=True)),
])
def test_trainer_state_odd_values(doc, want):
    o = parse_trainer_state(json.dumps(doc).encode())
    valid(o)
    for k, v in want.items():
        assert getattr(o, k) == v, k


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe\x00\x01", b"[]", b"null", b'{"epoch": 1}', b"{" * 100000,
                                 "{\"global_step\": 1, \"x\": \"\udcff\"}".encode("utf-8", "surrogatepass")])
def test_trainer_state_garbage(raw):
    assert parse_trainer_state(raw) is None


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=8)
_keys = st.sampled_from(["global_step", "max_steps", "epoch", "num_train_epochs", "num_input_tokens_seen",
                         "log_history", "loss", "learning_rate"])


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(_keys, _json | st.lists(st.dictionaries(_keys, _json, max_size=4), max_size=4), max_size=8))
def test_trainer_state_arbitrary_shapes(doc):
    o = parse_trainer_state(json.dumps(doc).encode())
    if o is not None:
        valid(o)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_trainer_state_arbitrary_bytes(raw):
    o = parse_trainer_state(raw)
    if o is not None:
        valid(o)
