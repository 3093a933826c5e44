"""One stop through the real daemon and the fake NVML (issue 36, must show): an idle stop held in
its final sync by a target that is down, GPU health BAD with on_bad = "stop" asked meanwhile, then
GPU load comes back. The health stop takes the idle stop over, activity does not drop it, and it
completes when the target returns, its mail naming the GPU."""

from __future__ import annotations

import shutil

import pytest

from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.inproc import wait_mail
from tests.fixtures.nvml import HEALTHY, gpu
from tests.idle.test_idle_e2e import config, lines, wait_idle
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_a_health_stop_survives_an_idle_stop_cancelled_by_activity(tmp_path, make_daemon, smtp_server, fake_nvml,
                                                                     s3_server, s3_prefix):
    fake_nvml.write([gpu(util=0, **HEALTHY)])
    HFWriter(tmp_path / "out").checkpoint(20)
    d = make_daemon(config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml,
                           idle={"count_ssh": False, "warn_after": "2s", "stop_after_warning": "2s"},
                           health={"on_bad": "stop", "expect_gpus": 1}))
    s3_server.stop()
    try:
        wait_mail(smtp_server, "NOT stopping: final sync failed", timeout=60)
        st = d.status()
        assert st["stop"]["reason"] == "idle" and st["stop"]["phase"] == "final_sync"
        # the GPU goes bad while the idle stop waits for the target
        fake_nvml.write([gpu(util=0, **{**HEALTHY, "retired_pending": 1})])
        d.req("health")
        wait_until(lambda: d.status()["stop"]["reason"] == "health", 20, what="the health stop taking over")
        # activity comes back: GPU load (the bad GPU still bad)
        fake_nvml.write([gpu(util=95, **{**HEALTHY, "retired_pending": 1})])
        wait_idle(d, lambda i: any(r.startswith("gpu: 9") for r in i["reasons"]), what="GPU load seen")
        st = d.status()
        assert st["idle"]["state"] == "STOPPING" and st["stop"]["reason"] == "health", st["stop"]
        assert [p["reason"] for p in st["stop"]["pending"]] == ["health"]
        assert not lines(tmp_path / "stopped.txt")  # nothing stops while the target is down
    finally:
        s3_server.start()
    wait_until(lambda: lines(tmp_path / "stopped.txt"), 90, what="the health stop's action once the target is back")
    subject, body = wait_mail(smtp_server, "stopping now (GPU health BAD)", timeout=30)
    assert "final sync verified" in subject
    assert "Why: GPU 0: retired memory pages pending" in body  # the mail names the GPU
    wait_idle(d, lambda i: i["state"] == "STOPPED", what="STOPPED")
    st = d.status()
    assert st["stop"]["reason"] == "health" and st["stop"]["final_sync"]["ok"] and st["stop"]["pending"] == []
    assert lines(tmp_path / "stopped.txt") == ["stopped"]  # one stop action
