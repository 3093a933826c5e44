"""vast.ai: instances are containers (a poweroff inside does nothing to the bill). Each carries its id
in CONTAINER_ID and an instance-scoped CONTAINER_API_KEY that may only start, stop or destroy that
instance. PUT /api/v0/instances/{id}/ {"state": "stopped"} stops it (GPU billing ends, the disk bills
on until the instance is destroyed); DELETE /api/v0/instances/{id}/ destroys it. The state is
`actual_status` of GET /api/v0/instances/{id}/ ("stopped": no GPU charges)."""

from __future__ import annotations

from supervisor.config import StopConfig
from supervisor.stop.providers.api import DESCRIBE_TIMEOUT_S, Api
from supervisor.stop.providers.base import (
    DAYS_PER_MONTH,
    Facts,
    Found,
    Info,
    NoCredential,
    ProviderError,
    State,
    number,
)

API_URL = "https://console.vast.ai"

INFO = Info(
    name="vast", label="vast.ai", noun="instance", found_by="env CONTAINER_ID (with VAST_CONTAINERLABEL or CONTAINER_API_KEY)",
    poweroff_ends_billing=False, poweroff_means="does nothing to the bill: an instance is a container",
    can_stop=True, api=True, stop_ends="ends GPU billing",
    stop_keeps="the instance's disk, until it is destroyed",
    terminate_keeps="",
    credential="CONTAINER_API_KEY (instance-scoped, in every instance), sent as Bearer",
    fix="CONTAINER_API_KEY in the daemon's environment (vast.ai puts one in every instance; an SSH session may "
        "lack it, the daemon also reads PID 1's), or stop.action = \"command\" with stop.command = "
        "\"vastai stop instance $CONTAINER_ID\"")


class Vast:
    info = INFO

    def __init__(self, api: Api, instance: str):
        self.api, self.instance = api, instance

    def _path(self) -> str:
        return f"/api/v0/instances/{self.instance}/"

    def _get(self, timeout: float | None = None) -> dict | None:
        code, doc = self.api.call("GET", self._path(), what=f"vast.ai GET instance {self.instance}", timeout=timeout)
        if code == 404:
            return None
        inner = doc.get("instances") if isinstance(doc, dict) else None  # {"instances": {...}}
        return inner if isinstance(inner, dict) else (doc if isinstance(doc, dict) else {})

    def describe(self) -> Facts:
        inst = self._get(DESCRIBE_TIMEOUT_S) or {}
        price = number(inst.get("dph_total"))
        disk = number(inst.get("disk_space")) or 0.0
        per_hour = number(inst.get("storage_total_cost"))
        per_gb_month = number(inst.get("storage_cost"))
        if per_hour:
            money = f", about {per_hour * 24:.2f} USD/day"
        elif per_gb_month and disk:
            money = f", about {disk * per_gb_month / DAYS_PER_MONTH:.2f} USD/day"
        else:
            money = ""
        kept = f"{disk:.0f} GB disk still billed until destroyed{money}" if disk else "the disk, until destroyed"
        return Facts(price, kept, "", f"instance {self.instance}")

    def stop(self) -> str:
        code, doc = self.api.call("PUT", self._path(), {"state": "stopped"}, what=f"vast.ai stop instance {self.instance}")
        self._check(code, doc, "stop")
        return f"vast.ai API: stop instance {self.instance} accepted"

    def terminate(self) -> str:
        code, doc = self.api.call("DELETE", self._path(), what=f"vast.ai destroy instance {self.instance}")
        if code == 404:
            return f"vast.ai API: destroy instance {self.instance} (already gone)"
        self._check(code, doc, "destroy")
        return f"vast.ai API: destroy instance {self.instance} accepted"

    def _check(self, code: int, doc: object, verb: str) -> None:
        """vast.ai may answer 200 with {"success": false, "msg": ...}: that is a refusal."""
        if code == 404:
            raise ProviderError(f"vast.ai {verb} instance {self.instance}: no such instance (404)", "refused", 404)
        if isinstance(doc, dict) and doc.get("success") is False:
            msg = str(doc.get("msg") or doc.get("error") or "success: false")[:300]
            raise ProviderError(f"vast.ai {verb} instance {self.instance}: {msg}", "refused", code, msg)

    def state(self) -> State:
        inst = self._get()
        if inst is None:
            return State("gone (404)", True, True)
        word = str(inst.get("actual_status") or "?")[:40]
        return State(word, word == "stopped", False)  # "exited" is a crash: the GPU stays rented


def connect(cfg: StopConfig, env: dict[str, str], found: Found, key: str = "") -> Vast:
    inst = cfg.instance_id or found.instance or env.get("CONTAINER_ID", "")
    key = key or env.get("CONTAINER_API_KEY", "")
    if not inst:
        raise NoCredential("no instance id (CONTAINER_ID is not set; set stop.instance_id)")
    if not key:
        raise NoCredential("CONTAINER_API_KEY is not set (nor stop.api_key_file)")
    return Vast(Api(cfg.api_url or API_URL, {"Authorization": f"Bearer {key}"}, secrets=(key,)), inst)
