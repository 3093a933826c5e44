"""The provider stop's pure parts (issue 52): what stop.action means with each provider found, the
words status and the mails use, terminate held back over unverified work, the one-call-per-attempt
confirmation machine, and detection from the environment and the DMI words."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.stop import confirm as cf
from supervisor.stop.choose import Plan, decide, terminate_allowed
from supervisor.stop.providers import detect
from supervisor.stop.providers.base import Facts, Found
from supervisor.stop.resolve import INFOS

RUNPOD, VAST, LAMBDA, AWS, GCP, AZURE = (INFOS[n] for n in ("runpod", "vast", "lambda", "aws", "gcp", "azure"))


# --- what stop.action means here ---------------------------------------------------------------------
def test_auto_calls_the_provider_where_its_credential_is_at_hand():
    for info in (RUNPOD, VAST, AWS, GCP, AZURE):
        assert decide("auto", "stop", Found(info.name, "x"), info, True) == ("provider", "", "")
    assert decide("auto", "terminate", Found("lambda", "x"), LAMBDA, True) == ("provider", "", "")


def test_auto_powers_off_where_that_ends_billing_and_warns_everywhere_else():
    # AWS (EBS) and GCP: a guest poweroff ends compute billing, no warning
    assert decide("auto", "stop", Found("aws", "DMI"), AWS, False, "no AWS credentials") == ("poweroff", "", "")
    assert decide("auto", "stop", Found("gcp", "DMI"), GCP, False, "no token") == ("poweroff", "", "")
    # Azure: a poweroff leaves the VM allocated and billed: warned, naming the fix
    action, warning, _ = decide("auto", "stop", Found("azure", "DMI chassis_asset_tag"), AZURE, False,
                                "Azure metadata: managed identity: HTTP 400")
    assert action == "poweroff"
    assert "still allocated, billed in full" in warning and "managed identity" in warning and "deallocate" in warning
    # RunPod without its key: the container's poweroff does nothing
    action, warning, _ = decide("auto", "stop", Found("runpod", "env RUNPOD_POD_ID", "p1"), RUNPOD, False,
                                "RUNPOD_API_KEY is not set (nor stop.api_key_file)")
    assert action == "poweroff" and "RUNPOD_API_KEY" in warning and "runpodctl stop pod $RUNPOD_POD_ID" in warning
    # warned about only: OCI, Nebius, DigitalOcean, Hetzner
    for name in ("oci", "nebius", "digitalocean", "hetzner"):
        action, warning, problem = decide("auto", "stop", Found(name, "DMI"), INFOS[name], False)
        assert action == "poweroff" and INFOS[name].label in warning and "stop.action = \"command\"" in warning
        assert problem == ""
    # nothing found: a plain machine, nothing to say
    assert decide("auto", "stop", None, None, False) == ("poweroff", "", "")


def test_lambda_has_no_stop_state_the_owner_must_choose_terminate():
    action, warning, _ = decide("auto", "stop", Found("lambda", "stop.api_key_file"), LAMBDA, True)
    assert action == "poweroff" and "no stop state" in warning and 'stop.mode = "terminate"' in warning
    assert decide("provider", "stop", Found("lambda", "x"), LAMBDA, True)[2].startswith("stop.action = \"provider\"")


def test_provider_fails_check_config_when_it_cannot_work():
    assert "no provider known" in decide("provider", "stop", None, None, False)[2]
    assert "not called by this version" in decide("provider", "stop", Found("oci", "DMI"), INFOS["oci"], False)[2]
    assert "RUNPOD_API_KEY" in decide("provider", "stop", Found("runpod", "env"), RUNPOD, False,
                                      "RUNPOD_API_KEY is not set")[2]
    assert decide("ec2", "stop", Found("aws", "x"), AWS, True) == ("provider", "", "")


def test_poweroff_as_written_is_kept_and_warned_where_it_does_not_end_billing():
    action, warning, _ = decide("poweroff", "stop", Found("azure", "DMI"), AZURE, False)
    assert action == "poweroff" and 'stop.action = "auto"' in warning
    assert decide("poweroff", "stop", Found("aws", "DMI"), AWS, False) == ("poweroff", "", "")
    assert decide("command", "stop", Found("azure", "DMI"), AZURE, True) == ("command", "", "")
    assert decide("dry-run", "terminate", Found("runpod", "env"), RUNPOD, True) == ("dry-run", "", "")


class Pod:
    instance = "abc"


def test_status_line_and_block_say_what_still_bills():
    facts = Facts(0.74, "50 GB volume still billed, about 0.33 USD/day", "", "pod abc")
    plan = Plan("auto", "provider", "stop", Found("runpod", "env RUNPOD_POD_ID", "abc"), RUNPOD, Pod(), facts)
    assert plan.line() == "RunPod API, pod abc (ends GPU billing; 50 GB volume still billed, about 0.33 USD/day)"
    b = plan.block()
    assert {k: b[k] for k in ("name", "detected_by", "instance", "mode", "ends_billing", "still_billed")} == {
        "name": "runpod", "detected_by": "env RUNPOD_POD_ID", "instance": "abc", "mode": "stop",
        "ends_billing": True, "still_billed": "50 GB volume still billed, about 0.33 USD/day"}
    assert b["price_per_hour"] == 0.74
    # terminate: what outlives it
    t = Plan("auto", "provider", "terminate", Found("runpod", "env", "abc"), RUNPOD, Pod(), Facts(0.74, "x", "", "pod abc"))
    assert t.line() == "RunPod API, pod abc (terminated once the final sync is verified (ends every charge))"
    t = Plan("auto", "provider", "terminate", Found("runpod", "env", "abc"), RUNPOD, Pod())  # its API not asked
    assert "network volume" in t.still_billed()
    # no provider: unknown, not false
    assert Plan("auto", "poweroff").block()["ends_billing"] is None
    assert Plan("auto", "poweroff", info=AWS, found=Found("aws", "DMI")).block()["ends_billing"] is True
    az = Plan("auto", "poweroff", info=AZURE, found=Found("azure", "DMI"), warning="w")
    assert az.block()["ends_billing"] is False and az.still_billed() == "the whole VM bills on"
    assert Plan("dry-run", "dry-run").block()["ends_billing"] is False


def test_terminate_only_over_verified_work():
    ok = {"ok": True, "unsynced": [], "files": 3}
    assert terminate_allowed(ok, "") == ""
    assert "cap" in terminate_allowed(ok, "the spend cap has come")
    assert "did not verify" in terminate_allowed({"ok": False, "error": "target down", "unsynced": ["a"]}, "")
    assert "2 files are not verified" in terminate_allowed({"ok": True, "unsynced": ["a", "b"]}, "")
    assert "no final sync" in terminate_allowed(None, "")


# --- the confirmation machine ------------------------------------------------------------------------
W = 600.0


def test_one_call_then_reads_until_not_billed():
    c = cf.Confirm("runpod", "abc")
    assert cf.next_step(c, 0, W) == cf.Step.CALL
    c = cf.begin(c, "stop", 1000.0, 0.0)
    assert c.last.phase == cf.Phase.CALLING and c.calls == 1
    assert cf.next_step(c, 1, W) == cf.Step.READ   # saved CALLING: read, never call again
    c = cf.answered(c, "accepted", "RunPod API: stop pod abc accepted")
    c = cf.seen(c, "RUNNING", False, False, 1001.0)
    assert cf.next_step(c, 5, W) == cf.Step.READ and c.confirmed is None
    c = cf.seen(c, "EXITED", True, False, 1002.0)
    assert cf.next_step(c, 6, W) == cf.Step.DONE and c.confirmed == {"state": "EXITED", "at": 1002.0}
    assert c.last.reads == 2 and c.calls == 1


def test_still_billing_after_confirm_within_then_a_new_call():
    c = cf.answered(cf.begin(cf.Confirm(), "stop", 0.0, 0.0), "accepted", "ok")
    c = cf.seen(c, "RUNNING", False, False, 1.0)
    assert cf.next_step(c, W - 1, W) == cf.Step.READ
    assert cf.next_step(c, W, W) == cf.Step.STILL_BILLING
    c = cf.still_billing(c)
    assert cf.next_step(c, W + 1, W) == cf.Step.CALL
    c = cf.begin(c, "stop", 2.0, W + 1)
    assert c.calls == 2 and [a.n for a in c.attempts] == [1, 2]


def test_a_refusal_ends_the_attempt_and_keeps_the_answer():
    c = cf.answered(cf.begin(cf.Confirm(), "stop", 0.0, 0.0), "refused", '{"error":"forbidden"}')
    assert c.last.phase == cf.Phase.REFUSED and c.last.answer == '{"error":"forbidden"}'
    assert cf.next_step(c, 1, W) == cf.Step.CALL
    c = cf.answered(cf.begin(c, "stop", 0.0, 2.0), "failed", "connection refused")
    assert c.last.phase == cf.Phase.FAILED and cf.next_step(c, 3, W) == cf.Step.CALL
    # no answer at all: it may have been carried out, so it is read like an accepted call
    c = cf.answered(cf.begin(c, "stop", 0.0, 4.0), "unknown", "no answer within 20s")
    assert c.last.phase == cf.Phase.CALLED and cf.next_step(c, 5, W) == cf.Step.READ


def test_terminate_is_confirmed_only_when_the_machine_is_gone():
    c = cf.answered(cf.begin(cf.Confirm(), "terminate", 0.0, 0.0), "accepted", "ok")
    c = cf.seen(c, "EXITED", True, False, 1.0)   # stopped, its volume still billed
    assert c.confirmed is None and cf.next_step(c, 2, W) == cf.Step.READ
    c = cf.seen(c, "gone (404)", True, True, 3.0)
    assert c.confirmed == {"state": "gone (404)", "at": 3.0}


def test_the_record_survives_json_and_a_damaged_one_reads_before_any_call():
    c = cf.seen(cf.answered(cf.begin(cf.Confirm("vast", "7"), "stop", 5.0, 1.0), "accepted", "ok"),
                "running", False, False, 6.0)
    assert cf.Confirm.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="damaged"):
        cf.Confirm.from_json({"attempts": [{"n": 1, "phase": "exploding"}]})
    u = cf.unknown_in_flight("vast", "7", "terminate", 9.0, 2.0)
    assert cf.next_step(u, 3.0, W) == cf.Step.READ


EVENTS = ("accepted", "refused", "failed", "unknown", "running", "stopped", "gone", "unread", "tick")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), max_size=40), st.sampled_from(["stop", "terminate"]))
def test_never_more_calls_than_attempts_and_never_a_call_while_one_is_open(events, verb):
    """Driven the way carry.py drives it: a CALL step begins an attempt; whatever the provider
    answers, a call is made only when no attempt is open, and each attempt made exactly one."""
    c, mono, calls = cf.Confirm(), 0.0, 0
    for ev in events:
        step = cf.next_step(c, mono, W)
        if step == cf.Step.DONE:
            break
        if step == cf.Step.CALL:
            assert c.last is None or c.last.phase not in cf.OPEN
            c = cf.begin(c, verb, 0.0, mono)
            calls += 1
        elif step == cf.Step.STILL_BILLING:
            c = cf.still_billing(c)
        if ev in ("accepted", "refused", "failed", "unknown"):
            c = cf.answered(c, ev, ev)
        elif ev == "unread":
            c = cf.unread(c, "timeout", 0.0)
        elif ev == "tick":
            mono += W / 3
        else:
            c = cf.seen(c, ev, ev != "running", ev == "gone", 0.0)
        assert c.calls == calls == (c.last.n if c.last else 0)
    if c.confirmed is not None:
        assert c.last.phase == cf.Phase.CONFIRMED
        assert verb == "stop" or c.confirmed["state"] == "gone"


# --- where this machine is -----------------------------------------------------------------------------
def test_env_first():
    assert detect.by_env({"RUNPOD_POD_ID": "p1"}) == Found("runpod", "env RUNPOD_POD_ID", "p1")
    assert detect.by_env({"CONTAINER_ID": "7", "VAST_CONTAINERLABEL": "C.7"}) == Found("vast", "env CONTAINER_ID", "7")
    assert detect.by_env({"CONTAINER_ID": "7", "CONTAINER_API_KEY": "k"}).name == "vast"
    assert detect.by_env({"CONTAINER_ID": "7"}) is None   # a bare CONTAINER_ID names no provider
    assert detect.by_env({}) is None


DMI = {
    "azure": {"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
              "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"},
    "oci": {"sys_vendor": "QEMU", "chassis_asset_tag": "OracleCloud.com"},
    "gcp": {"sys_vendor": "Google", "product_name": "Google Compute Engine"},
    "aws": {"sys_vendor": "Amazon EC2", "product_name": "p4d.24xlarge"},
    "digitalocean": {"sys_vendor": "DigitalOcean", "product_name": "Droplet"},
    "hetzner": {"sys_vendor": "Hetzner", "product_name": "vServer"},
    "nebius": {"sys_vendor": "Nebius", "product_name": "Nebius Compute"},
}


@pytest.mark.parametrize("name", sorted(DMI))
def test_dmi_words_name_the_provider_from_a_fake_tree(tmp_path, name):
    for f, v in DMI[name].items():
        (tmp_path / f).write_text(v + "\n")
    assert detect.find({}, str(tmp_path)).name == name
    assert detect.find({"RUNPOD_POD_ID": "p"}, str(tmp_path)).name == "runpod"   # env first


def test_old_xen_ec2_and_plain_machines(tmp_path):
    assert detect.by_dmi({"sys_vendor": "Xen", "bios_version": "4.11.amazon"}).name == "aws"
    for words in ({}, {"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"},
                  {"sys_vendor": "Dell Inc.", "product_name": "PowerEdge R750xa"}):
        assert detect.by_dmi(words) is None
    assert detect.dmi_words(str(tmp_path / "absent")) == {}


def test_pid1_environment_fills_in_what_an_ssh_session_lacks(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "environ").write_bytes(b"PATH=/usr/bin\0CONTAINER_ID=42\0CONTAINER_API_KEY=k-123456\0"
                                             b"VAST_CONTAINERLABEL=C.42\0SECRET=x\0")
    env = detect.provider_env({"HOME": "/root"}, str(tmp_path))
    assert env == {"HOME": "/root", "CONTAINER_ID": "42", "CONTAINER_API_KEY": "k-123456", "VAST_CONTAINERLABEL": "C.42"}
    assert detect.provider_env({"CONTAINER_ID": "9"}, str(tmp_path))["CONTAINER_ID"] == "9"   # ours wins
    assert detect.provider_env({}, str(tmp_path / "none")) == {}


def test_every_provider_is_described_in_full():
    for info in INFOS.values():
        assert info.label and info.noun and info.found_by and info.poweroff_means and info.credential
        assert info.poweroff_ends_billing is not None
        assert info.fix or info.poweroff_ends_billing  # where a poweroff does not end billing, say what does
    assert {n for n, i in INFOS.items() if i.api} == {"runpod", "vast", "lambda", "aws", "gcp", "azure"}
    assert not any(i.can_stop for i in INFOS.values() if not i.api)
    assert list(itertools.compress(INFOS, [i.poweroff_ends_billing for i in INFOS.values()])) == ["aws", "gcp"]
