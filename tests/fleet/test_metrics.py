"""Prometheus metrics: the pure status -> exposition function (checked with prometheus_client's own
parser), the atomic textfile writer, the loopback listener and the [metrics] config."""

from __future__ import annotations

import json
import math
import re
import threading
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from supervisor.config import ConfigError, from_dict, parse_listen
from supervisor.fleet.metrics import (
    CONTENT_TYPE,
    IDLE_STATES,
    MetricsDuty,
    MetricsServer,
    exposition,
    write_textfile,
)

NOW = 1764700000.0
FULL = {
    "version": "0.1.0", "now": NOW,
    "daemon": {"pid": 812, "started_at": NOW - 10000, "uptime_s": 10000.0, "problems": ["x"]},
    "training": {"state": "RUNNING", "pid": 4242, "started_at": NOW - 2030, "ended_at": None, "exit_code": None,
                 "restarts": 1,
                 "progress": {"step": 1200, "max_steps": 3750, "epoch": 0.96, "loss": 1.214, "tokens_per_s": 2410.0,
                              "eta_s": 4320.0, "steps_per_s": 0.59, "percent": 32.0, "elapsed_s": 2030.0,
                              "learning_rate": 0.00018, "stalled_since": None}},
    "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i}", "util_pct": 97 - i,
              "mem_used_bytes": 76441190400, "mem_total_bytes": 85520809984,
              "processes": [{"pid": 4250, "mem_bytes": 1}]} for i in range(2)],
    "gpu_error": None,
    "sync": {"target": "s3://b/r", "state": "uploading", "last_ok_at": NOW - 100, "last_error": None,
             "pending_bytes": 2147483648, "pending_files": 3, "uploaded_files": 48, "uploaded_bytes": 123456789},
    "idle": {"state": "IDLE", "idle_since": NOW - 600, "warn_at": NOW + 6600, "stop_at": NOW + 10200,
             "reasons": [], "keepalive_until": None},
    "stop": {"action": "poweroff", "planned_at": NOW + 10200},
    "alerts": [{"key": "gpu:mem_limit", "kind": "gpu_mem_limit", "severity": "warning"},
               {"key": "disk:/", "kind": "disk_full", "severity": "critical"},
               {"key": "disk:/w", "kind": "disk_full", "severity": "critical"}],
    "cost": {"price_per_hour": 3.9, "currency": "EUR", "spent": 2.2, "eta_cost": 4.68},
    "notify": {"channels": [{"name": "email", "kind": "email", "state": "ok", "queued": 0, "last_ok_at": NOW - 5},
                            {"name": "ntfy", "kind": "apprise", "state": "failing", "queued": 2, "last_ok_at": None}]},
    "orchestrator": {"name": "skypilot", "evidence": "SKYPILOT_TASK_ID in the environment"},
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, metric: str, **labels) -> float:
    return samples(text)[(metric, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def test_every_figure_of_the_status_is_exported_under_conventional_names():
    text = exposition(FULL)
    got = samples(text)
    v = lambda metric, **lab: value(text, "train_supervisor_" + metric, **lab)  # noqa: E731
    assert v("build_info", version="0.1.0") == 1
    assert v("status_timestamp_seconds") == NOW and v("daemon_start_timestamp_seconds") == NOW - 10000
    assert v("daemon_problems") == 1
    assert v("training_state", state="RUNNING") == 1 and v("training_state", state="FAILED") == 0
    assert v("training_start_timestamp_seconds") == NOW - 2030 and v("training_restarts") == 1
    assert (v("training_step"), v("training_max_steps"), v("training_epoch")) == (1200, 3750, 0.96)
    assert (v("training_loss"), v("training_learning_rate")) == (1.214, 0.00018)
    assert (v("training_tokens_per_second"), v("training_steps_per_second")) == (2410, 0.59)
    assert v("training_progress_ratio") == pytest.approx(0.32)
    assert (v("training_eta_seconds"), v("training_elapsed_seconds"), v("training_stalled")) == (4320, 2030, 0)
    assert v("cost_price_per_hour", currency="EUR") == 3.9 and v("cost_spent", currency="EUR") == 2.2
    assert v("cost_to_finish", currency="EUR") == 4.68
    assert v("gpus") == 2 and v("gpu_error") == 0
    lab = {"gpu": 1, "uuid": "GPU-1", "model": "NVIDIA H100 80GB HBM3"}
    assert v("gpu_utilization_ratio", **lab) == pytest.approx(0.96)
    assert v("gpu_memory_used_bytes", **lab) == 76441190400 and v("gpu_memory_total_bytes", **lab) == 85520809984
    assert v("gpu_processes", **lab) == 1
    assert v("idle_state", state="IDLE") == 1 and sum(v("idle_state", state=s) for s in IDLE_STATES) == 1
    assert v("idle_seconds") == 600 and v("idle_warn_timestamp_seconds") == NOW + 6600
    assert v("idle_stop_timestamp_seconds") == NOW + 10200 and v("stop_planned_timestamp_seconds") == NOW + 10200
    assert v("sync_state", state="uploading") == 1 and v("sync_state", state="failing") == 0
    assert (v("sync_pending_files"), v("sync_pending_bytes")) == (3, 2147483648)
    assert v("sync_last_success_timestamp_seconds") == NOW - 100
    assert v("sync_uploaded_files_total") == 48 and v("sync_uploaded_bytes_total") == 123456789
    assert v("alerts_active") == 3 and v("alerts_active_by_kind", kind="disk_full", severity="critical") == 2
    assert v("notify_channel_up", channel="email", kind="email") == 1
    assert v("notify_channel_up", channel="ntfy", kind="apprise") == 0
    assert v("notify_queued", channel="ntfy", kind="apprise") == 2
    assert v("notify_last_success_timestamp_seconds", channel="email", kind="email") == NOW - 5
    assert v("orchestrator_info", name="skypilot") == 1
    # unknown figures are left out, never 0
    assert not [k for k in got if k[0] in ("train_supervisor_training_exit_code",
                                           "train_supervisor_keepalive_until_timestamp_seconds",
                                           "train_supervisor_training_end_timestamp_seconds")]


def test_names_and_types_follow_the_conventions():
    text = exposition(FULL)
    helps = re.findall(r"^# HELP (\S+) ", text, re.M)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert len(helps) == len(set(helps)) == len(types)  # one HELP and TYPE per family
    for name, kind in types.items():
        assert re.fullmatch(r"train_supervisor_[a-z0-9_]+", name)
        assert name.endswith("_total") == (kind == "counter"), name
        assert kind in ("gauge", "counter")
        # units are base units in the name: no _percent, _ms, _mb, _gib
        assert not re.search(r"_(percent|pct|ms|mb|gb|gib|mib|minutes|hours)(_|$)", name), name
    for fam in text_string_to_metric_families(text):
        assert fam.documentation


def test_stalled_and_finished_runs():
    st_ = json.loads(json.dumps(FULL))
    st_["training"]["progress"]["stalled_since"] = NOW - 1800
    text = exposition(st_)
    assert value(text, "train_supervisor_training_stalled") == 1
    assert value(text, "train_supervisor_training_stalled_since_timestamp_seconds") == NOW - 1800
    st_["training"].update(state="FAILED", exit_code=-9, ended_at=NOW - 5)
    st_["training"]["progress"]["stalled_since"] = None
    text = exposition(st_)
    assert value(text, "train_supervisor_training_exit_code") == -9
    assert "train_supervisor_training_stalled " not in text  # only said of a running training
    st_["idle"] = {"state": "ACTIVE", "idle_since": None}
    assert value(exposition(st_), "train_supervisor_idle_seconds") == 0


def test_labels_are_escaped():
    st_ = {"now": 1.0, "gpus": [{"index": 0, "name": 'Weird "GPU"\\ with\nnewline', "util_pct": 5}]}
    (s,) = [s for f in text_string_to_metric_families(exposition(st_)) for s in f.samples
            if s.name == "train_supervisor_gpu_utilization_ratio"]
    assert s.labels["model"] == 'Weird "GPU"\\ with\nnewline' and s.value == 0.05


def test_an_unknown_state_value_still_shows():
    text = exposition({"now": 1.0, "sync": {"state": "verifying"}})
    assert value(text, "train_supervisor_sync_state", state="verifying") == 1
    assert value(text, "train_supervisor_sync_state", state="idle") == 0


def test_empty_status_is_still_valid():
    text = exposition({})
    assert value(text, "train_supervisor_build_info", version="unknown") == 1


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                                                      max_size=3), max_leaves=12)
keys = st.sampled_from(["now", "version", "daemon", "training", "gpus", "gpu_error", "sync", "idle", "stop",
                        "alerts", "cost", "notify", "orchestrator"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(keys, json_values, max_size=8))
def test_any_garbage_gives_parseable_text(garbage):
    text = exposition(garbage)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert math.isfinite(s.value)


def test_fuzz_inside_the_sections():
    # the sections with the right keys but the wrong types
    bad = {"now": "soon", "training": {"state": 5, "progress": {"step": "12", "loss": float("nan")}},
           "gpus": [None, 3, {"index": None, "util_pct": "97"}], "idle": {"state": "IDLE", "idle_since": "x"},
           "alerts": [None, "x"], "notify": {"channels": [None]}, "cost": {"spent": float("inf")}}
    text = exposition(bad)
    assert list(text_string_to_metric_families(text))


# --- the shell -------------------------------------------------------------------------------------

def test_textfile_is_replaced_atomically(tmp_path):
    path = tmp_path / "train_supervisor.prom"
    big = [exposition(FULL) * 40, exposition({"now": 2.0}) * 40]
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            write_textfile(str(path), big[i % 2])
            i += 1

    write_textfile(str(path), big[0])
    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(300):  # bounded: every read sees one whole version
            assert path.read_text() in big
    finally:
        stop.set()
        t.join()
    assert [p.name for p in tmp_path.iterdir()] == ["train_supervisor.prom"]  # no temp left behind
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_listener_serves_metrics_and_survives_a_failing_render():
    state = {"fail": False}

    def text():
        if state["fail"]:
            raise RuntimeError("boom")
        return exposition(FULL)

    srv = MetricsServer("127.0.0.1", 0, text)
    srv.start()
    try:
        base = f"http://127.0.0.1:{srv.address[1]}"
        code, ctype, body = get(base + "/metrics")
        assert code == 200 and ctype == CONTENT_TYPE and value(body, "train_supervisor_training_step") == 1200
        assert get(base + "/nope")[0] == 404
        state["fail"] = True
        assert get(base + "/metrics")[0] == 500
        state["fail"] = False
        assert get(base + "/metrics")[0] == 200
    finally:
        srv.close()


def test_duty_reports_an_unwritable_textfile_and_recovers(tmp_path, clock):
    path = tmp_path / "missing" / "ts.prom"
    duty = MetricsDuty(str(path), "", lambda: FULL, clock.time)
    duty.poll()
    assert "metrics.textfile" in duty.status()["error"] and duty.status()["written_at"] is None
    path.parent.mkdir()
    duty.poll()
    assert duty.status()["error"] is None and duty.status()["written_at"] == clock.time()
    assert duty.last_status is FULL and path.read_text() == exposition(FULL)


@pytest.mark.parametrize("listen,ok", [("127.0.0.1:9839", True), ("9839", True), ("localhost:9839", True),
                                       ("[::1]:9839", True), ("0.0.0.0:9839", False), ("10.0.0.5:9839", False),
                                       ("127.0.0.1", False), ("127.0.0.1:70000", False), ("a b:1", False)])
def test_listen_is_loopback_unless_asked(listen, ok):
    if ok:
        from_dict({"metrics": {"listen": listen}})
    else:
        with pytest.raises(ConfigError) as e:
            from_dict({"metrics": {"listen": listen}})
        assert "metrics.listen" in str(e.value)


def test_remote_listen_when_asked_and_textfile_must_end_in_prom():
    from_dict({"metrics": {"listen": "0.0.0.0:9839", "allow_remote": True}})
    assert parse_listen("9839") == ("127.0.0.1", 9839)
    with pytest.raises(ConfigError) as e:
        from_dict({"metrics": {"textfile": "/var/lib/prometheus/node-exporter/ts.txt"}})
    assert "must end in .prom" in str(e.value)


@pytest.mark.skipif(__import__("shutil").which("tmux") is None, reason="tmux is not installed")
def test_daemon_writes_the_textfile_and_serves_metrics(tmp_path, make_daemon):
    import socket

    from tests.waiting import wait_until

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom = tmp_path / "textfile" / "train_supervisor.prom"
    prom.parent.mkdir()
    d = make_daemon({"training": {"command": "sleep 300", "workdir": str(tmp_path), "log": str(tmp_path / "t.log"),
                                  "on_finish": "none"},
                     "gpu": {"nvml_library": str(tmp_path / "none.so"), "poll_interval": "0.3s"},
                     "stop": {"action": "dry-run"},
                     "metrics": {"textfile": str(prom), "listen": f"127.0.0.1:{port}"}})
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")

    def running_in_file():
        return prom.exists() and 'train_supervisor_training_state{state="RUNNING"} 1' in prom.read_text()

    wait_until(running_in_file, 30, what="the textfile to show RUNNING")
    assert value(prom.read_text(), "train_supervisor_gpu_error") == 1  # no driver here
    code, ctype, body = get(f"http://127.0.0.1:{port}/metrics")
    assert code == 200 and ctype == CONTENT_TYPE
    assert value(body, "train_supervisor_training_state", state="RUNNING") == 1
    st = d.status()["metrics"]
    assert st["error"] is None and st["written_at"] and st["address"] == f"127.0.0.1:{port}"
