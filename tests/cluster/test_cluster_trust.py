"""What the cluster trusts (issue 53). Every read of `_cluster/` and `_run/` goes through the untrusted
readers: one bad file is that node's problem, named in status, never the run's. With
`cluster.key_file` heartbeats and records carry an HMAC and unsigned or wrongly signed ones are
ignored (alerted once); without it status says plainly that whoever can write the bucket is trusted.
The run ledger reads only the records that changed.

The duty against a real folder target with a fake clock, the one-shot `status --cluster`, and the
ledger over a folder target and a real SeaweedFS."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.cluster import nodes as cn
from supervisor.cluster.watch import ClusterWatch
from supervisor.config import ClusterConfig
from supervisor.config.cluster import Identity
from supervisor.store.local import LocalTarget
from supervisor.untrusted import signed
from tests.cluster.test_cluster import Recorder, Training

KEY = b"0123456789abcdef0123456789abcdef"


def beat(rank: int = 1, seq: int = 3, training: str = "RUNNING", boot: str = "b1") -> cn.Beat:
    return cn.Beat(rank, f"host-{rank}", seq, boot, 1e9 + seq, training, 1, "run-a")


# --- signatures -----------------------------------------------------------------------------------------

def test_a_signed_heartbeat_counts_and_every_other_is_forged():
    b = beat()
    assert cn.parse_beat(cn.beat_doc(b, KEY), 1, KEY) == b
    with pytest.raises(cn.Forged, match="unsigned"):
        cn.parse_beat(cn.beat_doc(b), 1, KEY)
    with pytest.raises(cn.Forged, match="wrongly signed"):
        cn.parse_beat(cn.beat_doc(b, b"another-key-of-the-same-length!!"), 1, KEY)
    doc = json.loads(cn.beat_doc(b, KEY))
    doc["training"] = "FINISHED"  # a dead node kept "finished" by whoever can write the bucket
    with pytest.raises(cn.Forged, match="wrongly signed"):
        cn.parse_beat(json.dumps(doc).encode(), 1, KEY)
    doc["sig"] = 12345
    with pytest.raises(cn.Forged, match="unsigned"):
        cn.parse_beat(json.dumps(doc).encode(), 1, KEY)
    # without a key the signature is not looked at: the bucket is trusted
    assert cn.parse_beat(json.dumps(doc).encode(), 1).training == "FINISHED"


def test_a_key_file_shorter_than_16_bytes_is_refused(tmp_path):
    from supervisor.store.credentials import run_key

    (tmp_path / "k").write_text("short\n")
    assert run_key(str(tmp_path / "k"))[1].endswith("at least 16 are needed (e.g. `openssl rand -hex 32`)")
    (tmp_path / "k").write_text("\n  " + "a" * 64 + "  \nsecond line\n")
    assert run_key(str(tmp_path / "k")) == (b"a" * 64, "")
    assert run_key(str(tmp_path / "missing"))[0] is None and run_key("") == (None, "")
    assert signed.check(KEY, "x", signed.seal(KEY, "x", {"a": 1.5, "b": [1, "é"]})) == ""


def test_an_old_heartbeat_replayed_is_no_sign_of_life():
    s = cn.observe(cn.observe(None, beat(seq=5), 0.0), beat(seq=6), 5.0)
    assert cn.observe(s, beat(seq=4), 9.0) is s           # an older one of the same daemon
    s2 = cn.observe(s, beat(seq=1, boot="b2"), 10.0)       # the daemon restarted: its seq starts again
    assert s2.changed == 10.0 and s2.old_boots == ("b1",)
    assert cn.observe(s2, beat(seq=99, boot="b1"), 20.0) is s2  # the replaced daemon's heartbeats are stale


# --- one bad file is that node's problem ------------------------------------------------------------------

def three(tmp_path: Path, clock: FakeClock, key: bytes | None = None) -> tuple[list[ClusterWatch], Recorder]:
    rec = Recorder()
    ws = []
    for k in range(3):
        r = rec if k == 0 else Recorder()
        ws.append(ClusterWatch(ClusterConfig(nodes=3, rank=k, run_id="run-a", heartbeat=1.0, silent_after=5.0),
                               Identity(3, k, "run-a"), LocalTarget(str(tmp_path)), Training(), r, clock, f"host-{k}",
                               stop=r.stop, withdraw=r.withdraw, key=key))
    return ws, rec


NESTED = b'{"rank": 2, "seq": 1, "at": 1, "holds": ' + b"[" * 1400 + b"]" * 1400 + b"}"  # 2.8 KB, 1,400 deep


@pytest.mark.parametrize("garbage", [NESTED, b"[1, 2, 3]", b"\x00" * 3000, b'{"rank": 2, "seq": 1e999, "at": 1}'])
def test_a_malformed_heartbeat_is_named_on_its_node_and_the_others_are_judged_as_ever(tmp_path, garbage):
    """Node 2's heartbeat file is garbage (a 3 KB nested JSON made every read "target failing", so no
    node was ever lost): node 2 is named with what is wrong, the target is not failing, and node 1,
    gone silent, is lost and stops node 0."""
    assert len(NESTED) < 3 * 1024
    clock = FakeClock()
    ws, rec = three(tmp_path, clock)
    for _ in range(3):
        for w in ws:
            w.poll()
        clock.advance(1.0)
    for _ in range(8):  # node 1 falls silent; node 2's file is overwritten with garbage each round
        (tmp_path / "_cluster" / "node-2.json").write_bytes(garbage)
        ws[0].poll()
        clock.advance(1.0)
    st = ws[0].status()
    assert st["error"] == ""
    n = {x["rank"]: x for x in st["nodes"]}
    assert n[1]["state"] == "lost" and n[1]["problem"] == ""
    # node 2 is not heard from either (its file is no heartbeat): judged by the same rule, named apart
    assert "node 2's heartbeat" in n[2]["problem"] and n[2]["state"] != "ok"
    assert any(word == "node_lost" and "node 1" in why for word, why in rec.stops)
    from supervisor.cli.render import cluster_lines

    assert any("its heartbeat file: node 2's heartbeat" in ln for ln in cluster_lines({"cluster": st}))
    for w in ws:
        w.close()


def test_a_forged_heartbeat_cannot_keep_a_dead_node_finished_and_is_alerted_once(tmp_path):
    """With a key: node 1 dies; whoever can write the bucket plants an unsigned heartbeat saying it
    finished, again and again. It is ignored (node 1 is lost, node 0 is saved and stopped), named on
    node 1's line and alerted once. Without a key the same file keeps node 1 "finished": status says
    the bucket is trusted."""
    for key in (KEY, None):
        root = tmp_path / ("signed" if key else "trusted")
        clock = FakeClock()
        ws, rec = three(root, clock, key)
        for _ in range(3):
            for w in ws:
                w.poll()
            clock.advance(1.0)
        seq = 100
        for _ in range(10):  # node 1 is dead; a forger writes its heartbeat, a new seq each time
            seq += 1
            (root / "_cluster" / "node-1.json").write_bytes(cn.beat_doc(beat(seq=seq, training="FINISHED")))
            ws[0].poll()
            ws[2].poll()
            clock.advance(1.0)
        st = ws[0].status()
        n = {x["rank"]: x for x in st["nodes"]}
        if key:
            assert n[1]["state"] == "lost" and "unsigned" in n[1]["problem"], n[1]
            assert [k for k, _ in rec.fired].count("cluster:forged:1") == 1
            assert rec.stops and st["trust"]["signed"]
            # node 2's own signed heartbeat counts
            assert n[2]["state"] == "ok"
        else:
            assert n[1]["state"] == "finished" and not rec.stops
            assert not st["trust"]["signed"] and "whoever can write the sync target's _cluster/ folder is trusted" \
                in st["trust"]["words"]
        for w in ws:
            w.close()


def test_status_cluster_with_a_key_shows_forged_heartbeats_and_no_unsigned_record(tmp_path, capsys):
    from supervisor.cli.main import main
    from supervisor.saves.parts import record_doc

    remote = tmp_path / "run"
    clock = FakeClock(start=time.time())
    ws = [ClusterWatch(ClusterConfig(nodes=2, rank=k, run_id="run-a", heartbeat=1.0, silent_after=5.0),
                       Identity(2, k, "run-a"), LocalTarget(str(remote)), Training(), Recorder(), clock, f"host-{k}",
                       stop=Recorder().stop, withdraw=Recorder().withdraw, key=KEY) for k in range(2)]
    ws[0].poll()
    (remote / "_cluster" / "node-1.json").write_bytes(cn.beat_doc(cn.Beat(1, "evil", 1, "x", time.time(), "RUNNING",
                                                                          run_id="run-a")))
    (remote / "_cluster" / "checkpoint-20.json").write_bytes(record_doc("checkpoint-20", "run-a", {0: "a" * 64, 1: "b" * 64},
                                                                       "t", KEY))
    (remote / "_cluster" / "checkpoint-90.json").write_bytes(record_doc("checkpoint-90", "run-a", {0: "a" * 64, 1: "b" * 64},
                                                                       "t"))  # planted: unsigned
    (tmp_path / "key").write_bytes(KEY + b"\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[sync]\ntarget = "{remote}"\nwatch = ["{tmp_path}/out"]\n'
                   f'[cluster]\nnodes = 2\nrank = 0\nrun_id = "run-a"\nkey_file = "{tmp_path}/key"\n')
    assert main(["--config", str(cfg), "status", "--cluster", "--json"]) == 3
    d = json.loads(capsys.readouterr().out)
    assert d["whole"] == ["checkpoint-20"] and d["signed"]
    assert d["nodes"][1]["state"] == "silent" and "unsigned" in d["nodes"][1]["why"]
    for w in ws:
        w.close()


def test_a_record_that_is_json_but_no_object_is_written_over_once_the_unit_is_whole(tmp_path):
    """`_cluster/checkpoint-20.json` planted as `[]`: the run-wide check goes on (it once died on it)
    and writes the real record when both parts are on the target."""
    from supervisor.saves.parts import Held, part_digest
    from supervisor.sync.manifest import ManifestFile, build

    remote = tmp_path / "run"
    digests = {}
    for k in (0, 1):
        d = remote / f"node-{k}" / "checkpoint-20"
        d.mkdir(parents=True)
        (d / "w.bin").write_bytes(b"abc")
        (d / "_MANIFEST.json").write_bytes(build("checkpoint-20", [ManifestFile("w.bin", 3, "a" * 64)], 1e9))
        digests[k] = part_digest((d / "_MANIFEST.json").read_bytes())
    (remote / "_cluster").mkdir()
    (remote / "_cluster" / "checkpoint-20.json").write_bytes(b"[]")
    clock = FakeClock()
    rec = Recorder()
    w0 = ClusterWatch(ClusterConfig(nodes=2, rank=0, run_id="r", heartbeat=1.0, silent_after=5.0), Identity(2, 0, "r"),
                      LocalTarget(str(remote)), Training(), rec, clock, "h0", stop=rec.stop, withdraw=rec.withdraw,
                      part0=LocalTarget(str(remote / "node-0")))
    w1 = ClusterWatch(ClusterConfig(nodes=2, rank=1, run_id="r", heartbeat=1.0, silent_after=5.0), Identity(2, 1, "r"),
                      LocalTarget(str(remote)), Training(), Recorder(), clock, "h1", stop=rec.stop, withdraw=rec.withdraw,
                      holds=lambda: Held(True, (("checkpoint-20", digests[1]),)))
    for _ in range(5):
        w1.poll()
        w0.poll()
        clock.advance(1.0)
    assert json.loads((remote / "_cluster" / "checkpoint-20.json").read_text())["parts"] == {"0": digests[0], "1": digests[1]}
    assert not w0.status()["error"]
    w0.close()
    w1.close()


# --- the run ledger reads only what changed ----------------------------------------------------------------

def ledger(target_url: str, clock: FakeClock, host: str = "me"):
    from supervisor.config.target import parse_target
    from supervisor.money.runledger import RunLedger
    from supervisor.store import make_target

    return RunLedger(ClusterConfig(nodes=2, rank=0, run_id="run-a"), 2.0, "USD", target_url, clock, host,
                     lambda url: make_target(parse_target(url), _sync(target_url), "/tmp"))


def _sync(url: str):
    from supervisor.config import SyncConfig

    return SyncConfig(target=url)


def boot_doc(i: int, seconds: float = 3600.0) -> bytes:
    from supervisor.money import runmoney as rm

    return rm.record_doc(rm.Boot(f"old-{i}", f"boot-{i}", 0, 1e9 + i, seconds, 2.0, "USD", 1e9 + i + seconds), "run-a")


def test_the_ledger_of_a_run_resumed_300_times_reads_each_record_once(tmp_path):
    """300 earlier boots: the first look fetches them all; the next fetches none; a changed record is
    fetched again. A damaged record (nested JSON, valid JSON not an object) is named, never summed, and
    never fails the ledger."""
    led_dir = tmp_path / "run" / "_run" / "ledger"
    led_dir.mkdir(parents=True)
    for i in range(300):
        (led_dir / f"old-{i}.json").write_bytes(boot_doc(i))
    (led_dir / "bad-1.json").write_bytes(b'{"run_id": "run-a", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    (led_dir / "bad-2.json").write_bytes(b'["run_id", "run-a"]')
    clock = FakeClock()
    led = ledger(str(tmp_path / "run"), clock)
    led.poll()
    assert led.gets == 302 and not led.error
    st = led.status()
    assert len(st["machines"]) == 301 and sorted(st["ledger_damaged"]) == ["bad-1.json", "bad-2.json"]
    spent = st["run_spent"]
    led.poll()
    assert led.gets == 302  # nothing changed: nothing fetched (the listing says so)
    (led_dir / "old-7.json").write_bytes(boot_doc(7, seconds=7200.0))
    led.poll()
    assert led.gets == 303 and led.status()["run_spent"] == pytest.approx(spent + 2.0)
    led.close()


def test_the_ledger_over_s3_asks_by_etag(s3_server, s3_prefix):
    c = s3_server.client()
    for i in range(40):
        c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/_run/ledger/old-{i}.json", Body=boot_doc(i))
    from supervisor.config import SyncConfig
    from supervisor.config.target import parse_target
    from supervisor.money.runledger import RunLedger
    from supervisor.store import make_target

    sc = SyncConfig(**s3_server.sync_config(s3_prefix))
    led = RunLedger(ClusterConfig(nodes=2, rank=0, run_id="run-a"), 2.0, "USD", sc.target, FakeClock(), "me",
                    lambda url: make_target(parse_target(url), sc, "/tmp/tsup-ledger-test"))
    led.poll()
    assert led.gets == 40 and not led.error
    led.poll()
    led.poll()
    assert led.gets == 40
    c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/_run/ledger/old-3.json", Body=boot_doc(3, seconds=99.0))
    led.poll()
    assert led.gets == 41 and len(led.status()["machines"]) == 41
    led.close()


def test_the_ledger_over_rsync_asks_by_size_and_time(sshd_server, tmp_path):
    """rsync lists each record's size and modification time (to the second): unchanged ones are not
    fetched again (each fetch is an ssh round trip)."""
    import os

    from supervisor.config import SyncConfig
    from supervisor.config.target import parse_target
    from supervisor.money.runledger import RunLedger
    from supervisor.store import make_target

    remote = tmp_path / "remote"
    d = (remote / "_run" / "ledger")
    d.mkdir(parents=True)
    for i in range(12):
        (d / f"old-{i}.json").write_bytes(boot_doc(i))
        os.utime(d / f"old-{i}.json", (1e9, 1e9))
    sc = SyncConfig(**sshd_server.sync_config(remote))
    led = RunLedger(ClusterConfig(nodes=2, rank=0, run_id="run-a"), 2.0, "USD", sc.target, FakeClock(), "me",
                    lambda url: make_target(parse_target(url), sc, str(tmp_path / "st")))
    led.poll()
    assert led.gets == 12 and not led.error, led.error
    led.poll()
    assert led.gets == 12
    (d / "old-5.json").write_bytes(boot_doc(5, seconds=7200.0))
    os.utime(d / "old-5.json", (1e9 + 60, 1e9 + 60))
    led.poll()
    assert led.gets == 13 and len(led.status()["machines"]) == 13
    led.close()
