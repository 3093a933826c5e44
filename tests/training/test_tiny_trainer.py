"""examples/tiny_trainer.py: the README demo's job. Run for real (fast), its files and output read back."""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from supervisor import config
from supervisor.cli.render import progress_line
from supervisor.clock import FakeClock
from supervisor.notify.alerts import Alerts
from supervisor.progress.parse import parse_trainer_state
from supervisor.progress.tracker import ProgressTracker
from supervisor.statefile import StateStore
from tests.fixtures.context import ConfiguredContext

TRAINER = Path(__file__).resolve().parents[2] / "examples" / "tiny_trainer.py"
CKPT_FILES = {"model.safetensors", "config.json", "training_args.bin", "optimizer.pt", "scheduler.pt",
              "rng_state.pth", "trainer_state.json"}


def train(out: Path, *args: str, timeout: float = 60, merged: bool = False) -> subprocess.CompletedProcess:
    """Run it; `merged` interleaves stderr into stdout as in the training log (`2>&1`)."""
    # -I -S: no site-packages at all, so the demo job provably needs nothing but the standard library
    return subprocess.run([sys.executable, "-I", "-S", str(TRAINER), "--output", str(out), "--step-time", "0",
                           *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                          timeout=timeout)


def read_safetensors(path: Path) -> dict[str, list[float]]:
    """Read by the format's definition, checking every rule a loader checks."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0 and 8 + n <= len(data)
    header = json.loads(data[8:8 + n].decode("utf-8"))
    body = data[8 + n:]
    out, end = {}, 0
    for name, meta in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = meta["data_offsets"]
        assert a == end and meta["dtype"] == "F32" and b - a == 4 * math.prod(meta["shape"])
        out[name] = list(struct.unpack(f"<{(b - a) // 4}f", body[a:b]))
        end = b
    assert end == len(body)
    return out


def tracker(ctx: ConfiguredContext) -> ProgressTracker:
    return ProgressTracker(ctx, ctx.config.progress, price_per_hour=ctx.config.price_per_hour, currency=ctx.config.currency,
                           job_env=ctx.config.training.env, job_user=ctx.config.training.user)


def render_line(tr: ProgressTracker, now: float) -> str:
    """The status line as `supervisorctl status` builds it, from the status --json blocks alone."""
    return progress_line({"now": now, "training": {"progress": tr.snapshot(now)}, "cost": tr.cost(now)})


def tracker_over(output: bytes, state_dir: Path) -> ProgressTracker:
    clock = FakeClock()
    cfg = config.Config()
    ctx = ConfiguredContext(clock, StateStore(state_dir), Alerts(cfg.alerts, clock, None), cfg)
    tr = tracker(ctx)
    tr.start_run(1, clock.time())
    for line in output.decode("utf-8", errors="replace").split("\n"):
        clock.advance(1)
        tr.feed_line(line, clock.time())
    return tr


def final(tr: ProgressTracker) -> dict:
    return tr.snapshot(tr.ctx.clock.time())


class Recorder(FileSystemEventHandler):
    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def on_any_event(self, event):
        # only IN_CLOSE_WRITE: watchdog makes up "created" events, in listing order, for what it
        # finds in a folder that appeared before its watch was added
        if event.event_type == "closed" and not event.is_directory:
            with self.lock:
                self.events.append((event.event_type, event.src_path))


def test_checkpoint_layout_rotation_and_order(tmp_path):
    out = tmp_path / "out"
    for step in (20, 40, 60):   # watched from the start, so no write can beat the watch
        (out / f"checkpoint-{step}").mkdir(parents=True)
    rec = Recorder()
    obs = Observer()
    obs.schedule(rec, str(out), recursive=True)
    obs.start()
    try:
        r = train(out, "--steps", "60", "--save-steps", "20", "--save-total-limit", "2")
    finally:
        obs.stop()
        obs.join(5)
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-40", "checkpoint-60", "final"]
    for ck in ("checkpoint-40", "checkpoint-60"):
        assert {p.name for p in (out / ck).iterdir()} == CKPT_FILES
    assert {p.name for p in (out / "final").iterdir()} == {"model.safetensors", "config.json", "training_args.bin"}
    # within each checkpoint the Trainer's order: trainer_state.json is the last file touched
    for step in (20, 40, 60):
        folder = str(out / f"checkpoint-{step}")
        names = [Path(p).name for _, p in rec.events if str(Path(p).parent) == folder]
        assert names and names[-1] == "trainer_state.json", names
        assert set(names) == CKPT_FILES
    w60 = read_safetensors(out / "checkpoint-60" / "model.safetensors")
    assert set(w60) == {"linear.weight", "linear.bias"} and len(w60["linear.weight"]) == 16
    assert all(math.isfinite(x) for x in w60["linear.weight"])
    assert read_safetensors(out / "final" / "model.safetensors") == w60
    st = parse_trainer_state((out / "checkpoint-60" / "trainer_state.json").read_bytes())
    assert (st.step, st.max_steps, st.epoch, st.tokens) == (60, 60, 0.6, 60 * 32 * 128)
    assert st.loss is not None and 0 < st.loss < 1 and st.learning_rate is not None
    doc = json.loads((out / "checkpoint-40" / "trainer_state.json").read_text())
    assert [e["step"] for e in doc["log_history"]] == [10, 20, 30, 40]


def test_the_trackers_read_its_output(tmp_path):
    r = train(tmp_path / "out", "--steps", "60", "--save-steps", "30", merged=True)
    assert r.returncode == 0
    s = final(tracker_over(r.stdout, tmp_path / "state"))
    assert (s["step"], s["max_steps"], s["finished"], s["source"]) == (60, 60, True, "tsup")
    assert s["loss"] is not None and s["epoch"] == 0.6
    assert b"\r" in r.stdout and b"60/60 [" in r.stdout


@pytest.mark.parametrize("args", [("--no-tsup", "--log-style", "repr", "--no-tokens"),
                                  ("--no-tsup", "--no-banner")])
def test_without_tsup_the_trainer_lines_suffice(tmp_path, args):
    r = train(tmp_path / "out", "--steps", "40", "--save-steps", "20", *args, merged=True)
    assert r.returncode == 0
    assert b"TSUP" not in r.stdout
    s = final(tracker_over(r.stdout, tmp_path / "state"))
    assert (s["step"], s["max_steps"], s["finished"], s["source"]) == (40, 40, True, "tqdm")
    assert s["loss"] is not None


def test_fail_at_exits_1_with_a_traceback(tmp_path):
    r = train(tmp_path / "out", "--steps", "60", "--save-steps", "20", "--fail-at", "25")
    assert r.returncode == 1
    err = r.stderr.decode()
    assert "Traceback (most recent call last):" in err
    assert err.rstrip().splitlines()[-1] == "RuntimeError: tiny_trainer: simulated failure at step 25 (--fail-at)"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-20"]


def test_oom_at_dies_like_pytorch(tmp_path):
    r = train(tmp_path / "out", "--steps", "60", "--oom-at", "3")
    assert r.returncode == 1
    last = r.stderr.decode().rstrip().splitlines()[-1]
    assert last.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has")


def test_peft_layout(tmp_path):
    out = tmp_path / "out"
    assert train(out, "--steps", "20", "--save-steps", "20", "--peft").returncode == 0
    for folder in (out / "checkpoint-20", out / "final"):
        names = {p.name for p in folder.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names
        assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
        read_safetensors(folder / "adapter_model.safetensors")


def test_resume_continues_from_the_newest_checkpoint(tmp_path):
    out = tmp_path / "out"
    assert train(out, "--steps", "60", "--save-steps", "20", "--fail-at", "45").returncode == 1
    r = train(out, "--steps", "60", "--save-steps", "20", "--resume", merged=True)
    assert r.returncode == 0
    assert b"Continuing training from global step 40" in r.stdout
    doc = json.loads((out / "checkpoint-60" / "trainer_state.json").read_text())
    assert doc["global_step"] == 60
    assert [e["step"] for e in doc["log_history"]] == [10, 20, 30, 40, 50, 60]
    s = final(tracker_over(r.stdout, tmp_path / "state"))
    assert (s["step"], s["max_steps"], s["finished"]) == (60, 60, True)


def test_paced_run_reports_its_rate(tmp_path):
    r = subprocess.run([sys.executable, "-I", "-S", str(TRAINER), "--output", str(tmp_path / "out"),
                        "--steps", "8", "--step-time", "0.05", "--save-steps", "8"], capture_output=True, timeout=60)
    assert r.returncode == 0
    last_bar = r.stderr.decode().split("\r")[-1]
    rate = float(re.search(r"([\d.]+)it/s\]", last_bar).group(1))
    assert 5 < rate <= 21   # 20 steps/s asked; a loaded machine is slower, never faster
    metrics = [ln for ln in r.stdout.decode().splitlines() if "train_runtime" in ln]
    assert len(metrics) == 1


@pytest.mark.parametrize("bad", [("--steps", "0"), ("--step-time", "-1"), ("--save-steps", "x")])
def test_bad_arguments(tmp_path, bad):
    r = train(tmp_path / "out", *bad)
    assert r.returncode == 2 and b"error:" in r.stderr


def test_live_run_through_the_log_follower(tmp_path):
    """The demo's path in miniature: the job writes its log, the real LogFollower reads it, the
    status line shows a bar, the step, an ETA and the cost while it runs."""
    from supervisor.clock import SystemClock
    from supervisor.training.logfollow import LogFollower
    from tests.waiting import wait_until

    clock = SystemClock()
    cfg = config.from_dict({"state_dir": str(tmp_path / "state"), "price_per_hour": 3.90, "currency": "EUR"})
    ctx = ConfiguredContext(clock, StateStore(cfg.state_dir), Alerts(cfg.alerts, clock, None), cfg)
    tr = tracker(ctx)
    log_path = tmp_path / "train.log"
    tr.start_run(1, clock.time())
    follower = LogFollower(str(log_path), [tr])
    out = tmp_path / "out"
    with open(log_path, "wb") as logf:
        job = subprocess.Popen([sys.executable, "-I", "-S", str(TRAINER), "--output", str(out), "--steps", "150",
                                "--step-time", "0.02", "--save-steps", "50"], stdout=logf, stderr=subprocess.STDOUT)
    try:
        def running_line():
            follower.poll(clock.time())
            line = render_line(tr, clock.time())
            return line if re.search(r"\[[#-]{20}\]  \d+/150 .* ETA \d+s? .*spent €", line) else None

        line = wait_until(running_line, timeout=30, interval=0.05, what="a live progress line with ETA and cost")
        assert "tok/s" in line and "to finish ~€" in line
        assert job.wait(timeout=60) == 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    follower.poll(clock.time())
    tr.scan_checkpoints([str(out)])
    s = tr.snapshot(clock.time())
    assert (s["step"], s["max_steps"], s["finished"], s["eta_s"]) == (150, 150, True, 0.0)
    assert "done in" in render_line(tr, clock.time())
    follower.close()
