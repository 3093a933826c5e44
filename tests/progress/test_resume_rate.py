"""The rate after a resume counts only the steps this process did (issue 37, finding 6). The HF
Trainer's progress bar starts at 0 and leaps to the resumed step at its first update, and the it/s
it prints counts that leap: 15 s after a resume, status showed 339 steps/s and an ETA of 1 s.
Pure first (the bar's lines as the Trainer prints them), then the real daemon and the tiny
trainer, which draws its bar the same way."""

from __future__ import annotations

import sys
from pathlib import Path

from supervisor.progress.record import Run, figures, merge_line
from tests.waiting import wait_until

TRAINER = Path(__file__).resolve().parents[2] / "examples" / "tiny_trainer.py"


def bar(n: int, total: int, rate: str) -> str:
    return f" {n * 100 // total:3d}%|#         | {n}/{total} [00:01<00:10, {rate}]"


def test_the_leap_to_the_resumed_step_is_not_this_runs_rate():
    r = Run(run_id=2, started_at=0.0, from_step=5000)
    merge_line(r, bar(0, 10000, "?it/s"), 0.5)
    merge_line(r, bar(5001, 10000, "5001.00it/s"), 1.0)  # the first update: the leap
    for i in range(2, 16):
        merge_line(r, bar(5000 + 2 * i, 10000, "4000.00it/s"), float(i))  # tqdm's EMA still remembers it
    f = figures(r, 15.0, 600.0)
    assert f.steps_per_s is None and f.eta_s is None  # not known yet, rather than 4000/s and ETA 1 s
    for i in range(16, 40):
        merge_line(r, bar(5000 + 2 * i, 10000, "900.00it/s"), float(i))
    f = figures(r, 39.0, 600.0)
    assert abs(f.steps_per_s - 2.0) < 0.05, f
    assert 2400 < f.eta_s < 2500  # (10000 - 5078) / 2 steps/s


def test_a_run_from_nothing_keeps_its_bar_rate_and_its_window():
    r = Run(run_id=1, started_at=0.0)
    merge_line(r, bar(0, 1000, "?it/s"), 0.5)
    merge_line(r, bar(2, 1000, "2.00it/s"), 1.0)
    assert figures(r, 1.0, 600.0).steps_per_s == 2.0  # before our window, tqdm's own rate
    for i in range(2, 40):
        merge_line(r, bar(2 * i, 1000, "2.00it/s"), float(i))
    assert abs(figures(r, 39.0, 600.0).steps_per_s - 2.0) < 0.05
    assert r.leap_at is None


def test_a_resumed_tiny_trainer_never_shows_the_leap_as_speed(make_daemon, tmp_path):
    out = tmp_path / "out"
    base = f"{sys.executable} {TRAINER} --output {out} --save-steps 200 --logging-steps 50"
    d = make_daemon({"training": {"command": f"{base} --steps 200 --step-time 0"},
                     "sync": {"target": str(tmp_path / "remote"), "watch": [str(out)], "quiet_period": "0.3s"}})
    d.req("start")
    d.wait_training("FINISHED", 60)
    assert (out / "checkpoint-200" / "trainer_state.json").is_file()
    # the second run resumes from checkpoint-200 (TRAIN_SUPERVISOR_RESUME_FROM) at 5 steps/s
    r = d.ctl("run", "--", "sh", "-c", f"{base} --steps 2000 --step-time 0.2")
    assert r.returncode == 0, r.stderr
    seen: list[float] = []

    def look() -> bool:
        p = d.status()["training"].get("progress") or {}
        if p.get("steps_per_s") is not None:
            seen.append(p["steps_per_s"])
        return (p.get("step") or 0) > 200 and len(seen) >= 3
    wait_until(look, 60, interval=0.5, what="a measured rate after the resume")
    assert max(seen) < 7.5, seen  # about 5 steps/s; the leap would read as 200 and more
    assert d.status()["training"]["progress"]["eta_s"] > 200
