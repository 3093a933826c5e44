"""Providers found and warned about, not yet called: on each a poweroff leaves the machine billing, and
the warning (check-config, status, the mails) names what to set instead."""

from __future__ import annotations

from supervisor.stop.providers.base import Info

_NONE = ""

OCI = Info(
    name="oci", label="Oracle Cloud (OCI)", noun="instance", found_by="DMI chassis_asset_tag OracleCloud.com",
    poweroff_ends_billing=False,
    poweroff_means="does not stop billing (\"shutting down from the OS does not stop billing\")",
    can_stop=False, api=False, stop_ends=_NONE,
    stop_keeps="the whole instance (most GPU shapes bill even when stopped through the API)",
    terminate_keeps="boot and block volumes you keep",
    credential="(not called this version)",
    fix="stop.action = \"command\" with stop.command = \"oci compute instance terminate --instance-id ... --force\" "
        "(a stop through the API still bills most GPU shapes)")

NEBIUS = Info(
    name="nebius", label="Nebius", noun="VM", found_by="DMI words \"Nebius\"",
    poweroff_ends_billing=False, poweroff_means="counts as a failure: the VM is rebooted and bills on",
    can_stop=False, api=False, stop_ends=_NONE, stop_keeps="the whole VM (a guest shutdown reboots it)",
    terminate_keeps="disks you keep", credential="(not called this version)",
    fix="stop.action = \"command\" with stop.command = \"nebius compute instance stop --id ...\"")

DIGITALOCEAN = Info(
    name="digitalocean", label="DigitalOcean", noun="droplet", found_by="DMI sys_vendor DigitalOcean",
    poweroff_ends_billing=False, poweroff_means="leaves it billing: a powered-off droplet bills until destroyed",
    can_stop=False, api=False, stop_ends=_NONE, stop_keeps="the whole droplet, until it is destroyed",
    terminate_keeps="volumes and snapshots", credential="(not called this version)",
    fix="stop.action = \"command\" with stop.command = \"doctl compute droplet delete ... --force\"")

HETZNER = Info(
    name="hetzner", label="Hetzner", noun="server", found_by="DMI sys_vendor Hetzner",
    poweroff_ends_billing=False, poweroff_means="leaves it billing: a powered-off server bills until deleted",
    can_stop=False, api=False, stop_ends=_NONE, stop_keeps="the whole server, until it is deleted",
    terminate_keeps="volumes, snapshots and primary IPs you keep", credential="(not called this version)",
    fix="stop.action = \"command\" with stop.command = \"hcloud server delete ...\"")

INFOS = {i.name: i for i in (OCI, NEBIUS, DIGITALOCEAN, HETZNER)}
