"""Money across the run (issue 39): every machine, node and resume of a run counted from the ledger on
the target, so a cap holds for the run and not for one boot.

The pure sums (money.runmoney) and the caps through the real daemon with a fake billing clock
(tests/money/test_money_e2e's harness): a run resumed on its second machine, whose first machine already
spent 3 of its 5 USD, stops for the cap when the run's money, not this boot's, reaches it."""

from __future__ import annotations

import json
import re
import signal

import pytest

from supervisor.config import from_dict
from supervisor.money import runmoney as rm
from tests.fixtures.inproc import mails, run
from tests.money.test_money_e2e import PRICE, BillingClock, Feeder, config, start, stop_done
from tests.waiting import wait_until


def boot(host: str, secs: float, price: float | None = 10.0, rank: int = 0, since: float = 1e9) -> rm.Boot:
    return rm.Boot(host, f"{host}-boot", rank, since, secs, price, "USD", since + secs)


def test_a_record_round_trips_and_anything_else_is_not_summed():
    b = boot("gpu-1", 3600)
    assert rm.parse_record(rm.record_doc(b, "run-a"), "run-a") == b
    assert rm.parse_record(rm.record_doc(b, "run-a"), "run-b") is None        # another run's
    for junk in (b"{", b"[]", json.dumps({"format": rm.RECORD_FORMAT, "run_id": "run-a", "since": "x"}).encode(),
                 json.dumps({"format": rm.RECORD_FORMAT, "run_id": "run-a", "since": 1, "seconds": -5,
                             "updated": 1}).encode(), b"x" * 20000):
        assert rm.parse_record(junk, "run-a") is None


def test_the_run_is_the_sum_of_its_boots_and_this_one_counts_as_its_clock_says():
    old = boot("gpu-1", 2 * 3600)
    stale_me = boot("gpu-2", 60, since=2e9)
    me = boot("gpu-2", 1800, since=2e9)
    m = rm.totals([old, stale_me], me)
    assert m.seconds == 2 * 3600 + 1800 and m.spent == pytest.approx(25.0)
    assert [b.host for b in m.machines] == ["gpu-1", "gpu-2"]
    assert rm.totals([boot("x", 10, price=None)], me).spent is None


def test_two_nodes_bill_as_one_machine_at_twice_the_price():
    # 2 nodes, 3 h each at 10/h = 60 spent: as one machine at 20/h that is 3 h of uptime
    m = rm.totals([boot("a", 3 * 3600, rank=0)], boot("b", 3 * 3600, rank=1, since=1e9 + 1))
    up, price = rm.as_one_machine(m, 2, 10.0)
    assert price == 20.0 and up == pytest.approx(3 * 3600)
    assert price * up / 3600 == pytest.approx(m.spent)
    assert rm.as_one_machine(m, 2, None) == (3 * 3600, None)


def test_a_resumed_run_stops_when_the_runs_money_reaches_the_cap(tmp_path, daemon, smtp_server):
    """The first machine of the run spent 3.00 of the 5.00 USD cap before it was lost; on this one the
    cap comes after 12 min of uptime, not 30."""
    clock = BillingClock()
    target = tmp_path / "target"
    ledger = target / "_run" / "ledger"
    ledger.mkdir(parents=True)
    first = rm.Boot("gpu-old", "boot-old", 0, clock.time() - 7200, 18 * 60, PRICE, "USD", clock.time() - 5400)
    (ledger / first.key).write_bytes(rm.record_doc(first, str(target)))
    cfg = config(tmp_path, smtp_server, {"max_cost": 5.0, "margin": "1m", "scope": "run"})
    d = daemon(from_dict(cfg), clock)
    run(d, "run_ledger")
    b = d.status()["budget"]
    assert b["scope"] == "run" and b["run_spent"] == pytest.approx(3.0, abs=0.01)
    assert [m["host"] for m in b["machines"]][0] == "gpu-old" and len(b["machines"]) == 2
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    while d.guard.status()["idle"]["state"] != "STOPPING":
        feeder.round(60)
        run(d, "run_ledger")
        assert clock.boot()[1] < 30 * 60, d.status()["budget"]  # this boot alone would run 30 min
    began = clock.boot()[1]
    assert began < 12 * 60, began  # 2.00 USD left at 10 USD/h is 12 min, minus the lead
    stop = stop_done(d, feeder)
    assert stop["reason"] == "cost" and stop["final_sync"]["ok"]
    mine = json.loads((ledger / rm.record_key(d.ledger.hostname, "money-boot")).read_text())
    assert mine["seconds"] > 0 and mine["run_id"] == str(target)
    assert mails(smtp_server, "spend cap 5.00 USD")
    print(f"\nrun-scope cap: this boot stopped after {began / 60:.1f} min of its own uptime "
          f"(3.00 USD spent by the first machine)")


def test_the_finish_mail_gives_the_runs_total(tmp_path, daemon, smtp_server):
    clock = BillingClock(booted_s=3600)
    target = tmp_path / "target"
    (target / "_run" / "ledger").mkdir(parents=True)
    first = rm.Boot("gpu-old", "boot-old", 0, clock.time() - 9000, 3600, PRICE, "USD", clock.time() - 5400)
    (target / "_run" / "ledger" / first.key).write_bytes(rm.record_doc(first, str(target)))
    cfg = config(tmp_path, smtp_server, {"scope": "run"}, max_steps=20)
    d = daemon(from_dict(cfg), clock)
    run(d, "run_ledger")
    start(d, tmp_path)
    feeder = Feeder(d, tmp_path)
    feeder.round(60)
    assert d.training.send_signal(signal.SIGINT) == ""  # the trainer saves and exits 0: FINISHED

    wait_until(lambda: run(d, "training", "idle", "alerts") or mails(smtp_server, "training"), 30,
               what="the run's end mail")
    body = mails(smtp_server, "training")[0][1]
    assert re.search(r"The run so far: 20\.\d\d USD, 2\.0 machine-hours on 2 machine boots", body), body
