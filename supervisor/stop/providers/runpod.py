"""RunPod: pods are containers, so a poweroff inside one does nothing (a pod whose entrypoint exits is
restarted). Every pod carries a pod-scoped RUNPOD_API_KEY and its RUNPOD_POD_ID; the REST API
(https://rest.runpod.io/v1) stops it (POST /pods/{id}/stop: desiredStatus EXITED) or terminates it
(DELETE /pods/{id}: gone). A stopped pod's volume bills at $0.20/GB/month, twice the running rate;
a network volume survives even terminate and bills on."""

from __future__ import annotations

from supervisor.config import StopConfig
from supervisor.stop.providers.api import DESCRIBE_TIMEOUT_S, Api, dig
from supervisor.stop.providers.base import (
    STOPPED_VOLUME_USD_GB_MONTH,
    Facts,
    Found,
    Info,
    NoCredential,
    ProviderError,
    State,
    gb_month_per_day,
    number,
)

API_URL = "https://rest.runpod.io/v1"

INFO = Info(
    name="runpod", label="RunPod", noun="pod", found_by="env RUNPOD_POD_ID",
    poweroff_ends_billing=False, poweroff_means="does nothing to the bill: a pod is a container (one whose entrypoint exits is restarted)",
    can_stop=True, api=True, stop_ends="ends GPU billing",
    stop_keeps="the pod's volume ($0.20/GB/month while stopped, twice the running rate) and any network volume",
    terminate_keeps="a network volume, if one is attached (it outlives the pod)",
    credential="RUNPOD_API_KEY (pod-scoped, in every pod), sent as Bearer",
    fix="RUNPOD_API_KEY in the daemon's environment (RunPod puts one in every pod), or stop.action = \"command\" "
        "with stop.command = \"runpodctl stop pod $RUNPOD_POD_ID\"")


class RunPod:
    info = INFO

    def __init__(self, api: Api, pod: str):
        self.api, self.instance = api, pod

    def _pod(self, timeout: float | None = None) -> dict | None:
        code, doc = self.api.call("GET", f"/pods/{self.instance}", what=f"RunPod GET pod {self.instance}",
                                  timeout=timeout)
        return None if code == 404 else (doc if isinstance(doc, dict) else {})

    def describe(self) -> Facts:
        pod = self._pod(DESCRIBE_TIMEOUT_S) or {}
        price = number(pod.get("adjustedCostPerHr")) or number(pod.get("costPerHr"))
        vol = number(pod.get("volumeInGb")) or 0.0
        kept = [f"{vol:.0f} GB volume still billed, {gb_month_per_day(vol, STOPPED_VOLUME_USD_GB_MONTH)}"] if vol else []
        net = pod.get("networkVolumeId") or dig(pod, "networkVolume", "id")
        if net:
            kept.append(f"network volume {str(net)[:40]} still billed")
        return Facts(price, "; ".join(kept) if kept else "nothing billed while stopped (no volume)",
                     f"network volume {str(net)[:40]} still billed" if net else "", f"pod {self.instance}")

    def stop(self) -> str:
        code, _ = self.api.call("POST", f"/pods/{self.instance}/stop", what=f"RunPod stop pod {self.instance}")
        if code == 404:
            raise ProviderError(f"RunPod stop pod {self.instance}: no such pod (404)", "refused", 404)
        return f"RunPod API: stop pod {self.instance} accepted"

    def terminate(self) -> str:
        code, _ = self.api.call("DELETE", f"/pods/{self.instance}", what=f"RunPod terminate pod {self.instance}")
        return f"RunPod API: terminate pod {self.instance} " + ("(already gone)" if code == 404 else "accepted")

    def state(self) -> State:
        pod = self._pod()
        if pod is None:
            return State("gone (404)", True, True)
        word = str(pod.get("desiredStatus") or pod.get("status") or "?")[:40]
        return State(word, word in ("EXITED", "TERMINATED"), word == "TERMINATED")


def connect(cfg: StopConfig, env: dict[str, str], found: Found, key: str = "") -> RunPod:
    pod = cfg.instance_id or found.instance or env.get("RUNPOD_POD_ID", "")
    key = key or env.get("RUNPOD_API_KEY", "")
    if not pod:
        raise NoCredential("no pod id (RUNPOD_POD_ID is not set; set stop.instance_id)")
    if not key:
        raise NoCredential("RUNPOD_API_KEY is not set (nor stop.api_key_file)")
    return RunPod(Api(cfg.api_url or API_URL, {"Authorization": f"Bearer {key}"}, secrets=(key,)), pod)
