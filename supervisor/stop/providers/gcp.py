"""Google Compute Engine: a guest shutdown moves the VM to TERMINATED, which does not bill for compute
(its persistent disks and static IPs do). The API stop is POST .../instances/{name}/stop, terminate
DELETE .../instances/{name}, the state GET .../instances/{name} `status` (TERMINATED). The project,
zone and name, and an access token of the VM's service account, come from the metadata service
(`Metadata-Flavor: Google`). The default service account's scopes often lack compute: a refusal
then falls back to the poweroff that ends compute billing here anyway."""

from __future__ import annotations

import time

from supervisor import redact
from supervisor.config import StopConfig
from supervisor.stop.providers.api import Api, get_text
from supervisor.stop.providers.base import Facts, Found, Info, NoCredential, ProviderError, State
from supervisor.untrusted import Unreadable, json_object

API_URL = "https://compute.googleapis.com/compute/v1"
METADATA_URL = "http://metadata.google.internal"
HEADER = {"Metadata-Flavor": "Google"}

INFO = Info(
    name="gcp", label="Google Compute Engine", noun="VM", found_by="DMI product_name \"Google Compute Engine\"",
    poweroff_ends_billing=True, poweroff_means="moves the VM to TERMINATED (no compute billing)",
    can_stop=True, api=True, stop_ends="ends compute billing", stop_keeps="persistent disks and static IPs",
    terminate_keeps="disks not set to auto-delete, static IPs",
    credential="the VM's service account token from the metadata service (needs the compute scope)",
    fix="")


class Gcp:
    info = INFO

    def __init__(self, cfg: StopConfig, metadata: str, project: str, zone: str, name: str):
        self.cfg, self.metadata = cfg, metadata
        self.instance = name
        self.path = f"/projects/{project}/zones/{zone}/instances/{name}"
        self._token, self._until = "", 0.0

    def _api(self) -> Api:
        if not self._token or time.monotonic() > self._until:
            self._token, ttl = token(self.metadata)
            self._until = time.monotonic() + max(0.0, ttl - 60)
        return Api(self.cfg.api_url or API_URL, {"Authorization": f"Bearer {self._token}"}, secrets=(self._token,))

    def describe(self) -> Facts:
        return Facts(None, INFO.stop_keeps + " still billed", "", f"VM {self.instance}")

    def stop(self) -> str:
        code, _ = self._api().call("POST", self.path + "/stop", what=f"GCE stop VM {self.instance}")
        if code == 404:
            raise ProviderError(f"GCE stop VM {self.instance}: no such VM (404)", "refused", 404)
        return f"GCE API: stop VM {self.instance} accepted"

    def terminate(self) -> str:
        code, _ = self._api().call("DELETE", self.path, what=f"GCE delete VM {self.instance}")
        return f"GCE API: delete VM {self.instance} " + ("(already gone)" if code == 404 else "accepted")

    def state(self) -> State:
        code, doc = self._api().call("GET", self.path, what=f"GCE GET VM {self.instance}")
        if code == 404:
            return State("gone (404)", True, True)
        word = str(doc.get("status") if isinstance(doc, dict) else "?")[:40]
        return State(word, word == "TERMINATED", False)


def token(metadata: str) -> tuple[str, float]:
    """(access token, seconds it lives) of the VM's default service account."""
    raw = get_text(f"{metadata}/computeMetadata/v1/instance/service-accounts/default/token", HEADER)
    try:
        doc = json_object(raw, what="the metadata token")
    except Unreadable as e:
        raise ProviderError(f"metadata token: {e}", "failed") from None
    tok = doc.get("access_token")
    if not isinstance(tok, str) or not tok:
        raise ProviderError("metadata token: no access_token", "failed")
    redact.register(tok)
    ttl = doc.get("expires_in")
    return tok, float(ttl) if isinstance(ttl, int | float) and not isinstance(ttl, bool) else 300.0


def connect(cfg: StopConfig, env: dict[str, str], found: Found, key: str = "") -> Gcp:
    md = (cfg.metadata_url or METADATA_URL).rstrip("/")
    v1 = f"{md}/computeMetadata/v1"
    try:
        project = get_text(f"{v1}/project/project-id", HEADER)
        zone = get_text(f"{v1}/instance/zone", HEADER).rsplit("/", 1)[-1]
        name = cfg.instance_id or found.instance or get_text(f"{v1}/instance/name", HEADER)
        token(md)
    except ProviderError as e:
        raise NoCredential(f"GCE metadata: {e}") from None
    return Gcp(cfg, md, project, zone, name)
