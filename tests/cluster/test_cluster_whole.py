"""A run-wide verdict you can trust (issue 53): a unit is whole only when every node's part is
verified on the target, or the node provably never held any of it, and the union of the parts
holds every rank's files; a restarted node says "holds: unknown" until its first scan; a node
that lost its part before it was sent keeps saying so; the resume takes one unit for the whole run.

The pure rules exhaustively; then real sync engines (one per node, a folder target) under the
cluster duty with a fake clock; then the restore of a run whose newest unit one node lacks."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.cluster import nodes as cn
from supervisor.cluster.watch import ClusterWatch
from supervisor.config import ClusterConfig
from supervisor.config.cluster import Identity
from supervisor.resume.restore import NothingToRestore, Restorer
from supervisor.resume.wholerun import RunParts
from supervisor.saves import parts
from supervisor.saves.parts import Held
from supervisor.store.local import LocalTarget
from supervisor.sync.scan import watch_roots
from supervisor.training.ranks import Ranks, settle
from tests.cluster.test_cluster import Recorder, Training
from tests.fixtures.hf_writer import torch_zip_bytes
from tests.waiting import wait_until

U = "checkpoint-40"


def beat(holds: tuple[str, ...] | None = (), verified: dict | None = None, lost: tuple[str, ...] = (),
         ranks=None) -> cn.Beat:
    return cn.Beat(1, "h1", 7, "b", 1.0, "RUNNING", 1, "r", holds, verified or {}, lost, 4, ranks)


# --- whole or not: every case -----------------------------------------------------------------------

@pytest.mark.parametrize("part,want", [
    (cn.Part("d1", beat((U,), {U: "d1"})), "d1"),                       # held, verified as on the target
    (cn.Part("d1", beat(("checkpoint-20",))), "d1"),                    # sent, then deleted here (pruned)
    (cn.Part("d1", None), "d1"),                                        # never heard: its manifest vouches
    (cn.Part("d1", beat(None)), "d1"),                                  # restarted, complete part on the target
    (cn.Part("d1", beat((U,))), "still writes or sends"),               # held, its files differ from the manifest
    (cn.Part("d1", beat((U,), {U: "d0"})), "still writes or sends"),    # verified another version
    (cn.Part("d1", beat((U,)), lost=True), "d1"),                       # lost: its manifest is its last word
    (cn.Part("d1", beat((), lost=(U,))), "lost its part before it was sent"),
    (cn.Part("", None), "not heard from"),
    (cn.Part("", beat(None), fresh=True, watched_before=True), "first scan (holds: unknown)"),
    (cn.Part("", beat((U,)), fresh=True, watched_before=True), "still writes or sends"),
    (cn.Part("", beat(()), fresh=True, watched_before=True, listed=True), "held a part and it is not complete"),
    (cn.Part("", beat(()), fresh=False, watched_before=True), "not complete on the target"),
    (cn.Part("", beat(()), fresh=True, watched_before=False), "started after the unit was saved"),
    (cn.Part("", beat(()), fresh=True, watched_before=True), "none"),   # provably never held any of it
])
def test_node_1s_part_counts_only_when_verified_or_provably_never_held(part, want):
    why, got = cn.unit_whole(U, 2, {0: cn.Part("d0"), 1: part})
    if why:
        assert want in why and not got
    else:
        assert got == {0: "d0", 1: want}


def test_no_node_with_a_part_is_no_whole_unit():
    never = cn.Part("", beat(()), fresh=True, watched_before=True)
    assert cn.unit_whole(U, 2, {0: never, 1: never})[0] == "no node's part is complete"


# --- the union of the parts ----------------------------------------------------------------------------

def dsn(ranks, model: bool) -> list[str]:
    out = [f"global_step40/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks]
    out += [f"rng_state_{r}.pth" for r in ranks]
    return out + (["global_step40/mp_rank_00_model_states.pt", "latest", "trainer_state.json"] if model else [])


def test_the_union_of_node_local_parts_must_hold_every_rank_and_the_files_one_rank_writes():
    assert parts.covers({0: dsn(range(8), True), 1: dsn(range(8, 16), False)}, 16) == ""
    # a shared disk: every part holds every file
    every = dsn(range(16), True)
    assert parts.covers({0: every, 1: every}, 16) == ""
    gap = [f for f in dsn(range(8, 16), False) if "rank_11_" not in f]
    assert parts.covers({0: dsn(range(8), True), 1: gap}, 16).startswith(
        "rank 11 of 16: global_step40/zero_pp_rank_11_mp_rank_00_optim_states.pt in no node's part")
    assert "mp_rank_00_model_states.pt in no node's part" in parts.covers(
        {0: dsn(range(8), False), 1: dsn(range(8, 16), False)}, 16)
    # the world from the heartbeats: a third node's ranks never arrived
    assert "rank 16 of 24" in parts.covers({0: dsn(range(8), True), 1: dsn(range(8, 16), False)}, 24)
    no_state = [f for f in dsn(range(8), True) if f != "trainer_state.json"]
    assert parts.covers({0: no_state, 1: dsn(range(8, 16), False)}, 16).startswith("trainer_state.json in no node's part")
    # DCP: the coordinator's .metadata in some part, beside the shards
    assert parts.covers({0: ["w/__0_0.distcp"], 1: ["w/__1_0.distcp"]}, 2).startswith("w/.metadata in no node's part")
    assert parts.covers({0: ["w/__0_0.distcp", "w/.metadata"], 1: ["w/__1_0.distcp"]}, 2) == ""
    # Accelerate: every process's random states
    assert "random_states_2.pkl in no node's part" in parts.covers(
        {0: ["random_states_0.pkl", "random_states_1.pkl"], 1: ["random_states_3.pkl"]}, 4)
    # hostile names are bounded, never a loop of a billion turns
    assert "more than any run has" in parts.covers({0: ["g/zero_pp_rank_9999999_mp_rank_00_optim_states.pt",
                                                        "g/mp_rank_00_model_states.pt"]}, None)


# --- records from the target are untrusted --------------------------------------------------------------

KEY = b"k" * 32


@pytest.mark.parametrize("data,words", [
    (b"[]", "JSON but not an object"),
    (b"[" * 1500 + b"]" * 1500, "nests deeper"),
    (b"\xff\xfe", "not UTF-8"),
    (json.dumps({"format": parts.RECORD_FORMAT, "unit": "checkpoint-20", "parts": {"0": "a" * 64, "1": "b" * 64}}).encode(),
     "another format or unit"),
    (json.dumps({"format": parts.RECORD_FORMAT, "unit": U, "parts": {"0": "a" * 64}}).encode(), "no part of node 1"),
    (json.dumps({"format": parts.RECORD_FORMAT, "unit": U, "parts": {"0": "a" * 64, "1": "../../x"}}).encode(),
     "no part of node 1"),
    (json.dumps({"format": parts.RECORD_FORMAT, "unit": U, "parts": {"0": "none", "1": "none"}}).encode(), "no part at all"),
])
def test_a_record_that_is_not_one_is_no_record_never_an_error(data, words):
    rec, why = parts.read_record(data, U, 2)
    assert rec is None and words in why


def test_records_are_signed_with_the_runs_key_and_others_ignored():
    good = parts.record_doc(U, "r", {0: "a" * 64, 1: "none"}, "t", KEY)
    assert parts.read_record(good, U, 2, KEY) == ({0: "a" * 64, 1: "none"}, "")
    unsigned = parts.record_doc(U, "r", {0: "a" * 64, 1: "none"}, "t")
    assert "unsigned" in parts.read_record(unsigned, U, 2, KEY)[1]
    assert "wrongly signed" in parts.read_record(parts.record_doc(U, "r", {0: "a" * 64, 1: "none"}, "t", b"x" * 32),
                                                 U, 2, KEY)[1]
    tampered = json.loads(good)
    tampered["parts"]["1"] = "c" * 64
    assert "wrongly signed" in parts.read_record(json.dumps(tampered).encode(), U, 2, KEY)[1]
    # without a key the bucket is trusted: the signature is not looked at
    assert parts.read_record(good, U, 2)[0] is not None


def test_one_unit_for_the_whole_run():
    recs = {"checkpoint-60": {0: "a" * 64, 1: "b" * 64}, "checkpoint-40": {0: "c" * 64, 1: "none"}}
    now = {"checkpoint-60": {0: "a" * 64, 1: "x" * 64}, "checkpoint-40": {0: "c" * 64},
           "checkpoint-20": {0: "e" * 64, 1: "f" * 64}}

    def record(u):
        return (recs.get(u), "")

    ch = parts.run_choice(["checkpoint-60", "checkpoint-40", "checkpoint-20"], record, lambda u: now.get(u, {}), 2, 1)
    # 60: node 1's part was sent again since its record; 40: whole, and node 1 never held any of it
    assert (ch.unit, ch.mine) == ("checkpoint-40", "none")
    assert ch.skipped[0][0] == "checkpoint-60" and "no longer on the target as the run-wide record" in ch.skipped[0][1]
    assert parts.run_choice(["checkpoint-40", "checkpoint-20"], record, lambda u: now.get(u, {}), 2, 0).mine == "c" * 64
    # no record: every part complete now
    ch = parts.run_choice(["checkpoint-20"], lambda u: (None, ""), lambda u: now.get(u, {}), 2, 1)
    assert (ch.unit, ch.mine) == ("checkpoint-20", "f" * 64)
    ch = parts.run_choice(["checkpoint-40"], lambda u: (None, ""), lambda u: now.get(u, {}), 2, 1)
    assert ch.unit == "" and "node 1's part is not complete" in ch.skipped[0][1]


# --- real sync engines under the cluster duty ------------------------------------------------------------

def write_ck(out: Path, step: int, rank: int) -> None:
    ck = out / f"checkpoint-{step}"
    (ck / f"global_step{step}").mkdir(parents=True, exist_ok=True)
    (ck / f"global_step{step}" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(torch_zip_bytes(3000, rank))
    (ck / f"rng_state_{rank}.pth").write_bytes(torch_zip_bytes(500, rank + 7))
    if rank == 0:
        (ck / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(torch_zip_bytes(4000, 99))
        (ck / "trainer_state.json").write_text(json.dumps({"global_step": step}))


class Run:
    """Two nodes on one box: a real sync engine per node (a folder target, its own state), the
    cluster duty of each on a fake clock, world 2 with one rank per node."""

    def __init__(self, tmp: Path, make_engine, quiet: str = "0.2s"):
        self.tmp = tmp
        self.remote = tmp / "run"
        self.outs = [tmp / f"n{k}" / "out" for k in range(2)]
        for o in self.outs:
            o.mkdir(parents=True)
        # each node's ranks as its workers would say them: world 2, one rank per node
        self.engines = [make_engine({"target": str(self.remote / f"node-{k}"), "watch": [str(self.outs[k])],
                                     "quiet_period": quiet}, state=f"st{k}",
                                    world_size=lambda k=k: settle(Ranks(2, frozenset({k}), "workers"), nodes=2, node=k))
                        for k in range(2)]
        self.clock = FakeClock()
        self.recs = [Recorder(), Recorder()]
        self.watches = [self.watch(k) for k in range(2)]

    def watch(self, k: int, holds=None) -> ClusterWatch:
        e = self.engines[k]
        return ClusterWatch(ClusterConfig(nodes=2, rank=k, run_id="r", heartbeat=1.0, silent_after=30.0),
                            Identity(2, k, "r"), LocalTarget(str(self.remote)), Training(), self.recs[k], self.clock,
                            f"h{k}", stop=self.recs[k].stop, withdraw=self.recs[k].withdraw,
                            holds=holds or e.answers.held_parts,
                            part0=LocalTarget(str(self.remote / "node-0")) if k == 0 else None,
                            ranks=lambda: Ranks(2, frozenset({k}), nodes=2), state_dir=str(self.tmp / f"cw{k}"))

    def rounds(self, n: int) -> None:
        for _ in range(n):
            for w in self.watches:
                w.poll()
            self.clock.advance(1.0)

    def sent(self, k: int, unit: str) -> bool:
        return (self.remote / f"node-{k}" / unit / "_MANIFEST.json").exists()

    def record(self, unit: str) -> dict | None:
        p = self.remote / "_cluster" / f"{unit}.json"
        return json.loads(p.read_text())["parts"] if p.exists() else None

    def waiting(self) -> dict:
        return {w["unit"]: w["why"] for w in self.watches[0].status()["records"]["waiting"]}

    def close(self) -> None:
        for w in self.watches:
            w.close()


def test_node_local_parts_are_recorded_once_each_is_verified_and_their_union_is_whole(make_engine, tmp_path):
    r = Run(tmp_path, make_engine)
    wait_until(lambda: all(e.answers.held_parts().scanned for e in r.engines), 10, what="first scans")
    r.rounds(2)
    write_ck(r.outs[0], 20, 0)
    write_ck(r.outs[1], 20, 1)
    wait_until(lambda: r.sent(0, "checkpoint-20") and r.sent(1, "checkpoint-20"), 30, what="both parts sent")
    wait_until(lambda: r.engines[1].answers.held_parts().units[0][1], 10, what="node 1's part verified")
    r.rounds(4)
    got = r.record("checkpoint-20")
    assert got and set(got) == {"0", "1"} and "none" not in got.values(), (got, r.waiting())
    beat1 = json.loads((r.remote / "_cluster" / "node-1.json").read_text())
    assert beat1["ranks"] == [[1, 1]] and beat1["world"] == 2 and beat1["verified"]["checkpoint-20"] == got["1"]
    st = r.engines[1].answers.unit_formats()[0]
    assert st["complete"] and st["format"] == "deepspeed"  # node 1: its rank's shard, no model states, complete
    r.close()


def test_a_restarted_node_says_holds_unknown_and_rank_0_waits_for_its_first_scan(make_engine, tmp_path):
    r = Run(tmp_path, make_engine)
    r.rounds(2)
    write_ck(r.outs[0], 20, 0)
    wait_until(lambda: r.sent(0, "checkpoint-20"), 30, what="node 0's part sent")
    # node 1's daemon restarts: its engine has not scanned yet (a Held that knows nothing)
    r.watches[1].close()
    r.watches[1] = r.watch(1, holds=lambda: Held(False))
    r.rounds(4)
    beat1 = json.loads((r.remote / "_cluster" / "node-1.json").read_text())
    assert beat1["holds"] is None
    assert r.record("checkpoint-20") is None
    assert "has not finished its first scan (holds: unknown)" in r.waiting()["checkpoint-20"]
    # its first scan ends and finds nothing of the unit; but its daemon started after the unit was
    # saved: whether it held a part that went away meanwhile is not known, so still no record
    r.watches[1].close()
    r.watches[1] = r.watch(1, holds=lambda: Held(True))
    r.rounds(4)
    assert r.record("checkpoint-20") is None
    assert "started after the unit was saved" in r.waiting()["checkpoint-20"]
    # a unit saved while it watches, of which it never holds any (the Trainer's DDP save: the main
    # process alone writes it): "none"
    ck = r.outs[0] / "checkpoint-40"
    ck.mkdir()
    (ck / "optimizer.pt").write_bytes(torch_zip_bytes(3000, 1))
    (ck / "trainer_state.json").write_text('{"global_step": 40}')
    wait_until(lambda: r.sent(0, "checkpoint-40"), 30, what="node 0's part of 40 sent")
    r.rounds(5)
    assert r.record("checkpoint-40") == {"0": parts.part_digest(
        (r.remote / "node-0" / "checkpoint-40" / "_MANIFEST.json").read_bytes()), "1": "none"}, r.waiting()
    r.close()


def test_a_part_rotated_away_before_it_was_sent_keeps_the_unit_from_its_record_and_the_resume(make_engine, tmp_path):
    """Node 1's save_total_limit deletes its part of checkpoint-40 while it still waits (a long quiet
    period): node 1 says it lost it in every heartbeat, across a restart of its duty; rank 0 never
    reads "does not hold it" as "has no part"; a resume on both nodes takes checkpoint-20, whole."""
    r = Run(tmp_path, make_engine, quiet="60s")
    r.rounds(2)
    for step in (20, 40):
        write_ck(r.outs[0], step, 0)
        write_ck(r.outs[1], step, 1)
    # 20 is complete by its rules on both; node 1's part of 40 is made to wait: no rng state yet
    (r.outs[1] / "checkpoint-40" / "rng_state_1.pth").unlink()
    wait_until(lambda: all(r.sent(k, "checkpoint-20") for k in (0, 1)) and r.sent(0, "checkpoint-40"), 30,
               what="20 on both, 40 on node 0")
    wait_until(lambda: "checkpoint-40" in dict(r.engines[1].answers.held_parts().units), 10, what="node 1 holds 40")
    r.rounds(3)
    assert "checkpoint-40" in json.loads((r.remote / "_cluster" / "node-1.json").read_text())["holds"]
    shutil.rmtree(r.outs[1] / "checkpoint-40")  # the rotation
    r.engines[1].request_sync()
    wait_until(lambda: "checkpoint-40" in r.engines[1].answers.held_parts().lost, 20, what="node 1's loss seen")
    r.rounds(4)
    assert r.record("checkpoint-20") and r.record("checkpoint-40") is None
    assert "node 1 lost its part before it was sent" in r.waiting()["checkpoint-40"]
    # node 1's duty restarts (its engine's memory of the loss too): the state file keeps saying so
    r.watches[1].close()
    r.watches[1] = r.watch(1, holds=lambda: Held(True, (("checkpoint-20", r.record("checkpoint-20")["1"]),)))
    r.rounds(3)
    assert json.loads((r.remote / "_cluster" / "node-1.json").read_text())["lost"] == ["checkpoint-40"]
    r.close()

    # the resume of a run whose newest unit one node lacks: both nodes take checkpoint-20
    got = []
    for k in (0, 1):
        dest = tmp_path / f"again{k}"
        dest.mkdir()
        rs = Restorer(LocalTarget(str(r.remote / f"node-{k}")), None, watch_roots([str(dest)]), time.time,
                      etag_is_sha=True, run=RunParts(LocalTarget(str(r.remote)), 2, k, None,
                                                      LocalTarget(str(r.remote / "_cluster"))))
        res = rs.restore()
        got.append(res.unit.key)
        assert (dest / res.unit.key / f"rng_state_{k}.pth").is_file()
        if k == 0:
            assert [(u.key, u.why) for u in res.skipped][0][0] == "checkpoint-40"
    assert got == ["checkpoint-20", "checkpoint-20"]


def test_a_node_without_a_part_of_the_runs_unit_restores_nothing_never_an_older_one(tmp_path):
    """checkpoint-40 is whole with node 1's part "none" (the Trainer saved it on rank 0 alone); node 1
    still has a part of checkpoint-20 on the target. Before, node 1 restored checkpoint-20 while
    node 0 restored checkpoint-40: one run resumed from two steps."""
    from supervisor.sync.manifest import ManifestFile, build

    remote = tmp_path / "run"

    def part(k: int, unit: str) -> str:
        f = ManifestFile(f"rank-{k}.pt", 3, "a" * 64)
        d = remote / f"node-{k}" / unit
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank-{k}.pt").write_bytes(b"abc")
        (d / "_MANIFEST.json").write_bytes(build(unit, [f], 1e9))
        return parts.part_digest((d / "_MANIFEST.json").read_bytes())

    part(0, "checkpoint-20")
    part(1, "checkpoint-20")
    d40 = part(0, "checkpoint-40")
    (remote / "_cluster").mkdir()
    (remote / "_cluster" / "checkpoint-40.json").write_bytes(parts.record_doc("checkpoint-40", "r", {0: d40, 1: "none"}, "t"))
    (remote / "_cluster" / "checkpoint-60.json").write_bytes(b"[1, 2]")  # valid JSON, not a record: no harm

    def restorer(k: int) -> Restorer:
        (tmp_path / f"o{k}").mkdir(exist_ok=True)
        return Restorer(LocalTarget(str(remote / f"node-{k}")), None, watch_roots([str(tmp_path / f"o{k}")]), time.time,
                        etag_is_sha=True, run=RunParts(LocalTarget(str(remote)), 2, k, None,
                                                        LocalTarget(str(remote / "_cluster"))))

    assert restorer(0).restore(dry_run=True).unit.key == "checkpoint-40"
    with pytest.raises(NothingToRestore, match="the run resumes from checkpoint-40, of which this node .rank 1. holds no part"):
        restorer(1).restore()
    assert not (tmp_path / "o1" / "checkpoint-20").exists()
