"""The caps' moves in the idle machine, the hooks' environment, the config keys, and
`supervisorctl budget` through the real control socket of an in-process daemon."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.config import ConfigError, from_dict, parse
from supervisor.daemon.control import Peer, refusal, request
from supervisor.daemon.main import MEMBER_COMMANDS, Daemon
from supervisor.hooks.env import hook_env
from supervisor.idle import machine as idle
from supervisor.idle.machine import BeginStop, IdleMachine, Now, Signal, Signals, Thresholds
from supervisor.states import IdleState

TH = Thresholds(warn_after=7200, stop_after_warning=3600, poll_interval=30)


def now(t: float) -> Now:
    return Now(1_800_000_000 + t, 1000 + t, "b", t)


def test_a_cap_stop_is_not_cancelled_by_activity_nor_moved_by_keepalive():
    m, _ = idle.step(IdleMachine(), Signals(), now(0), TH)
    m, acts = idle.begin_cap_stop(m, now(10), "deadline")
    assert m.state == IdleState.STOPPING and m.stop_reason == "deadline" and isinstance(acts[-1], BeginStop)
    busy = Signals(items=(Signal("ssh", True, "ssh: you"),))
    m, acts = idle.step(m, busy, now(40), TH)
    assert m.state == IdleState.STOPPING and acts == []
    with pytest.raises(idle.Refused, match="keepalive does not move"):
        idle.keepalive(m, 7200, now(50))
    assert idle.begin_cap_stop(m, now(60), "max_cost")[1] == []  # one cap stop at a time
    with pytest.raises(idle.Refused):
        idle.begin_cap_stop(IdleMachine(), now(0), "idle")


def test_an_idle_stop_under_way_becomes_the_caps():
    m, _ = idle.step(IdleMachine(), Signals(), now(0), TH)
    m.state, m.stop_reason, m.cycle = IdleState.STOPPING, "idle", 3
    m, acts = idle.begin_cap_stop(m, now(1), "max_runtime")
    assert [type(a).__name__ for a in acts] == ["AbortStop", "BeginStop"] and m.cycle == 4


def test_a_hook_sees_the_facts_and_nothing_of_the_daemons_environment():
    os.environ["AWS_SECRET_ACCESS_KEY"] = "s3cr3t"
    try:
        env = hook_env("stop", {"reason": "deadline", "checkpoint": "checkpoint-1800", "target": "s3://b/p",
                                "weird-name!": "x", "none": None})
    finally:
        os.environ.pop("AWS_SECRET_ACCESS_KEY")
    assert env["TRAIN_SUPERVISOR_EVENT"] == "stop" and env["TRAIN_SUPERVISOR_CHECKPOINT"] == "checkpoint-1800"
    assert env["TRAIN_SUPERVISOR_WEIRDNAME"] == "x" and env["TRAIN_SUPERVISOR_NONE"] == ""
    assert "AWS_SECRET_ACCESS_KEY" not in env and set(env) >= {"PATH", "HOME", "LANG"}


def test_budget_and_hooks_config_problems_name_the_key():
    with pytest.raises(ConfigError) as e:
        parse('[budget]\nmax_cost = 50.0\ndeadline = "friday"\nwarn_at = 2\n'
              '[[hooks]]\nrun = "x"\nevents = ["finish"]\nrequired = true\n')
    text = "\n".join(e.value.problems)
    assert "budget.max_cost: needs price_per_hour" in text and "budget.deadline: expected" in text
    assert "budget.warn_at: must be at most 1" in text and "hooks[0].required: only a hook on \"stop\"" in text
    c = parse('price_per_hour = 2.0\n[budget]\nmax_cost = 50.0\ndeadline = "2026-12-05T08:00:00Z"\n'
              'max_runtime = "10h"\n[[hooks]]\nrun = "x"\nevents = ["stop", "alert"]\ntimeout = "30s"\n')
    assert c.budget.max_runtime == 36000 and c.hooks[0].timeout == 30 and c.hooks[0].events == ["stop", "alert"]


def test_budget_is_roots_alone():
    assert "budget" not in MEMBER_COMMANDS
    member = Peer(pid=1, uid=1000, gid=1000)
    assert refusal("budget", member, MEMBER_COMMANDS, owner_uid=0)


def test_budget_plus_20_over_the_socket_moves_the_cap_says_what_it_means_and_persists(tmp_path):
    clock = FakeClock(start=time.time(), boot=("b", 3600.0))
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "c.sock"),
                     "price_per_hour": 10.0, "budget": {"max_cost": 50.0, "margin": "5m"},
                     "stop": {"action": "dry-run"}})
    d = Daemon(cfg, clock=clock)
    d.start(schedule=False)
    try:
        d.money.poll()
        st = request(cfg.socket, "status")["budget"]
        assert st["cap"]["kind"] == "max_cost" and st["spent"] == 10.0
        assert abs(st["cap"]["left_s"] - 4 * 3600) < 1
        res = request(cfg.socket, "budget", {"amount": "+20"})
        assert res["budget"]["max_cost"] == 70.0 and abs(res["budget"]["cap"]["left_s"] - 6 * 3600) < 1
        assert "the first cap is the spend cap of 70.00 USD" in res["message"] and "spent so far 10.00 USD" in res["message"]
        import contextlib
        import io

        from supervisor.cli import main as cli

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main(["--socket", cfg.socket, "budget"]) == 0
        assert "\nthe first cap is the spend cap of 70.00 USD" in "\n" + buf.getvalue()  # (the log shares stdout)
        res = request(cfg.socket, "budget", {"deadline": "2999-01-01 08:00"})
        assert res["budget"]["deadline"] > time.time()
        with pytest.raises(Exception, match="expected a local time"):
            request(cfg.socket, "budget", {"deadline": "next friday"})
    finally:
        d.shutdown()
    d2 = Daemon(cfg, clock=clock)  # persisted in state_dir
    try:
        assert d2.money.caps().max_cost == 70.0
    finally:
        d2.shutdown()
    clock.set_boot("next-boot", 60.0)  # a new boot (the next rental): the config's caps again
    d3 = Daemon(cfg, clock=clock)
    try:
        assert d3.money.caps().max_cost == 50.0 and d3.money.state.acted == ""
    finally:
        d3.shutdown()


def test_an_alert_runs_the_alert_hooks_with_its_facts(tmp_path):
    from tests.waiting import wait_until

    out = tmp_path / "hook.out"
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "c.sock"),
                     "stop": {"action": "dry-run"},
                     "hooks": [{"run": f'echo "$TRAIN_SUPERVISOR_EVENT|$TRAIN_SUPERVISOR_ALERT_KIND|'
                                       f'$TRAIN_SUPERVISOR_REASON|$TRAIN_SUPERVISOR_HOST" >> {out}',
                                "events": ["alert"], "timeout": "5s"},
                               {"run": f"echo preempted >> {out}.p", "events": ["preemption"], "timeout": "5s"}]})
    d = Daemon(cfg, clock=FakeClock(start=time.time()))
    try:
        d.alerts.event("disk:full:1", "disk_full", "critical", "disk almost full", "body")
        line = wait_until(lambda: out.exists() and out.read_text().strip(), 10, what="the alert hook ran")
        event, kind, reason, host = line.split("|")
        assert (event, kind, reason) == ("alert", "disk_full", "disk almost full") and host
        assert d.hooks.wait(5) and d.hooks.status()[-1]["ok"]
        d.alerts.event("preemption:1", "preemption", "critical", "spot notice: terminate", "body")
        wait_until(lambda: Path(f"{out}.p").exists(), 10, what="the preemption hook ran")
    finally:
        d.shutdown()


def test_the_status_screen_shows_the_cap_the_time_left_and_the_projection():
    from supervisor.cli.render import budget_lines

    n = 1_800_000_000.0
    lines = budget_lines({"now": n, "budget": {
        "currency": "USD", "max_cost": 50.0, "spent": 38.2,
        "cap": {"kind": "max_cost", "at": n + 7200, "act_at": n + 6300},
        "projection": {"need_cost": 62.0, "eta_at": n + 14000, "fits": False, "last_checkpoint": 1800}}})
    assert "spend cap 50.00 USD at" in lines[0] and "(in 2h00m)" in lines[0] and "spent 38.20 USD" in lines[0]
    assert "needs 62.00 USD" in lines[1] and "does NOT fit" in lines[1] and "checkpoint-1800" in lines[1]
    assert budget_lines({"now": n, "budget": {"cap": None}}) == []


def test_the_save_time_is_measured_from_the_last_checkpoint_and_counts_in_the_lead(tmp_path):
    from supervisor.money.guard import checkpoints, save_figures

    out = tmp_path / "out"
    for step, t0 in ((100, 1000.0), (200, 2000.0)):
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        for i, name in enumerate(("model.safetensors", "optimizer.pt", "trainer_state.json")):
            (d / name).write_bytes(b"x" * 1000)
            os.utime(d / name, (t0 + 20 * i, t0 + 20 * i))
    (out / "checkpoint-300").mkdir()  # no trainer_state.json: being written, not counted
    assert [s for s, _ in checkpoints([str(out)])] == [100, 200]
    assert save_figures(str(out / "checkpoint-200")) == (40.0, 3000)

    clock = FakeClock(start=time.time(), boot=("b", 600.0))
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "c.sock"),
                     "price_per_hour": 10.0, "budget": {"max_cost": 50.0, "margin": "2m"},
                     "training": {"stop_grace": "30s"}, "sync": {"target": str(tmp_path / "t"), "watch": [str(out)]},
                     "stop": {"action": "dry-run"}})
    d = Daemon(cfg, clock=clock)
    try:
        d.money.poll()
        lead = d.money.status()["lead"]
        # 40 s save + 30 s stop_grace + at least 60 s of final sync + 120 s margin
        assert lead["save_s"] == 40.0 and lead["final_sync_s"] >= 60 and lead["total_s"] >= 250
        assert d.money.status()["projection"]["last_checkpoint"] == 200
    finally:
        d.shutdown()
