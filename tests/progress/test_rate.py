"""Rates, ETA and cost: checked against figures worked out by hand, and for never being wrong."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.progress.rate import (
    MIN_SPAN_S,
    Sample,
    Series,
    eta_seconds,
    fits_budget,
    fraction,
    money,
    stalled_since,
    window_rate,
)


def series(points) -> list[Sample]:
    return [Sample(float(t), float(v)) for t, v in points]


# --- the sliding window ---------------------------------------------------------------------------

def test_steady_rate():
    # a step every 2 s for 10 minutes: 0.5 steps/s whatever the window
    s = series((t, t // 2) for t in range(0, 601, 2))
    assert window_rate(s, 600, 300) == pytest.approx(0.5)
    assert window_rate(s, 600, 60) == pytest.approx(0.5)


def test_window_sees_only_recent_speed():
    # 1 step/s for 10 min, then 0.25 steps/s for 5 min: a 5-minute window sees the new speed
    pts = [(t, t) for t in range(0, 601, 4)] + [(600 + t, 600 + t / 4) for t in range(4, 301, 4)]
    s = series(pts)
    assert window_rate(s, 900, 300) == pytest.approx(0.25)
    # the anchor just before the window is used: window of 302 s starts at 598 -> anchor (596, 596)
    assert window_rate(s, 900, 302) == pytest.approx((675 - 596) / (900 - 596))


def test_sparse_samples_use_the_anchor():
    # a checkpoint every 10 minutes, 100 steps each: 100/600 steps/s from any 5-minute window
    s = series([(0, 0), (600, 100), (1200, 200)])
    assert window_rate(s, 1300, 300) == pytest.approx(100 / 600)
    assert window_rate(s, 1200, 300) == pytest.approx(100 / 600)


def test_unknown_cases():
    assert window_rate([], 100, 300) is None
    assert window_rate(series([(0, 5)]), 100, 300) is None
    assert window_rate(series([(0, 5), (MIN_SPAN_S - 1, 9)]), 100, 300) is None   # too short to judge
    assert window_rate(series([(0, 5), (100, 9)]), 50, 300) is None                # the future is ignored
    assert window_rate(series([(0, 5), (100, 3)]), 100, 300) is None                # went backwards


def test_standing_still_is_zero_not_unknown():
    assert window_rate(series([(0, 5), (100, 5)]), 100, 300) == 0.0


def test_rounded_counters_give_no_rate_when_rounding_dominates():
    # tokens printed as '1.235e+08' (+-50,000) growing by 720,000 in the window: 14% error -> unknown
    coarse = [Sample(0, 1.235e8, 5e4), Sample(300, 1.2422e8, 5e4)]
    assert window_rate(coarse, 300, 300) is None
    fine = [Sample(0, 1.235e8, 50), Sample(300, 1.2422e8, 50)]
    assert window_rate(fine, 300, 300) == pytest.approx(720000 / 300)


def test_stall():
    s = series((t, t // 10) for t in range(0, 1001, 10))      # a sample every 10 s up to t=1000
    assert stalled_since(s, 1000, 300) is None
    assert stalled_since(s, 1300, 300) is None                 # quiet for exactly the window
    assert stalled_since(s, 1301, 300) == 1000
    sparse = series([(0, 0), (600, 100), (1200, 200)])       # cadence 600 s: 3 x 600 before a stall
    assert stalled_since(sparse, 2900, 300) is None
    assert stalled_since(sparse, 3001, 300) == 1200
    assert stalled_since([], 10, 300) is None


# --- Series ----------------------------------------------------------------------------------------

def test_series_records_changes_only_and_merges_bursts():
    s = Series()
    assert s.add(0, 0)
    for v in range(1, 1001):           # a backlog read in one poll: one moment, the newest value
        assert s.add(100, v)
    assert [(x.t, x.v) for x in s.samples] == [(0, 0), (100, 1000)]
    assert s.add(130, 1000)            # no change: the time of the last change stays
    assert s.last.t == 100
    assert s.add(130.5, 1015)
    assert window_rate(s.samples, 130.5, 300) == pytest.approx(1015 / 130.5)


def test_series_half_second_steps_keep_about_one_sample_a_second():
    s = Series()
    for i in range(0, 200):
        s.add(i * 0.5, i)
    assert 95 <= len(s) <= 101
    assert window_rate(s.samples, 99.5, 300) == pytest.approx(2.0, rel=0.02)


def test_series_rejects_backwards_and_nonfinite():
    s = Series()
    s.add(10, 5)
    assert not s.add(20, 4)
    assert not s.add(5, 6)
    assert not s.add(math.nan, 7) and not s.add(30, math.inf)
    assert [(x.t, x.v) for x in s.samples] == [(10, 5)]


def test_series_prune_keeps_an_anchor():
    s = Series()
    for t in range(0, 100, 10):
        s.add(t, t)
    s.prune(before=55)
    assert [x.t for x in s.samples] == [50, 60, 70, 80, 90]


def test_series_json_roundtrip_and_garbage():
    s = Series()
    for t in range(0, 50, 5):
        s.add(t, t * 2, 0.5)
    again = Series.from_json(s.to_json())
    assert again.samples == s.samples
    junk = Series.from_json([[1, 2], "x", [1, 2, "3"], [True, 1, 0], [5.0, 7.0, 0.0], None])
    assert [(x.t, x.v) for x in junk.samples] == [(5.0, 7.0)]
    assert len(Series.from_json({"a": 1})) == 0


# --- ETA, cost ------------------------------------------------------------------------------------

def test_eta_hand_computed():
    # 1200 of 3750 steps at 0.59 steps/s: 2550 / 0.59 = 4322.03 s
    assert eta_seconds(1200, 3750, 0.59) == pytest.approx(4322.0339, abs=1e-3)
    # the step was seen 30 s ago: 30 s less to go
    assert eta_seconds(1200, 3750, 0.59, since_done=30) == pytest.approx(4292.0339, abs=1e-3)
    assert eta_seconds(3750, 3750, None) == 0.0
    assert eta_seconds(3749, 3750, 0.5, since_done=100) == 0.0


@pytest.mark.parametrize("args", [(None, 10, 1), (1, None, 1), (1, 10, None), (1, 10, 0.0), (11, 10, 1),
                                  (-1, 10, 1), (1, 0, 1), (1, 10, math.nan), (math.inf, 10, 1)])
def test_eta_unknown(args):
    assert eta_seconds(*args) is None


def test_money_hand_computed():
    # EUR 3.90/h: 2030 s of run = 2.1992; 4320 s to go = 4.68
    assert money(3.90, 2030) == pytest.approx(2.199166, abs=1e-6)
    assert money(3.90, 4320) == pytest.approx(4.68)
    assert money(None, 100) is None and money(3.9, None) is None and money(3.9, -1) is None
    assert money(0.0, 3600) == 0.0


def test_fits_budget():
    assert fits_budget(2.2, 4.68, 10.0) is True
    assert fits_budget(2.2, 4.68, 6.88) is True          # exactly the budget fits
    assert fits_budget(2.2, 4.68, 6.0) is False
    assert fits_budget(None, 4.68, 10.0) is None and fits_budget(2.2, None, 10) is None
    assert fits_budget(2.2, 4.68, None) is None


def test_fraction():
    assert fraction(1200, 3750) == pytest.approx(0.32)
    assert fraction(None, 3750) is None and fraction(5, None) is None
    assert fraction(3751, 3750) is None and fraction(1, 0) is None


# --- properties ------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.001, 1e6), gaps=st.lists(st.floats(1.0, 120.0), min_size=2, max_size=60),
       window=st.floats(30.0, 3600.0))
def test_linear_counter_gives_its_rate(rate, gaps, window):
    t, pts = 0.0, []
    for g in gaps:
        t += g
        pts.append(Sample(t, rate * t))
    r = window_rate(pts, t, window)
    if r is not None:
        assert r == pytest.approx(rate, rel=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(-1e9, 1e9)), max_size=40),
       st.floats(-1e6, 1e6), st.floats(1.0, 1e5))
def test_series_and_rate_never_negative(points, now, window):
    s = Series()
    for t, v in points:
        s.add(t, v)
    xs = s.samples
    assert all(a.t <= b.t and a.v <= b.v for a, b in zip(xs, xs[1:], strict=False))
    r = window_rate(xs, now, window)
    assert r is None or (r >= 0 and math.isfinite(r))
    e = eta_seconds(xs[-1].v if xs else None, 1e9, r)
    assert e is None or e >= 0
