"""Azure: a VM shut down from inside is "Stopped" and still allocated: billed in full. Only
deallocate ends compute billing (the powerOff API is billed too, so it is never used):
POST .../virtualMachines/{name}/deallocate; terminate is DELETE .../virtualMachines/{name}; the state
is the PowerState/* code of GET .../instanceView (PowerState/deallocated). The subscription, group and
name come from the instance metadata service, a token of the VM's managed identity from its
identity endpoint (both with `Metadata: true`)."""

from __future__ import annotations

import time
from urllib.parse import quote

from supervisor import redact
from supervisor.config import StopConfig
from supervisor.stop.providers.api import Api, dig, get_text
from supervisor.stop.providers.base import Facts, Found, Info, NoCredential, ProviderError, State, number
from supervisor.untrusted import Unreadable, json_object

API_URL = "https://management.azure.com"
METADATA_URL = "http://169.254.169.254"
API_VERSION = "2024-07-01"
HEADER = {"Metadata": "true"}
RESOURCE = "https://management.azure.com/"

INFO = Info(
    name="azure", label="Azure", noun="VM", found_by="DMI chassis_asset_tag 7783-7084-3265-9085-8269-3286-77",
    poweroff_ends_billing=False, poweroff_means="leaves the VM \"Stopped\": still allocated, billed in full",
    can_stop=True, api=True, stop_ends="ends compute billing: deallocated", stop_keeps="managed disks and public IPs",
    terminate_keeps="disks, NICs and public IPs whose deleteOption is not Delete",
    credential="the VM's managed identity (a role allowed deallocate on the VM), through the metadata service",
    fix="a managed identity on the VM with a role allowed Microsoft.Compute/virtualMachines/deallocate/action, or "
        "stop.action = \"command\" with stop.command = \"az vm deallocate ...\"")


def _json(raw: str, what: str) -> dict:
    try:
        return json_object(raw, what=what)
    except Unreadable as e:
        raise ProviderError(f"{what}: {e}", "failed") from None


def token(metadata: str) -> tuple[str, float]:
    raw = get_text(f"{metadata}/metadata/identity/oauth2/token?api-version=2018-02-01&resource={quote(RESOURCE, safe='')}",
                   HEADER)
    doc = _json(raw, "the managed identity token")
    tok = doc.get("access_token")
    if not isinstance(tok, str) or not tok:
        raise ProviderError("managed identity: no access_token", "failed")
    redact.register(tok)
    return tok, number(doc.get("expires_in")) or 300.0   # Azure sends "3599", a string


class Azure:
    info = INFO

    def __init__(self, cfg: StopConfig, metadata: str, sub: str, group: str, name: str):
        self.cfg, self.metadata, self.instance = cfg, metadata, name
        self.path = f"/subscriptions/{sub}/resourceGroups/{group}/providers/Microsoft.Compute/virtualMachines/{name}"
        self._token, self._until = "", 0.0

    def _api(self) -> Api:
        if not self._token or time.monotonic() > self._until:
            self._token, ttl = token(self.metadata)
            self._until = time.monotonic() + max(0.0, ttl - 60)
        return Api(self.cfg.api_url or API_URL, {"Authorization": f"Bearer {self._token}"}, secrets=(self._token,))

    def describe(self) -> Facts:
        return Facts(None, INFO.stop_keeps + " still billed", "", f"VM {self.instance}")

    def stop(self) -> str:
        code, _ = self._api().call("POST", f"{self.path}/deallocate?api-version={API_VERSION}",
                                   what=f"Azure deallocate VM {self.instance}")
        if code == 404:
            raise ProviderError(f"Azure deallocate VM {self.instance}: no such VM (404)", "refused", 404)
        return f"Azure API: deallocate VM {self.instance} accepted"

    def terminate(self) -> str:
        code, _ = self._api().call("DELETE", f"{self.path}?api-version={API_VERSION}",
                                   what=f"Azure delete VM {self.instance}")
        return f"Azure API: delete VM {self.instance} " + ("(already gone)" if code == 404 else "accepted")

    def state(self) -> State:
        code, doc = self._api().call("GET", f"{self.path}/instanceView?api-version={API_VERSION}",
                                     what=f"Azure GET VM {self.instance} instanceView")
        if code == 404:
            return State("gone (404)", True, True)
        codes = [str(s.get("code")) for s in (dig(doc, "statuses") or []) if isinstance(s, dict)]
        word = next((c for c in codes if c.startswith("PowerState/")), "PowerState/unknown")[:60]
        return State(word, word == "PowerState/deallocated", False)


def connect(cfg: StopConfig, env: dict[str, str], found: Found, key: str = "") -> Azure:
    md = (cfg.metadata_url or METADATA_URL).rstrip("/")
    try:
        doc = _json(get_text(f"{md}/metadata/instance?api-version=2021-02-01", HEADER), "the instance metadata")
        sub, group = dig(doc, "compute", "subscriptionId"), dig(doc, "compute", "resourceGroupName")
        name = cfg.instance_id or found.instance or dig(doc, "compute", "name")
        if not (isinstance(sub, str) and isinstance(group, str) and isinstance(name, str) and sub and group and name):
            raise ProviderError("the instance metadata lacks subscriptionId, resourceGroupName or name", "failed")
        token(md)
    except ProviderError as e:
        raise NoCredential(f"Azure metadata: {e}") from None
    return Azure(cfg, md, sub, group, name)
