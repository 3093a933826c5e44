"""The caps through the real daemon: its real Training in real tmux, its real sync engine to a local
folder target, real SMTP (aiosmtpd), with a fake clock where the hours pass and the machine's uptime
(what the provider bills) moves with it. Duties run one by one as the scheduler would (Daemon.duties()).

The trainer prints TSUP progress lines the test feeds it (one step every 10 s of fake time), writes a
checkpoint every 100 steps, and saves one more on SIGINT. Each test prints the margin left at the stop."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.clock import FakeClock
from supervisor.config import from_dict
from supervisor.daemon.main import Daemon
from supervisor.interfaces import FinalSyncResult, RequestError
from tests.fixtures.inproc import mails, run
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

REPO = Path(__file__).resolve().parents[2]
PRICE = 10.0  # per hour

TRAINER = """
import json, signal, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.fixtures.hf_writer import HFWriter

feed, out = Path({feed!r}), Path({out!r})
step = 0

def save(signum, frame):
    HFWriter(out).checkpoint(step)
    print("saved checkpoint-%d on %s" % (step, signal.Signals(signum).name), flush=True)
    sys.exit(0)

signal.signal(signal.SIGINT, save)
seen = 0
while True:
    lines = feed.read_text().splitlines() if feed.exists() else []
    for line in lines[seen:]:
        n, t = line.split()
        before, step = step, int(n)
        print("TSUP " + json.dumps({{"step": step, "max_steps": {max_steps}, "time": float(t)}}), flush=True)
        if step // 100 > before // 100:  # save_steps = 100
            HFWriter(out).checkpoint(step // 100 * 100)
    seen = len(lines)
    time.sleep(0.02)
"""


class BillingClock(FakeClock):
    """A fake clock whose machine uptime (the billed time) moves with it from `booted_s`."""

    def __init__(self, booted_s: float = 0.0):
        super().__init__(start=time.time())
        self._mono0 = self.monotonic() - booted_s

    def boot(self) -> tuple[str, float]:
        return ("money-boot", self.monotonic() - self._mono0)


def config(tmp_path: Path, smtp, budget: dict, max_steps: int = 300, **extra) -> dict:
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir(exist_ok=True)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(repo=str(REPO), feed=str(tmp_path / "feed"), out=str(out), max_steps=max_steps))
    cfg = {
        "state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "control.sock"),
        "price_per_hour": PRICE, "currency": "USD",
        "training": {"command": f"{sys.executable} {script}", "workdir": str(tmp_path),
                     "log": str(tmp_path / "train.log"), "on_finish": "none", "stop_grace": "30s"},
        "sync": {"target": str(target), "watch": [str(out)], "quiet_period": "1s"},
        "idle": {"count_ssh": False, "count_tmux_clients": False},
        "stop": {"action": "dry-run", "final_sync": [str(out)], "retry_interval": "2m"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp.port, "security": "none"},
        "alerts": {"first_delay": "0s", "max_per_hour": 60},
        "budget": budget,
    }
    cfg.update(extra)
    return cfg


def start(d: Daemon, tmp_path: Path) -> None:
    d.training.start()
    wait_until(lambda: run(d, "training") or d.training.info().state.value == "RUNNING", 30, what="RUNNING")


class Feeder:
    """Moves the fake clock and feeds the trainer its steps (0.1 step/s of fake time)."""

    def __init__(self, d: Daemon, tmp_path: Path):
        self.d, self.feed, self.step = d, tmp_path / "feed", 0

    def round(self, seconds: float) -> None:
        d = self.d
        d.clock.advance(seconds)
        if d.training.info().state.value == "RUNNING" and d.guard.status()["idle"]["state"] != "STOPPING":
            self.step += int(seconds / 10)
            with open(self.feed, "a") as f:
                f.write(f"{self.step} {d.clock.time()}\n")
            wait_until(lambda: run(d, "log") or d.progress.snapshot(d.clock.time()).get("step") == self.step, 20,
                       interval=0.02, what=f"step {self.step} read")
        run(d, "training", "progress", "idle", "budget", "alerts")


def stop_done(d: Daemon, feeder: Feeder, tick: float = 1.0, timeout: float = 60) -> dict:
    """Go on (the clock moving `tick` per 0.05 s of real time: the stop's real steps cost fake time too)
    until the stop action ran; the stop block of status."""
    def done() -> bool:
        feeder.round(tick)
        d.guard.drain(0.05)
        return d.guard.status()["idle"]["state"] == "STOPPED"
    wait_until(done, timeout, interval=0.05, what="the stop action ran")
    return d.guard.status()["stop"]


def test_max_cost_the_eta_exceeds_warns_with_the_projection_saves_first_and_stops_with_money_left(
        tmp_path, daemon, smtp_server):
    # 5 USD at 10 USD/h: the cap is 30 min of uptime; the run needs 300 steps at 0.1/s = 50 min
    clock = BillingClock()
    seen = tmp_path / "hooks.env"
    # one file per event: the final_sync_done hook runs on its own thread, the stop hook beside it, and
    # two shells appending to one file interleave their lines (seen on the fresh machine)
    hooks = [{"run": f"env | grep ^TRAIN_SUPERVISOR_ | sort > {seen}.$TRAIN_SUPERVISOR_EVENT",
              "events": ["stop", "final_sync_done"], "timeout": "10s"}]
    d = daemon(from_dict(config(tmp_path, smtp_server, {"max_cost": 5.0, "margin": "1m"}, hooks=hooks)), clock)
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    while d.guard.status()["idle"]["state"] != "STOPPING":
        feeder.round(60)
        assert feeder.step < 300, d.status()["budget"]
    spent_at_begin = PRICE * clock.boot()[1] / 3600
    with pytest.raises(RequestError, match="keepalive does not move"):
        d.guard.keepalive(7200)  # keepalive does not move a cap

    # the warning (80 % = 24 min): the projection, the cap's moment, the last checkpoint before it
    warn = wait_until(lambda: mails(smtp_server, "spend cap 5.00 USD"), 20, what="the projection mail")
    subject, body = warn[0]
    assert "stops before the end" in subject
    assert "At this rate the run needs 8.33 USD (ETA" in body  # 50 min of uptime at 10 USD/h
    assert "the spend cap of 5.00 USD is reached at" in body
    assert "the last checkpoint before then will be about checkpoint-100" in body
    b = d.status()["budget"]
    assert b["cap"]["kind"] == "max_cost" and b["projection"]["fits"] is False and b["acted"] == "max_cost=5"

    stop = stop_done(d, feeder)
    st = d.status()
    assert stop["phase"] == "done" and stop["reason"] == "cost" and stop["final_sync"]["ok"]
    assert stop["interrupt_ended"] == "exit code 0"
    saved_step = feeder.step
    log = (tmp_path / "train.log").read_text()
    assert f"saved checkpoint-{saved_step} on SIGINT" in log
    assert (tmp_path / "target" / f"checkpoint-{saved_step}" / "trainer_state.json").exists()
    # the money at the moment the action ran (dry-run: its record is the action)
    rec = d.guard.stopper.rec
    boot_wall = st["now"] - clock.boot()[1]
    spent_at_action = PRICE * (rec.done_at - boot_wall) / 3600
    left = 5.0 - spent_at_action
    print(f"\nMARGIN max_cost: stop began at {spent_at_begin:.3f} USD, action ran at {spent_at_action:.3f} USD "
          f"of 5.00: {left:.3f} USD left ({left / PRICE * 3600:.0f} s of uptime)")
    assert left > 0
    stopping = mails(smtp_server, "stopping now")
    assert stopping and "the spend cap of 5.00 USD" in stopping[-1][0]
    # the hooks: told the event, the reason, the target and the newest checkpoint on it (the SIGINT save)
    assert d.hooks.wait(10)
    def env_of(event: str) -> dict:
        f = seen.with_name(f"{seen.name}.{event}")
        return dict(x.split("=", 1) for x in f.read_text().splitlines() if "=" in x) if f.exists() else {}
    stop_env = env_of("stop")
    assert stop_env.get("TRAIN_SUPERVISOR_EVENT") == "stop", stop_env
    assert stop_env["TRAIN_SUPERVISOR_REASON"] == "max_cost" and stop_env["TRAIN_SUPERVISOR_FINAL_SYNC_OK"] == "True"
    assert stop_env["TRAIN_SUPERVISOR_CHECKPOINT"].endswith(f"checkpoint-{saved_step}")
    assert stop_env["TRAIN_SUPERVISOR_TARGET"] == str(tmp_path / "target")
    assert env_of("final_sync_done").get("TRAIN_SUPERVISOR_EVENT") == "final_sync_done"


def test_a_deadline_with_a_40s_final_sync_still_stops_before_the_deadline(tmp_path, daemon, smtp_server):
    clock = BillingClock(booted_s=600)
    deadline = clock.time() + 40 * 60
    local = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(deadline))
    d = daemon(from_dict(config(tmp_path, smtp_server, {"deadline": local, "margin": "1m"})), clock)
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    real_final = d.sync.final_sync
    took: list[float] = []

    def slow_final(paths, timeout_s):  # a slow target: the final sync takes 40 s of the fake clock
        r = real_final(paths, timeout_s)
        clock.advance(40)
        took.append(40)
        return r
    d.sync.final_sync = slow_final
    while d.guard.status()["idle"]["state"] != "STOPPING":
        feeder.round(60)
        assert clock.time() < deadline, d.status()["budget"]
    stop = stop_done(d, feeder)
    assert stop["phase"] == "done" and stop["reason"] == "deadline" and stop["final_sync"]["ok"] and took
    left = int(deadline) - d.guard.stopper.rec.done_at
    print(f"\nMARGIN deadline: the action ran {left:.0f} s before the deadline (final sync 40 s)")
    assert left > 0
    assert any("deadline" in s for s, _ in mails(smtp_server, "stopping now"))


def test_a_hanging_final_sync_is_cut_at_the_caps_moment_and_the_mail_names_what_did_not_make_it(
        tmp_path, daemon, smtp_server):
    clock = BillingClock()
    deadline = clock.time() + 20 * 60
    d = daemon(from_dict(config(tmp_path, smtp_server, {"deadline": time.strftime(
        "%Y-%m-%dT%H:%M:%S%z", time.localtime(deadline)), "margin": "1m"})), clock)
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    given: list[float] = []

    def hanging_final(paths, timeout_s):  # a target that never answers: the sync hangs to its timeout
        given.append(timeout_s)
        clock.advance(timeout_s)
        return FinalSyncResult(ok=False, target=str(tmp_path / "target"), error="final sync timed out",
                               unsynced=[f"{tmp_path}/out/checkpoint-{feeder.step}/model.safetensors"])
    d.sync.final_sync = hanging_final
    while d.guard.status()["idle"]["state"] != "STOPPING":
        feeder.round(60)
    stop = stop_done(d, feeder)
    # not the 30 min final_sync_timeout: only what was left to the deadline, less the action's reserve
    assert given and given[0] < 20 * 60 and stop["phase"] == "done"
    left = deadline - d.guard.stopper.rec.done_at
    print(f"\nMARGIN hanging sync: cut after {given[0]:.0f} s; the action ran {left:.0f} s before the deadline")
    assert left > 0
    subject, body = mails(smtp_server, "stopping now")[-1]
    assert "FAILED, stopping anyway" in subject and "Not synced:" in body and "model.safetensors" in body
    assert "deadline" in body


def test_a_required_stop_hook_that_fails_holds_the_stop_and_alerts_until_the_caps_moment(
        tmp_path, daemon, smtp_server):
    clock = BillingClock()
    deadline = clock.time() + 20 * 60
    ok_flag, ran = tmp_path / "hook-ok", tmp_path / "hook-ran"
    hook = f'echo "$TRAIN_SUPERVISOR_EVENT $TRAIN_SUPERVISOR_REASON $SECRET_TOKEN" >> {ran}; test -e {ok_flag}'
    cfg = config(tmp_path, smtp_server, {"deadline": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(deadline)),
                                         "margin": "1m"},
                 hooks=[{"run": hook, "events": ["stop"], "required": True, "timeout": "5s"}])
    cfg["stop"]["retry_interval"] = "1m"
    os.environ["SECRET_TOKEN"] = "hunter2"  # the daemon's environment: a hook never sees it
    try:
        d = daemon(from_dict(cfg), clock)
        start(d, tmp_path)
        feeder = Feeder(d, tmp_path)
        while d.guard.status()["idle"]["state"] != "STOPPING":
            feeder.round(60)
        # the training is interrupted and synced, then the hook fails: held, alerted, retried
        wait_until(lambda: feeder.round(1) or d.guard.drain(0.05) and "required stop hook failed"
                   in (d.guard.status()["stop"]["last_error"] or ""), 60, interval=0.05, what="held by the hook")
        assert d.guard.status()["idle"]["state"] == "STOPPING"
        held = wait_until(lambda: run(d, "alerts") or mails(smtp_server, "stop held"), 20, interval=0.1,
                          what="the hold's alert")
        assert "exited 1" in held[0][1]
        stop = stop_done(d, feeder, tick=5)
        runs = ran.read_text().splitlines()
        assert len(runs) >= 2 and all(r.strip() == "stop deadline" for r in runs)  # no secret in its env
        left = deadline - d.guard.stopper.rec.done_at
        print(f"\nMARGIN required hook: held {len(runs)} tries, forced at the deadline's moment; "
              f"the action ran {left:.0f} s before the deadline")
        assert stop["phase"] == "done" and left > 0
        assert "required stop hook failed" in " ".join(d.guard.stopper.rec.history)
    finally:
        os.environ.pop("SECRET_TOKEN", None)


def test_a_hook_that_hangs_is_killed_at_its_timeout(tmp_path):
    from supervisor.config import HookConfig
    from supervisor.hooks.runner import Hooks

    pidfile = tmp_path / "pid"
    alerts: list[tuple[str, str, str]] = []
    hooks = Hooks([HookConfig(run=f"echo $$ > {pidfile}; sleep 300 & echo $! >> {pidfile}; wait",
                              events=["idle_warning"], timeout=1.0)],
                  alert=lambda k, s, b: alerts.append((k, s, b)))
    t0 = time.monotonic()
    results = hooks.run_blocking("idle_warning", {"reason": "idle"})
    took = time.monotonic() - t0
    assert results[0].why == "timed out after 1s and was killed" and took < 8
    for pid in map(int, pidfile.read_text().split()):  # the shell and its child: the whole group
        wait_until(lambda p=pid: not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE,
                   5, what=f"pid {pid} gone")
    assert alerts and "timed out" in alerts[0][1]


def test_max_idle_cost_cuts_a_hanging_final_sync_at_its_moment(tmp_path, daemon, smtp_server):
    # idle: warned after 10 min, the stop 10 min later; 5 USD at 10 USD/h = 30 min of idleness
    clock = BillingClock()
    warned = tmp_path / "warned"
    cfg = config(tmp_path, smtp_server, {}, max_idle_cost=5.0,
                 hooks=[{"run": f'echo "$TRAIN_SUPERVISOR_EVENT $TRAIN_SUPERVISOR_STOP_AT" > {warned}',
                         "events": ["idle_warning"], "timeout": "10s"}])
    cfg["idle"].update({"warn_after": "10m", "stop_after_warning": "10m", "activity_window": "1m"})
    d = daemon(from_dict(cfg), clock)
    given: list[float] = []

    def hanging_final(paths, timeout_s):
        given.append(timeout_s)
        clock.advance(timeout_s)
        return FinalSyncResult(ok=False, target=str(tmp_path / "target"), error="final sync timed out",
                               unsynced=[f"{tmp_path}/out/checkpoint-300/optimizer.pt"])
    d.sync.final_sync = hanging_final
    feeder = Feeder(d, tmp_path)
    while d.guard.status()["idle"]["state"] != "STOPPING":
        feeder.round(30)
    stop = stop_done(d, feeder, tick=5)
    idle_cost = d.guard.status()["idle"]["idle_cost"]
    # the sync was given what was left to 5 USD of idleness (about 10 min), not final_sync_timeout (30 min)
    assert given and given[0] <= 11 * 60 and stop["phase"] == "done"
    print(f"\nMARGIN max_idle_cost: hanging sync cut after {given[0]:.0f} s; idle cost at the stop "
          f"{idle_cost:.2f} of 5.00 USD")
    subject, body = mails(smtp_server, "stopping now")[-1]
    assert "FAILED, stopping anyway" in subject and "max_idle_cost" in body and "optimizer.pt" in body
    assert d.hooks.wait(10) and warned.read_text().startswith("idle_warning ")
