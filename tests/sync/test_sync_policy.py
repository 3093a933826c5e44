"""Which files are uploaded and how they group: globs, temp names, the HF cache, units."""

from __future__ import annotations

import fnmatch
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.config import SyncConfig
from supervisor.sync.policy import (
    MANIFEST_NAME,
    Policy,
    could_match_below,
    folder_prefix,
    glob_match,
    hf_cache_roots,
    is_cache_dir,
    is_temp_name,
)

DEFAULT = SyncConfig().include


@pytest.mark.parametrize("pattern,path,ok", [
    ("checkpoint-*/**", "checkpoint-5/model.safetensors", True),
    ("checkpoint-*/**", "checkpoint-5/global_step5/mp_rank_00_model_states.pt", True),
    ("checkpoint-*/**", "checkpoint-5", False),
    ("checkpoint-*/**", "runs/checkpoint-5/x", False),
    ("checkpoint-*/**", "tmp-checkpoint-5/x", False),
    ("**/adapter_config.json", "adapter_config.json", True),
    ("**/adapter_config.json", "a/b/c/adapter_config.json", True),
    ("**/adapter_config.json", "a/xadapter_config.json", False),
    ("*.safetensors", "model.safetensors", True),
    ("*.safetensors", "sub/model.safetensors", False),
    ("model-?????-of-*.safetensors", "model-00001-of-00002.safetensors", True),
    ("[!.]*.json", ".hidden.json", False),
    ("[!.]*.json", "config.json", True),
    ("logs/", "logs/a/b.txt", True),
    ("./final/**", "final/x", True),
    ("a/**/b", "a/b", True),
    ("a/**/b", "a/x/y/b", True),
    ("a/**/b", "ab", False),
])
def test_glob(pattern, path, ok):
    assert glob_match(pattern, path) is ok


def _reference(pattern: str, path: str) -> bool:
    """Component-wise fnmatch with ** as any number of components: an independent oracle."""
    pp, xp = pattern.split("/"), path.split("/")

    def rec(i: int, j: int) -> bool:
        if i == len(pp):
            return j == len(xp)
        if pp[i] == "**":
            if i == len(pp) - 1:
                return j < len(xp)  # trailing ** is everything inside (at least one component)
            return any(rec(i + 1, k) for k in range(j, len(xp) + 1))
        return j < len(xp) and fnmatch.fnmatchcase(xp[j], pp[i]) and rec(i + 1, j + 1)

    return rec(0, 0)


_comp = st.sampled_from(["a", "b", "ck-1", "x.json", "model.safetensors", ".h", "c-2"])
_pcomp = st.sampled_from(["a", "b", "*", "ck-*", "*.json", "?", "**", "*.safetensors", "c-?"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_pcomp, min_size=1, max_size=4), st.lists(_comp, min_size=1, max_size=5))
def test_glob_agrees_with_reference(pat, path):
    p, x = "/".join(pat), "/".join(path)
    if re.search(r"\*\*/\*\*", p):
        return  # redundant double ** : both readings are defensible
    assert glob_match(p, x) == _reference(p, x), (p, x)


@settings(max_examples=300, deadline=None)
@given(st.lists(_pcomp, min_size=1, max_size=4), st.lists(_comp, min_size=2, max_size=5))
def test_pruning_never_hides_a_match(pat, path):
    """could_match_below must say yes for every folder above a path the glob matches."""
    p, x = "/".join(pat), "/".join(path)
    if glob_match(p, x):
        for i in range(1, len(path)):
            assert could_match_below(p, "/".join(path[:i])), (p, x, i)


@pytest.mark.parametrize("name", [
    "tmp-checkpoint-500", "model.safetensors.tmp", "x.part", "x.partial", "blob.incomplete", ".model.safetensors.Ab12Cd",
    "file~", ".#lock", ".nfs000123", "a.swp", ".x.bin.tsync-0a1b2c3d", "file.lock"])
def test_temp_names(name):
    assert is_temp_name(name)


@pytest.mark.parametrize("name", [
    "checkpoint-500", "model.safetensors", "trainer_state.json", "optimizer.pt", ".gitattributes", "README.md",
    "model-00001-of-00002.safetensors", "rng_state_3.pth"])
def test_not_temp_names(name):
    assert not is_temp_name(name)


@pytest.mark.parametrize("name,ok", [("models--meta-llama--Llama-2-7b", True), ("datasets--x--y", True),
                                     (".cache", True), (".locks", True), ("huggingface", True),
                                     ("checkpoint-5", False), ("adapter", False), ("hub", False)])
def test_cache_dirs(name, ok):
    assert is_cache_dir(name) is ok


def test_default_policy_selects_checkpoints_adapters_and_final_model_only():
    p = Policy(DEFAULT)
    assert p.selects("checkpoint-100/model.safetensors")
    assert p.selects("checkpoint-100/optimizer.pt")
    assert p.selects("checkpoint-100/global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert p.selects("lora/adapter_model.safetensors")
    assert p.selects("lora/adapter_config.json")
    assert p.selects("model.safetensors") and p.selects("config.json") and p.selects("tokenizer.json")
    assert not p.selects("train.log")
    assert not p.selects("runs/events.out.tfevents.1")
    assert not p.selects("data/train.jsonl")
    assert not p.selects("tmp-checkpoint-100/model.safetensors")
    assert not p.selects("checkpoint-100/model.safetensors.tmp")
    assert not p.selects(f"checkpoint-100/{MANIFEST_NAME}")
    # the HF model cache, wherever it sits under the watched folder
    assert not p.selects("hf/hub/models--org--m/snapshots/abc/model.safetensors")
    assert not p.selects(".cache/huggingface/hub/models--org--m/blobs/adapter_config.json")
    assert not p.selects("checkpoint-1/../etc/passwd")


def test_exclude_wins_and_prunes():
    p = Policy(DEFAULT, exclude=["checkpoint-*/global_step*/**", "**/*.pth"])
    assert not p.selects("checkpoint-1/global_step1/x.pt")
    assert not p.selects("checkpoint-1/rng_state.pth")
    assert p.selects("checkpoint-1/optimizer.pt")
    assert not p.enter_dir("checkpoint-1/global_step1", "/w/checkpoint-1/global_step1")
    assert p.enter_dir("checkpoint-1", "/w/checkpoint-1")


def test_enter_dir_skips_caches_and_cache_roots():
    p = Policy(DEFAULT, excluded_roots=["/workspace/hf"])
    assert not p.enter_dir("hf", "/workspace/hf")
    assert not p.enter_dir("x/models--a--b", "/workspace/x/models--a--b")
    assert not p.enter_dir(".cache", "/workspace/.cache")
    assert p.enter_dir("runs", "/workspace/runs")  # "**/adapter_config.json" may be anywhere
    q = Policy(["./checkpoint-*/**"])              # anchored at the watched folder
    assert not q.enter_dir("runs", "/w/runs")      # nothing under runs/ can match: not walked


def test_a_checkpoint_folder_pattern_matches_at_any_depth():
    # issue 29: watch /workspace/out, output_dir /workspace/out/tiny: the run folder one level
    # down was never uploaded while the final sync said "verified"
    p = Policy(DEFAULT)
    assert p.selects("tiny/checkpoint-5/model.safetensors")
    assert p.selects("a/b/checkpoint-5/optimizer.pt")
    assert p.unit_of("tiny/checkpoint-5/sub/x.pt", set()) == ("dir", "tiny/checkpoint-5")
    assert p.enter_dir("tiny", "/w/tiny")
    assert not p.selects("tiny/models--a/checkpoint-5/x")   # caches stay out at any depth
    anchored = Policy(["./checkpoint-*/**"])
    assert anchored.selects("checkpoint-5/x.pt") and not anchored.selects("tiny/checkpoint-5/x.pt")
    explicit = Policy(["**/checkpoint-*/**"])  # written out: also gets its folder unit (manifest)
    assert explicit.unit_of("run/checkpoint-7/x.pt", set()) == ("dir", "run/checkpoint-7")
    assert folder_prefix("**/checkpoint-*/**") == "**/checkpoint-*"


def test_units():
    p = Policy(DEFAULT)
    assert folder_prefix("checkpoint-*/**") == "checkpoint-*"
    assert folder_prefix("**/adapter_config.json") is None
    assert p.unit_of("checkpoint-5/sub/x.pt", set()) == ("dir", "checkpoint-5")
    assert p.unit_of("lora/adapter_model.safetensors", {"lora"}) == ("dir", "lora")
    assert p.unit_of("checkpoint-5/adapter_model.safetensors", {"checkpoint-5"}) == ("dir", "checkpoint-5")
    assert p.unit_of("adapter_model.safetensors", {""}) == ("dir", "")
    assert p.unit_of("model.safetensors", set()) == ("file", "model.safetensors")


def test_hf_cache_roots_from_environment():
    roots = hf_cache_roots([{"HF_HOME": "/workspace/hf"}, {"HF_HUB_CACHE": "/data/hub", "TRANSFORMERS_CACHE": "rel"}])
    assert "/workspace/hf" in roots and "/data/hub" in roots
    assert all(r.startswith("/") for r in roots)


def test_hf_home_above_the_watched_folder_excludes_only_caches_and_token():
    roots = hf_cache_roots([{"HF_HOME": "/workspace"}], ["/workspace/out"])
    assert "/workspace" not in roots
    assert {"/workspace/hub", "/workspace/datasets", "/workspace/token"} <= set(roots)
    p = Policy(["**"], excluded_roots=roots)
    assert p.enter_dir("out", "/workspace/out") and not p.enter_dir("hub", "/workspace/hub")
