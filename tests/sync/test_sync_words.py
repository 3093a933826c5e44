"""Golden texts for what the sync engine says to people: the "sync failing" mail and the `sync`
lines of `supervisorctl status`. Pinned before the words moved out of the engine; the strings
here must not change when code moves."""

from __future__ import annotations

import time

from supervisor.cli import render
from supervisor.clock import FakeClock
from supervisor.notify.mails import sync as mails_sync
from supervisor.sync.engine import SyncEngine
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.sync_engine import ListMailer
from tests.waiting import wait_until

NOW = 1_800_000_000.0
T = "s3://bucket/run1"


# --- how the words are produced (the only part allowed to change when code moves) ----------------

def sync_lines(st: dict, now: float) -> list[str]:
    return render.sync_lines({"now": now, "sync": st})


def alerts_of(e: SyncEngine):
    return e.alerts


def failing_mail(target: str, failing_for_s: float, last_error: str, pending_files: int,
                 pending_bytes: int) -> tuple[str, str]:
    m = mails_sync.sync_failing(target, failing_for_s, last_error, pending_files, pending_bytes)
    return m.subject, m.body


# --- the "sync failing" mail ---------------------------------------------------------------------

def test_failing_mail_golden():
    subject, body = failing_mail(T, 3 * 3600 + 5 * 60, "s3://bucket/run1: 403 AccessDenied", 13, 5 * 1024**2 + 1)
    assert subject == "sync failing: s3://bucket/run1 for 3h05m"
    assert body == (
        "Uploads to s3://bucket/run1 have been failing for 3h05m.\n"
        "Last error: s3://bucket/run1: 403 AccessDenied\n"
        "Not yet on the target: 13 files (5.0 MiB).\n"
        "\n"
        "Retries continue with backoff; a final sync before any stop will wait for the target.\n"
        "Check with: supervisorctl status; retry now with: supervisorctl sync --wait")


def test_failing_mail_golden_small_numbers():
    subject, body = failing_mail("me@host:/backup", 61, "", 0, 0)
    assert subject == "sync failing: me@host:/backup for 1m01s"
    assert body == (
        "Uploads to me@host:/backup have been failing for 1m01s.\n"
        "Last error: \n"
        "Not yet on the target: 0 files (0 B).\n"
        "\n"
        "Retries continue with backoff; a final sync before any stop will wait for the target.\n"
        "Check with: supervisorctl status; retry now with: supervisorctl sync --wait")


def test_failing_mail_as_delivered_by_a_real_engine(make_engine, hf_writer, tmp_path):
    remote = tmp_path / "remote"
    remote.write_text("a file where the target folder should be")
    clock = FakeClock(start=time.time())
    mails = ListMailer()
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    e = make_engine({"target": str(remote), "watch": [str(hf_writer.out)], "fail_alert_after": "5m"},
                    clock=clock, mailer=mails)
    wait_until(lambda: e.status()["state"] == "failing", 20, what="failing")
    clock.advance(301)
    wait_until(lambda: e.status()["failing_for_s"] == 301 and alerts_of(e).active(), 10, what="sync failing alert")
    alerts_of(e).tick()
    wait_until(lambda: mails.subjects(), 10, what="alert mail")
    subject, body = mails.sent[0]
    n = len(hf_writer.contents["checkpoint-1"])
    size = sum(len(v) for v in hf_writer.contents["checkpoint-1"].values())
    from supervisor.durations import format_bytes

    err = body.split("Last error: ", 1)[1].split("\n", 1)[0]  # the start probe's or a pass's: the same words
    assert err.removeprefix("probe: ").startswith(f"{remote}: cannot create target folder")
    assert subject == f"testbox: sync failing: {remote} for 5m01s"
    assert body == (
        f"Uploads to {remote} have been failing for 5m01s.\n"
        f"Last error: {err}\n"
        f"Not yet on the target: {n} files ({format_bytes(size)}).\n"
        "\n"
        "Retries continue with backoff; a final sync before any stop will wait for the target.\n"
        "Check with: supervisorctl status; retry now with: supervisorctl sync --wait")
    remote.unlink()
    clock.advance(600)
    wait_until(lambda: (remote / "checkpoint-1" / MANIFEST_NAME).exists(), 20, what="recovery")


# --- the status lines ----------------------------------------------------------------------------

def status(**kw) -> dict:
    base = {"target": T, "state": "idle", "last_ok_at": NOW - 125, "last_error": "", "last_error_at": None,
            "pending_bytes": 0, "pending_files": 0, "uploaded_files": 40, "uploaded_bytes": 3 * 1024**3,
            "current_file": "", "rate_bps": None, "failing_for_s": None, "next_retry_in_s": None,
            "waiting": [], "partial": [], "sent_bytes": 0, "watch": ["/w/out"]}
    return {**base, **kw}


def test_lines_disabled():
    assert sync_lines(status(state="disabled", target=""), NOW) == ["sync      disabled (no sync.target configured)"]


def test_lines_idle_never_synced():
    assert sync_lines(status(last_ok_at=None, uploaded_files=0, uploaded_bytes=0), NOW) == [
        "sync      s3://bucket/run1  idle",
        "          pending 0 files (0 B)  uploaded 0 files (0 B)  last ok never",
    ]


def test_lines_uploading_with_rate_waiting_and_partial():
    st = status(state="uploading", current_file="checkpoint-200/optimizer.pt", rate_bps=52_428_800.0,
                pending_files=7, pending_bytes=1536 * 1024**2,
                waiting=[{"unit": f"checkpoint-{n}", "reason": "waiting for trainer_state.json"} for n in (3, 4, 5, 6)],
                partial=["checkpoint-8", "checkpoint-9", "checkpoint-10", "checkpoint-11"])
    assert sync_lines(st, NOW) == [
        "sync      s3://bucket/run1  uploading  checkpoint-200/optimizer.pt at 50.0 MiB/s",
        "          pending 7 files (1.5 GiB)  uploaded 40 files (3.0 GiB)  last ok 2m05s ago",
        "          waiting checkpoint-3: waiting for trainer_state.json",
        "          waiting checkpoint-4: waiting for trainer_state.json",
        "          waiting checkpoint-5: waiting for trainer_state.json",
        "          partial checkpoint-8",
        "          partial checkpoint-9",
        "          partial checkpoint-10",
    ]


def test_lines_uploading_without_rate_and_current_file_only_while_uploading():
    assert sync_lines(status(state="uploading", current_file="model.safetensors"), NOW)[0] == \
        "sync      s3://bucket/run1  uploading  model.safetensors"
    assert sync_lines(status(state="scanning", current_file="model.safetensors", rate_bps=10.0), NOW)[0] == \
        "sync      s3://bucket/run1  scanning"


def test_lines_failing_with_and_without_retry():
    st = status(state="failing", last_error="s3://bucket/run1: endpoint unreachable", failing_for_s=3725.0,
                next_retry_in_s=42.4, pending_files=2, pending_bytes=2048)
    assert sync_lines(st, NOW) == [
        "sync      s3://bucket/run1  failing",
        "          pending 2 files (2.0 KiB)  uploaded 40 files (3.0 GiB)  last ok 2m05s ago",
        "          FAILING for 1h02m, retry in 42s: s3://bucket/run1: endpoint unreachable",
    ]
    st = status(state="failing", last_error="boom", failing_for_s=5.0, next_retry_in_s=None)
    assert sync_lines(st, NOW)[-1] == "          FAILING for 5s: boom"


def test_lines_last_error_after_recovery():
    st = status(last_error="checkpoint-3/optimizer.pt: unreadable: Input/output error")
    assert sync_lines(st, NOW)[-1] == "          last error: checkpoint-3/optimizer.pt: unreadable: Input/output error"
    assert len(sync_lines(st, NOW)) == 3


# --- a Hub target: the "sync refused" mail and the target_info lines ------------------------------

def test_refused_mail_golden():
    m = mails_sync.sync_refused("hf://alice/run1", "the Hugging Face Hub rejected the token from HF_TOKEN (401)",
                                3, 3 * 1024**2)
    assert m.subject == "sync refused: hf://alice/run1 rejects the credentials"
    assert m.body == (
        "Uploads to hf://alice/run1 are refused: the Hugging Face Hub rejected the token from HF_TOKEN (401)\n"
        "Not yet on the target: 3 files (3.0 MiB).\n"
        "\n"
        "Nothing is lost: the files stay on this machine and the daemon tries again with backoff, and at once\n"
        "after `supervisorctl sync`. A final sync before any stop will wait for the target.\n"
        "Fix the credentials, then: supervisorctl sync --wait")


def test_lines_hub_target_info():
    info = {"kind": "hf", "repo": "alice/run1", "repo_type": "model", "revision": "main", "folder": "",
            "endpoint": "https://huggingface.co", "upload_path": "xet",
            "upload_path_reason": "hf_xet is installed", "private": True, "created": True,
            "token_from": "HF_TOKEN", "warning": None}
    st = status(target="hf://alice/run1", target_info=info)
    assert sync_lines(st, NOW)[1:3] == [
        "          pending 0 files (0 B)  uploaded 40 files (3.0 GiB)  last ok 2m05s ago",
        "          via Xet (hf_xet is installed)  model repo private, branch main",
    ]
    public = {**info, "upload_path": "lfs", "upload_path_reason": "HF_HUB_DISABLE_XET is set", "private": False,
              "repo_type": "dataset", "revision": "exp-1",
              "warning": "alice/open is a public repo: every checkpoint uploaded there is visible to anyone"}
    assert sync_lines(status(target="hf://datasets/alice/open", target_info=public), NOW)[2:4] == [
        "          via LFS (HF_HUB_DISABLE_XET is set)  dataset repo PUBLIC, branch exp-1",
        "          WARNING: alice/open is a public repo: every checkpoint uploaded there is visible to anyone",
    ]
    assert sync_lines(status(target_info={"kind": "hf", "upload_path": "lfs", "private": None}), NOW)[2] == \
        "          via LFS  model repo not checked yet, branch main"
    assert len(sync_lines(status(target_info={}), NOW)) == 2  # S3, rsync, local: nothing more
