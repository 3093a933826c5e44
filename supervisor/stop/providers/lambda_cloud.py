"""Lambda Cloud: no stop, no pause. An instance bills until it is terminated through the API
(POST /instance-operations/terminate {"instance_ids": [id]}); terminate wipes the local NVMe, and a
persistent filesystem survives and bills per GB. The machine has no identity of its own, so the
account key comes from stop.api_key_file; the instance is stop.instance_id, or the one in the
account's listing (GET /instances) with this machine's address."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

from supervisor.config import StopConfig
from supervisor.stop.providers.api import DESCRIBE_TIMEOUT_S, Api, dig
from supervisor.stop.providers.base import Facts, Found, Info, NoCredential, ProviderError, State, number

API_URL = "https://cloud.lambda.ai/api/v1"

INFO = Info(
    name="lambda", label="Lambda Cloud", noun="instance", found_by="stop.provider = \"lambda\", or stop.api_key_file",
    poweroff_ends_billing=False, poweroff_means="leaves it billing: an instance bills until it is terminated",
    can_stop=False, api=True, stop_ends="",
    stop_keeps="the whole instance (Lambda has no stop state: only terminate ends billing)",
    terminate_keeps="persistent filesystems (per GB), if any",
    credential="an account API key in stop.api_key_file, sent as Bearer",
    fix="stop.mode = \"terminate\" (the instance is terminated once the final sync is verified) and "
        "stop.api_key_file")
GONE = ("terminating", "terminated")


def local_addresses(toward: str) -> set[str]:
    """This machine's addresses: the one it reaches `toward` from (a UDP connect sends nothing) and
    those its hostname resolves to."""
    out: set[str] = set()
    host = urlparse(toward).hostname or ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 443))
            out.add(s.getsockname()[0])
    except OSError:
        pass
    try:
        out |= {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    return out


def pick(listing: object, addresses: set[str]) -> str:
    """The id of the one instance in `listing` (GET /instances) with one of `addresses`; "" when
    none or several match. Pure."""
    rows = dig(listing, "data") if isinstance(listing, dict) else None
    ids = [str(r.get("id")) for r in (rows if isinstance(rows, list) else []) if isinstance(r, dict)
           and r.get("id") and ({str(r.get("ip") or ""), str(r.get("private_ip") or "")} & addresses)]
    return ids[0] if len(ids) == 1 else ""


class LambdaCloud:
    info = INFO

    def __init__(self, api: Api, instance: str):
        self.api, self.instance = api, instance

    def _get(self, timeout: float | None = None) -> dict | None:
        code, doc = self.api.call("GET", f"/instances/{self.instance}", what=f"Lambda GET instance {self.instance}",
                                  timeout=timeout)
        if code == 404:
            return None
        data = dig(doc, "data")
        return data if isinstance(data, dict) else {}

    def describe(self) -> Facts:
        inst = self._get(DESCRIBE_TIMEOUT_S) or {}
        cents = number(dig(inst, "instance_type", "price_cents_per_hour"))
        fs = inst.get("file_system_names")
        fs_words = f"persistent filesystem {', '.join(str(x)[:40] for x in fs[:3])} still billed (per GB)" \
            if isinstance(fs, list) and fs else ""
        return Facts(None if cents is None else cents / 100.0, INFO.stop_keeps, fs_words, f"instance {self.instance}")

    def stop(self) -> str:
        raise ProviderError("Lambda Cloud has no stop: only terminate ends billing (stop.mode = \"terminate\")",
                            "refused")

    def terminate(self) -> str:
        code, doc = self.api.call("POST", "/instance-operations/terminate", {"instance_ids": [self.instance]},
                                  what=f"Lambda terminate instance {self.instance}")
        done = dig(doc, "data", "terminated_instances")
        if code == 404 or (isinstance(done, list) and not done):
            raise ProviderError(f"Lambda terminate instance {self.instance}: nothing was terminated", "refused", code)
        return f"Lambda Cloud API: terminate instance {self.instance} accepted"

    def state(self) -> State:
        inst = self._get()
        if inst is None:
            return State("gone (404)", True, True)
        word = str(inst.get("status") or "?")[:40]
        return State(word, word in GONE, word in GONE)


def connect(cfg: StopConfig, env: dict[str, str], found: Found, key: str = "") -> LambdaCloud:
    if not key:
        raise NoCredential("no API key: Lambda machines have no identity of their own; set stop.api_key_file")
    base = cfg.api_url or API_URL
    api = Api(base, {"Authorization": f"Bearer {key}"}, secrets=(key,))
    inst = cfg.instance_id or found.instance
    if not inst:
        try:
            _, listing = api.call("GET", "/instances", what="Lambda GET instances", timeout=DESCRIBE_TIMEOUT_S)
        except ProviderError as e:
            raise NoCredential(f"the instance listing failed ({e}); set stop.instance_id") from None
        inst = pick(listing, local_addresses(base))
        if not inst:
            raise NoCredential("no instance in the account's listing has this machine's address; set stop.instance_id")
    return LambdaCloud(api, inst)
