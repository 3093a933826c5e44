"""money.plan: when to warn and when to act on a cap, as pure functions of the caps and `now`."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from supervisor.money import plan
from supervisor.money.plan import Act, Caps, Lead, MoneyState, Run, Warn

T0 = 1_800_000_000.0
LEAD = Lead(save_s=20, stop_grace=30, final_sync_s=60, margin=300)  # 410 s


def test_the_spend_cap_is_a_moment_counted_from_boot():
    caps = Caps(max_cost=50.0, price_per_hour=5.0)  # 10 h of uptime
    cap = plan.first_cap(caps, LEAD, T0, uptime_s=3600)
    assert cap.kind == "max_cost" and cap.at == T0 + 9 * 3600 and cap.act_at == cap.at - 410
    assert plan.spent(5.0, 3600) == 5.0


def test_the_earliest_cap_wins():
    caps = Caps(max_cost=50.0, price_per_hour=5.0, deadline=T0 + 3600, max_runtime=7200)
    assert plan.first_cap(caps, LEAD, T0, uptime_s=0).kind == "deadline"
    caps = Caps(max_cost=50.0, price_per_hour=5.0, deadline=T0 + 3 * 3600, max_runtime=7200)
    assert plan.first_cap(caps, LEAD, T0, uptime_s=0).kind == "max_runtime"
    assert plan.first_cap(Caps(max_cost=50.0), LEAD, T0, 0) is None  # no price: no money cap


def test_warns_at_warn_at_with_the_projection_then_again_only_on_a_change_over_ten_percent():
    caps = Caps(max_cost=50.0, price_per_hour=5.0, warn_at=0.8)
    run = Run(alive=True, step=1500, steps_per_s=0.1, eta_s=4 * 3600, checkpoint_every=100, last_checkpoint=1500)
    s, out = plan.decide(MoneyState(), caps, LEAD, run, T0, uptime_s=7.9 * 3600)
    assert out == []
    s, out = plan.decide(s, caps, LEAD, run, T0, uptime_s=8 * 3600)
    assert len(out) == 1 and isinstance(out[0], Warn) and not out[0].again
    p = out[0].projection
    assert p.need_cost == 60.0 and p.fits is False and p.eta_at == T0 + 4 * 3600
    # checkpoint expected before the stop begins: 2 h - 410 s at 0.1 step/s from step 1500
    assert p.last_checkpoint == (1500 + int(0.1 * (2 * 3600 - 410))) // 100 * 100
    s, out = plan.decide(s, caps, LEAD, run, T0 + 60, uptime_s=8 * 3600 + 60)
    assert out == []  # 60.0 -> 60.0: no new mail
    slower = Run(alive=True, step=1500, steps_per_s=0.05, eta_s=8 * 3600, checkpoint_every=100)
    s, out = plan.decide(s, caps, LEAD, slower, T0 + 120, uptime_s=8 * 3600 + 120)
    assert len(out) == 1 and out[0].again and out[0].projection.need_cost > 66


def test_acts_once_at_cap_minus_lead_and_a_raised_cap_is_a_new_one():
    caps = Caps(max_cost=50.0, price_per_hour=5.0)
    act_up = 10 * 3600 - LEAD.total
    s, out = plan.decide(MoneyState(), caps, LEAD, Run(), T0, uptime_s=act_up - 1)
    assert [type(a) for a in out] == [Warn]
    s, out = plan.decide(s, caps, LEAD, Run(), T0, uptime_s=act_up)
    assert [type(a) for a in out] == [Act] and out[0].cap.kind == "max_cost"  # warned at 80 % before
    s, out = plan.decide(s, caps, LEAD, Run(), T0 + 5, uptime_s=act_up + 5)
    assert out == []  # never asked twice
    raised = Caps(max_cost=70.0, price_per_hour=5.0)
    s, out = plan.decide(s, raised, LEAD, Run(), T0 + 5, uptime_s=14 * 3600 - LEAD.total)
    assert [type(a) for a in out] == [Warn, Act]  # a cap never warned about: the projection first


def test_the_cut_keeps_time_for_the_action():
    cap = plan.Cap("deadline", T0 + 100, T0 - 310, T0 + 100)
    assert plan.cut_in(cap, T0, 30) == 70
    assert plan.cut_in(cap, T0 + 200, 30) == 0
    assert plan.cut_in(None, T0, 30) is None


@given(uptime=st.floats(0, 48 * 3600), price=st.floats(0.1, 100), cap=st.floats(1, 5000),
       lead=st.floats(0, 7200))
def test_acting_at_the_decided_moment_leaves_the_lead_in_money(uptime, price, cap, lead):
    caps = Caps(max_cost=cap, price_per_hour=price)
    ld = Lead(save_s=0, stop_grace=0, final_sync_s=0, margin=lead)
    _, out = plan.decide(MoneyState(), caps, ld, Run(), T0, uptime)
    if any(isinstance(a, Act) for a in out):
        # acting now: either the lead was already short, or exactly the lead's money is left
        assert plan.spent(price, uptime) >= cap - price * lead / 3600 - 1e-6
    else:
        assert plan.spent(price, uptime) < cap - price * lead / 3600 + 1e-6


@given(steps=st.lists(st.tuples(st.floats(0, 3600), st.sampled_from([None, 40.0, 60.0, 80.0])), min_size=1,
                      max_size=40))
@example(steps=[(40000.0, None), (0.0, 40.0), (0.0, None), (0.0, 40.0)])  # past both caps: 50, 40, 50, 40
def test_over_any_run_of_looks_a_cap_warns_before_it_acts_and_acts_once(steps):
    # "once" per cap: a cap moved with `supervisorctl budget` is a new cap, so moving it back
    # (40 -> 50 -> 40) may ask again; the same cap, looked at again and again, never does
    state, t, up, warned, last_act = MoneyState(), T0, 0.0, False, None
    for dt, cap in steps:
        t, up = t + dt, up + dt
        caps = Caps(max_cost=cap or 50.0, price_per_hour=5.0)
        state, out = plan.decide(state, caps, LEAD, Run(), t, up)
        for a in out:
            if isinstance(a, Warn):
                warned = True
            else:
                assert warned, "a stop without its projection mail first"
                assert a.cap.key != last_act, f"asked twice to stop for {a.cap.key}"
                last_act = a.cap.key
