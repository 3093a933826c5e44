"""The pure GPU health verdict (supervisor.gpu.health): every check alone, every field unknown,
and properties over any machine NVML could describe (hypothesis)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.gpu import health as H
from supervisor.gpu.health import BAD, DEGRADED, OK, UNKNOWN, GpuHealth, HealthFacts, LiveState, judge, live

GOOD = GpuHealth(0, "NVIDIA H100 80GB HBM3", "GPU-0", ecc_mode=True, ecc_uncorrected_volatile=0,
                 ecc_uncorrected_aggregate=0, retired_pending=False, remap_pending=False, remap_failed=False,
                 pcie_gen=5, pcie_gen_max=5, pcie_width=16, pcie_width_max=16, throttle=0x1, temp_c=33,
                 power_w=70.0, persistence=True, nvlink_up=18, nvlink_down=0, util_pct=0.0)


def facts(*gpus: GpuHealth, **kw) -> HealthFacts:
    gs = tuple(replace(g, index=i) for i, g in enumerate(gpus))
    return HealthFacts(gs, len(gs), **kw)


def test_healthy_machine_is_ok():
    v = judge(facts(GOOD, GOOD), 2)
    assert v.verdict == OK and v.findings == () and v.unknown == () and H.advice(v) == ""


# one field changed on GPU 1 of two healthy GPUs -> (level, check, what)
SINGLE = [
    (dict(error="GPU is lost (fell off the bus?)"), BAD, "lost", "GPU is lost (fell off the bus?)"),
    (dict(ecc_uncorrected_volatile=2), BAD, "ecc", "2 uncorrectable ECC errors"),
    (dict(ecc_uncorrected_volatile=1), BAD, "ecc", "1 uncorrectable ECC error"),
    (dict(ecc_uncorrected_aggregate=3), DEGRADED, "ecc_aggregate",
     "3 uncorrectable ECC errors in its lifetime (none since the driver loaded)"),
    (dict(remap_failed=True), BAD, "remap_failed", "row remapping failed"),
    (dict(remap_pending=True), BAD, "remap_pending", "row remapping pending (needs a GPU reset)"),
    (dict(retired_pending=True), BAD, "retired_pending", "retired memory pages pending (needs a GPU reset)"),
    (dict(nvlink_up=16, nvlink_down=2), BAD, "nvlink", "2 NVLink links down (16 up where another GPU has 18)"),
    (dict(nvlink_up=0, nvlink_down=18), BAD, "nvlink", "18 NVLink links down (0 up where another GPU has 18)"),
    (dict(pcie_width=4), DEGRADED, "pcie_width", "PCIe link x4 (max x16)"),
    (dict(throttle=0x8), DEGRADED, "throttle_at_rest", "clocks held down at rest (HW slowdown)"),
    (dict(throttle=0x1 | 0x40 | 0x80), DEGRADED, "throttle_at_rest",
     "clocks held down at rest (HW thermal slowdown, HW power brake)"),
    (dict(temp_c=H.HOT_AT_REST_C), DEGRADED, "hot_at_rest", f"{H.HOT_AT_REST_C} C at rest"),
    (dict(ecc_mode=False), DEGRADED, "ecc_off", "ECC off: memory errors go undetected"),
    (dict(persistence=False), DEGRADED, "persistence", "persistence mode off"),
]


@pytest.mark.parametrize("change,level,check,what", SINGLE, ids=[s[2] + str(i) for i, s in enumerate(SINGLE)])
def test_each_check_alone(change, level, check, what):
    v = judge(facts(GOOD, replace(GOOD, **change)), 2)
    assert v.verdict == level
    assert [(f.gpu, f.level, f.check, f.what) for f in v.findings] == [(1, level, check, what)]
    assert v.reasons() == [f"GPU 1: {what}"]
    assert H.advice(v).startswith(f"GPU 1: {what} — ")
    if level == BAD:
        assert H.advice(v).endswith("ask the provider for another machine; this one is billing")


@pytest.mark.parametrize("change", [dict(throttle=0x8), dict(temp_c=90), dict(throttle=0x4), dict(throttle=0x10),
                                    dict(throttle=0x2), dict(pcie_gen=1)])
def test_under_load_or_harmless_these_are_no_fault(change):
    at_rest = "temp_c" not in change and change.get("throttle") not in (0x8,)
    assert judge(facts(replace(GOOD, **change)), 1, at_rest=at_rest).verdict == OK


def test_pcie_generation_below_max_is_a_note_not_a_fault():
    v = judge(facts(replace(GOOD, pcie_gen=1)), 1)
    assert v.verdict == OK and "normal at rest" in v.notes[0]


def test_the_issue_example_advice_line():
    bad = replace(GOOD, ecc_uncorrected_volatile=2, remap_failed=True)
    v = judge(facts(GOOD, GOOD, GOOD, bad), 4)
    assert H.advice(v) == ("GPU 3: 2 uncorrectable ECC errors, row remapping failed — ask the provider for "
                           "another machine; this one is billing")


def test_gpu_count_against_expectation():
    assert judge(facts(GOOD, GOOD, GOOD), 4).reasons() == ["3 of 4 GPUs present"]
    assert judge(facts(GOOD, GOOD, GOOD), 4).verdict == BAD
    more = judge(facts(GOOD, GOOD), 1)
    assert more.verdict == OK and "2 GPUs present, 1 expected" in more.notes[0]
    assert judge(facts(GOOD), None).verdict == OK
    assert judge(facts(GOOD), 0).verdict == OK  # 0 = no expectation


def test_no_driver():
    none = HealthFacts(error="NVIDIA driver not loaded")
    v = judge(none, 8)
    assert v.verdict == BAD and v.reasons() == ["no GPU answers (NVIDIA driver not loaded); 8 expected"]
    u = judge(none, None)
    assert u.verdict == UNKNOWN and u.findings == () and "NVIDIA driver not loaded" in u.notes


def test_nvlink_inactive_alike_everywhere_is_how_the_machine_is_built():
    pcie = replace(GOOD, nvlink_up=0, nvlink_down=4)  # PCIe cards, no bridge
    v = judge(facts(pcie, pcie), 2)
    assert v.verdict == OK and "no bridge" in v.notes[0]
    paired = replace(GOOD, nvlink_up=4, nvlink_down=8)  # one bridge of three on each pair
    assert judge(facts(paired, paired, paired, paired), 4).verdict == OK
    lone = replace(GOOD, nvlink_up=16, nvlink_down=2)  # one GPU: nothing to compare with
    assert judge(facts(lone), 1).verdict == OK


def test_every_field_unknown_is_ok_and_listed():
    blank = GpuHealth(0)
    v = judge(facts(blank), 1)
    assert v.verdict == OK and v.findings == ()
    assert len(v.unknown) == 11 and v.unknown[0] == "GPU 0: ecc_mode"


def test_burn_in_flags_a_gpu_over_15_percent_slower():
    v = judge(facts(GOOD, GOOD, GOOD, GOOD), 4, burn_in={0: 700.0, 1: 690.0, 2: 560.0, 3: 705.0})
    assert v.verdict == DEGRADED
    assert v.reasons() == ["GPU 2: slow in burn-in: 560 TFLOP/s, 20 % below the others (700)"]
    assert judge(facts(GOOD, GOOD), 2, burn_in={0: 700.0, 1: 600.0}).verdict == OK  # 14 % below the other
    assert judge(facts(GOOD), 1, burn_in={0: 1.0}).verdict == OK  # nothing to compare with


def test_to_dict_is_json_shaped():
    import json

    d = judge(facts(GOOD, replace(GOOD, pcie_width=8)), 2).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["verdict"] == DEGRADED and d["findings"][0]["check"] == "pcie_width" and d["advice"]


# --- properties over any machine -------------------------------------------------------------------

_opt_int = st.one_of(st.none(), st.integers(0, 5))
_opt_bool = st.one_of(st.none(), st.booleans())
gpus = st.builds(
    GpuHealth, st.just(0), error=st.one_of(st.none(), st.just("GPU is lost (fell off the bus?)")),
    ecc_mode=_opt_bool, ecc_uncorrected_volatile=_opt_int, ecc_uncorrected_aggregate=_opt_int,
    retired_pending=_opt_bool, remap_pending=_opt_bool, remap_failed=_opt_bool,
    pcie_gen=st.one_of(st.none(), st.integers(1, 5)), pcie_gen_max=st.one_of(st.none(), st.integers(1, 5)),
    pcie_width=st.one_of(st.none(), st.sampled_from([1, 4, 8, 16])),
    pcie_width_max=st.one_of(st.none(), st.sampled_from([8, 16])),
    throttle=st.one_of(st.none(), st.integers(0, 0x7FF)), temp_c=st.one_of(st.none(), st.integers(20, 95)),
    power_w=st.one_of(st.none(), st.floats(0, 700)), persistence=_opt_bool,
    nvlink_up=st.one_of(st.none(), st.integers(0, 18)), nvlink_down=st.one_of(st.none(), st.integers(0, 18)),
    util_pct=st.one_of(st.none(), st.floats(0, 100)))
machines = st.lists(gpus, min_size=1, max_size=8)
RANK = {OK: 0, DEGRADED: 1, BAD: 2}


@settings(max_examples=300, deadline=None)
@given(machines, st.one_of(st.none(), st.integers(1, 8)), st.booleans())
def test_verdict_is_the_worst_finding_and_bad_means_replace(gs, expect, at_rest):
    v = judge(facts(*gs), expect, at_rest=at_rest)
    assert v.verdict == max((f.level for f in v.findings), key=RANK.__getitem__, default=OK)
    for f in v.findings:
        assert f.what and f.advice and f.level in (DEGRADED, BAD)
        if f.level == BAD:
            assert f.advice == H.REPLACE
    lines = H.advice(v).splitlines()
    assert len(lines) == len({f.gpu for f in v.findings})


@settings(max_examples=300, deadline=None)
@given(machines, st.integers(0, 7), st.data())
def test_an_unknown_field_never_makes_it_worse(gs, which, data):
    """Forgetting any field (NotSupported) can only hide a fault, never add one."""
    i = which % len(gs)
    names = [f.name for f in fields(GpuHealth) if f.name not in ("index", "name", "uuid")]
    name = data.draw(st.sampled_from(names))
    before = judge(facts(*gs), len(gs))
    gs2 = list(gs)
    gs2[i] = replace(gs2[i], **{name: None})
    after = judge(facts(*gs2), len(gs2))
    assert RANK[after.verdict] <= RANK[before.verdict]


@settings(max_examples=200, deadline=None)
@given(machines)
def test_at_rest_only_adds_findings(gs):
    load = {(f.gpu, f.check) for f in judge(facts(*gs), None, at_rest=False).findings}
    rest = {(f.gpu, f.check) for f in judge(facts(*gs), None, at_rest=True).findings}
    assert load <= rest
    assert {c for _, c in rest - load} <= {"throttle_at_rest", "hot_at_rest"}


# --- during the run --------------------------------------------------------------------------------

def run_gpu(**kw) -> GpuHealth:
    return replace(GOOD, **{"util_pct": 95.0, "throttle": 0x4, **kw})


def test_new_ecc_errors_during_the_run():
    s, found = live(LiveState(), facts(run_gpu(ecc_uncorrected_volatile=1)), 0.0)
    assert found == []  # the count at the start is the baseline (the preflight judged it)
    s, found = live(s, facts(run_gpu(ecc_uncorrected_volatile=3)), 5.0)
    assert [(f.key, f.gpu, f.what) for f in found] == [("ecc_new:0", 0, "2 new uncorrectable ECC errors during the run")]
    assert H.REPLACE in found[0].advice


def test_sustained_slowdown_with_utilisation_dropping():
    s, found = live(LiveState(), facts(run_gpu(throttle=0x40, util_pct=96.0)), 0.0)
    assert found == []
    s, found = live(s, facts(run_gpu(throttle=0x40, util_pct=60.0)), H.SUSTAIN_S - 1)
    assert found == []  # not sustained yet
    s, found = live(s, facts(run_gpu(throttle=0x40, util_pct=60.0, temp_c=88)), H.SUSTAIN_S)
    assert [f.key for f in found] == ["slowdown:0"]
    assert found[0].what == "HW thermal slowdown for 2 min, utilisation 96% -> 60%, 88 C"
    s2, found = live(s, facts(run_gpu(throttle=0x40, util_pct=93.0)), H.SUSTAIN_S + 5)
    assert found == []  # utilisation held up: throttling alone is not the fault
    s, found = live(s, facts(run_gpu(throttle=0x4, util_pct=60.0)), H.SUSTAIN_S + 10)
    assert found == [] and s.slow_since == {}  # the slowdown ended: the stretch starts over


def test_slowdown_with_unknown_utilisation_decides_nothing():
    s, _ = live(LiveState(), facts(run_gpu(throttle=0x8, util_pct=None)), 0.0)
    _, found = live(s, facts(run_gpu(throttle=0x8, util_pct=None)), 1000.0)
    assert found == []


def test_training_slower_than_at_start_while_throttling_says_both():
    f = facts(run_gpu(throttle=0x20), run_gpu())
    _, found = live(LiveState(), f, 0.0, rate_start=2.0, rate_now=1.3)
    assert [(x.key, x.what) for x in found] == [("slower", "training 35 % slower than at its start while GPU 0 throttles")]
    assert live(LiveState(), f, 0.0, rate_start=2.0, rate_now=1.5)[1] == []         # only 25 % slower
    calm = facts(run_gpu(), run_gpu())
    assert live(LiveState(), calm, 0.0, rate_start=2.0, rate_now=1.0)[1] == []      # slower, but no throttling
    assert live(LiveState(), f, 0.0, rate_start=None, rate_now=1.0)[1] == []        # no start rate yet


def test_lost_gpu_is_not_a_live_finding_here():
    """The GPU monitor alerts a lost GPU (gpu:failed); the live check skips it."""
    assert live(LiveState(), facts(replace(GOOD, error="GPU is lost")), 0.0)[1] == []
