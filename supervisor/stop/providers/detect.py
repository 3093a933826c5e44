"""Where this machine is, without root and without the network: the environment first (RunPod and
vast.ai put their ids in every container; an SSH session may lack them, so PID 1's environment is
read for those names too), then the words the firmware leaves in /sys/class/dmi/id (what
cloud-init's ds-identify reads). Nothing here opens a socket: the metadata service is asked only by
the provider module a finding names (aws, gcp, azure), so a plain machine makes no network call.

`by_env` and `by_dmi` are pure; `find` reads the files (roots injectable, for a fake tree)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.stop.providers.base import Found

DMI_ROOT = "/sys/class/dmi/id"
PROC_ROOT = "/proc"
DMI_FILES = ("sys_vendor", "product_name", "chassis_asset_tag", "bios_vendor", "bios_version", "board_vendor")
# the variables a provider's container carries, looked for in PID 1's environment when ours lacks them
PROVIDER_VARS = ("RUNPOD_POD_ID", "RUNPOD_API_KEY", "CONTAINER_ID", "CONTAINER_API_KEY", "VAST_CONTAINERLABEL")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


def by_env(env: dict[str, str]) -> Found | None:
    if env.get("RUNPOD_POD_ID"):
        return Found("runpod", "env RUNPOD_POD_ID", env["RUNPOD_POD_ID"])
    if env.get("CONTAINER_ID") and (env.get("VAST_CONTAINERLABEL") or env.get("CONTAINER_API_KEY")):
        return Found("vast", "env CONTAINER_ID", env["CONTAINER_ID"])
    if env.get("VAST_CONTAINERLABEL"):
        return Found("vast", "env VAST_CONTAINERLABEL", env.get("CONTAINER_ID", ""))
    return None


def by_dmi(words: dict[str, str]) -> Found | None:
    """The provider the firmware's words name (each field as read, stripped)."""
    vendor, product = words.get("sys_vendor", ""), words.get("product_name", "")
    tag, bios = words.get("chassis_asset_tag", ""), words.get("bios_version", "").lower()
    if tag == AZURE_ASSET_TAG:
        return Found("azure", f"DMI chassis_asset_tag {AZURE_ASSET_TAG}")
    if tag == "OracleCloud.com":
        return Found("oci", "DMI chassis_asset_tag OracleCloud.com")
    if product == "Google Compute Engine" or vendor == "Google":
        return Found("gcp", f"DMI product_name {product or vendor}")
    if vendor == "Amazon EC2" or bios.endswith("amazon"):
        return Found("aws", "DMI sys_vendor Amazon EC2" if vendor == "Amazon EC2" else "DMI bios_version ...amazon")
    if vendor == "DigitalOcean":
        return Found("digitalocean", "DMI sys_vendor DigitalOcean")
    if vendor == "Hetzner":
        return Found("hetzner", "DMI sys_vendor Hetzner")
    if any("nebius" in w.lower() for w in words.values()):
        return Found("nebius", "DMI words Nebius")
    return None


def dmi_words(root: str = DMI_ROOT) -> dict[str, str]:
    out = {}
    for name in DMI_FILES:
        try:
            with open(os.path.join(root, name), "rb") as f:
                out[name] = f.read(256).decode("utf-8", "replace").strip()
        except OSError:
            continue
    return out


def pid1_env(proc_root: str = PROC_ROOT) -> dict[str, str]:
    """The provider variables in PID 1's environment (the container's own, which a daemon started
    from an SSH session may not have inherited); {} when unreadable."""
    try:
        raw = Path(proc_root, "1", "environ").read_bytes()[: 1 << 20]
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, _, v = item.decode("utf-8", "replace").partition("=")
        if k in PROVIDER_VARS and v:
            out[k] = v
    return out


def provider_env(env: dict[str, str], proc_root: str = PROC_ROOT) -> dict[str, str]:
    """`env`, with the provider variables it lacks taken from PID 1's."""
    extra = {k: v for k, v in pid1_env(proc_root).items() if not env.get(k)}
    return {**env, **extra} if extra else env


def find(env: dict[str, str], dmi_root: str = DMI_ROOT) -> Found | None:
    return by_env(env) or by_dmi(dmi_words(dmi_root))
