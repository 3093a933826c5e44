"""The recipes in examples/recipes/: each engine's file is read by the engine's own parser when that
package is installed (`pip install -e .[recipes]` gives the Kubernetes client; dstack's configuration
models and SkyPilot's task loader are used when those are installed), else by a light check of the keys
it relies on. The train-supervisor config each recipe writes is parsed by our own loader."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from supervisor.config import SECTIONS, parse

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"
SAMPLE_ENV = {"SYNC_TARGET": "s3://my-bucket/qwen-run1", "MAX_COST": "120", "HOME": "/home/sky",
              "WORKDIR": "/workspace"}


def has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def our_config(toml: str) -> None:
    """Our loader on the config a recipe writes ($VARS filled in; [resume] left out until this tree has it)."""
    text = re.sub(r"\$(\w+)", lambda m: SAMPLE_ENV.get(m.group(1), m.group(0)), toml)
    if "resume" not in SECTIONS:
        text = re.sub(r"(?ms)^\[resume\]\n(?:[^\[].*\n?)*", "", text)
    parse(text, "recipe")


def heredoc(script: str) -> str:
    m = re.search(r"<<TOML\n(.*?)\n\s*TOML", script, re.S)
    assert m, "the recipe writes its config with a <<TOML heredoc"
    lines = m.group(1).splitlines()
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return "\n".join(x[indent:] for x in lines) + "\n"


# --- Kubernetes ------------------------------------------------------------------------------------
def k8s_docs() -> list[dict]:
    return list(yaml.safe_load_all((RECIPES / "kubernetes-pod.yaml").read_text()))


def strict(model_cls, data, path="") -> None:
    """Every key is one the client's model knows (its deserializer alone would drop unknown ones)."""
    import kubernetes.client as k

    if not isinstance(data, dict) or not hasattr(model_cls, "attribute_map"):
        return
    by_json = {v: a for a, v in model_cls.attribute_map.items()}
    for key, value in data.items():
        assert key in by_json, f"{path}{key}: not a field of {model_cls.__name__}"
        t = model_cls.openapi_types[by_json[key]]
        inner = re.fullmatch(r"list\[(\w+)\]", t)
        name = inner.group(1) if inner else t
        sub = getattr(k, name, None)
        for item in (value if inner and isinstance(value, list) else [value]):
            if sub is not None:
                strict(sub, item, f"{path}{key}.")


def test_kubernetes_pod_has_a_native_sidecar_whose_prestop_makes_the_final_sync():
    cm, pod = k8s_docs()
    side = pod["spec"]["initContainers"][0]
    assert side["restartPolicy"] == "Always"  # native sidecar
    assert side["lifecycle"]["preStop"]["exec"]["command"][:3] == ["supervisorctl", "sync", "--wait"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 1500
    mounts = {m["name"] for m in side["volumeMounts"]} & {m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert "out" in mounts  # the sidecar sees what the training saves
    our_config(cm["data"]["config.toml"])


@pytest.mark.skipif(not has("kubernetes"), reason="the kubernetes client is not installed (pip install -e .[recipes])")
def test_kubernetes_recipe_reads_as_the_clients_own_models():
    import json

    from kubernetes.client import ApiClient, V1ConfigMap, V1Pod

    class Resp:  # what older clients hand to deserialize()
        def __init__(self, d):
            self.data = json.dumps(d)

    def read(d, kind):
        try:
            return api.deserialize(json.dumps(d), kind, "application/json")  # kubernetes >= 33
        except TypeError:
            return api.deserialize(Resp(d), kind)

    cm, pod = k8s_docs()
    api = ApiClient()
    p = read(pod, "V1Pod")
    side = p.spec.init_containers[0]
    pre = side.lifecycle.pre_stop
    assert side.restart_policy == "Always"
    assert (getattr(pre, "_exec", None) or getattr(pre, "exec", None)).command[0] == "supervisorctl"
    assert read(cm, "V1ConfigMap").data["config.toml"]
    strict(V1Pod, pod)
    strict(V1ConfigMap, cm)


# --- dstack ----------------------------------------------------------------------------------------
def dstack_conf() -> dict:
    return yaml.safe_load((RECIPES / "dstack-task.dstack.yml").read_text())


def test_dstack_task_runs_the_daemon_and_ends_after_its_verified_stop():
    c = dstack_conf()
    assert c["type"] == "task" and c["max_duration"] and c["resources"]["gpu"]
    assert set(c) <= {"type", "name", "python", "env", "commands", "resources", "max_duration", "retry",
                      "utilization_policy", "image", "ports", "nodes", "volumes", "working_dir", "spot_policy",
                      "idle_duration", "backends", "regions", "files"}
    cmds = "\n".join(c["commands"])
    assert "train-supervisord --config" in cmds and "stopped" in cmds
    our_config(heredoc(cmds))


@pytest.mark.skipif(not has("dstack"), reason="dstack is not installed")
def test_dstack_recipe_parses_with_dstacks_own_configuration_models():
    from dstack._internal.core.models.configurations import parse_run_configuration

    conf = parse_run_configuration(dstack_conf())
    assert conf.type == "task" and conf.max_duration == 12 * 3600


# --- SkyPilot --------------------------------------------------------------------------------------
def sky_conf() -> dict:
    return yaml.safe_load((RECIPES / "skypilot-task.yaml").read_text())


def test_skypilot_task_autostops_after_idle_check_and_hooks_sync_first():
    c = sky_conf()
    assert set(c) <= {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup",
                      "run", "config", "volumes", "event_callback"}
    r = c["resources"]
    assert set(r["autostop"]) <= {"idle_minutes", "down", "wait_for", "hook", "hook_timeout"}
    assert isinstance(r["autostop"]["idle_minutes"], int)
    assert r["job_recovery"]["strategy"] in ("FAILOVER", "EAGER_NEXT_REGION")
    for h in c["config"]["hooks"]:
        assert set(h) <= {"run", "events", "timeout"} and set(h["events"]) <= {"stop", "preemption", "down"}
        assert isinstance(h["timeout"], int) and "supervisorctl sync --wait" in h["run"]
    assert "supervisorctl idle-check" in c["run"] and "supervisorctl run --" in c["run"]
    our_config(heredoc(c["setup"]))


def sky_or_skip():
    if not has("sky"):
        pytest.skip("skypilot is not installed (its task loader needs the whole client)")
    try:
        import sky
        return sky
    except Exception as e:  # noqa: BLE001 - a partial install: its own loader cannot run here
        pytest.skip(f"skypilot does not import here: {e}")


def test_skypilot_recipe_loads_with_skys_own_task_loader():
    sky = sky_or_skip()

    task = sky.Task.from_yaml(str(RECIPES / "skypilot-task.yaml"))
    assert task.name == "train-qwen"


# --- many machines: one run across nodes ---------------------------------------------------------
def test_skypilot_multinode_task_gives_each_node_its_place_and_one_config():
    c = yaml.safe_load((RECIPES / "skypilot-multinode.yaml").read_text())
    assert set(c) <= {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup",
                      "run", "config", "volumes", "event_callback"}
    assert c["num_nodes"] >= 2
    run = c["run"]
    assert "SKYPILOT_NODE_RANK" in run and "SKYPILOT_NUM_NODES" in run and "/etc/train-supervisor/environment" in run
    assert "supervisorctl run -- torchrun" in run and '--node_rank "$SKYPILOT_NODE_RANK"' in run
    cfg = parse(re.sub(r"\$(\w+)", lambda m: SAMPLE_ENV.get(m.group(1), m.group(0)), heredoc(c["setup"])), "recipe")
    assert cfg.cluster.on_node_lost == "save_and_stop" and cfg.budget.scope == "run"
    assert cfg.cluster.nodes == 0 and cfg.cluster.rank is None  # from SkyPilot's variables, not per node


def test_dstack_task_with_nodes_runs_one_supervisor_per_node():
    c = yaml.safe_load((RECIPES / "dstack-nodes.dstack.yml").read_text())
    assert c["type"] == "task" and c["nodes"] >= 2 and c["max_duration"]
    cmds = "\n".join(c["commands"])
    assert "train-supervisord --config" in cmds and "$DSTACK_NODE_RANK" in cmds and "$DSTACK_NODES_NUM" in cmds
    toml = heredoc(cmds)
    our_config(toml)
    assert "[cluster]" in toml and 'scope = "run"' in toml


def test_torchrun_node_script_writes_one_config_for_every_node(tmp_path):
    script = RECIPES / "torchrun-node.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "NODE_RANK=%s" in text and "supervisorctl run -- torchrun" in text and "status --cluster" in text
    our_config(heredoc(text))


def test_the_cluster_recipes_nodes_find_their_place_in_the_engines_variables():
    """What each recipe gives the daemon's environment is what [cluster] reads (config.cluster)."""
    from supervisor.config.cluster import identity

    for env, want in [({"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_TASK_ID": "sky-1"}, (2, 1)),
                      ({"DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "2", "DSTACK_RUN_NAME": "r"}, (2, 1)),
                      ({"NODE_RANK": "1", "NNODES": "2"}, (2, 1)), ({"NODE_RANK": "1", "NUM_NODES": "2"}, (2, 1))]:
        ident = identity(0, None, "", [env], "s3://my-bucket/qwen")
        assert (ident.nodes, ident.rank) == want


@pytest.mark.skipif(not has("dstack"), reason="dstack is not installed")
def test_dstack_nodes_recipe_parses_with_dstacks_own_configuration_models():
    from dstack._internal.core.models.configurations import parse_run_configuration

    conf = parse_run_configuration(yaml.safe_load((RECIPES / "dstack-nodes.dstack.yml").read_text()))
    assert conf.type == "task" and conf.nodes == 2


def test_skypilot_multinode_recipe_loads_with_skys_own_task_loader():
    sky = sky_or_skip()

    task = sky.Task.from_yaml(str(RECIPES / "skypilot-multinode.yaml"))
    assert task.name == "train-qwen-multinode" and task.num_nodes == 2


# --- the engines' own parsers, in their own environment -------------------------------------------
# Their dependencies are many and pinned, so they live in .venv-recipes (tests/run.sh builds it with
# .ci/recipes-venv), not in the daemon's venv: the three checks above run there, by that interpreter.
RECIPES_PY = os.environ.get("TSUP_RECIPES_PYTHON", "")
ENGINE_TESTS = ("kubernetes_recipe_reads_as_the_clients_own_models or dstack_recipe_parses_with_dstacks_own "
                "or skypilot_recipe_loads_with_skys_own_task_loader or dstack_nodes_recipe_parses_with_dstacks_own "
                "or skypilot_multinode_recipe_loads_with_skys_own_task_loader")


@pytest.mark.skipif(not RECIPES_PY, reason="TSUP_RECIPES_PYTHON is not set (tests/run.sh builds .venv-recipes)")
def test_each_recipe_passes_its_engines_own_parser_in_the_engines_environment():
    repo = RECIPES.parents[1]
    r = subprocess.run([RECIPES_PY, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", "-rs",
                        str(Path(__file__).relative_to(repo)), "-k", ENGINE_TESTS],
                       cwd=repo, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "5 passed" in r.stdout and "skipped" not in r.stdout, \
        r.stdout[-3000:] + r.stderr[-2000:]
