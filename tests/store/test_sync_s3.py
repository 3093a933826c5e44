"""The engine against a real S3 server (SeaweedFS on loopback): integrity, multipart, both
checksum modes, credentials, kill -9 mid-upload, and the server going down and coming back."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from supervisor.clock import FakeClock
from supervisor.sync.manifest import parse
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes
from tests.waiting import wait_until

MiB = 1024 * 1024


def assert_remote_matches(s3, prefix: str, unit: str, files: dict[str, bytes]) -> dict:
    objs = s3.objects(f"{prefix}/{unit}")
    assert set(objs) == set(files) | {MANIFEST_NAME}, sorted(objs)
    for name, data in files.items():
        assert s3.get(f"{prefix}/{unit}/{name}") == data, name
    listed = {f.path: f for f in parse(s3.get(f"{prefix}/{unit}/{MANIFEST_NAME}"))}
    assert {n: (f.size, f.sha256) for n, f in listed.items()} == {
        n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}
    return objs


def test_checkpoint_and_adapter_to_s3(make_engine, hf_writer, s3_server, s3_prefix):
    hf_writer.checkpoint(50, model_bytes=18 * MiB)  # above the single-PUT limit: multipart
    hf_writer.adapter("lora")
    hf_writer.age(60)
    e = make_engine({**s3_server.sync_config(s3_prefix, part_size="5M", multipart_threshold="16M", concurrency=4),
                     "watch": [str(hf_writer.out)]})
    r = e.wait_idle(60)
    assert r.ok, r
    objs = assert_remote_matches(s3_server, s3_prefix, "checkpoint-50", hf_writer.contents["checkpoint-50"])
    assert objs["model.safetensors"]["etag"].endswith("-4")  # 18 MiB in 5 MiB parts
    assert_remote_matches(s3_server, s3_prefix, "lora", hf_writer.contents["lora"])
    # the manifest was written last
    t_manifest = s3_server.chunk_times(f"{s3_prefix}/checkpoint-50/{MANIFEST_NAME}")
    for name in hf_writer.contents["checkpoint-50"]:
        assert max(s3_server.chunk_times(f"{s3_prefix}/checkpoint-50/{name}")) <= min(t_manifest), name
    assert s3_server.uploads(s3_prefix) == []
    st = e.status()
    assert st["target"] == f"s3://{s3_server.bucket}/{s3_prefix}" and st["uploaded_files"] == 13


def test_md5_mode_for_stores_that_reject_new_checksums(make_engine, hf_writer, s3_server, s3_prefix):
    hf_writer.checkpoint(1, model_bytes=18 * MiB)
    hf_writer.age(60)
    e = make_engine({**s3_server.sync_config(s3_prefix, part_size="5M", multipart_threshold="5M",
                                             request_checksum_calculation="when_required"),
                     "watch": [str(hf_writer.out)], "include": ["checkpoint-*/**"]})
    assert e.wait_idle(60).ok
    files = hf_writer.contents["checkpoint-1"]
    objs = assert_remote_matches(s3_server, s3_prefix, "checkpoint-1", files)
    assert objs["config.json"]["etag"] == hashlib.md5(files["config.json"]).hexdigest()
    model, ps = files["model.safetensors"], 5 * MiB
    md5s = [hashlib.md5(model[i:i + ps]).digest() for i in range(0, len(model), ps)]
    assert objs["model.safetensors"]["etag"] == f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


@pytest.mark.parametrize("mode", ["when_supported", "when_required"])
def test_file_under_the_multipart_threshold_goes_in_one_streamed_put(make_engine, hf_writer, s3_server, s3_prefix,
                                                                     mode):
    """18 MiB is above the in-memory limit and under the default multipart_threshold: one PUT,
    streamed from the file, checked by the store (CRC32 or Content-MD5) and in the manifest."""
    hf_writer.checkpoint(4, model_bytes=18 * MiB)
    hf_writer.age(60)
    e = make_engine({**s3_server.sync_config(s3_prefix, request_checksum_calculation=mode, bandwidth_limit="64M"),
                     "watch": [str(hf_writer.out)], "include": ["checkpoint-*/**"]})
    assert e.wait_idle(60).ok
    files = hf_writer.contents["checkpoint-4"]
    objs = assert_remote_matches(s3_server, s3_prefix, "checkpoint-4", files)
    assert objs["model.safetensors"]["etag"] == hashlib.md5(files["model.safetensors"]).hexdigest()
    assert s3_server.uploads(s3_prefix) == []


def test_wrong_credentials_fail_clearly_without_leaking(make_engine, hf_writer, s3_server, s3_prefix, tmp_path):
    creds = tmp_path / "creds"
    creds.write_text("[default]\naws_access_key_id = tsupervisor\naws_secret_access_key = WRONG-SECRET-123\n")
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    e = make_engine({**s3_server.sync_config(s3_prefix), "credentials_file": str(creds),
                     "watch": [str(hf_writer.out)]})
    r = e.wait_idle(30)
    assert not r.ok and ("SignatureDoesNotMatch" in r.error or "check the credentials" in r.error), r
    st = e.status()
    assert st["state"] == "failing" and "WRONG-SECRET" not in json.dumps(st) and "WRONG-SECRET" not in r.error
    assert s3_server.objects(s3_prefix) == {}


def test_remote_loss_is_found_by_final_sync(make_engine, hf_writer, s3_server, s3_prefix):
    hf_writer.checkpoint(2)
    hf_writer.age(60)
    e = make_engine({**s3_server.sync_config(s3_prefix), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/checkpoint-2/optimizer.pt")
    assert e.wait_idle(30).ok  # the ledger says it is there; a normal pass sends no LIST
    r = e.final_sync([str(hf_writer.out)], 60)
    assert r.ok and r.uploaded_files == 1, r
    assert_remote_matches(s3_server, s3_prefix, "checkpoint-2", hf_writer.contents["checkpoint-2"])


def test_a_manifest_on_the_store_but_not_in_the_ledger_is_kept(make_engine, hf_writer, s3_server, s3_prefix):
    """The kill between a manifest's PUT and its ledger record (the kill -9 test below can land
    there): the restarted daemon reads it back, finds it says what it would write, keeps it."""
    hf_writer.checkpoint(2)
    hf_writer.age(60)
    cfg = {**s3_server.sync_config(s3_prefix), "watch": [str(hf_writer.out)]}
    e1 = make_engine(cfg)
    assert e1.wait_idle(60).ok and e1.ledger is not None
    e1.ledger.manifest_forget("checkpoint-2")
    e1.ledger.sync()
    e1.close()
    key = f"{s3_prefix}/checkpoint-2/{MANIFEST_NAME}"
    times = s3_server.chunk_times(key)
    e2 = make_engine(cfg)
    assert e2.wait_idle(60).ok and e2.ledger is not None and e2.ledger.manifest("checkpoint-2")
    assert s3_server.chunk_times(key) == times, "the manifest was sent again"


def _journal_has(proc, op: str, key_part: str, n: int = 1) -> bool:
    return sum(1 for r in proc.journal() if r.get("op") == op and key_part in r.get("k", "")) >= n


def _read_so_far(proc) -> int:
    """Bytes the sync process has read so far (/proc/PID/io rchar: its files, as a streamed PUT
    reads them while it sends)."""
    try:
        text = open(f"/proc/{proc.proc.pid}/io").read()
    except OSError:
        return 0
    return int(text.split("rchar:", 1)[1].split()[0])


class _MidSinglePut:
    """True once both large files have begun as single PUTs (each checksummed, which reads it
    whole, before its begin is journalled) and then 6 MiB more were read: their bodies going out
    together, neither finished."""

    def __init__(self, proc):
        self.proc = proc
        self.base: int | None = None

    def __call__(self) -> bool:
        j = self.proc.journal()
        begun = {r["k"].rsplit("/", 1)[1] for r in j if r.get("op") == "begin" and r.get("i", {}).get("mode") == "put"}
        if any(r.get("op") == "done" and "model.safetensors" in r["k"] for r in j):
            raise AssertionError("the model finished before the kill: raise the test's size or lower its bandwidth")
        if self.base is None:
            if {"model.safetensors", "optimizer.pt"} <= begun:
                self.base = _read_so_far(self.proc)
            return False
        return _read_so_far(self.proc) - self.base >= 6 * MiB


@pytest.mark.slow
@pytest.mark.parametrize(("concurrency", "part_mib", "threshold_mib"), [(2, 5, 5), (16, 8, 8), (16, 8, 64)],
                         ids=["2x5M", "16x8M", "16x64M-put"])
def test_kill9_mid_upload_resumes_and_sends_nothing_twice(sync_proc, hf_writer, s3_server, s3_prefix,
                                                          concurrency, part_mib, threshold_mib):
    """Killed three times (mid upload of the model, between files, among the small files): every
    file the store held at a kill is never sent again, and the rest goes up once (plus what was in
    flight). 16x8M is the parallel multipart path: many files and parts in flight together;
    16x64M-put the default for files of this size: each large file in one streamed PUT, killed
    in the middle of one."""
    multipart = threshold_mib < 24
    cp = hf_writer.out / "checkpoint-9"
    cp.mkdir(parents=True)
    files = {"model.safetensors": safetensors_bytes({"w": 24 * MiB}, 9),
             "optimizer.pt": torch_zip_bytes(24 * MiB, 10)}
    for i in range(30):
        files[f"rng_state_{i}.pth"] = torch_zip_bytes(20_000 + i, i)
    files["trainer_state.json"] = json.dumps({"global_step": 9}).encode()
    for n, d in files.items():
        (cp / n).write_bytes(d)
    hf_writer.age(60)
    total = sum(len(d) for d in files.values())
    proc = sync_proc({**s3_server.sync_config(s3_prefix, part_size=f"{part_mib}M", concurrency=concurrency,
                                              multipart_threshold=f"{threshold_mib}M", bandwidth_limit="12M"),
                      "watch": [str(hf_writer.out)]})
    received0 = s3_server.received_bytes()
    finished_at_kill: dict[str, tuple] = {}

    def kill_when(cond, what):
        proc.start()
        wait_until(cond, 60, interval=0.02, what=what)
        proc.kill9()
        for key in s3_server.objects(s3_prefix):  # objects exist only once complete
            finished_at_kill.setdefault(key, s3_server.chunk_times(f"{s3_prefix}/{key}"))

    if multipart:
        # 1: in the middle of a multipart upload
        kill_when(lambda: _journal_has(proc, "part", "model.safetensors", 2), "two parts of the model")
        # 2: the model done, the optimizer half way
        kill_when(lambda: _journal_has(proc, "done", "model.safetensors")
                  and _journal_has(proc, "part", "optimizer.pt", 2), "model done, optimizer under way")
    else:
        # 1: in the middle of the model's single PUT
        kill_when(_MidSinglePut(proc), "the model's PUT under way")
        assert "model.safetensors" not in finished_at_kill
        # 2: the model done (the optimizer, sent alongside it, done or nearly)
        kill_when(lambda: _journal_has(proc, "done", "model.safetensors"), "model done")
    # 3: among the small files
    kill_when(lambda: sum(1 for r in proc.journal() if r.get("op") == "done") >= 12, "a dozen files done")
    proc.start()
    wait_until(lambda: MANIFEST_NAME in s3_server.objects(f"{s3_prefix}/checkpoint-9"), 90, what="complete")
    proc.stop()

    assert_remote_matches(s3_server, s3_prefix, "checkpoint-9", files)
    assert s3_server.uploads(s3_prefix) == [], "an interrupted multipart upload was left behind"
    for key, times in finished_at_kill.items():
        assert s3_server.chunk_times(f"{s3_prefix}/{key}") == times, f"{key} was sent again after it was finished"
    # what the server received: everything once, plus at most what was in flight at each kill
    received = s3_server.received_bytes() - received0
    in_flight = concurrency * part_mib * MiB if multipart else 48 * MiB
    in_flight_allowance = 3 * (in_flight + 64 * 1024)
    assert total <= received <= total + in_flight_allowance + 64 * 1024, (received, total)
    journal = proc.journal()
    done_keys = [r["k"] for r in journal if r.get("op") == "done"]
    assert sorted(done_keys) == sorted(f"checkpoint-9/{n}" for n in files), "a file done twice"
    for i, r in enumerate(journal):
        if r.get("op") == "done":
            assert not any(x.get("op") == "begin" and x.get("k") == r["k"] for x in journal[i + 1:]), r["k"]
    begun = {r["i"].get("mode") for r in journal if r.get("op") == "begin" and "model" in r["k"]}
    assert begun == ({"mp"} if multipart else {"put"}), begun
    if multipart:
        assert "s3_resume" in proc.log_text()


@pytest.mark.slow
def test_server_down_for_a_minute_alerts_once_then_resolves(make_engine, hf_writer, s3_server, s3_prefix,
                                                            smtp_server):
    clock = FakeClock(start=time.time())
    hf_writer.checkpoint(3, model_bytes=20 * MiB)
    hf_writer.age(60)
    e = make_engine({**s3_server.sync_config(s3_prefix, part_size="5M", multipart_threshold="5M", concurrency=2,
                                             bandwidth_limit="8M"),
                     "watch": [str(hf_writer.out)], "fail_alert_after": "1m", "retry_max_backoff": "20s"},
                    clock=clock, mailer="smtp",
                    email={"to": ["owner@example.com"], "smtp_host": "127.0.0.1", "smtp_port": smtp_server.port,
                           "security": "none", "from": "sup@example.com"})
    alerts = e.alerts
    wait_until(lambda: e.status()["sent_bytes"] >= 5 * MiB, 30, what="upload under way")
    s3_server.stop()
    try:
        wait_until(lambda: e.status()["state"] == "failing", 60, what="failing")
        assert not alerts.active()  # failing, but not for a minute yet: no alert
        clock.advance(30)
        e.request_sync()
        time.sleep(0.6)  # let the worker look at the clock (nothing to wait on: it must NOT alert)
        assert not alerts.active()
        clock.advance(31)
        wait_until(lambda: alerts.active(), 10, what="sync failing alert")
        wait_until(lambda: (alerts.tick(), len(smtp_server.messages) >= 1)[1], 20, what="alert mail")
        assert "sync failing" in smtp_server.subjects()[0]
        clock.advance(60)  # still down: a retry fails, no second first-mail
        e.request_sync()
        wait_until(lambda: e.status()["failing_for_s"] >= 120, 10, what="still failing")
    finally:
        s3_server.start()
    # a try that began while weed was down can end failing after weed is back, and set its backoff
    # on this fake clock then (CI 12-07: the worker slept on a clock that moved no more, nothing
    # hung): move the clock past each backoff the worker waits out, as real time would
    def back() -> bool:
        st = e.status()
        if st["state"] == "failing" and (st.get("next_retry_in_s") or 0) > 0:
            clock.advance(30)
        return st["state"] != "failing" and not st["pending_files"]

    wait_until(back, 60, what="the sync back after weed started again")
    r = e.wait_idle(60)
    assert r.ok, r
    wait_until(lambda: (alerts.tick(), len(smtp_server.messages) >= 2)[1], 20, what="resolved mail")
    subjects = smtp_server.subjects()
    assert len(subjects) == 2 and "RESOLVED" in subjects[1] and "sync failing" in subjects[1], subjects
    assert e.status()["state"] == "idle" and not alerts.active()
    assert_remote_matches(s3_server, s3_prefix, "checkpoint-3", hf_writer.contents["checkpoint-3"])
    assert s3_server.uploads(s3_prefix) == []
