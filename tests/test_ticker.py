"""The daemon's duty scheduler: each duty at its own rate, a slow one delaying no other, and a
duty that overran its turns runs once, not once per missed turn."""

from __future__ import annotations

import threading
import time

from supervisor.ticker import Ticker
from tests.waiting import wait_until


def test_duties_run_at_their_rates_and_a_slow_one_delays_no_other():
    runs = {"fast": 0, "slow": 0}
    release = threading.Event()

    def slow() -> None:
        runs["slow"] += 1
        release.wait(10)  # a mail to a dead server

    t = Ticker()
    t.add("fast", 0.02, lambda: runs.__setitem__("fast", runs["fast"] + 1), first_in=0)
    t.add("slow", 0.02, slow, first_in=0)
    t.start()
    try:
        wait_until(lambda: runs["fast"] >= 10, 10, what="the fast duty keeps its turns")
        assert runs["slow"] == 1
    finally:
        release.set()
        t.shutdown()


def test_an_overrun_collapses_missed_turns_into_one():
    starts: list[float] = []
    gate = threading.Event()

    def duty() -> None:
        starts.append(time.monotonic())
        if len(starts) == 1:
            gate.wait(10)

    t = Ticker()
    t.add("d", 0.01, duty, first_in=0)
    t.start()
    try:
        wait_until(lambda: len(starts) == 1, 10, what="first run")
        blocked = time.monotonic()
        while time.monotonic() - blocked < 0.2:  # twenty turns pass while the first run blocks
            gate.wait(0.01)
        gate.set()
        wait_until(lambda: len(starts) >= 3, 10, what="runs after the overrun")
        # after the overrun the duty runs again at once, then keeps its rate: no burst of 20
        assert starts[2] - starts[1] >= 0.005
    finally:
        t.shutdown()


def test_shutdown_stops_every_duty():
    runs = []
    t = Ticker()
    t.add("d", 0.01, lambda: runs.append(1), first_in=0)
    t.start()
    wait_until(lambda: len(runs) >= 2, 10, what="running")
    t.shutdown()
    for th in t._threads:
        th.join(5)
        assert not th.is_alive()
