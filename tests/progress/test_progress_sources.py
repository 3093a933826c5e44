"""Progress from where trainers really write (issue 40): TensorBoard event files and the MLflow file
store read without their SDKs, incrementally; trainer_state.json alone enough for a rate and the
final step; the freshest source named in status and in the stall alert.

The readers against bytes built here, then against the real writers (tensorboardX and mlflow, in
the side venv TSUP_HF_PYTHON names), and a real HF Trainer with disable_tqdm=True under the real
daemon."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.config import ConfigError, from_dict
from supervisor.progress import trackfiles as tf
from supervisor.progress.trackers import TrackerFiles
from tests.waiting import wait_until

HF_PYTHON = os.environ.get("TSUP_HF_PYTHON", "")
FIXTURES = Path(__file__).parents[1] / "fixtures"


# --- bytes built here ------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wt: int, payload: bytes) -> bytes:
    return _varint(num << 3 | wt) + payload


def event(step: int, wall: float, tag: str, value: float, tensor: bool = False) -> bytes:
    if tensor:  # the new-style scalar: a one-element float tensor (dtype 1, float_val packed)
        t = _field(1, 0, _varint(1)) + _field(5, 2, _varint(4) + struct.pack("<f", value))
        v = _field(1, 2, _varint(len(tag)) + tag.encode()) + _field(8, 2, _varint(len(t)) + t)
    else:
        v = _field(1, 2, _varint(len(tag)) + tag.encode()) + _field(2, 5, struct.pack("<f", value))
    summary = _field(1, 2, _varint(len(v)) + v)
    return (_field(1, 1, struct.pack("<d", wall)) + _field(2, 0, _varint(step))
            + _field(5, 2, _varint(len(summary)) + summary))


def record(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + b"\0" * 4 + data + b"\0" * 4


def test_whole_records_only_and_the_rest_read_later():
    buf = record(event(1, 10.0, "train/loss", 2.5)) + record(event(2, 11.0, "train/loss", 2.0, tensor=True))
    recs, used = tf.tf_records(buf[:-3])  # the writer is inside the second record
    assert len(recs) == 1 and used == len(record(event(1, 10.0, "train/loss", 2.5)))
    recs, used = tf.tf_records(buf)
    assert used == len(buf)
    pts = [p for r in recs for p in tf.tf_scalars(r)]
    assert [(p.step, p.key, round(p.value, 3)) for p in pts] == [(1, "train/loss", 2.5), (2, "train/loss", 2.0)]


@pytest.mark.parametrize("junk", [struct.pack("<Q", 1 << 40) + b"\0" * 20, record(b"\xff\xff\xff")])
def test_bytes_that_are_not_events_are_named_not_guessed(junk):
    with pytest.raises(tf.Garbage):
        recs, _ = tf.tf_records(junk)
        for r in recs:
            tf.tf_scalars(r)


def test_mlflow_lines_and_status():
    text = "1700000000000 2.5 1\n1700000001000 nan 2\nbroken\n1700000002000 1.5 3\n"
    assert [(p.step, p.t, p.value) for p in tf.mlflow_lines(text, "loss")] == [(1, 1.7e9, 2.5), (3, 1.7e9 + 2, 1.5)]
    assert tf.mlflow_status("run_id: x\nstatus: 3\n") == "FINISHED"
    assert tf.mlflow_status("status: 4\n") == "FAILED" and tf.mlflow_status("status: 1\n") == "RUNNING"
    assert [tf.kind(k) for k in ("train/loss", "Loss", "train/epoch", "train/learning_rate", "eval/loss")] == [
        "loss", "loss", "epoch", "learning_rate", ""]


def test_files_are_read_incrementally_never_from_the_start_again(tmp_path):
    runs = tmp_path / "out" / "runs" / "x"
    runs.mkdir(parents=True)
    ev = runs / "events.out.tfevents.1.host"
    ev.write_bytes(record(event(0, 1.0, "hparams", 0.0)))
    metrics = tmp_path / "out" / "mlruns" / "0" / "abc" / "metrics" / "train"
    metrics.mkdir(parents=True)
    (metrics.parent.parent / "meta.yaml").write_text("status: 1\n")
    (metrics / "loss").write_text("1700000000000 3.0 1\n")
    t = TrackerFiles(["auto"])
    got = t.poll([str(tmp_path / "out")], None)
    assert sorted((o.source, o.step, o.loss) for o, _ in got.obs) == [("mlflow", 1, 3.0)]
    with open(ev, "ab") as f:
        full = record(event(5, 2.0, "train/loss", 1.25))
        f.write(full[:10])  # half a record: nothing yet
    assert t.poll([str(tmp_path / "out")], None).obs == []
    with open(ev, "ab") as f:
        f.write(full[10:])
    with open(metrics / "loss", "a") as f:
        f.write("1700000009000 2.0 2\n17000000")  # a line being written
    got = t.poll([str(tmp_path / "out")], None)
    assert sorted((o.source, o.step, o.loss) for o, _ in got.obs) == [("mlflow", 2, 2.0), ("tensorboard", 5, 1.25)]
    st = {f["source"]: f["read_bytes"] for f in t.status()["files"]}
    assert st["tensorboard"] == ev.stat().st_size  # each byte read once
    (metrics.parent.parent / "meta.yaml").write_text("status: 3\n")
    with open(metrics / "loss", "a") as f:
        f.write("10000 1.0 3\n")
    got = t.poll([str(tmp_path / "out")], None)
    assert [(o.step, o.loss) for o, _ in got.obs] == [(3, 1.0)]
    assert [v.rsplit(": ", 1)[1] for v in got.ended.values()] == ["FINISHED"]


def test_a_fifo_or_a_link_named_like_an_event_file_holds_nothing_up(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "events.out.tfevents.9.fifo")
    (out / "events.out.tfevents.9.link").symlink_to("/etc/hostname")
    t = TrackerFiles(["tensorboard"])
    assert t.poll([str(out)], None).obs == []
    assert t.status()["files"] == []


def test_sources_are_checked_by_name():
    from_dict({"progress": {"sources": ["log", "tensorboard", "mlflow", "trainer_state"]}})
    with pytest.raises(ConfigError) as e:
        from_dict({"progress": {"sources": ["wandb", "comet"]}})
    from_dict({"progress": {"sources": ["trackio", "wandb"]}})
    assert e.value.problems == ['progress.sources[1]: "comet" is not a source; expected auto, log, trainer_state, '
                                'tensorboard, mlflow, trackio, wandb, lightning']
    t = TrackerFiles(["log"])
    assert not t.wanted


def test_trackio_rows_and_what_is_skipped():
    rows = [(1, 1, "2026-12-05T21:47:15.697073+00:00", b'{"train/loss": 1.0, "epoch": 0.2, "note": "x"}'),
            (2, 2, "not a time", b"{}"), (3, 3, "2026-12-05T21:47:16+00:00", b"[1]"),
            (7, 4, "2026-12-05T21:47:17+00:00", '{"train/loss": NaN, "lr": 0.1}')]
    import datetime as dt

    pts, last = tf.trackio_rows(rows, lambda ts: dt.datetime.fromisoformat(ts).timestamp())
    assert last == 7
    assert [(p.step, p.key, p.value) for p in pts] == [(1, "train/loss", 1.0), (1, "epoch", 0.2), (4, "lr", 0.1)]


def wandb_file(records: list[bytes], block: int = 32768) -> bytes:
    """A W&B datastore as its writer lays it out: the header, then chunks that never cross a block."""
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for rec in records:
        first = True
        while True:
            left = block - len(out) % block
            if left < 7:
                out += b"\0" * left
                continue
            room = left - 7
            part, rec = rec[:room], rec[room:]
            typ = (1 if not rec else 2) if first else (4 if not rec else 3)
            out += struct.pack("<IHB", 0, len(part), typ) + part
            first = False
            if not rec:
                break
    return bytes(out)


def wandb_history(step: int, t: float, items: dict[str, float]) -> bytes:
    hist = b""
    for k, v in items.items():
        item = _field(1, 2, _varint(len(k)) + k.encode()) + _field(6, 1, struct.pack("<d", v))
        hist += _field(1, 2, _varint(len(item)) + item)
    ts = json.dumps(t).encode()
    item = _field(1, 2, _varint(10) + b"_timestamp") + _field(16, 2, _varint(len(ts)) + ts)
    hist += _field(1, 2, _varint(len(item)) + item)
    st = _field(1, 0, _varint(step))
    hist += _field(2, 2, _varint(len(st)) + st)
    return _field(1, 0, _varint(step)) + _field(2, 2, _varint(len(hist)) + hist)


def test_wandb_records_across_blocks_and_reads_that_stop_anywhere():
    big = {f"k{i}": float(i) for i in range(3000)}  # one record of ~60 KiB: first, middle, last chunks
    recs = [wandb_history(1, 10.0, {"train/loss": 2.0}), wandb_history(2, 11.0, big),
            wandb_history(3, 12.0, {"train/loss": 1.0})]
    data = wandb_file(recs)
    got, pos, pending = [], 0, b""
    for cut in range(4096, len(data) + 4096, 4096):  # the file as a reader sees it while it grows
        rs, used, pending = tf.wandb_chunks(data[pos:cut], pos, pending)
        got += rs
        pos += used
    assert got == recs and pending == b""
    pts = [tf.wandb_record(r)[0] for r in got]
    assert [(p.step, p.key, p.value, p.t) for p in pts[0]] == [(1, "train/loss", 2.0, 10.0)]
    assert len(pts[1]) == 3000 and pts[2][0].value == 1.0
    with pytest.raises(tf.Garbage):
        tf.wandb_chunks(b"NOTWANDB" + data[8:], 0, b"")


# --- the real writers ------------------------------------------------------------------------------
needs_hf = pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf)")


@needs_hf
def test_what_tensorboardx_and_mlflow_write_is_read(tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import mlflow
        from tensorboardX import SummaryWriter
        w = SummaryWriter({str(out / "runs" / "a")!r})
        mlflow.set_tracking_uri("file:{out / "mlruns"}")
        with mlflow.start_run():
            for s in range(1, 31):
                w.add_scalar("train/loss", 3.0 / s, s)
                w.add_scalar("train/epoch", s / 30, s)
                mlflow.log_metric("train/loss", 3.0 / s, step=s)
        w.close()
    """)
    r = subprocess.run([HF_PYTHON, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = TrackerFiles(["auto"]).poll([str(out)], None)
    tb = [(o.step, round(o.loss, 4), round(o.epoch, 3)) for o, _ in got.obs if o.source == "tensorboard"]
    ml = [(o.step, round(o.loss, 4)) for o, _ in got.obs if o.source == "mlflow"]
    assert tb[-1] == (30, 0.1, 1.0) and len(tb) == 30
    assert ml[-1] == (30, 0.1) and len(ml) == 30
    assert [v.rsplit(": ", 1)[1] for v in got.ended.values()] == ["FINISHED"]


@needs_hf
def test_what_a_real_trackio_run_writes_is_read_as_it_grows(tmp_path):
    store = tmp_path / "trackio"

    def log(first: int, last: int, finish: bool) -> None:
        script = textwrap.dedent(f"""
            import trackio
            trackio.init(project="p1", name="run-a", resume="allow")
            for s in range({first}, {last} + 1):
                trackio.log({{"train/loss": 3.0 / s, "train/epoch": s / 40}}, step=s)
            trackio.finish()
        """)
        r = subprocess.run([HF_PYTHON, "-c", script], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "TRACKIO_DIR": str(store)})
        assert r.returncode == 0, r.stderr[-2000:]

    log(1, 20, False)
    t = TrackerFiles(["trackio"])
    got = t.poll([], None, trackio_dirs=[str(store)])
    assert [o.step for o, _ in got.obs] == list(range(1, 21))
    assert round(got.obs[-1][0].loss, 4) == 0.15 and got.obs[-1][0].source == "trackio"
    log(21, 40, True)
    got = t.poll([], None, trackio_dirs=[str(store)])
    assert [o.step for o, _ in got.obs] == list(range(21, 41))  # only what is new
    assert got.obs[-1][0].epoch == 1.0


@needs_hf
def test_what_a_real_wandb_offline_run_writes_is_read(tmp_path):
    script = textwrap.dedent("""
        import wandb
        run = wandb.init(project="p", mode="offline")
        for s in range(1, 31):
            wandb.log({"train/loss": 3.0 / s, "train/epoch": s / 30}, step=s)
        run.finish()
    """)
    r = subprocess.run([HF_PYTHON, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = TrackerFiles(["wandb"]).poll([str(tmp_path)], None)
    steps = [(o.step, round(o.loss, 4), round(o.epoch, 3)) for o, _ in got.obs]
    assert steps[-1] == (30, 0.1, 1.0) and len(steps) == 30
    assert [v.rsplit(": ", 1)[1] for v in got.ended.values()] == ["exit code 0"]


@needs_hf
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_trainer_without_a_bar_is_followed_through_its_trackers_to_its_end(tmp_path, make_daemon):
    """disable_tqdm=True, TensorBoard and MLflow: the step and its source while it runs, an ETA once
    a checkpoint gave max_steps, and 60/60 at the end."""
    out = tmp_path / "out"
    cmd = f"{HF_PYTHON} {FIXTURES / 'hf_trackers_train.py'} {out} 60 40 0.6"
    d = make_daemon({"training": {"command": cmd, "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                                  "on_finish": "none",
                                  "env": {"MLFLOW_TRACKING_URI": f"file:{out / 'mlruns'}",
                                          "MLFLOW_ALLOW_FILE_STORE": "true", "OMP_NUM_THREADS": "1"}},
                     "idle": {"count_ssh": False}, "stop": {"action": "dry-run"},
                     "progress": {"sources": ["auto"]}})
    d.req("start")

    def progress() -> dict:
        return d.status()["training"]["progress"]
    p = wait_until(lambda: (lambda p: p if p.get("source") in ("tensorboard", "mlflow") and (p.get("step") or 0) > 5
                            else None)(progress()), 180, interval=0.5, what="a step from a tracker")
    assert p["loss"] is not None
    p = wait_until(lambda: (lambda p: p if p.get("max_steps") == 60 and p.get("eta_s") is not None else None)(
        progress()), 180, interval=0.5, what=f"an ETA once checkpoint-40 gave max_steps; last {progress()}")
    d.wait_training("FINISHED", timeout=240)
    p = wait_until(lambda: (lambda p: p if p.get("step") == 60 else None)(progress()), 60, interval=0.5,
                   what=f"60/60 at the end; last {progress()}")
    assert p["max_steps"] == 60
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 60
    print(f"\nfinal progress: {p}")


def test_the_final_trainer_state_at_the_top_of_output_dir_is_the_end(tmp_path):
    """save_strategy that never lands on the last step: trainer.save_state() at the top says 60."""
    from supervisor.progress.tracker import _newest_state

    out = tmp_path / "out"
    (out / "checkpoint-40").mkdir(parents=True)
    (out / "checkpoint-40" / "trainer_state.json").write_text(json.dumps({"global_step": 40, "max_steps": 60}))
    os.utime(out / "checkpoint-40" / "trainer_state.json", (1e9, 1e9))
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 60, "max_steps": 60}))
    path, _, _ = _newest_state([str(out)], since=0.0)
    assert path == str(out / "trainer_state.json")


def test_a_stall_names_the_source_it_read():
    from supervisor.notify.mails import stall as words

    f = words.Stalled(1, 40, 1.7e9, 3600.0, 1800.0, False, source="tensorboard")
    assert "(from the TensorBoard event files; no source has a newer one)" in words.stalled(f).body


def test_the_tracker_reader_costs_little(tmp_path):
    """Four sources written once a second for a minute: the reads stay small (bench in bench_progress)."""
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    ev = out / "runs" / "events.out.tfevents.1.h"
    t = TrackerFiles(["auto"])
    for s in range(60):
        with open(ev, "ab") as f:
            f.write(record(event(s, float(s), "train/loss", 1.0 / (s + 1))))
        got = t.poll([str(out)], None)
        assert [o.step for o, _ in got.obs] == [s]
    assert t.status()["files"][0]["read_bytes"] == ev.stat().st_size
    assert sys.getsizeof(t._files) < 10_000


def test_the_finish_mail_names_the_source_and_the_trackers_end_state():
    from supervisor.notify.mails import training as run_words

    p = run_words.LastProgress(60, 60, 0.47, 4.32, None, "USD", "mlflow", ("MLflow run /w/out/mlruns/0/abc: FINISHED",))
    text = run_words._progress_text(p)
    assert "Last progress: step 60/60, epoch 0.47, loss 4.32 (from mlflow)" in text
    assert "Tracker: MLflow run /w/out/mlruns/0/abc: FINISHED" in text


@pytest.mark.parametrize("source", ["tensorboard", "mlflow", "trackio", "wandb", "lightning"])
def test_a_tracker_that_lags_the_log_never_restarts_the_rate(source):
    """A tracker's flush behind the step the log already gave is that tracker lagging: the rate's
    series stays (a step going back would otherwise read as a restart of the run)."""
    from supervisor.progress import record as pr
    from supervisor.progress.parse import Observation

    run = pr.Run(run_id=1, started_at=0.0)
    for t, step in ((10.0, 10), (20.0, 20), (30.0, 30)):
        pr.merge(run, Observation(step=step, source="log"), t)
    pr.merge(run, Observation(step=15, loss=1.5, source=source), 31.0)
    assert run.step == 30 and [s.v for s in run.steps.samples] == [10, 20, 30]


def test_a_fifo_put_in_place_of_a_trackio_database_holds_up_nothing(tmp_path, monkeypatch):
    """The training user swaps the database for a FIFO between our lstat and SQLite's own open:
    the look gives up within TRACKIO_WAIT_S and leaves the file alone from then on."""
    import sqlite3
    import time

    from supervisor.progress import trackers

    store = tmp_path / "trackio"
    store.mkdir()
    db = store / "p1.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE metrics (id INTEGER PRIMARY KEY, run_id TEXT, timestamp TEXT, run_name TEXT, "
                "step INTEGER, metrics TEXT)")
    con.commit()
    con.close()
    t = TrackerFiles(["trackio"])
    assert t.poll([], None, trackio_dirs=[str(store)]).obs == []  # found, read: no rows yet
    db.unlink()
    os.mkfifo(db)
    real_lstat = os.lstat
    regular = os.stat(FIXTURES / "ddp_node.py")
    monkeypatch.setattr(trackers.os, "lstat", lambda p: regular if str(p) == str(db) else real_lstat(p))
    monkeypatch.setattr(trackers, "TRACKIO_WAIT_S", 0.5)
    t0 = time.monotonic()
    try:
        got = t.poll([], None, trackio_dirs=[str(store)])
        took = time.monotonic() - t0
        assert got.obs == [] and took < 3, took
        assert t.status()["files"][0]["error"].startswith("did not answer within 0.5 s")
        assert t.poll([], None, trackio_dirs=[str(store)]).obs == []  # not tried again
    finally:
        try:
            os.close(os.open(db, os.O_WRONLY | os.O_NONBLOCK))  # lets the reader left waiting go
        except OSError:
            pass


def test_the_final_trainer_state_of_an_output_dir_one_folder_below_the_watched_one(tmp_path):
    """sync.watch = /workspace, --output_dir /workspace/run1: save_state()'s trainer_state.json in
    run1/ is the end too, not only a checkpoint's."""
    from supervisor.progress.tracker import _newest_state

    run1 = tmp_path / "workspace" / "run1"
    (run1 / "checkpoint-40").mkdir(parents=True)
    (run1 / "checkpoint-40" / "trainer_state.json").write_text(json.dumps({"global_step": 40, "max_steps": 60}))
    os.utime(run1 / "checkpoint-40" / "trainer_state.json", (1e9, 1e9))
    (run1 / "trainer_state.json").write_text(json.dumps({"global_step": 60, "max_steps": 60}))
    path, _, _ = _newest_state([str(tmp_path / "workspace")], since=0.0)
    assert path == str(run1 / "trainer_state.json")
