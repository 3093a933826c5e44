"""`supervisorctl status --cluster`: every node of the run, read from the heartbeats on the sync
target. No SSH and no daemon needed: any machine with the config and the keys can ask.

A one-shot look cannot watch a heartbeat change, so a node's age here is its heartbeat's own time
against this machine's clock (clock skew shows as age; the daemons judge by change, nodes.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from supervisor.cluster import nodes as cn
from supervisor.config.cluster import for_node
from supervisor.durations import format_duration
from supervisor.training.checkpoints import unit_order

if TYPE_CHECKING:
    from supervisor.config import Config


def read_cluster(cfg: Config, env: Mapping[str, str], now: float | None = None) -> dict:
    """{"run_id", "target", "nodes": [...], "whole": [...]}. ValueError when the config names no
    run of several nodes; TargetError when the target cannot be read."""
    from supervisor.config.target import parse_target
    from supervisor.saves.parts import RECORDS, record_names_all
    from supervisor.store import make_target
    from supervisor.store.base import reader
    from supervisor.store.credentials import run_key

    cfg, run_target = for_node(cfg, env)
    c = cfg.cluster
    if c.nodes <= 1 or not run_target:
        raise ValueError("this config is not a run of several nodes (cluster.nodes, or NNODES and the like, "
                         "and sync.target)")
    now = time.time() if now is None else now
    key, problem = run_key(c.key_file)
    if problem:
        raise ValueError(f"cluster.key_file cannot be read ({problem})")
    target = make_target(parse_target(run_target), cfg.sync, cfg.state_dir)
    records = make_target(parse_target(f"{run_target.rstrip('/')}/{RECORDS}"), cfg.sync, cfg.state_dir)
    try:
        rd = reader(target)
        out = []
        for k in range(c.nodes):
            data = rd.read_file(cn.beat_key(k))
            try:
                b = cn.parse_beat(data, k, key) if data is not None else None
            except ValueError as e:
                out.append({"rank": k, "state": cn.SILENT, "why": str(e)})
                continue
            if b is None or b.run_id != c.run_id:
                out.append({"rank": k, "state": cn.SILENT, "why": "no heartbeat of this run on the target"})
                continue
            age = max(0.0, now - b.at)
            state = (cn.FINISHED if b.training == "FINISHED" else cn.LOST if age >= c.silent_after
                     else cn.SILENT if age >= cn.quiet_limit(c.heartbeat) else cn.OK)
            out.append({"rank": k, "host": b.host, "state": state, "training": b.training, "age_s": round(age, 1),
                        "last_seen": b.at, "newest_held": b.holds[0] if b.holds else None})
        try:
            keys = reader(records).list_keys()
        except Exception:  # noqa: BLE001 - no record yet (a folder target without _cluster/)
            keys = {}
        named = sorted((k[: -len(".json")] for k in keys if k.endswith(".json") and "/" not in k
                        and not k.startswith(cn.PART_PREFIX)), key=unit_order, reverse=True)
        whole = []
        rr = reader(records) if named else None
        for u in named[:64]:  # the newest records that are ours (valid, signed where the run has a key)
            if rr is not None and record_names_all(rr.read_file(f"{u}.json"), u, c.nodes, key):
                whole.append(u)
                if len(whole) == 5:
                    break
    finally:
        target.close()
        records.close()
    return {"run_id": c.run_id, "target": run_target, "nodes": out, "whole": whole[:5],
            "silent_after_s": c.silent_after, "signed": key is not None}


def render_cluster(d: dict) -> str:
    lines = [f"run {d['run_id']} on {d['target']}: {len(d['nodes'])} nodes; newest unit whole on every node: "
             f"{d['whole'][0] if d['whole'] else 'none yet'}"]
    if not d.get("signed"):
        lines.append("  no cluster.key_file: whoever can write the target's _cluster/ is trusted by the cluster")
    for n in d["nodes"]:
        if n.get("host") is None:
            lines.append(f"  node {n['rank']:<3} {n['state']:<8} {n.get('why', '')}")
            continue
        lines.append(f"  node {n['rank']:<3} {n['state']:<8} {n['host']}  training {n['training'] or '?'}, "
                     f"heartbeat {format_duration(n['age_s'])} ago, newest unit here {n['newest_held'] or 'none'}")
    return "\n".join(lines)


def all_well(d: dict) -> bool:
    return all(n["state"] in (cn.OK, cn.FINISHED) for n in d["nodes"])
