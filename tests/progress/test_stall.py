"""A hung run is judged by its step, and its stacks are read from outside with a real py-spy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.progress import stacks, stall
from tests.waiting import wait_until


def test_no_threshold_before_the_first_step():
    assert stall.threshold([], None) is None
    assert stall.judge(None, None, 10_000.0, 1800.0, True) is None


def test_threshold_is_the_larger_of_the_floor_and_ten_typical_steps():
    assert stall.threshold([0.0, 1.0, 2.0, 3.0], None) == 1800.0              # fast steps: the floor
    assert stall.threshold([0, 600, 1200, 1800, 2400], None) == 6000.0        # 10 min steps: 100 min
    assert stall.threshold([0, 600, 1200, 90_000], None) == 6000.0           # median ignores one long gap
    assert stall.threshold([5.0], None) == 1800.0                             # one step: the floor


def test_configured_threshold_wins():
    assert stall.threshold([0, 600, 1200], 300.0) == 300.0
    assert stall.threshold([], 300.0) == 300.0


def test_judge():
    assert stall.judge(120, 1000.0, 1000.0 + 1799, 1800.0, True) is None
    s = stall.judge(120, 1000.0, 1000.0 + 1800, 1800.0, True)
    assert s == stall.Stall(120, 1000.0, 1800.0, 1800.0)
    assert stall.judge(120, 1000.0, 99_999.0, 1800.0, running=False) is None


@given(st.lists(st.floats(0, 1e6, allow_nan=False), max_size=50), st.floats(0, 1e7, allow_nan=False))
def test_never_stalled_sooner_than_the_floor(times, waited):
    th = stall.threshold(sorted(times), None)
    verdict = stall.judge(7, 0.0, waited, th, True)
    if th is None:
        assert verdict is None
    else:
        assert th >= stall.FLOOR_S
        assert (verdict is not None) == (waited >= th)


HANGING = textwrap.dedent("""
    import sys, threading
    def wait_for_the_collective():
        threading.Event().wait()
    print("ready", flush=True)
    wait_for_the_collective()
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="py-spy needs ptrace rights over the process (root here)")
def test_dump_shows_where_a_real_process_hangs(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        text = wait_until(lambda: (t := stacks.dump([p.pid])) and "wait_for_the_collective" in t and t,
                          timeout=30, what="py-spy to show the hanging function")
        assert f"{p.pid}" in text
        assert p.poll() is None  # reading the stacks did not stop the process
    finally:
        p.kill()
        p.wait()


def test_dump_says_why_when_nothing_can_be_read():
    assert stacks.dump([]).startswith("(stacks not available")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert "no Python process" in stacks.dump([sleeper.pid])
    finally:
        sleeper.kill()
        sleeper.wait()
