"""Each provider's calls against its stand-in on loopback (tests/fixtures/providers.py, written from the
providers' docs), through the real stop sequence and its stop.json: the path, the verb and the
credential header of each call, the price and what still bills, the confirmation read back, a
refusal (mailed words carry the provider's answer, never the key), a stop accepted but never carried
out (still billing, then a second call), terminate held back over unverified work, and a process
killed mid-terminate that resumes without a second terminate. AWS runs through boto3 against moto.
Time is the fake clock's: the sequence's sleep between state reads advances it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.config import from_dict
from supervisor.idle.stop import StopActionError, StopSequence
from supervisor.interfaces import FinalSyncResult
from supervisor.statefile import StateStore
from supervisor.stop.resolve import choose, priced
from tests.fixtures.providers import KEY, TOKEN
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
OK = FinalSyncResult(ok=True, target="s3://b/run", files=3, bytes=300)
FAILED = FinalSyncResult(ok=False, target="s3://b/run", files=0, bytes=0, error="AccessDenied", unsynced=["out/a"])
ENV = {
    "runpod": {"RUNPOD_POD_ID": "abc123xyz", "RUNPOD_API_KEY": KEY},
    "vast": {"CONTAINER_ID": "4242", "CONTAINER_API_KEY": KEY, "VAST_CONTAINERLABEL": "C.4242"},
    "lambda": {}, "gcp": {}, "azure": {},
}
STOP_CALL = {
    "runpod": ("POST", "/v1/pods/abc123xyz/stop"),
    "vast": ("PUT", "/api/v0/instances/4242/"),
    "gcp": ("POST", "/compute/v1/projects/my-project/zones/europe-west4-a/instances/train-1/stop"),
    "azure": ("POST", "/subscriptions/sub-1/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm1/deallocate"),
}
TERMINATE_CALL = {
    "runpod": ("DELETE", "/v1/pods/abc123xyz"),
    "vast": ("DELETE", "/api/v0/instances/4242/"),
    "lambda": ("POST", "/api/v1/instance-operations/terminate"),
    "gcp": ("DELETE", "/compute/v1/projects/my-project/zones/europe-west4-a/instances/train-1"),
    "azure": ("DELETE", "/subscriptions/sub-1/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm1"),
}


def stop_cfg(tmp_path: Path, s, **stop):
    keyfile = tmp_path / "lambda.key"
    keyfile.write_text(KEY + "\n")
    named = {"lambda": {"provider": "lambda", "api_key_file": str(keyfile), "instance_id": s.instance},
             "gcp": {"provider": "gcp"}, "azure": {"provider": "azure"}}.get(s.provider, {})
    return from_dict({"state_dir": str(tmp_path / "state"),
                      "stop": {"api_url": s.api_url, "metadata_url": s.metadata_url, "confirm_within": "60s",
                               **named, **stop}}).stop


def sequence(tmp_path: Path, s, clock: FakeClock, powered: list | None = None, **stop) -> StopSequence:
    cfg = stop_cfg(tmp_path, s, **stop)
    plan = choose(cfg, dict(ENV[s.provider]), dmi_root=str(tmp_path / "no-dmi"), proc_root=str(tmp_path / "no-proc"))
    return StopSequence(cfg, StateStore(tmp_path / "state"), clock, state_dir=tmp_path / "state", plan=plan,
                        sleep=clock.advance, runners={"poweroff": lambda c: (powered if powered is not None else []).append(1) or "powered off"})


def begin(seq: StopSequence, clock: FakeClock, result: FinalSyncResult = OK, forced: str = ""):
    rec = seq.begin("boot-1", 1, "finished", clock.time())
    seq.record_sync(result, clock.time(), clock.monotonic())
    if forced:
        seq.force(forced, clock.time())
    return rec


def saved(tmp_path: Path) -> str:
    return (tmp_path / "state" / "stop.json").read_text()


@pytest.mark.parametrize("provider", ["runpod", "vast", "gcp", "azure"])
def test_the_stop_is_one_call_with_its_credential_then_confirmed(tmp_path, stand_in, provider):
    s = stand_in(provider)
    s.flip_after = 2   # the provider carries it out a little later
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock)
    assert seq.plan.action == "provider", seq.plan
    rec = begin(seq, clock)
    result = seq.act(clock.time(), clock.monotonic())
    assert s.mutations() == [STOP_CALL[provider]]
    assert all(authed for _, path, authed, _ in s.calls if not path.startswith(("/computeMetadata", "/metadata")))
    assert rec.phase == "done" and "confirmed" in result, result
    conf = rec.provider["confirmed"]
    assert conf["state"] == {"runpod": "EXITED", "vast": "stopped", "gcp": "TERMINATED",
                             "azure": "PowerState/deallocated"}[provider]
    assert rec.provider["attempts"][-1]["reads"] == 3 and rec.provider["calls"] == 1
    assert KEY not in saved(tmp_path) and TOKEN not in saved(tmp_path)
    if provider == "azure":
        assert not any(p.endswith("/powerOff") for _, p, _, _ in s.calls)  # billed in full: never used


def test_vast_sends_the_documented_body_and_reads_actual_status(tmp_path, stand_in):
    s = stand_in("vast")
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock)
    begin(seq, clock)
    seq.act(clock.time(), clock.monotonic())
    assert [b for m, _, _, b in s.calls if m == "PUT"] == [{"state": "stopped"}]


PRICES = {"runpod": (0.74, "50 GB volume still billed, about 0.33 USD/day"),
          "vast": (0.412, "64 GB disk still billed until destroyed, about 0.32 USD/day"),
          "lambda": (0.75, "the whole instance (Lambda has no stop state: only terminate ends billing)")}


@pytest.mark.parametrize("provider", sorted(PRICES))
def test_the_price_comes_from_the_provider_unless_the_config_sets_one(tmp_path, stand_in, provider):
    s = stand_in(provider)
    cfg = from_dict({"state_dir": str(tmp_path), "stop": {"api_url": s.api_url}})
    plan = choose(stop_cfg(tmp_path, s, mode="terminate"), dict(ENV[provider]), dmi_root=str(tmp_path / "none"),
                  proc_root=str(tmp_path / "none"))
    price, kept = PRICES[provider]
    assert plan.price_per_hour == price and plan.facts.still_billed == kept
    assert priced(cfg, plan).price_per_hour == price
    assert priced(from_dict({**{"state_dir": str(tmp_path)}, "price_per_hour": 2.0}), plan).price_per_hour == 2.0
    assert priced(from_dict({"state_dir": str(tmp_path), "currency": "EUR"}), plan).price_per_hour is None
    assert [m for m, _ in s.mutations()] == []   # describing calls nothing that changes the machine
    # a stop.command of the owner's own still gets the price; the plan calls nothing else
    cmd = choose(stop_cfg(tmp_path, s, action="command", command="true"), dict(ENV[provider]),
                 dmi_root=str(tmp_path / "none"), proc_root=str(tmp_path / "none"))
    assert cmd.action == "command" and cmd.price_per_hour == price and cmd.provider is None


@pytest.mark.parametrize("provider", ["runpod", "vast"])
def test_a_refusal_is_reported_with_the_answer_and_no_key_then_retried_as_a_new_attempt(tmp_path, stand_in, provider):
    s = stand_in(provider)
    # the provider's answer echoes the key it was sent: the message must not
    s.refuse = (403, json.dumps({"error": f"key {KEY} may not stop pod {s.instance}: insufficient permissions"}))
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock)
    rec = begin(seq, clock)
    with pytest.raises(StopActionError) as e:
        seq.act(clock.time(), clock.monotonic())
    text = str(e.value)
    assert "refused the stop" in text and "HTTP 403" in text and "insufficient permissions" in text
    assert KEY not in text and KEY not in saved(tmp_path) and KEY not in json.dumps(rec.history)
    assert rec.phase == "final_sync" and rec.provider["attempts"][-1]["phase"] == "refused"
    assert len(s.mutations()) == 1
    s.refuse = None
    seq.record_sync(OK, clock.time(), clock.monotonic())
    assert "confirmed" in seq.act(clock.time(), clock.monotonic())
    assert len(s.mutations()) == 2 and rec.provider["calls"] == 2


def test_accepted_but_never_carried_out_is_still_billing_then_stopped_again(tmp_path, stand_in):
    s = stand_in("runpod")
    s.never = True
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock, confirm_within="60s")
    rec = begin(seq, clock)
    t0 = clock.monotonic()
    with pytest.raises(StopActionError, match="still billing: RunPod still reports pod abc123xyz .*RUNNING 1m") as e:
        seq.act(clock.time(), clock.monotonic())
    assert "the stop is made again" in str(e.value)
    assert clock.monotonic() - t0 >= 60 and len(s.mutations()) == 1
    assert rec.provider["attempts"][-1]["phase"] == "still_billing" and rec.provider["confirmed"] is None
    s.never = False
    seq.record_sync(OK, clock.time(), clock.monotonic())
    seq.act(clock.time(), clock.monotonic())
    assert len(s.mutations()) == 2 and rec.phase == "done"


def test_a_state_that_cannot_be_read_is_named_when_the_stop_is_not_confirmed(tmp_path, stand_in):
    s = stand_in("vast")
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock, confirm_within="30s")
    begin(seq, clock)
    s.refuse_reads = (403, '{"success": false, "error": "permission_denied", "msg": "key may not read"}')
    with pytest.raises(StopActionError, match="the state could not be read: .*HTTP 403.*key may not read"):
        seq.act(clock.time(), clock.monotonic())


@pytest.mark.parametrize("provider", ["runpod", "vast", "lambda", "gcp", "azure"])
def test_terminate_runs_over_verified_work_and_is_confirmed_when_gone(tmp_path, stand_in, provider):
    s = stand_in(provider)
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock, mode="terminate")
    rec = begin(seq, clock)
    result = seq.act(clock.time(), clock.monotonic())
    assert s.mutations() == [TERMINATE_CALL[provider]], s.calls
    assert rec.phase == "done" and rec.provider["attempts"][-1]["verb"] == "terminate"
    assert rec.provider["confirmed"]["state"] in ("gone (404)", "terminating", "terminated"), result
    if provider == "lambda":
        assert [b for m, _, _, b in s.calls if m == "POST"] == [{"instance_ids": [s.instance]}]


@pytest.mark.parametrize("provider", ["runpod", "vast", "gcp", "azure"])
def test_terminate_is_held_back_over_unverified_work_and_the_machine_stopped_instead(tmp_path, stand_in, provider):
    s = stand_in(provider)
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock, mode="terminate", stop_even_if_sync_fails=True)
    rec = begin(seq, clock, FAILED, forced="stop.stop_even_if_sync_fails is set")
    result = seq.act(clock.time(), clock.monotonic())
    assert s.mutations() == [STOP_CALL[provider]]            # a stop, never the terminate
    assert result.startswith("terminate held back (the stop goes ahead without a verified final sync")
    assert "stopping instead" in result and rec.provider["attempts"][-1]["verb"] == "stop"


def test_lambda_cannot_stop_so_unverified_work_keeps_it_running(tmp_path, stand_in):
    s = stand_in("lambda")
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock, mode="terminate")
    begin(seq, clock, FAILED, forced="the spend cap has come")
    with pytest.raises(StopActionError, match="terminate held back: .*Lambda Cloud has no stop"):
        seq.act(clock.time(), clock.monotonic())
    assert s.mutations() == []


def test_lambda_finds_its_instance_in_the_listing_by_this_machines_address(tmp_path, stand_in):
    s = stand_in("lambda")
    s.ip = "127.0.0.1"   # the address this machine reaches the (loopback) API from
    cfg = stop_cfg(tmp_path, s, mode="terminate", instance_id="")
    plan = choose(cfg, {}, dmi_root=str(tmp_path / "none"), proc_root=str(tmp_path / "none"))
    assert plan.action == "provider" and plan.provider.instance == s.instance
    assert plan.line() == (f"Lambda Cloud API, instance {s.instance} (terminated once the final sync "
                           "is verified (ends every charge))")
    s.ip = "198.51.100.9"
    plan = choose(cfg, {}, dmi_root=str(tmp_path / "none"), proc_root=str(tmp_path / "none"))
    assert plan.action == "poweroff" and "set stop.instance_id" in plan.warning


def test_auto_on_gcp_powers_off_when_the_service_account_may_not_stop(tmp_path, stand_in):
    """The default service account's scopes lack compute: the refusal is kept, and the poweroff that
    ends compute billing on GCE runs at once."""
    s = stand_in("gcp")
    s.refuse = (403, json.dumps({"error": {"code": 403, "message": "Request had insufficient authentication scopes."}}))
    powered: list = []
    clock = FakeClock()
    seq = sequence(tmp_path, s, clock, powered)
    rec = begin(seq, clock)
    result = seq.act(clock.time(), clock.monotonic())
    assert powered == [1] and "refused the stop" in result and "powered off instead" in result
    assert "insufficient authentication scopes" in result and rec.phase == "done"


KILLED = """
import sys
from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.idle.stop import StopSequence
from supervisor.interfaces import FinalSyncResult
from supervisor.statefile import StateStore
from supervisor.stop.resolve import choose
state, api = sys.argv[1], sys.argv[2]
cfg = from_dict({"state_dir": state, "stop": {"api_url": api, "mode": "terminate", "confirm_within": "60s"}}).stop
plan = choose(cfg, {"RUNPOD_POD_ID": "abc123xyz", "RUNPOD_API_KEY": sys.argv[3]}, dmi_root="/none", proc_root="/none")
seq = StopSequence(cfg, StateStore(state), SystemClock(), state_dir=state, plan=plan)
seq.begin("boot-1", 1, "finished", 1.0)
seq.record_sync(FinalSyncResult(ok=True, target="s3://b/r", files=1, bytes=1), 1.0, 1.0)
seq.act(2.0, 2.0)
"""


def test_a_process_killed_mid_terminate_resumes_without_a_second_terminate(tmp_path, stand_in):
    s = stand_in("runpod")
    s.answer_after = 30.0   # RunPod takes the DELETE; its answer never reaches the process we kill
    state = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(state), s.api_url, KEY], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: s.mutations(), 30, what="the terminate call")
        wait_until(lambda: '"calling"' in (state / "stop.json").read_text(), 10, what="the attempt saved")
    finally:
        p.kill()
        p.wait(10)
    s.answer_after = 0.0
    clock = FakeClock()
    cfg = from_dict({"state_dir": str(state), "stop": {"api_url": s.api_url, "mode": "terminate",
                                                       "confirm_within": "60s"}}).stop
    plan = choose(cfg, dict(ENV["runpod"]), dmi_root=str(tmp_path / "none"), proc_root=str(tmp_path / "none"))
    seq = StopSequence(cfg, StateStore(state), clock, state_dir=state, plan=plan, sleep=clock.advance)
    rec = seq.begin("boot-1", 1, "finished", 3.0)
    assert rec.phase == "acting" and rec.provider["attempts"][-1]["phase"] == "calling"
    result = seq.act(clock.time(), clock.monotonic())
    assert s.mutations() == [("DELETE", "/v1/pods/abc123xyz")]   # one terminate, ever
    assert rec.phase == "done" and "gone (404)" in result
    assert any("no second call" in h for h in rec.history)


# --- AWS: boto3 against moto, the instance from IMDSv2 -------------------------------------------------
@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("mode", ["stop", "terminate"])
def test_aws_found_by_its_dmi_words_stops_through_boto3_and_reads_the_state(moto_ec2, imds, aws_env, tmp_path, mode):
    ec2 = moto_ec2.ec2("eu-central-1")
    iid = ec2.run_instances(ImageId="ami-03cf127a", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    imds.instance_id = iid
    dmi = tmp_path / "dmi"
    dmi.mkdir()
    (dmi / "sys_vendor").write_text("Amazon EC2\n")
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "stop": {"metadata_url": imds.url, "api_url": moto_ec2.url,
                                                                    "mode": mode}}).stop
    plan = choose(cfg, {}, dmi_root=str(dmi), proc_root=str(tmp_path / "none"))
    assert plan.action == "provider" and plan.found.detected_by == "DMI sys_vendor Amazon EC2"
    clock = FakeClock()
    seq = StopSequence(cfg, StateStore(tmp_path / "state"), clock, state_dir=tmp_path / "state", plan=plan,
                       sleep=clock.advance)
    rec = begin(seq, clock)
    seq.act(clock.time(), clock.monotonic())
    state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert rec.phase == "done" and rec.provider["confirmed"]["state"] == state == {"stop": "stopped",
                                                                                   "terminate": "terminated"}[mode]
    assert imds.requests[0] == ("PUT", "/latest/api/token", True)
