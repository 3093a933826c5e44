"""One run on several machines (issue 39): which node this is, the heartbeats through the target,
and a lost node that releases the survivors, saved and then stopped.

The pure rules (config.cluster.identity, cluster.nodes.observe/judge) exhaustively; the duty
against a real folder target with a fake clock; and two real daemons with a real torchrun job
(gloo on CPU, nnodes = 2) on one SeaweedFS target, one node frozen whole by SIGSTOP."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.clock import FakeClock
from supervisor.cluster import nodes as cn
from supervisor.cluster.watch import ClusterWatch
from supervisor.config import ClusterConfig, ConfigError, from_dict
from supervisor.config.cluster import Identity, identity, part_target
from supervisor.interfaces import TrainingInfo
from supervisor.resume.wholerun import RunParts
from supervisor.saves.parts import Held
from supervisor.states import TrainingState
from supervisor.store.local import LocalTarget
from tests.fixtures.ports import free_port
from tests.waiting import wait_until

ME = Identity(3, 0, "run-a")


# --- which node ------------------------------------------------------------------------------------
@pytest.mark.parametrize("env,want", [
    ({"NNODES": "4", "NODE_RANK": "2"}, (4, 2)),                         # torchrun's launch variables
    ({"PET_NNODES": "2", "GROUP_RANK": "1"}, (2, 1)),                   # torchrun's own, inside a worker
    ({"SKYPILOT_NUM_NODES": "8", "SKYPILOT_NODE_RANK": "7"}, (8, 7)),
    ({"DSTACK_NODES_NUM": "3", "DSTACK_NODE_RANK": "0"}, (3, 0)),
    ({"NUM_NODES": "2", "NODE_RANK": "1"}, (2, 1)),                     # RunPod instant clusters
    ({}, (1, 0)),
])
def test_the_node_is_found_in_the_engines_environment(env, want):
    ident = identity(0, None, "", [env], "s3://b/run1")
    assert (ident.nodes, ident.rank) == want
    assert ident.clustered == (want[0] > 1)


def test_the_config_wins_over_the_environment_and_the_run_is_named():
    ident = identity(2, 1, "", [{"NNODES": "8", "NODE_RANK": "5", "SKYPILOT_TASK_ID": "sky-7"}], "s3://bkt/r")
    assert (ident.nodes, ident.rank, ident.run_id) == (2, 1, "sky-7")
    assert identity(2, 0, "", [{}], "s3://bkt/r").run_id == "s3://bkt/r"
    assert identity(2, 0, "mine", [{"DSTACK_RUN_NAME": "d"}], "x").run_id == "mine"


@pytest.mark.parametrize("nodes,rank,env,words", [
    (2, 2, {}, "cluster.rank: 2 is not a node of a run of 2"),
    (0, None, {"NNODES": "two"}, "NNODES='two'"),
    (0, None, {"NNODES": "2", "NODE_RANK": "3"}, "cluster.rank: 3"),
])
def test_a_node_that_does_not_fit_is_named(nodes, rank, env, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        identity(nodes, rank, "", [env], "")


def test_each_node_syncs_its_part_below_the_run():
    assert part_target("s3://b/run1/", 3) == "s3://b/run1/node-3"
    assert part_target("me@host:/backups/run1", 0) == "me@host:/backups/run1/node-0"
    assert part_target("/mnt/shared/run1", 1) == "/mnt/shared/run1/node-1"


def test_check_config_refuses_a_hub_target_and_a_silence_shorter_than_two_heartbeats():
    with pytest.raises(ConfigError) as e:
        from_dict({"sync": {"target": "hf://me/run", "watch": ["/w"]}, "cluster": {"nodes": 2, "rank": 0}})
    assert any(p.startswith("cluster.nodes: a run of 2 nodes needs a target every node can write") for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        from_dict({"sync": {"target": "s3://bkt/r", "watch": ["/w"]},
                   "cluster": {"nodes": 2, "rank": 0, "heartbeat": "30s", "silent_after": "40s"}})
    assert any(p.startswith("cluster.silent_after: at least two heartbeats") for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        from_dict({"cluster": {"nodes": 2, "rank": 5}})
    assert any(p.startswith("cluster.rank: 5 is not a node") for p in e.value.problems)
    from_dict({"sync": {"target": "s3://bkt/r", "watch": ["/w"]}, "cluster": {"nodes": 2, "rank": 1}})


# --- what the heartbeats say ------------------------------------------------------------------------
def beat(rank: int, seq: int, training: str = "RUNNING", boot: str = "b1") -> cn.Beat:
    return cn.Beat(rank, f"host-{rank}", seq, boot, 1e9 + seq, training, 1, "run-a")


def states(seen: dict[int, cn.Seen], now: float, ok_since: float | None = 0.0, mine: str = "RUNNING") -> dict:
    return {v.rank: v.state for v in cn.judge(seen, ME, "host-0", mine, now, ok_since, 5.0, 30.0)}


def test_a_heartbeat_round_trips_and_garbage_is_named():
    b = beat(1, 7)
    assert cn.parse_beat(cn.beat_doc(b), 1) == b
    for data, words in [(b"{", "not JSON"), (b"[]", "not an object"), (b'{"rank": 2, "seq": 1, "at": 1}', "lacks"),
                        (b'{"rank": 1, "seq": true, "at": 1}', "lacks"), (b"x" * 140000, "more than any")]:
        with pytest.raises(ValueError, match=words):
            cn.parse_beat(data, 1)


def test_a_node_never_heard_from_or_never_seen_to_change_is_silent_and_never_lost():
    seen = {1: cn.observe(None, beat(1, 40), 0.0)}  # a heartbeat an earlier run left on the prefix
    assert states(seen, 10_000.0) == {0: "ok", 1: "silent", 2: "silent"}


def test_a_node_seen_alive_is_lost_after_silent_after_and_back_when_it_writes_again():
    s = cn.observe(None, beat(1, 1), 0.0)
    s = cn.observe(s, beat(1, 2), 5.0)
    assert states({1: s}, 10.0)[1] == "ok"
    assert states({1: s}, 20.0)[1] == "silent"   # two heartbeats missed
    assert states({1: s}, 34.9)[1] == "silent"
    assert states({1: s}, 35.0)[1] == "lost"
    s = cn.observe(s, beat(1, 2), 40.0)           # the same heartbeat read again changes nothing
    assert states({1: s}, 40.0)[1] == "lost"
    s = cn.observe(s, beat(1, 3), 41.0)
    assert states({1: s}, 41.0)[1] == "ok"


def test_a_restarted_daemon_counts_again_from_its_first_heartbeat():
    s = cn.observe(cn.observe(None, beat(1, 9), 0.0), beat(1, 1, boot="b2"), 5.0)  # seq back to 1, new boot
    assert s.changed == 5.0 and s.alive


def test_this_nodes_own_read_outage_judges_nobody_lost():
    s = cn.observe(cn.observe(None, beat(1, 1), 0.0), beat(1, 2), 5.0)
    assert states({1: s}, 100.0, ok_since=None)[1] == "silent"
    # the reads work again at 100: the other node gets a fresh silent_after from then
    assert states({1: s}, 120.0, ok_since=100.0)[1] == "silent"
    assert states({1: s}, 130.0, ok_since=100.0)[1] == "lost"


def test_a_finished_node_is_never_lost():
    s = cn.observe(cn.observe(None, beat(1, 1), 0.0), beat(1, 2, "FINISHED"), 5.0)
    assert states({1: s}, 10_000.0)[1] == "finished"
    assert states({}, 0.0, mine="FINISHED")[0] == "finished"


def test_a_node_whose_training_failed_is_lost_only_while_ours_runs():
    s = cn.observe(cn.observe(None, beat(1, 1), 0.0), beat(1, 2, "FAILED"), 5.0)
    for t in range(3, 20):  # its daemon goes on writing: it is not silent
        s = cn.observe(s, beat(1, t, "FAILED"), 5.0 + t)
        assert states({1: s}, 5.0 + t)[1] == "ok"
    s = cn.observe(s, beat(1, 30, "FAILED"), 35.0)
    assert states({1: s}, 35.0)[1] == "lost"
    assert states({1: s}, 35.0, mine="FINISHED")[1] == "ok"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 5.0), st.booleans(), st.booleans()), min_size=1, max_size=80))
def test_a_node_that_writes_every_heartbeat_is_never_lost(rounds):
    """Whatever this node's reads do (fail or work, at any cadence up to a heartbeat), a node whose
    heartbeat changes at least once a heartbeat is never judged lost."""
    now, seq, ok_since = 0.0, 1, 0.0
    s = cn.observe(None, beat(1, seq), now)
    for dt, read_ok, wrote in rounds:
        now += dt
        if wrote:
            seq += 1
        if read_ok:
            ok_since = now if ok_since is None else ok_since
            s = cn.observe(s, beat(1, seq), now)
        else:
            ok_since = None
        if wrote or read_ok:
            assert states({1: s}, now, ok_since)[1] != "lost"


# --- the duty, against a real folder target, with a fake clock -------------------------------------
@dataclass
class Training:
    state: TrainingState = TrainingState.RUNNING

    def info(self) -> TrainingInfo:
        return TrainingInfo(state=self.state, run_id=1, command="train")


@dataclass
class Recorder:
    fired: list[tuple[str, str]] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    stops: list[tuple[str, str]] = field(default_factory=list)
    withdrawn: list[str] = field(default_factory=list)

    def fire(self, key, kind, severity, subject, body):
        self.fired.append((key, body))

    def resolve(self, key):
        self.resolved.append(key)

    def stop(self, word, why):
        self.stops.append((word, why))
        return True

    def withdraw(self, word):
        self.withdrawn.append(word)


def watch_for(rank: int, remote: Path, clock: FakeClock, rec: Recorder, training: Training, **cfg) -> ClusterWatch:
    c = ClusterConfig(nodes=2, rank=rank, run_id="run-a", heartbeat=1.0, silent_after=5.0, **cfg)
    return ClusterWatch(c, Identity(2, rank, "run-a"), LocalTarget(str(remote)), training, rec, clock, f"host-{rank}",
                        stop=rec.stop, withdraw=rec.withdraw, display=str(remote))


def test_the_duty_alerts_stops_and_withdraws_when_the_node_comes_back(tmp_path):
    clock = FakeClock()
    a, b = Recorder(), Recorder()
    w0 = watch_for(0, tmp_path, clock, a, Training())
    w1 = watch_for(1, tmp_path, clock, b, Training())
    for _ in range(4):
        w1.poll()
        w0.poll()
        clock.advance(1.0)
    assert json.loads((tmp_path / "_cluster" / "node-1.json").read_text())["host"] == "host-1"
    assert [n["state"] for n in w0.status()["nodes"]] == ["ok", "ok"]
    for _ in range(7):  # node 1 falls silent
        w0.poll()
        clock.advance(1.0)
    assert [n["state"] for n in w0.status()["nodes"]] == ["ok", "lost"]
    assert a.stops and a.stops[0][0] == "node_lost" and "node 1 (host-1) was lost" in a.stops[0][1]
    assert a.fired[0][0] == "cluster:lost:1" and "ends its training" in a.fired[0][1]
    w0.poll()
    assert len(a.stops) == 1  # asked once
    w1.poll()                  # it writes again before the stop acted
    clock.advance(1.0)
    w0.poll()
    assert a.resolved == ["cluster:lost:1"] and a.withdrawn == ["node_lost"]
    w0.close()
    w1.close()


def test_a_silent_supervisor_while_the_run_still_steps_stops_nothing(tmp_path):
    """Node 1's daemon is down but its training runs (its collectives answer ours: this run steps):
    a warning that its supervisor is silent, no stop; once this run stops stepping, the node is lost."""
    clock = FakeClock()
    a = Recorder()
    since = {"s": 1.0}
    c = ClusterConfig(nodes=2, rank=0, run_id="run-a", heartbeat=1.0, silent_after=5.0)
    w0 = ClusterWatch(c, Identity(2, 0, "run-a"), LocalTarget(str(tmp_path)), Training(), a, clock, "host-0",
                      stop=a.stop, withdraw=a.withdraw, since_step=lambda: since["s"])
    w1 = watch_for(1, tmp_path, clock, Recorder(), Training())
    for _ in range(3):
        w1.poll()
        w0.poll()
        clock.advance(1.0)
    for _ in range(8):  # node 1's supervisor falls silent; this run goes on stepping
        w0.poll()
        clock.advance(1.0)
    assert not a.stops and [k for k, _ in a.fired] == ["cluster:silent:1"]
    assert "still steps" in a.fired[0][1]
    since["s"] = 30.0  # the run hangs: no step for 30 s
    w0.poll()
    assert a.stops and a.stops[0][0] == "node_lost"
    assert "cluster:silent:1" in a.resolved and a.fired[-1][0] == "cluster:lost:1"
    w0.close()
    w1.close()


@pytest.mark.parametrize("how", ["alert", "not running"])
def test_a_lost_node_only_alerts_when_asked_or_when_nothing_runs_here(tmp_path, how):
    clock = FakeClock()
    a = Recorder()
    w0 = watch_for(0, tmp_path, clock, a, Training(TrainingState.FINISHED if how == "not running" else TrainingState.RUNNING),
                   **({"on_node_lost": "alert"} if how == "alert" else {}))
    w1 = watch_for(1, tmp_path, clock, Recorder(), Training())
    for _ in range(3):
        w1.poll()
        w0.poll()
        clock.advance(1.0)
    for _ in range(7):
        w0.poll()
        clock.advance(1.0)
    assert a.fired and not a.stops
    assert ("nothing is stopped" in a.fired[0][1])


def test_a_node_whose_run_finished_and_whose_machine_stopped_is_not_lost(tmp_path):
    clock = FakeClock()
    a = Recorder()
    t1 = Training()
    w0 = watch_for(0, tmp_path, clock, a, Training())
    w1 = watch_for(1, tmp_path, clock, Recorder(), t1)
    for _ in range(3):
        w1.poll()
        w0.poll()
        clock.advance(1.0)
    t1.state = TrainingState.FINISHED
    w1.beat_soon()
    w1.poll()      # its last heartbeat says FINISHED; then its machine stops
    for _ in range(30):
        w0.poll()
        clock.advance(1.0)
    assert [n["state"] for n in w0.status()["nodes"]] == ["ok", "finished"]
    assert not a.stops and not a.fired


@pytest.mark.parametrize("kind", ["s3", "rsync"])
def test_heartbeats_go_through_s3_and_rsync_too(kind, request, tmp_path):
    """The same duty over a real SeaweedFS and a real sshd: no server of our own on any target."""
    from supervisor.config import SyncConfig
    from supervisor.config.target import parse_target
    from supervisor.store import make_target

    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        d = server.sync_config(f"t-{os.getpid()}-{time.monotonic_ns()}")
    else:
        d = request.getfixturevalue("sshd_server").sync_config(tmp_path / "remote")
    cfg = SyncConfig(**d)
    clock = FakeClock()
    a, b = Recorder(), Recorder()
    w = []
    for k, rec in ((0, a), (1, b)):
        t = make_target(parse_target(cfg.target), cfg, tmp_path / f"st{k}")
        w.append(ClusterWatch(ClusterConfig(nodes=2, rank=k, run_id="run-a", heartbeat=1.0, silent_after=5.0),
                              Identity(2, k, "run-a"), t, Training(), rec, clock, f"host-{k}",
                              stop=rec.stop, withdraw=rec.withdraw))
    try:
        for _ in range(3):
            w[1].poll()
            w[0].poll()
            clock.advance(1.0)
        assert [n["state"] for n in w[0].status()["nodes"]] == ["ok", "ok"], w[0].status()
        for _ in range(7):
            w[0].poll()
            clock.advance(1.0)
        assert [n["state"] for n in w[0].status()["nodes"]] == ["ok", "lost"]
        assert a.stops and not w[0].status()["error"]
    finally:
        for x in w:
            x.close()


def test_a_target_that_fails_judges_nobody_lost_and_says_so(tmp_path):
    clock = FakeClock()
    a = Recorder()
    remote = tmp_path / "remote"
    w0 = watch_for(0, remote, clock, a, Training())
    w1 = watch_for(1, remote, clock, Recorder(), Training())
    for _ in range(3):
        w1.poll()
        w0.poll()
        clock.advance(1.0)
    os.rename(remote, tmp_path / "gone")
    remote.write_text("not a folder")  # every read and write fails now
    for _ in range(20):
        w0.poll()
        clock.advance(1.0)
    st = w0.status()
    assert st["error"] and not a.stops and st["nodes"][1]["state"] != "lost"


def test_status_cluster_shows_every_node_from_the_target_without_a_daemon(tmp_path, capsys):
    from supervisor.cli.main import main

    clock = FakeClock(start=time.time())
    remote = tmp_path / "run"
    held = ["checkpoint-40"]
    w = [ClusterWatch(ClusterConfig(nodes=3, rank=k, run_id="run-a", heartbeat=1.0, silent_after=5.0),
                      Identity(3, k, "run-a"), LocalTarget(str(remote)), Training(), Recorder(), clock, f"host-{k}",
                      stop=Recorder().stop, withdraw=Recorder().withdraw, holds=lambda: held) for k in range(2)]
    for x in w:
        x.poll()
    from supervisor.saves.parts import record_doc

    (remote / "_cluster" / "checkpoint-20.json").write_bytes(
        record_doc("checkpoint-20", "run-a", {0: "a" * 64, 1: "b" * 64, 2: "none"}, "2025-01-01T00:00:00Z"))
    (remote / "_cluster" / "checkpoint-30.json").write_text("{}")  # not a record: never shown as whole
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[sync]\ntarget = "{remote}"\nwatch = ["{tmp_path}/out"]\n'
                   '[cluster]\nnodes = 3\nrank = 0\nrun_id = "run-a"\nheartbeat = "1s"\nsilent_after = "5s"\n')
    rc = main(["--config", str(cfg), "status", "--cluster", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 3  # node 2 never wrote
    assert [(n["rank"], n["state"]) for n in d["nodes"]] == [(0, "ok"), (1, "ok"), (2, "silent")]
    assert d["nodes"][1]["host"] == "host-1" and d["nodes"][1]["newest_held"] == "checkpoint-40"
    assert d["whole"] == ["checkpoint-20"]
    assert main(["--config", str(cfg), "status", "--cluster"]) == 3
    text = capsys.readouterr().out
    assert "newest unit whole on every node: checkpoint-20" in text and "node 2   silent" in text
    for x in w:
        x.close()


# --- whole units: every node's part ----------------------------------------------------------------
def test_a_unit_is_whole_when_every_part_is_verified_or_its_node_never_held_any():
    """More cases in tests/cluster/test_cluster_whole.py (issue 53: "no part" only for a node that never held it)."""
    u = "checkpoint-40"
    held = cn.Beat(1, "h", 5, "b", 1.0, "RUNNING", holds=(u,), verified={u: "d1"})
    assert cn.unit_whole(u, 2, {0: cn.Part("d0"), 1: cn.Part("d1", held)}) == ("", {0: "d0", 1: "d1"})
    assert cn.unit_whole(u, 2, {0: cn.Part("d0")})[0] == "node 1's part is not complete on the target (node 1 not heard from)"
    sending = cn.Beat(1, "h", 5, "b", 1.0, "RUNNING", holds=(u,))
    assert cn.unit_whole(u, 2, {0: cn.Part("d0"), 1: cn.Part("", sending, fresh=True)})[0] == \
        "node 1 still writes or sends its part"
    # the HF Trainer's DDP checkpoint: the main process alone writes it; node 1 never held any of it
    never = cn.Beat(1, "h", 5, "b", 1.0, "RUNNING", holds=("checkpoint-20",))
    assert cn.unit_whole(u, 2, {0: cn.Part("d0"), 1: cn.Part("", never, fresh=True, watched_before=True)}) == \
        ("", {0: "d0", 1: "none"})
    assert cn.unit_whole(u, 3, {})[0].startswith("node 0's part is not complete")


def part(remote: Path, rank: int, unit: str, complete: bool = True) -> None:
    from supervisor.sync.manifest import ManifestFile, build

    f = ManifestFile(f"rank-{rank}.pt", 3, "a" * 64)  # the survey checks sizes; content is checked at a fetch
    d = remote / f"node-{rank}" / unit
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank-{rank}.pt").write_bytes(b"abc")
    (d / "_MANIFEST.json").write_bytes(build(unit, [f], 1e9, partial="" if complete else "cut short"))


def test_rank_0_records_a_unit_once_every_nodes_part_is_on_the_target(tmp_path):
    clock = FakeClock()
    remote = tmp_path / "run"
    a, b = Recorder(), Recorder()
    held: list[str] = ["checkpoint-20", "checkpoint-40"]
    c = ClusterConfig(nodes=2, rank=0, run_id="run-a", heartbeat=1.0, silent_after=5.0)
    w0 = ClusterWatch(c, Identity(2, 0, "run-a"), LocalTarget(str(remote)), Training(), a, clock, "host-0",
                      stop=a.stop, withdraw=a.withdraw, part0=LocalTarget(str(remote / "node-0")))
    w1 = ClusterWatch(ClusterConfig(nodes=2, rank=1, run_id="run-a", heartbeat=1.0, silent_after=5.0),
                      Identity(2, 1, "run-a"), LocalTarget(str(remote)), Training(), b, clock, "host-1",
                      stop=b.stop, withdraw=b.withdraw,
                      # node 1's sync engine: its parts of 20 verified on the target, of 40 still going up
                      holds=lambda: Held(True, tuple((u, part_digest(1) if u == "checkpoint-20" else "") for u in held)))

    def rounds(n: int) -> None:
        for _ in range(n):
            w1.poll()
            w0.poll()
            clock.advance(1.0)

    rounds(3)
    part(remote, 0, "checkpoint-20")
    part(remote, 1, "checkpoint-20")
    part(remote, 0, "checkpoint-40")
    part(remote, 1, "checkpoint-40", complete=False)  # node 1's part of 40 cut short
    part(remote, 0, "checkpoint-60")                  # node 1 never had a part of 60 (held says so)
    rounds(6)
    rec = remote / "_cluster"
    assert json.loads((rec / "checkpoint-20.json").read_text())["parts"] == {"0": part_digest(0), "1": part_digest(1)}
    assert not (rec / "checkpoint-40.json").exists()
    assert json.loads((rec / "checkpoint-60.json").read_text())["parts"]["1"] == "none"
    waiting = {x["unit"]: x["why"] for x in w0.status()["records"]["waiting"]}
    assert waiting == {"checkpoint-40": "node 1 still writes or sends its part"}
    assert w0.status()["records"]["recorded"][:2] == ["checkpoint-60", "checkpoint-20"]
    w0.close()
    w1.close()


def part_digest(rank: int) -> str:
    from supervisor.sync.manifest import ManifestFile, digest

    return digest([ManifestFile(f"rank-{rank}.pt", 3, "a" * 64)])


def test_a_resume_takes_this_nodes_part_of_the_newest_whole_unit_only(tmp_path):
    from supervisor.resume.restore import Restorer
    from supervisor.sync.scan import watch_roots

    remote = tmp_path / "run"
    part(remote, 0, "checkpoint-20")
    part(remote, 1, "checkpoint-20")
    part(remote, 1, "checkpoint-40")
    part(remote, 0, "checkpoint-40", complete=False)  # node 0 died while sending its part of 40
    out = tmp_path / "out"
    out.mkdir()
    rs = Restorer(LocalTarget(str(remote / "node-1")), None, watch_roots([str(out)]), time.time,
                  etag_is_sha=True, run=RunParts(LocalTarget(str(remote)), 2, 1))
    sv = rs.survey()
    assert [u.key for u in sv.order] == ["checkpoint-20"]
    assert [(u.key, u.why) for u in sv.skipped] == [
        ("checkpoint-40", "not complete on every node of the run: node 0's part is not complete on the target")]
    # without the run (one machine) the part alone would have been taken
    alone = Restorer(LocalTarget(str(remote / "node-1")), None, watch_roots([str(out)]), time.time, etag_is_sha=True)
    assert alone.survey().order[0].key == "checkpoint-40"


# --- two real daemons, a real torchrun job, one node frozen ----------------------------------------
HF_PYTHON = os.environ.get("TSUP_HF_PYTHON", "")


def node_config(tmp_path: Path, k: int, s3, prefix: str, port: int) -> dict:
    here = tmp_path / f"n{k}"
    out = here / "out"
    out.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).parents[1] / "fixtures" / "ddp_node.py"
    cmd = (f"{HF_PYTHON} -m torch.distributed.run --nnodes 2 --node_rank {k} --nproc_per_node 1 "
           f"--master_addr 127.0.0.1 --master_port {port} {script} {out}")
    return {
        "training": {"command": cmd, "workdir": str(here), "log": str(here / "train.log"), "on_finish": "none",
                     "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TMPDIR": str(here)}},
        "sync": s3.sync_config(prefix, watch=[str(out)], quiet_period="0.5s"),
        "idle": {"warn_after": "2h", "count_ssh": False},
        "stop": {"action": "command", "command": f"echo stopped >> {here / 'stopped.txt'}", "final_sync": [str(out)],
                 "retry_interval": "1s", "final_sync_timeout": "30s"},
        "cluster": {"nodes": 2, "rank": k, "run_id": "ddp-1", "heartbeat": "1s", "silent_after": "6s"},
    }


@pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf with torch)")
def test_a_frozen_node_releases_the_survivor_saved_then_stopped_in_time(tmp_path, make_daemon, s3_server, s3_prefix):
    port = free_port()
    d0 = make_daemon(node_config(tmp_path, 0, s3_server, s3_prefix, port), sub="d0")
    d1 = make_daemon(node_config(tmp_path, 1, s3_server, s3_prefix, port), sub="d1")
    d0.req("start")
    d1.req("start")

    def both_saved() -> bool:
        objs = s3_server.objects(s3_prefix)
        return all(any(k.startswith(f"node-{n}/checkpoint-") and k.endswith("_MANIFEST.json") for k in objs)
                   for n in (0, 1))
    wait_until(both_saved, 120, interval=0.5, what="a checkpoint of each node's part on the target")
    wait_until(lambda: [n["state"] for n in d0.status()["cluster"]["nodes"]] == ["ok", "ok"], 30,
               what="both nodes ok")
    objs = s3_server.objects(s3_prefix)
    assert {"_cluster/node-0.json", "_cluster/node-1.json"} <= set(objs)
    assert not [k for k in objs if not k.startswith(("node-0/", "node-1/", "_cluster/", "_run/ledger/"))], sorted(objs)

    # node 1 frozen whole: its daemon and every process of its training (torchrun starts its workers
    # in sessions of their own, so the job's process group alone would leave the worker training)
    import psutil

    here = str(tmp_path / "n1")
    frozen = [d1.proc.pid] + [p.pid for p in psutil.process_iter(["cmdline"])
                              if any(here in a for a in (p.info["cmdline"] or []))]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    assert len(frozen) >= 3, frozen  # the daemon, torchrun, its worker (and the shell around them)
    last_beat = time.time()
    try:
        wait_until(lambda: (tmp_path / "n0" / "stopped.txt").exists(), 6 + 60,
                   interval=0.2, what="node 0 stopped")
        took = time.time() - last_beat
        st = d0.status()
        assert st["stop"]["reason"] == "node_lost", st["stop"]
        assert st["stop"]["final_sync"]["ok"], st["stop"]
        assert st["training"]["state"] in ("STOPPED", "FAILED"), st["training"]
        assert [n["state"] for n in st["cluster"]["nodes"]] == ["ok", "lost"]
        assert any(a["kind"] == "node_lost" for a in st["alerts"]) or d0.req("alerts")["recent"]
        assert took <= 6 + 60, took
        # what node 0 saved is on the target, verified, under its part
        saved = [k for k in s3_server.objects(s3_prefix) if k.startswith("node-0/") and k.endswith("_MANIFEST.json")]
        assert saved
        print(f"node 0 stopped {took:.1f} s after node 1's last heartbeat")
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    d0.cleanup()
    d1.cleanup()

    # both nodes again, on fresh machines: each restores its part of the same newest whole unit
    objs = s3_server.objects(s3_prefix)
    recorded = {k[len("_cluster/"):-len(".json")] for k in objs if k.startswith("_cluster/checkpoint-")}
    assert recorded, sorted(objs)[:20]
    got = []
    for k in (0, 1):
        cfg = node_config(tmp_path / "again", k, s3_server, s3_prefix, port)
        cfg["resume"] = {"from_target": True}
        d = make_daemon(cfg, sub=f"again{k}")
        res = d.req("resume", {}, timeout=120)
        got.append(res["unit"])
        here = tmp_path / "again" / f"n{k}" / "out" / res["unit"]
        assert (here / f"rank-{k}.pt").is_file() and not (here / f"rank-{1 - k}.pt").exists()
    assert got[0] == got[1] and got[0] in recorded | {u for u in got if all(
        f"node-{n}/{u}/_MANIFEST.json" in objs for n in (0, 1))}, (got, sorted(recorded))
    newest_whole = max(recorded, key=lambda u: int(u.split("-")[1]))
    assert int(got[0].split("-")[1]) >= int(newest_whole.split("-")[1])
