"""Per-node rank sets (issue 53): a node of a multi-node run expects the files of the ranks its own
workers run, never WORLD_SIZE of them, and waits for a file only one rank writes only where that
rank runs. Ranks not known: not complete, saying what is awaited.

The pure readers and rules exhaustively (layouts from DeepSpeed's engine.save_checkpoint, torch's
FileSystemWriter, Megatron, NeMo, the HF Trainer, Accelerate); /proc read from a real torchrun of
two nodes x two workers on loopback; the walker's first look before the workers exist."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.config import SyncConfig
from supervisor.saves.formats import Facts, Rule, detect, judge
from supervisor.store._log import Once, get_logger
from supervisor.sync.policy import Policy
from supervisor.sync.scan import Root
from supervisor.sync.walk import Walker
from supervisor.training import ranks as rk
from tests.fixtures.hf_writer import torch_zip_bytes
from tests.fixtures.ports import free_port
from tests.waiting import wait_until

HF_PYTHON = os.environ.get("TSUP_HF_PYTHON", "")


def env(**kw) -> bytes:
    return b"\0".join(f"{k}={v}".encode() for k, v in kw.items()) + b"\0PATH=/usr/bin\0"


# --- what the workers were told ----------------------------------------------------------------------

def test_a_nodes_ranks_are_its_workers_rank_less_local_rank_plus_local_world():
    w = [rk.parse_environ(env(WORLD_SIZE=16, RANK=9, LOCAL_RANK=1, LOCAL_WORLD_SIZE=8, GROUP_RANK=1))]
    r = rk.from_workers(w, 1, 0, True)
    assert (r.world, r.mine) == (16, frozenset(range(8, 16)))
    assert rk.spans(r.mine) == [[8, 15]] and r.to_json()["ranks"] == [[8, 15]]
    # the deepspeed launcher says LOCAL_SIZE
    r = rk.from_workers([rk.parse_environ(env(WORLD_SIZE=4, RANK=2, LOCAL_RANK=0, LOCAL_SIZE=2))], 1, 0, True)
    assert r.mine == frozenset({2, 3})


@pytest.mark.parametrize("workers,want", [
    # the launcher alone (torchrun before its workers start): nothing known, never "one process"
    ([rk.Worker(launcher=True)], (None, None, "launcher")),
    ([rk.parse_environ(env(HOME="/root"), b"/usr/bin/python3\0-m\0torch.distributed.run\0--nnodes\0002")],
     (None, None, "launcher")),
    ([rk.parse_environ(env(HOME="/root"), b"/opt/venv/bin/torchrun\0train.py")], (None, None, "launcher")),
    # a plain `python train.py`: one process
    ([rk.parse_environ(env(HOME="/root"), b"python\0train.py")], (1, frozenset({0}), "")),
    # WORLD_SIZE without RANK: the world, not this node's share
    ([rk.Worker(world=8)], (8, None, "")),
    # hostile numbers: a 5,000-digit rank, a negative, a rank past the world
    ([rk.parse_environ(b"WORLD_SIZE=" + b"9" * 5000 + b"\0RANK=1\0")], (None, None, "WORLD_SIZE")),
    ([rk.parse_environ(env(WORLD_SIZE=4, RANK=7, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2))], (4, None, "")),
])
def test_what_the_processes_say(workers, want):
    r = rk.from_workers(workers, len(workers), 0, True)
    assert (r.world, r.mine) == want[:2]
    assert want[2] in r.waiting


def test_the_config_stands_in_where_the_workers_do_not_say():
    # sync.world_size with cluster.nodes: torchrun's order, node k runs k*W/N .. (k+1)*W/N - 1
    r = rk.settle(rk.Ranks(), world_size=16, nodes=2, node=1)
    assert (r.world, r.mine, r.nodes) == (16, frozenset(range(8, 16)), 2) and "split evenly" in r.source
    # one node runs every rank
    assert rk.settle(rk.Ranks(4, None), nodes=1).mine == frozenset(range(4))
    # the workers' own ranks win over the even split
    assert rk.settle(rk.Ranks(12, frozenset({0, 1, 2, 3})), nodes=3, node=2).mine == frozenset({0, 1, 2, 3})
    # an uneven split and no LOCAL_WORLD_SIZE: not known, and said
    r = rk.settle(rk.Ranks(10, None), nodes=3, node=1)
    assert r.mine is None and "does not split evenly over 3 nodes" in r.waiting
    # nothing at all
    r = rk.settle(rk.Ranks(waiting="the training's workers (its launcher runs; they have not started yet)"), nodes=2)
    assert r.world is None and "launcher" in r.waiting


# --- the rules with a node's ranks -------------------------------------------------------------------

def ds(step: int, ranks: range | list[int], model: bool, zero3: bool = False, tp: int = 1) -> list[str]:
    """DeepSpeed's layout for the given global ranks (rank r: dp r // tp, mp r % tp)."""
    tag = f"global_step{step}"
    out = [f"{tag}/zero_pp_rank_{r // tp}_mp_rank_{r % tp:02d}_optim_states.pt" for r in ranks]
    if zero3:
        out += [f"{tag}/zero_pp_rank_{r // tp}_mp_rank_{r % tp:02d}_model_states.pt" for r in ranks]
    elif model:
        out += [f"{tag}/mp_rank_{mp:02d}_model_states.pt" for mp in range(tp)]
    return out


NODE0 = Facts(world_size=16, ranks=frozenset(range(8)))
NODE1 = Facts(world_size=16, ranks=frozenset(range(8, 16)))


def test_deepspeed_on_node_local_disks_each_node_waits_for_its_own_ranks_only():
    """2 nodes x 8 GPUs: node 0 holds ranks 0-7 and the model states, node 1 ranks 8-15 and never
    the model states (only data-parallel rank 0 writes them). Before, node 0 waited for "rank 8 of
    16" and node 1 for the model states, for ever."""
    assert judge("deepspeed", "global_step40", ds(40, range(8), True), NODE0) == Rule(positive=True)
    assert judge("deepspeed", "global_step40", ds(40, range(8, 16), False), NODE1) == Rule(positive=True, elsewhere=True)
    r = judge("deepspeed", "global_step40", ds(40, [8, 9, 10, 11, 12, 13, 14], False), NODE1)
    assert r.waiting == "rank 15 of 16: global_step40/zero_pp_rank_15_mp_rank_00_optim_states.pt missing"
    r = judge("deepspeed", "global_step40", ds(40, range(8), False), NODE0)
    assert r.waiting.startswith("global_step40/mp_rank_00_model_states.pt (the model's states")
    # ZeRO-3: every rank writes its own model states too
    assert judge("deepspeed", "g", ds(40, range(8, 16), False, zero3=True), NODE1).positive
    short = [f for f in ds(40, range(8, 16), False, zero3=True) if f != "global_step40/zero_pp_rank_12_mp_rank_00_model_states.pt"]
    assert judge("deepspeed", "g", short, NODE1).waiting == \
        "rank 12 of 16: global_step40/zero_pp_rank_12_mp_rank_00_model_states.pt missing"
    # tensor parallel 2: ranks 8..15 are dp 4..7, mp 0..1; the model states are dp 0's (node 0)
    assert judge("deepspeed", "g", ds(40, range(8, 16), False, tp=2), NODE1).positive
    assert "mp_rank_01_model_states.pt" in judge("deepspeed", "g", ds(40, range(8), False, tp=2)
                                                  + ["global_step40/mp_rank_00_model_states.pt"], NODE0).waiting


def test_deepspeed_on_a_shared_disk_every_node_sees_every_rank_and_is_complete_by_its_own():
    every = ds(40, range(16), True)
    assert judge("deepspeed", "global_step40", every, NODE0).positive
    assert judge("deepspeed", "global_step40", every, NODE1).positive
    # node 1 is complete by its own ranks while rank 3 still writes: the run-wide check asks the union
    assert judge("deepspeed", "global_step40", [f for f in every if "rank_3_" not in f], NODE1).positive


def test_deepspeed_with_unknown_ranks_is_never_complete_and_says_what_it_waits_for():
    files = ds(40, range(16), True)
    r = judge("deepspeed", "global_step40", files, Facts())
    assert r.waiting.startswith("the world size (set sync.world_size)") and r.soft and not r.positive
    r = judge("deepspeed", "global_step40", files, Facts(world_size=16, ranks_waiting="this node's ranks (WORLD_SIZE 16 ...)"))
    assert r.waiting.startswith("this node's ranks") and r.soft
    # the launcher's words travel to what the unit waits for
    r = judge("deepspeed", "g", files, Facts(ranks_waiting="the training's workers (its launcher runs)"))
    assert "its launcher runs" in r.waiting


def test_dcp_waits_for_the_metadata_only_where_the_coordinator_runs():
    shards = [f"__{r}_0.distcp" for r in range(8, 16)] + ["__9_1.distcp"]
    assert detect("step_7", shards) == "dcp"
    assert judge("dcp", "step_7", shards, NODE1) == Rule(elsewhere=True)  # its ranks' files: the quiet period, not "complete by rule"
    r = judge("dcp", "step_7", [s for s in shards if not s.startswith("__12_")], NODE1)
    assert r.waiting.startswith("__12_0.distcp (rank 12 of this node")
    node0 = [f"__{r}_0.distcp" for r in range(8)]
    assert judge("dcp", "step_7", node0, NODE0).waiting.startswith(".metadata (")
    assert judge("dcp", "step_7", [*node0, ".metadata"], NODE0) == Rule(positive=True)
    # the HF Trainer's FSDP folder inside checkpoint-N/ on node 1
    fsdp = [f"pytorch_model_fsdp_0/__{r}_0.distcp" for r in range(8, 16)]
    assert judge("hf", "checkpoint-7", fsdp, NODE1).waiting == ""
    assert judge("dcp", "step_7", shards, Facts(world_size=16, ranks_waiting="this node's ranks")).soft


def test_megatron_nemo_and_the_trainer_wait_for_rank_0s_file_only_on_its_node():
    it = ["mp_rank_04/model_optim_rng.pt"]
    # node 1 on its own disk never gets latest_checkpointed_iteration.txt: its files wait out the quiet period
    assert judge("megatron", "iter_0000200", it, NODE1) == Rule(elsewhere=True)
    # on a shared disk the tracker is there, and counts
    assert judge("megatron", "iter_0000200", it, Facts(16, {"../latest_checkpointed_iteration.txt": "100"},
                                                        ranks=frozenset(range(8, 16)))).waiting.endswith("(it names 100)")
    assert "beside it to name iteration 200" in judge("megatron", "iter_0000200", it, NODE0).waiting
    assert judge("megatron", "iter_0000200", it, Facts(16, ranks_waiting="this node's ranks")).soft
    # NeMo's -unfinished marker is global rank 0's: without rank 0 no marker proves the save is over
    name = "megatron_gpt--step=100.ckpt"
    node1 = [f"model_weights/__{r}_0.distcp" for r in range(8, 16)]
    assert judge("nemo", name, node1, NODE1) == Rule(elsewhere=True)
    assert judge("nemo", name, ["model_weights/__0_0.distcp", "model_weights/.metadata"], NODE0).positive
    marker = frozenset({name, "megatron_gpt--step=100-unfinished"})
    assert "still beside it" in judge("nemo", name, node1,
                                      Facts(16, siblings=marker, ranks=frozenset(range(8, 16)))).waiting
    # the Trainer: trainer_state.json is the main process's; node 1 holds its processes' rng states
    hf = [f"rng_state_{r}.pth" for r in range(8, 16)] + ds(40, range(8, 16), False)
    assert judge("hf", "checkpoint-40", hf, NODE1).positive
    assert judge("hf", "checkpoint-40", hf[1:], NODE1).waiting.startswith("rng_state_8.pth (rank 8 of this node")
    assert not judge("hf", "checkpoint-40", [f"rng_state_{r}.pth" for r in range(8)], NODE0).positive
    # Accelerate: random_states_{process} of this node's processes
    acc = [f"random_states_{r}.pkl" for r in range(8, 16)]
    assert judge("accelerate", "checkpoint_3", acc, NODE1) == Rule(positive=True, elsewhere=True)
    assert judge("accelerate", "checkpoint_3", acc[:-1], NODE1).waiting.startswith("random_states_15.pkl")


# --- /proc: a real torchrun of two nodes x two workers ---------------------------------------------------

WORKER = "import os, time\ntime.sleep(120)\n"


@pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf with torch)")
def test_each_node_reads_its_own_ranks_from_its_torchrun_workers(tmp_path):
    """torchrun --nnodes 2 --nproc_per_node 2 on loopback: node 0's workers run ranks 0-1, node 1's
    2-3. While node 0's launcher waits for node 1 at the rendezvous its workers do not exist: nothing
    is known (a plain run's "one process" would have judged a half-written save complete)."""
    import psutil

    script = tmp_path / "w.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []

    def node(k: int) -> subprocess.Popen:
        p = subprocess.Popen([HF_PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(k),
                              "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                              str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        return p

    def tree(p: subprocess.Popen) -> set[int]:
        try:
            return {p.pid, *(c.pid for c in psutil.Process(p.pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    try:
        n0 = node(0)
        wait_until(lambda: Path(f"/proc/{n0.pid}/cmdline").exists(), 10, what="torchrun started")
        time.sleep(0.5)  # the launcher alone, at its rendezvous (a real wait: nothing to poll for)
        alone = rk.settle(rk.read(tree(n0), single_if_unset=True), nodes=2, node=0)
        assert alone.world is None and alone.mine is None and "launcher" in alone.waiting, alone
        n1 = node(1)

        def both() -> tuple:
            return tuple(rk.read(tree(p), single_if_unset=True) for p in (n0, n1))

        wait_until(lambda: all(r.mine is not None and len(r.mine) == 2 for r in both()), 60,
                   what="both nodes' workers read")
        r0, r1 = both()
        assert (r0.world, r0.mine) == (4, frozenset({0, 1})) and (r1.world, r1.mine) == (4, frozenset({2, 3}))
        assert "LOCAL_WORLD_SIZE" in r0.source
    finally:
        for p in procs:
            for pid in tree(p):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            p.wait()


# --- the walker's first look, before the workers exist ---------------------------------------------------

def test_a_first_look_before_the_workers_exist_is_not_complete_and_is_looked_at_again(tmp_path):
    """The launcher alone answers "not known" (never a plain run's one process): a ZeRO-3 save whose
    last rank still writes waits, saying so, and the next look (5 s on) finds the ranks."""
    out = tmp_path / "out"
    ck = out / "checkpoint-40" / "global_step40"
    ck.mkdir(parents=True)
    for r in range(3):  # rank 3 of 4 has not begun its files
        (ck / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(torch_zip_bytes(2000, r))
        (ck / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").write_bytes(torch_zip_bytes(2000, r + 10))
    old = time.time() - 600
    for p in ck.iterdir():
        os.utime(p, (old, old))
    answers = [rk.Ranks(waiting="the training's workers (its launcher runs; they have not started yet)", nodes=1)]
    cfg = SyncConfig()
    cfg.quiet_period = 1.0
    w = Walker(Policy(["checkpoint-*/**"]), cfg, Once(get_logger("test")), world_size=lambda: answers[-1])
    root = Root(str(out), "")
    mono = 1000.0

    def look(at: float):
        return next(iter(w.scan([root], [], time.time(), at, lambda prefix: []).values())).verdict

    v = look(mono)
    assert not v.complete and v.waiting_for.startswith("the world size (set sync.world_size)"), v
    answers.append(rk.settle(rk.Ranks(4, frozenset(range(4)), "workers"), nodes=1))
    assert not look(mono + 1).complete  # read again only every 5 s while not known: still the first answer
    v = look(mono + 6)
    assert not v.complete and v.waiting_for == "rank 3 of 4: global_step40/zero_pp_rank_3_mp_rank_00_optim_states.pt missing"
    assert w.ranks is not None and w.ranks.world == 4
    # the training ends: its saves keep the ranks it ran with
    answers.append(rk.Ranks(waiting="nothing runs"))
    look(mono + 12)
    assert w.ranks.world == 4


def test_the_worlds_words_reach_the_lost_mail_advice():
    """A rotation that deleted a unit still waiting for the world size: the advice names sync.world_size."""
    from supervisor.sync.lost import _rule_advice

    r = judge("deepspeed", "x", ds(40, range(4), True), Facts())
    assert "sync.world_size" in _rule_advice(r.waiting, "the Trainer's save_total_limit")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
