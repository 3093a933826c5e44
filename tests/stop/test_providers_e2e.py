"""The bill stops, confirmed (issue 52), through the real daemon: a run finishes, the final sync goes to
SeaweedFS, and the default stop.action = "auto" calls the provider's stand-in on loopback (RunPod,
vast.ai, Lambda Cloud) with the pod's own credential, reads its state back and records
stop.confirmed. Status and the mails say what still bills and how much; the price comes from the
provider; a refusal is mailed at once with the provider's answer and retried; terminate runs only
over verified work; no key appears in any output (status, mails, the journal, stop.json)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.inproc import wait_mail
from tests.fixtures.nvml import gpu
from tests.fixtures.providers import KEY
from tests.idle.test_idle_e2e import config, lines
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def finish_stop_config(tmp_path, s3, prefix, smtp, fake_nvml, stand, **stop) -> dict:
    cfg = config(tmp_path, s3, prefix, smtp, fake_nvml,
                 training={"command": "sleep 1", "on_finish": "stop", "finish_grace": "2s"},
                 idle={"count_ssh": False, "warn_after": "1h"})
    del cfg["price_per_hour"]     # the provider tells it
    cfg["currency"] = "USD"
    cfg["stop"] = {**{k: v for k, v in cfg["stop"].items() if k != "command"}, "action": "auto",
                   "api_url": stand.api_url, "confirm_within": "20s", **stop}
    return cfg


def everything_said(d, smtp) -> str:
    mails = "\n".join(f"{m['Subject']}\n{m.get_payload()}" for m in list(smtp.messages))
    stop_json = (d.state_dir / "stop.json").read_text() if (d.state_dir / "stop.json").exists() else ""
    return "\n".join([json.dumps(d.status()), d.ctl("status").stdout, mails, d.log_text(), stop_json])


def test_runpod_finish_stop_is_confirmed_and_said_everywhere(tmp_path, make_daemon, smtp_server, fake_nvml,
                                                              s3_server, s3_prefix, stand_in):
    fake_nvml.write([gpu(util=0)])
    HFWriter(tmp_path / "out").checkpoint(10)
    pod = stand_in("runpod")
    pod.flip_after = 2
    d = make_daemon(finish_stop_config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml, pod), start=False)
    d.env.update({"RUNPOD_POD_ID": pod.instance, "RUNPOD_API_KEY": KEY})
    d.start()
    st = d.status()
    p = st["stop"]["provider"]
    assert {k: p[k] for k in ("name", "detected_by", "instance", "mode", "ends_billing", "still_billed")} == {
        "name": "runpod", "detected_by": "env RUNPOD_POD_ID", "instance": pod.instance, "mode": "stop",
        "ends_billing": True, "still_billed": "50 GB volume still billed, about 0.33 USD/day"}
    assert st["stop"]["confirmed"] is None
    assert st["cost"]["price_per_hour"] == 0.74, st["cost"]   # RunPod's costPerHr: no config line
    human = d.ctl("status").stdout
    assert (f"stop      RunPod API, pod {pod.instance} (ends GPU billing; 50 GB volume still billed, "
            "about 0.33 USD/day)") in human, human
    assert pod.mutations() == []

    assert d.ctl("start").returncode == 0
    subject, body = wait_mail(smtp_server, "stopping now (training finished)", timeout=60)
    assert "final sync verified" in subject
    assert f"Stop action: RunPod API: stop pod {pod.instance} (ends GPU billing; 50 GB volume still billed" in body
    # the confirmation is recorded by the stop worker; the idle machine reads STOPPED from it at its next
    # poll (a loaded fresh machine showed the two a poll apart): wait for both, then look
    wait_until(lambda: (lambda st: st["stop"]["confirmed"] and st["idle"]["state"] == "STOPPED")(d.status()), 60,
               what="the provider's confirmation, and the machine STOPPED")
    st = d.status()
    assert st["stop"]["confirmed"]["state"] == "EXITED" and st["idle"]["state"] == "STOPPED"
    assert pod.mutations() == [("POST", f"/v1/pods/{pod.instance}/stop")]          # one call
    assert all(authed for _, _, authed, _ in pod.calls)                              # each with the pod's key
    assert "stop      confirmed by the provider: EXITED at" in d.ctl("status").stdout
    assert KEY not in everything_said(d, smtp_server)


def test_vast_refusal_is_mailed_at_once_with_its_answer_and_retried(tmp_path, make_daemon, smtp_server, fake_nvml,
                                                                     s3_server, s3_prefix, stand_in):
    fake_nvml.write([gpu(util=0)])
    HFWriter(tmp_path / "out").checkpoint(10)
    inst = stand_in("vast")
    inst.refuse = (403, json.dumps({"success": False, "error": "permission_denied",
                                    "msg": f"api key {KEY} may not change instance {inst.instance}"}))
    d = make_daemon(finish_stop_config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml, inst), start=False)
    d.env.update({"CONTAINER_ID": inst.instance, "CONTAINER_API_KEY": KEY, "VAST_CONTAINERLABEL": f"C.{inst.instance}"})
    d.start()
    assert d.status()["stop"]["provider"]["still_billed"] == \
        "64 GB disk still billed until destroyed, about 0.32 USD/day"
    assert d.ctl("start").returncode == 0
    subject, body = wait_mail(smtp_server, "stop action failed", timeout=60)
    assert "vast.ai refused the stop" in subject + body and "HTTP 403" in body and "may not change instance" in body
    assert "still running (and billing)" in body
    assert d.status()["stop"]["confirmed"] is None and len(inst.mutations()) >= 1
    inst.refuse = None   # the owner fixed the key's rights: the next attempt (stop.retry_interval) goes through
    wait_until(lambda: d.status()["stop"]["confirmed"], 60, what="the confirmation after the retry")
    assert d.status()["stop"]["confirmed"]["state"] == "stopped"
    puts = [b for m, _, _, b in inst.calls if m == "PUT"]
    assert puts and all(b == {"state": "stopped"} for b in puts)
    assert KEY not in everything_said(d, smtp_server)


def test_lambda_terminates_once_the_work_is_verified(tmp_path, make_daemon, smtp_server, fake_nvml, s3_server,
                                                     s3_prefix, stand_in):
    fake_nvml.write([gpu(util=0)])
    HFWriter(tmp_path / "out").checkpoint(10)
    inst = stand_in("lambda")
    key_file = tmp_path / "lambda.key"
    key_file.write_text(KEY + "\n")
    d = make_daemon(finish_stop_config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml, inst, provider="lambda",
                                       mode="terminate", api_key_file=str(key_file), instance_id=inst.instance))
    p = d.status()["stop"]["provider"]
    assert p["name"] == "lambda" and p["mode"] == "terminate" and p["warning"] == ""
    assert d.status()["cost"]["price_per_hour"] == 0.75   # price_cents_per_hour 75
    assert d.ctl("start").returncode == 0
    wait_until(lambda: d.status()["stop"]["confirmed"], 90, what="the terminate confirmed")
    assert inst.mutations() == [("POST", "/api/v1/instance-operations/terminate")]
    assert [b for m, _, _, b in inst.calls if m == "POST"] == [{"instance_ids": [inst.instance]}]
    assert "checkpoint-10/_MANIFEST.json" in s3_server.objects(s3_prefix)   # verified before it was destroyed
    assert KEY not in everything_said(d, smtp_server)


def test_terminate_is_held_back_while_the_target_refuses_writes(tmp_path, make_daemon, smtp_server, fake_nvml,
                                                                s3_server, s3_prefix, stand_in):
    """The target refuses every write (a key it does not know): with stop_even_if_sync_fails the machine
    stops, it is never terminated over work that is not on the target."""
    fake_nvml.write([gpu(util=0)])
    HFWriter(tmp_path / "out").checkpoint(10)
    pod = stand_in("runpod")
    bad = tmp_path / "bad-credentials"
    bad.write_text("[default]\naws_access_key_id = NOSUCHKEY0000000000\naws_secret_access_key = nope-nope-nope\n")
    cfg = finish_stop_config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml, pod, mode="terminate",
                             stop_even_if_sync_fails=True)
    cfg["sync"]["credentials_file"] = str(bad)
    d = make_daemon(cfg, start=False)
    d.env.update({"RUNPOD_POD_ID": pod.instance, "RUNPOD_API_KEY": KEY})
    d.start()
    assert d.ctl("start").returncode == 0
    subject, _ = wait_mail(smtp_server, "stopping now (training finished)", timeout=90)
    assert "final sync FAILED" in subject
    wait_until(lambda: d.status()["stop"]["confirmed"], 60, what="the stop confirmed")
    assert pod.mutations() == [("POST", f"/v1/pods/{pod.instance}/stop")]   # stopped, never DELETE
    result = d.status()["stop"]["result"]
    assert result.startswith("terminate held back (") and "stopping instead" in result, result
    assert not lines(tmp_path / "stopped.txt")
    assert KEY not in everything_said(d, smtp_server)


def test_a_daemon_killed_mid_terminate_resumes_without_a_second_terminate(tmp_path, make_daemon, smtp_server,
                                                                           fake_nvml, s3_server, s3_prefix, stand_in):
    fake_nvml.write([gpu(util=0)])
    HFWriter(tmp_path / "out").checkpoint(10)
    pod = stand_in("runpod")
    pod.answer_after = 60.0   # RunPod takes the DELETE at once; its answer never reaches the daemon we kill
    d = make_daemon(finish_stop_config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml, pod, mode="terminate"),
                    start=False)
    d.env.update({"RUNPOD_POD_ID": pod.instance, "RUNPOD_API_KEY": KEY})
    d.start()
    assert d.ctl("start").returncode == 0
    wait_until(lambda: pod.mutations(), 90, what="the terminate call")
    assert '"calling"' in (d.state_dir / "stop.json").read_text()   # saved before the call went out
    d.kill9()
    pod.answer_after = 0.0
    d.start()
    wait_until(lambda: d.status()["stop"]["confirmed"], 60, what="the resumed stop confirmed")
    assert d.status()["stop"]["confirmed"]["state"] == "gone (404)"
    assert pod.mutations() == [("DELETE", f"/v1/pods/{pod.instance}")]   # one terminate, across the kill
    assert "no second call" in (d.state_dir / "stop.json").read_text()
